// The fused attention library of the CPU emulation (run.sh): backends/cuda/sdpa.h's interface
// over tests/support/sdpa_reference.h (float64, cuDNN's documented semantics), so that the
// CUDA backend's library attention (library_attention.cpp) runs without a GPU. It takes what
// cuDNN takes on Hopper (bf16, head sizes a multiple of 8 up to 256, query heads a multiple
// of key/value heads, the bottom-right mask over no more rows than keys) and refuses the rest;
// a padded graph's rows and keys past a call's lengths are left NaN in its outputs, and its
// workspace is filled with NaN, so that a caller that reads either shows it.
#include <cuda_bf16.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "backends/cuda/sdpa.h"
#include "core/check.h"
#include "support/sdpa_reference.h"

namespace sppo::cuda {

namespace {

double load(const void* p, i64 i, DType t) {
  if (t == DType::BF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  return static_cast<const float*>(p)[i];
}
void store(void* p, i64 i, double x, DType t) {
  if (t == DType::BF16) static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(float(x));
  else static_cast<float*>(p)[i] = float(x);
}
void fill_nan(void* p, i64 n, DType t) {
  for (i64 i = 0; i < n; ++i) store(p, i, std::numeric_limits<double>::quiet_NaN(), t);
}

class ReferenceSdpa final : public SdpaLibrary {
 public:
  std::string name() const override { return "the emulation's reference SDPA"; }

  std::string check(const SdpaGraphKey& k) override {
    if (k.act != DType::BF16) return "bf16 only";
    if (k.A % 8 != 0 || k.A > 256) return "head size a multiple of 8, at most 256";
    if (k.Zkv <= 0 || k.Z % k.Zkv != 0) return "query heads a multiple of key/value heads";
    if (k.mask == PieceMask::BottomRight && k.rows > k.keys) return "bottom-right mask over more rows than keys";
    return "";
  }

  // Something to carve, as a real library's graphs ask: the backward's fp32 dQ accumulator.
  std::size_t workspace_bytes(const SdpaGraphKey& k) override {
    SPPO_CHECK(check(k).empty(), "attention") << "refused: " << check(k);
    ++builds_;
    return k.backward ? std::size_t(k.rows) * k.Z * k.A * sizeof(float) : 256;
  }

  void forward(const SdpaGraphKey& k, const SdpaForwardCall& c, void* workspace, cudaStream_t) override {
    const auto [rows, keys] = lengths(k, c.seq_lens);
    poison(k, workspace);
    fill_nan(c.o, i64(k.rows) * k.Z * k.A, k.act);
    fill_nan(c.stats, i64(k.rows) * k.Z, DType::F32);
    const testing::SdpaRefShape s = shape(k, rows, keys);
    const i64 za = i64(k.Z) * k.A;
    testing::sdpa_reference_forward(
        s,
        [&](char t, int i, int h, int a) {
          if (t == 'q') return load(c.q, i * k.ldq + h * k.A + a, k.act);
          return load(t == 'k' ? c.k : c.v, i * (t == 'k' ? k.ldk : k.ldv) + h * k.A + a, k.act);
        },
        [&](char, int i, int h, int a, double v) { store(c.o, i * za + h * k.A + a, v, k.act); },
        [&](int i, int h, double v) { c.stats[i64(h) * k.rows + i] = float(v); });
  }

  void backward(const SdpaGraphKey& k, const SdpaBackwardCall& c, void* workspace, cudaStream_t) override {
    const auto [rows, keys] = lengths(k, c.seq_lens);
    poison(k, workspace);
    const i64 za = i64(k.Z) * k.A, ga = i64(k.Zkv) * k.A;
    fill_nan(c.dq, k.rows * za, k.act);
    fill_nan(c.dk, k.keys * ga, k.act);
    fill_nan(c.dv, k.keys * ga, k.act);
    const testing::SdpaRefShape s = shape(k, rows, keys);
    testing::sdpa_reference_backward(
        s,
        [&](char t, int i, int h, int a) {
          switch (t) {
            case 'q': return load(c.q, i * k.ldq + h * k.A + a, k.act);
            case 'o': return load(c.o, i * za + h * k.A + a, k.act);
            case 'd': return load(c.dout, i * k.ld_dout + h * k.A + a, k.act);
            case 'k': return load(c.k, i * k.ldk + h * k.A + a, k.act);
            default: return load(c.v, i * k.ldv + h * k.A + a, k.act);
          }
        },
        [&](int i, int h) { return double(c.stats[i64(h) * k.rows + i]); },
        [&](char t, int i, int h, int a, double v) {
          if (t == 'q') store(c.dq, i * za + h * k.A + a, v, k.act);
          else store(t == 'k' ? c.dk : c.dv, i * ga + h * k.A + a, v, k.act);
        });
  }

  BuildStats build_stats() const override { return {builds_, 0, 0}; }

 private:
  static std::pair<int, int> lengths(const SdpaGraphKey& k, const int* seq_lens) {
    if (!k.padded) return {k.rows, k.keys};
    SPPO_ASSERT_MSG(seq_lens && seq_lens[0] >= 1 && seq_lens[0] <= k.rows && seq_lens[1] >= 1 &&
                        seq_lens[1] <= k.keys,
                    "a padded call's lengths outside its graph's");
    return {seq_lens[0], seq_lens[1]};
  }
  static testing::SdpaRefShape shape(const SdpaGraphKey& k, int rows, int keys) {
    SPPO_ASSERT_MSG(k.mask == PieceMask::None || rows <= keys, "bottom-right mask over more rows than keys");
    return {rows, keys, k.Z, k.Zkv, k.A, k.mask, 1.0 / std::sqrt(double(float(k.A)))};
  }
  void poison(const SdpaGraphKey& k, void* workspace) {
    const std::size_t n = k.backward ? std::size_t(k.rows) * k.Z * k.A : 64;
    fill_nan(workspace, i64(n), DType::F32);
  }

  int builds_ = 0;
};

}  // namespace

bool cudnn_sdpa_built() { return true; }
std::unique_ptr<SdpaLibrary> open_cudnn_sdpa() { return std::make_unique<ReferenceSdpa>(); }
std::string validate_cudnn_sdpa(const SdpaGraphKey&, int) { return "not in the emulation"; }

}  // namespace sppo::cuda
