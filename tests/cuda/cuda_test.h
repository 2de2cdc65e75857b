// What the CUDA tests share (tests/cuda): host bf16 rounding, fresh random inputs (never
// zero), device buffers and their copies, element-wise comparison with a tolerance, and the
// fixture that skips every test where no GPU is visible.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/check.h"
#include "backends/cuda/ops.h"
#include "core/check.h"
#include "core/layout.h"

namespace sppo::testing {

using Vec = std::vector<float>;

// ---- host bf16 ------------------------------------------------------------------------------
inline std::uint16_t bf16_bits(float x) {  // round to nearest even (inputs here are finite)
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
inline float bf16_value(std::uint16_t b) {
  const std::uint32_t u = std::uint32_t{b} << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
inline float round_bf16(float x) { return bf16_value(bf16_bits(x)); }
inline Vec rounded(Vec x, DType t) {
  if (t == DType::BF16)
    for (float& e : x) e = round_bf16(e);
  return x;
}
inline const char* name(DType t) { return t == DType::F32 ? "f32" : "bf16"; }

// ---- random inputs ------------------------------------------------------------------------
inline Vec randn(std::size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Vec v(n);
  for (float& x : v) {
    do x = dist(rng);
    while (x == 0.0f);
    x *= scale;
  }
  return v;
}
inline std::vector<std::int32_t> rand_ids(std::size_t n, int V, std::mt19937& rng) {
  std::uniform_int_distribution<std::int32_t> dist(0, V - 1);
  std::vector<std::int32_t> ids(n);
  for (auto& id : ids) id = dist(rng);
  return ids;
}

// ---- device buffers -----------------------------------------------------------------------
class Dev {
 public:
  explicit Dev(std::size_t bytes) : bytes_(std::max<std::size_t>(bytes, 16)) {
    SPPO_CUDA_CHECK(cudaMalloc(&ptr_, bytes_));
  }
  ~Dev() { cudaFree(ptr_); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  Dev(Dev&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_;
};

// Host floats -> device elements of type t (bf16: rounded to nearest even). Synchronises: a
// copy from pageable memory may return before its DMA has landed.
inline Dev upload(const Vec& x, DType t) {
  Dev d(x.size() * dtype_bytes(t));
  if (t == DType::F32) {
    SPPO_CUDA_CHECK(cudaMemcpy(d.get(), x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  } else {
    std::vector<std::uint16_t> b(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) b[i] = bf16_bits(x[i]);
    SPPO_CUDA_CHECK(cudaMemcpy(d.get(), b.data(), b.size() * 2, cudaMemcpyHostToDevice));
  }
  SPPO_CUDA_CHECK(cudaDeviceSynchronize());
  return d;
}
template <typename T>
inline Dev upload_raw(const std::vector<T>& x) {
  Dev d(x.size() * sizeof(T));
  SPPO_CUDA_CHECK(cudaMemcpy(d.get(), x.data(), x.size() * sizeof(T), cudaMemcpyHostToDevice));
  SPPO_CUDA_CHECK(cudaDeviceSynchronize());
  return d;
}
inline Vec download(const Dev& d, std::size_t n, DType t) {
  SPPO_CUDA_CHECK(cudaDeviceSynchronize());
  Vec x(n);
  if (t == DType::F32) {
    SPPO_CUDA_CHECK(cudaMemcpy(x.data(), d.get(), n * 4, cudaMemcpyDeviceToHost));
  } else {
    std::vector<std::uint16_t> b(n);
    SPPO_CUDA_CHECK(cudaMemcpy(b.data(), d.get(), n * 2, cudaMemcpyDeviceToHost));
    for (std::size_t i = 0; i < n; ++i) x[i] = bf16_value(b[i]);
  }
  return x;
}
inline double download_double(const Dev& d) {
  SPPO_CUDA_CHECK(cudaDeviceSynchronize());
  double x = 0.0;
  SPPO_CUDA_CHECK(cudaMemcpy(&x, d.get(), sizeof x, cudaMemcpyDeviceToHost));
  return x;
}

// ---- comparison ---------------------------------------------------------------------------
// |got - ref| <= atol + atol_elem[i] + rtol |ref| for every i (atol_elem may be empty); both
// infinite with the same sign also pass. Reports the first failures and the worst ratio.
inline void expect_close(const Vec& got, const Vec& ref, double atol, double rtol, const std::string& what,
                  const std::vector<double>& atol_elem = {}) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  std::size_t bad = 0;
  double worst = 0.0;
  std::size_t worst_i = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], r = ref[i];
    if (std::isinf(r) && g == r) continue;
    const double tol = atol + (atol_elem.empty() ? 0.0 : atol_elem[i]) + rtol * std::fabs(r);
    const double err = std::fabs(g - r);
    const double ratio = err == 0.0 ? 0.0 : err / tol;
    if (!(ratio <= worst)) {  // also catches NaN
      worst = std::isnan(ratio) ? std::numeric_limits<double>::infinity() : ratio;
      worst_i = i;
    }
    if (!(err <= tol)) {
      if (bad < 5)
        ADD_FAILURE() << what << "[" << i << "]: got " << g << ", want " << r << " (tol " << tol
                      << ")";
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements out of tolerance";
  // The margin, for the record: the largest error as a fraction of its tolerance.
  std::printf("  %-44s worst error %.3g of tolerance (element %zu)\n", what.c_str(), worst,
              worst_i);
}

inline void expect_equal(const Vec& got, const Vec& ref, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  std::size_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &ref[i], 4) != 0) {
      if (bad < 5) ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << ref[i];
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements differ";
}

inline double max_abs(const Vec& x) {
  double m = 0.0;
  for (float e : x) m = std::max(m, std::fabs(static_cast<double>(e)));
  return m;
}

// Rows [0, rows) x columns [0, width) of a [rows, ld] buffer, dense.
inline Vec cols(const Vec& x, int rows, int width, int ld) {
  Vec y(static_cast<std::size_t>(rows) * width);
  for (int t = 0; t < rows; ++t)
    for (int c = 0; c < width; ++c) y[std::size_t(t) * width + c] = x[std::size_t(t) * ld + c];
  return y;
}

// ---- fixture ------------------------------------------------------------------------------
class Cuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::device_available())
      GTEST_SKIP() << "no CUDA device visible (cudaGetDeviceCount finds none): the CUDA kernels "
                      "are built but can only be checked on a machine with a GPU";
    // A blocking stream: it also orders itself after the uploads (legacy default stream).
    SPPO_CUDA_CHECK(cudaStreamCreate(&stream_));
  }
  void TearDown() override {
    if (stream_ != nullptr) {
      SPPO_CUDA_CHECK(cudaStreamSynchronize(stream_));
      SPPO_CUDA_CHECK(cudaStreamDestroy(stream_));
    }
  }
  cudaStream_t stream_ = nullptr;
  std::mt19937 rng_{12345};
};

}  // namespace sppo::testing
