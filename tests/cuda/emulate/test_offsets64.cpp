// The CUDA kernels on tensors past 2^31 elements, through the emulator: run.sh links this file
// into the emulated test program only, as it relies on the emulator's block filter and on
// device memory being host memory.
//
// Note [Far offsets in the emulator]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A kernel that forms an element offset in 32 bits (row * H in int, blockIdx.x * blockDim.x in
// unsigned) goes wrong only past 2^31 elements, so each test here hands a kernel a tensor
// longer than that: "device" memory is host memory in the emulator, mapped with MAP_NORESERVE
// so that it costs nothing until written (untouched pages read as zeros), and only the far end
// is filled with fresh random values. Two shapes get there:
//  - dense rows, T H > 2^31: the emulator runs every block on the CPU, so a launch runs only
//    the blocks that reach the far end (emu::g_run_block): the last blocks of a grid of rows,
//    or the block of a grid-stride loop whose threads reach element n - 1. Blocks left out
//    leave their outputs as they were; new device memory is zeros meanwhile
//    (emu::g_alloc_fill), so a reduction's partials of the left-out (all-zero) rows are zeros
//    too and the sums come out whole. Each output element the far blocks computed is compared
//    with the CPU kernel of the same contract run on those rows alone; every other element of
//    the far end must be untouched.
//  - a few rows of a huge stride (the copies, RoPE, attention): every block runs, every row is
//    checked, and the last rows lie past 2^31.
// A launch past CUDA's grid limits fails as on a GPU (emu.h).
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backends/cpu/attention.h"
#include "backends/cpu/ops.h"
#include "backends/cuda/attention.h"
#include "core/adamw.h"
#include "core/rope.h"
#include "cuda/cuda_test.h"

namespace sppo {
namespace {

using namespace sppo::testing;

constexpr i64 kPast31 = (i64{1} << 31) + 12345;  // elements of the element-wise tensors
constexpr double kU = 1.0 / 256.0;                // bf16 unit roundoff
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Memory that costs nothing until written: untouched pages read as zeros.
class Sparse {
 public:
  explicit Sparse(std::size_t bytes) : bytes_(bytes) {
    p_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    SPPO_ASSERT_MSG(p_ != MAP_FAILED, "mmap of " << bytes_ << " bytes (MAP_NORESERVE) failed");
  }
  Sparse(i64 elems, DType t) : Sparse(std::size_t(elems) * dtype_bytes(t)) {}
  ~Sparse() { munmap(p_, bytes_); }
  Sparse(const Sparse&) = delete;
  Sparse& operator=(const Sparse&) = delete;
  void* get() const { return p_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  std::size_t bytes_;
  void* p_;
};

// Element i of an activation buffer of type t.
float load(const void* p, DType t, i64 i) {
  return t == DType::F32 ? static_cast<const float*>(p)[i] : bf16_value(static_cast<const std::uint16_t*>(p)[i]);
}
void store(void* p, DType t, i64 i, float x) {
  if (t == DType::F32) static_cast<float*>(p)[i] = x;
  else static_cast<std::uint16_t*>(p)[i] = bf16_bits(x);
}
bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

// Elements [from, from + n) of p (type t) as floats, and back.
Vec gather(const void* p, DType t, i64 from, i64 n) {
  Vec v(static_cast<std::size_t>(n));
  for (i64 i = 0; i < n; ++i) v[std::size_t(i)] = load(p, t, from + i);
  return v;
}
// Rows [r0, r0 + rows) x columns [c0, c0 + width) of a [., ld] buffer, dense.
Vec gather_rows(const void* p, DType t, i64 ld, i64 r0, int rows, i64 c0, int width) {
  Vec v(std::size_t(rows) * width);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < width; ++c) v[std::size_t(r) * width + c] = load(p, t, (r0 + r) * ld + c0 + c);
  return v;
}
void scatter_rows(void* p, DType t, i64 ld, i64 r0, int rows, i64 c0, int width, const Vec& v) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < width; ++c) store(p, t, (r0 + r) * ld + c0 + c, v[std::size_t(r) * width + c]);
}

// Runs only the blocks `pick` takes, on zero-filled new memory, until destroyed
// (Note [Far offsets in the emulator]).
class Window {
 public:
  explicit Window(std::function<bool(const dim3&, const dim3&, const uint3&)> pick) {
    emu::g_run_block = std::move(pick);
    emu::g_alloc_fill = 0;
  }
  ~Window() {
    emu::g_run_block = nullptr;
    emu::g_alloc_fill = 0x5A;
  }
  Window(const Window&) = delete;
  Window& operator=(const Window&) = delete;
};

// The last k blocks along x of every launch (all along y and z).
auto last_blocks(unsigned k) {
  return [k](const dim3& grid, const dim3&, const uint3& b) { return b.x + k >= grid.x; };
}

// A grid-stride loop over n elements: thread j of the grid computes j, j + stride, ... The
// block that reaches element n - 1, and what it computes.
struct GridStride {
  i64 n = 0, stride = 0;
  int threads = 0;
  std::function<bool(const dim3&, const dim3&, const uint3&)> pick() {
    return [this](const dim3& grid, const dim3& block, const uint3& b) {
      stride = i64(grid.x) * block.x;
      threads = int(block.x);
      return i64(b.x) == owner() && b.y == 0 && b.z == 0;
    };
  }
  i64 owner() const { return ((n - 1) % stride) / threads; }
  bool computes(i64 i) const { return (i % stride) / threads == owner(); }
};

// Fresh random values (never zero) at elements [from, from + n) of p.
void fill_random(void* p, DType t, i64 from, i64 n, std::mt19937& rng, float scale = 1.0f, float shift = 0.0f) {
  const Vec v = randn(std::size_t(n), rng, scale);
  for (i64 i = 0; i < n; ++i) store(p, t, from + i, v[std::size_t(i)] + shift);
}
void fill(void* p, DType t, i64 from, i64 n, float x) {
  for (i64 i = 0; i < n; ++i) store(p, t, from + i, x);
}

// =============================================================================================
// Element-wise kernels: grid-stride loops over n > 2^31 elements
// =============================================================================================

// The far end checked: its elements the far block computed against `ref` (computed on those
// elements alone), the others against what they held before.
struct FarEnd {
  i64 from;
  std::vector<i64> index;  // computed elements, ascending
};
FarEnd far_end(const GridStride& g, i64 tail) {
  FarEnd f{g.n - tail, {}};
  for (i64 i = f.from; i < g.n; ++i)
    if (g.computes(i)) f.index.push_back(i);
  return f;
}
Vec pick(const void* p, DType t, const std::vector<i64>& index) {
  Vec v(index.size());
  for (std::size_t k = 0; k < index.size(); ++k) v[k] = load(p, t, index[k]);
  return v;
}
// The computed elements' values in `before`, a copy of the far end.
Vec pick(const Vec& before, const FarEnd& f) {
  Vec v(f.index.size());
  for (std::size_t k = 0; k < f.index.size(); ++k) v[k] = before[std::size_t(f.index[k] - f.from)];
  return v;
}
void expect_rest_untouched(const void* p, DType t, const FarEnd& f, i64 n, const Vec& before, const std::string& what) {
  std::size_t k = 0, bad = 0;
  for (i64 i = f.from; i < n; ++i) {
    if (k < f.index.size() && f.index[k] == i) {
      ++k;
      continue;
    }
    if (!same_bits(load(p, t, i), before[std::size_t(i - f.from)]) && bad++ < 5)
      ADD_FAILURE() << what << ": element " << i << " was written by a block that does not own it";
  }
  EXPECT_EQ(bad, 0u) << what;
}

constexpr i64 kTail = i64{1} << 20;  // elements of the far end filled and checked

TEST_F(Cuda, Offsets64ElementWise) {
  const i64 n = kPast31;
  GridStride g{n};
  Window w(g.pick());
  const DType bf = DType::BF16, f32 = DType::F32;

  // convert fp32 -> bf16; add_inplace; gelu forward and backward (bf16 activations).
  Sparse src(n, f32), x(n, bf), y(n, bf), out(n, bf), dout(n, bf);
  fill_random(src.get(), f32, n - kTail, kTail, rng_, 3.0f);
  fill_random(x.get(), bf, n - kTail, kTail, rng_, 3.0f);
  fill_random(y.get(), bf, n - kTail, kTail, rng_);
  fill_random(dout.get(), bf, n - kTail, kTail, rng_);
  fill(out.get(), bf, n - kTail, kTail, kNaN);
  const Vec y0 = gather(y.get(), bf, n - kTail, kTail), out0 = gather(out.get(), bf, n - kTail, kTail),
            dout0 = gather(dout.get(), bf, n - kTail, kTail);

  cuda::convert(out.get(), bf, src.get(), f32, n, stream_);
  const FarEnd f = far_end(g, kTail);
  ASSERT_EQ(f.index.back(), n - 1);
  Vec ref = pick(src.get(), f32, f.index);
  for (float& e : ref) e = round_bf16(e);
  expect_equal(pick(out.get(), bf, f.index), ref, "convert f32 -> bf16");
  expect_rest_untouched(out.get(), bf, f, n, out0, "convert");

  cuda::add_inplace(y.get(), bf, x.get(), bf, n, stream_);
  ref = pick(x.get(), bf, f.index);
  const Vec ys = pick(y0, f);
  for (std::size_t k = 0; k < ref.size(); ++k) ref[k] = round_bf16(ys[k] + ref[k]);
  expect_equal(pick(y.get(), bf, f.index), ref, "add_inplace bf16");
  expect_rest_untouched(y.get(), bf, f, n, y0, "add_inplace");

  fill(out.get(), bf, n - kTail, kTail, kNaN);
  cuda::gelu_forward(out.get(), x.get(), n, bf, stream_);
  const Vec xs = pick(x.get(), bf, f.index);
  ref.assign(xs.size(), 0.0f);
  cpu::gelu_forward(ref.data(), xs.data(), i64(xs.size()));
  expect_close(pick(out.get(), bf, f.index), ref, 1e-6, kU + 1e-4, "gelu_forward far end");
  expect_rest_untouched(out.get(), bf, f, n, out0, "gelu_forward");

  cuda::gelu_backward(dout.get(), dout.get(), x.get(), n, bf, stream_);  // din aliases dout
  const Vec dys = pick(dout0, f);
  ref.assign(xs.size(), 0.0f);
  cpu::gelu_backward(ref.data(), dys.data(), xs.data(), i64(xs.size()));
  expect_close(pick(dout.get(), bf, f.index), ref, 1e-6 * max_abs(dys), kU + 1e-4, "gelu_backward far end");
  expect_rest_untouched(dout.get(), bf, f, n, dout0, "gelu_backward");
}

// The optimizer's kernels on fp32 arrays of n > 2^31 (a model's flat parameters).
TEST_F(Cuda, Offsets64Optimizer) {
  const i64 n = kPast31;
  GridStride g{n};
  Window w(g.pick());
  const DType f32 = DType::F32;
  Sparse p(n, f32), m(n, f32), v(n, f32), gr(n, f32);
  fill_random(p.get(), f32, n - kTail, kTail, rng_);
  fill_random(m.get(), f32, n - kTail, kTail, rng_, 0.1f);
  fill_random(gr.get(), f32, n - kTail, kTail, rng_);
  Vec v0 = randn(std::size_t(kTail), rng_, 0.1f);
  for (i64 i = 0; i < kTail; ++i) v.as<float>()[n - kTail + i] = v0[std::size_t(i)] * v0[std::size_t(i)];
  const Vec p0 = gather(p.get(), f32, n - kTail, kTail), m0 = gather(m.get(), f32, n - kTail, kTail);
  v0 = gather(v.get(), f32, n - kTail, kTail);

  cuda::scale_inplace(p.as<float>(), n, 0.75f, stream_);
  const FarEnd f = far_end(g, kTail);
  ASSERT_EQ(f.index.back(), n - 1);
  Vec ref = pick(p0, f);
  for (float& e : ref) e *= 0.75f;
  expect_equal(pick(p.get(), f32, f.index), ref, "scale_inplace far end");
  expect_rest_untouched(p.get(), f32, f, n, p0, "scale_inplace");

  // AdamW: the CPU's step on the far block's elements alone.
  const Vec p1 = gather(p.get(), f32, n - kTail, kTail);
  cuda::adamw_step(p.as<float>(), m.as<float>(), v.as<float>(), gr.as<float>(), n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3,
                   stream_, nullptr);
  Vec pm = pick(p1, f), mm = pick(m0, f), vm = pick(v0, f);
  const Vec gs = pick(gr.get(), f32, f.index);
  cpu::adamw_step(pm.data(), mm.data(), vm.data(), gs.data(), i64(pm.size()), 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3);
  // The GPU's kernel contracts products into FMAs where the CPU's need not: fp32 rounding.
  expect_close(pick(p.get(), f32, f.index), pm, 1e-7, 1e-6, "adamw p far end");
  expect_close(pick(m.get(), f32, f.index), mm, 1e-7, 1e-6, "adamw m far end");
  expect_close(pick(v.get(), f32, f.index), vm, 1e-9, 1e-6, "adamw v far end");
  expect_rest_untouched(p.get(), f32, f, n, p1, "adamw p");
  expect_rest_untouched(v.get(), f32, f, n, v0, "adamw v");
}

// SwiGLU over [T, F] with T F > 2^31: row t of gu is 2F wide, so its offset passes 2^32.
TEST_F(Cuda, Offsets64SwiGlu) {
  const int F = 1 << 15, T = (1 << 16) + 1;
  const i64 n = i64(T) * F;
  const int rows = int(kTail / F);  // the far rows filled and checked
  GridStride g{n};
  Window w(g.pick());
  const DType bf = DType::BF16;
  Sparse gu(2 * n, bf), out(n, bf), dgu(2 * n, bf);
  fill_random(gu.get(), bf, (T - rows) * 2 * i64(F), i64(rows) * 2 * F, rng_, 3.0f);
  fill_random(dgu.get(), bf, (T - rows) * 2 * i64(F), i64(rows) * 2 * F, rng_);
  fill(out.get(), bf, n - kTail, kTail, kNaN);
  const Vec out0 = gather(out.get(), bf, n - kTail, kTail);
  const Vec gu_rows = gather(gu.get(), bf, (T - rows) * 2 * i64(F), i64(rows) * 2 * F);
  const Vec dgu0 = gather(dgu.get(), bf, (T - rows) * 2 * i64(F), i64(rows) * 2 * F);

  cuda::swiglu_forward(out.get(), gu.get(), T, F, bf, stream_);
  const FarEnd f = far_end(g, kTail);
  ASSERT_EQ(f.index.back(), n - 1);
  Vec all(std::size_t(rows) * F);
  cpu::swiglu_forward(all.data(), gu_rows.data(), rows, F);
  const Vec ref = pick(all, f);  // the far end of out is the far rows' last kTail elements
  expect_close(pick(out.get(), bf, f.index), ref, 1e-6 * max_abs(all), kU + 1e-4, "swiglu_forward far end");
  expect_rest_untouched(out.get(), bf, f, n, out0, "swiglu_forward");

  // Backward in place: element (t, j) of the far block writes dgu[t, j] and dgu[t, F + j].
  cuda::swiglu_backward(dgu.get(), gu.get(), T, F, bf, stream_);
  Vec dall = dgu0;
  cpu::swiglu_backward(dall.data(), gu_rows.data(), rows, F);
  std::size_t bad = 0;
  const double atol = 1e-6 * max_abs(dall);
  for (i64 i = n - kTail; i < n; ++i) {
    const i64 t = i / F, j = i % F, r = t - (T - rows);
    for (const i64 col : {j, F + j}) {
      const std::size_t at = std::size_t(r * 2 * F + col);
      const float got = load(dgu.get(), bf, t * 2 * F + col);
      const float want = g.computes(i) ? round_bf16(dall[at]) : dgu0[at];
      const bool ok = g.computes(i) ? std::fabs(got - want) <= (kU + 1e-4) * std::fabs(want) + atol
                                    : same_bits(got, want);
      if (!ok && bad++ < 5) ADD_FAILURE() << "swiglu_backward dgu[" << t << ", " << col << "]: got " << got << ", want " << want;
    }
  }
  EXPECT_EQ(bad, 0u) << "swiglu_backward far end";
}

// =============================================================================================
// Strided rows: the copies and RoPE on a few rows of a stride that puts the last past 2^31
// =============================================================================================

// 80 rows 2^25 + 64 elements apart: rows 64 on start past 2^31, and every kernel runs whole.
constexpr int kRows = 80;
constexpr int kLd = (1 << 25) + 64;
static_assert(i64(64) * kLd > (i64{1} << 31));

TEST_F(Cuda, Offsets64CopiesAndRope) {
  const int width = 64, col = 192;
  for (const DType t : {DType::F32, DType::BF16}) {
    const std::string tag = name(t);
    Sparse big(i64(kRows) * kLd, t);
    const Vec dense = rounded(randn(std::size_t(kRows) * width, rng_), t);
    Dev d = upload(dense, t);
    // put_cols: dense rows -> columns [col, col + width) of the strided rows (all blocks run).
    cuda::put_cols(big.get(), t, d.get(), t, kRows, width, kLd, col, stream_);
    expect_equal(gather_rows(big.get(), t, kLd, 0, kRows, col, width), dense, "put_cols " + tag);
    // copy_cols: and back.
    Dev back(dense.size() * 4);
    cuda::copy_cols(back.get(), t, big.get(), t, kRows, width, kLd, col, stream_);
    expect_equal(download(back, dense.size(), t), dense, "copy_cols " + tag);
    // add_rows: strided += dense.
    const Vec more = rounded(randn(dense.size(), rng_), t);
    Dev m = upload(more, t);
    cuda::add_rows(static_cast<char*>(big.get()) + std::size_t(col) * dtype_bytes(t), t, kLd, m.get(), t, width, kRows,
                   width, stream_);
    Vec sum(dense.size());
    for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = t == DType::BF16 ? round_bf16(dense[i] + more[i]) : dense[i] + more[i];
    expect_equal(gather_rows(big.get(), t, kLd, 0, kRows, col, width), sum, "add_rows " + tag);
    // copy_rows: strided -> dense, converting to fp32.
    Dev f(dense.size() * 4);
    cuda::copy_rows(f.get(), DType::F32, width, static_cast<char*>(big.get()) + std::size_t(col) * dtype_bytes(t), t,
                    kLd, kRows, width, stream_);
    expect_equal(download(f, dense.size(), DType::F32), sum, "copy_rows " + tag);
    // zero_cols.
    cuda::zero_cols(big.get(), t, kRows, width / 2, kLd, col, stream_);
    Vec half = sum;
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < width / 2; ++c) half[std::size_t(r) * width + c] = 0.0f;
    expect_equal(gather_rows(big.get(), t, kLd, 0, kRows, col, width), half, "zero_cols " + tag);

    // RoPE on Z heads of A at the start of each strided row, at positions past 10^6.
    const int Z = 2, A = 64;
    const i64 pos0 = 1000003;
    const RopeTable table = rope_table(A, 10000.0);
    const Vec x0 = rounded(randn(std::size_t(kRows) * Z * A, rng_), t);
    scatter_rows(big.get(), t, kLd, 0, kRows, 0, Z * A, x0);
    Vec ref = x0;
    cpu::rope_forward(ref.data(), kRows, Z, A, pos0, table, Z * A);
    cuda::rope_forward(big.get(), kRows, Z, A, pos0, table, kLd, t, stream_);
    expect_close(gather_rows(big.get(), t, kLd, 0, kRows, 0, Z * A), ref, 1e-5 * max_abs(x0),
                 t == DType::BF16 ? kU + 1e-4 : 1e-4, "rope_forward strided " + tag);
  }
}

// =============================================================================================
// Norms: one warp a row, and the row-block partials of dw and db
// =============================================================================================

// 2^24 + 256 rows of 128 (the per-head norms' shape: T Z rows of A): past 2^31 elements, and
// 65537 row blocks of the dw reduction, more than a grid's y can hold (65535).
constexpr int kNormRows = (1 << 24) + 256, kNormH = 128, kNormFar = 64;

TEST_F(Cuda, Offsets64Norms) {
  const int T = kNormRows, H = kNormH, far = kNormFar, t0 = T - far;
  const DType bf = DType::BF16;
  const i64 at = i64(t0) * H, n = i64(far) * H;
  Window w(last_blocks(4));  // rows T - 32 .. T - 1 of the row kernels, T - 1024 .. of the partials
  Sparse x(i64(T) * H, bf), y(i64(T) * H, bf), out(i64(T) * H, bf), dout(i64(T) * H, bf), dx(i64(T) * H, bf);
  Sparse mean(T, DType::F32), rstd(T, DType::F32);
  fill_random(x.get(), bf, at, n, rng_, 2.0f, 3.0f);  // a mean far from 0
  fill_random(y.get(), bf, at, n, rng_);
  fill_random(dout.get(), bf, at, n, rng_);
  fill_random(dx.get(), bf, at, n, rng_);
  const Vec xs = gather(x.get(), bf, at, n), ys = gather(y.get(), bf, at, n), gs = gather(dout.get(), bf, at, n),
            dx0 = gather(dx.get(), bf, at, n);
  const Vec wv = randn(H, rng_), bv = randn(H, rng_);
  Dev wd = upload(wv, DType::F32), bd = upload(bv, DType::F32);

  // The rows the far blocks computed: those whose output is no longer NaN. The last must be one.
  const auto computed_rows = [&](const void* p) {
    std::vector<int> r;
    for (int t = 0; t < far; ++t)
      if (!std::isnan(load(p, bf, at + i64(t) * H))) r.push_back(t);
    return r;
  };
  const auto check_rows = [&](const void* p, const Vec& ref, const std::vector<int>& rows, const std::string& what) {
    ASSERT_FALSE(rows.empty()) << what << ": no far row computed";
    ASSERT_EQ(rows.back(), far - 1) << what << ": the last row was not computed";
    Vec got, want;
    for (int t = 0; t < far; ++t) {
      const bool done = std::find(rows.begin(), rows.end(), t) != rows.end();
      for (int h = 0; h < H; ++h) {
        const float g = load(p, bf, at + i64(t) * H + h);
        if (done) got.push_back(g), want.push_back(ref[std::size_t(t) * H + h]);
        else EXPECT_TRUE(std::isnan(g)) << what << ": row " << t0 + t << " written by a block that does not own it";
      }
    }
    expect_close(got, want, 1e-5 * max_abs(want), kU + 1e-4, what);
  };

  for (const bool rms : {false, true}) {
    const std::string tag = rms ? "rmsnorm" : "layernorm";
    fill(out.get(), bf, at, n, kNaN);
    fill(mean.get(), DType::F32, t0, far, kNaN);
    fill(rstd.get(), DType::F32, t0, far, kNaN);
    Vec ref(static_cast<std::size_t>(n)), mr(far), rr(far);
    if (rms) {
      cpu::rmsnorm_forward(ref.data(), rr.data(), xs.data(), wv.data(), far, H, 1e-6f);
      cuda::rmsnorm_forward(out.get(), rstd.as<float>(), x.get(), wd.as<float>(), T, H, 1e-6f, bf, stream_);
    } else {
      cpu::layernorm_forward(ref.data(), mr.data(), rr.data(), xs.data(), wv.data(), bv.data(), far, H, 1e-5f);
      cuda::layernorm_forward(out.get(), mean.as<float>(), rstd.as<float>(), x.get(), wd.as<float>(), bd.as<float>(),
                              T, H, 1e-5f, bf, stream_);
    }
    const std::vector<int> rows = computed_rows(out.get());
    check_rows(out.get(), ref, rows, tag + " forward far rows");
    for (int t : rows) {
      EXPECT_NEAR(rstd.as<float>()[t0 + t], rr[t], 1e-6 * rr[t]) << tag << " rstd of row " << t0 + t;
      if (!rms) EXPECT_NEAR(mean.as<float>()[t0 + t], mr[t], 1e-6 * std::fabs(mr[t])) << "mean of row " << t0 + t;
    }

    // The residual add fused with the norm: y += x, then the norm of y.
    Sparse y2(i64(T) * H, bf);
    for (i64 i = 0; i < n; ++i) store(y2.get(), bf, at + i, ys[std::size_t(i)]);
    fill(out.get(), bf, at, n, kNaN);
    Vec sum(static_cast<std::size_t>(n)), ref2(static_cast<std::size_t>(n));
    for (i64 i = 0; i < n; ++i) sum[std::size_t(i)] = round_bf16(ys[std::size_t(i)] + xs[std::size_t(i)]);
    if (rms) cpu::rmsnorm_forward(ref2.data(), rr.data(), sum.data(), wv.data(), far, H, 1e-6f);
    else cpu::layernorm_forward(ref2.data(), mr.data(), rr.data(), sum.data(), wv.data(), bv.data(), far, H, 1e-5f);
    cuda::add_norm_forward(y2.get(), x.get(), out.get(), mean.as<float>(), rstd.as<float>(), wd.as<float>(),
                           bd.as<float>(), T, H, rms ? 1e-6f : 1e-5f, rms, bf, stream_);
    check_rows(out.get(), ref2, computed_rows(out.get()), tag + " add_norm far rows");

    // Backward, from the statistics of x: dx accumulates into the far rows, dw (db) into
    // non-zero starts from every row; only the far rows are not zero.
    if (rms) cpu::rmsnorm_forward(ref.data(), rr.data(), xs.data(), wv.data(), far, H, 1e-6f);
    else cpu::layernorm_forward(ref.data(), mr.data(), rr.data(), xs.data(), wv.data(), bv.data(), far, H, 1e-5f);
    for (int t = 0; t < far; ++t) mean.as<float>()[t0 + t] = mr[t], rstd.as<float>()[t0 + t] = rr[t];
    for (i64 i = 0; i < n; ++i) store(dx.get(), bf, at + i, dx0[std::size_t(i)]);
    const Vec dw0 = randn(H, rng_), db0 = randn(H, rng_);
    Vec dxr = dx0, dwr = dw0, dbr = db0;
    Dev dwd = upload(dw0, DType::F32), dbd = upload(db0, DType::F32);
    if (rms) {
      cpu::rmsnorm_backward(dxr.data(), dwr.data(), gs.data(), xs.data(), wv.data(), rr.data(), far, H);
      cuda::rmsnorm_backward(dx.get(), dwd.as<float>(), dout.get(), x.get(), wd.as<float>(), rstd.as<float>(), T, H,
                             bf, stream_);
    } else {
      cpu::layernorm_backward(dxr.data(), dwr.data(), dbr.data(), gs.data(), xs.data(), wv.data(), mr.data(),
                              rr.data(), far, H);
      cuda::layernorm_backward(dx.get(), dwd.as<float>(), dbd.as<float>(), dout.get(), x.get(), wd.as<float>(),
                               mean.as<float>(), rstd.as<float>(), T, H, bf, stream_);
    }
    Vec got, want;
    int last = -1;
    for (int t = 0; t < far; ++t) {
      const Vec row = gather(dx.get(), bf, at + i64(t) * H, H);
      bool changed = false;
      for (int h = 0; h < H; ++h) changed = changed || !same_bits(row[h], dx0[std::size_t(t) * H + h]);
      if (!changed) continue;
      last = t;
      got.insert(got.end(), row.begin(), row.end());
      want.insert(want.end(), dxr.begin() + std::ptrdiff_t(t) * H, dxr.begin() + std::ptrdiff_t(t + 1) * H);
    }
    ASSERT_EQ(last, far - 1) << tag << " backward: the last row's dx was not computed";
    expect_close(got, want, 1e-5 * max_abs(dxr), kU + 1e-4, tag + " dx far rows");
    expect_close(download(dwd, H, DType::F32), dwr, 1e-6 * max_abs(dwr), 1e-5, tag + " dw");
    if (!rms) expect_close(download(dbd, H, DType::F32), dbr, 1e-6 * max_abs(dbr), 1e-5, tag + " db");
  }
}

// =============================================================================================
// Cross-entropy and softmax: one block a row of V logits, T V > 2^31
// =============================================================================================

TEST_F(Cuda, Offsets64CrossEntropyAndSoftmax) {
  const int V = 1 << 17, T = (1 << 14) + 1, far = 2;
  const i64 at = i64(T - far) * V, n = i64(far) * V;
  Window w(last_blocks(far));
  Sparse logits(i64(T) * V, DType::F32), dlogits(i64(T) * V, DType::BF16), dx(i64(T) * V, DType::F32);
  fill_random(logits.get(), DType::F32, at, n, rng_, 3.0f);
  const Vec lg = gather(logits.get(), DType::F32, at, n);
  std::vector<std::int32_t> targets = rand_ids(T, V, rng_);
  targets[T - 2] = kNoTarget;  // a row that is not predicted, at the far end
  const std::vector<std::int32_t> far_targets(targets.end() - far, targets.end());
  const float scale = 1.0f / 37.0f;
  const auto far_losses = [&](const Vec& losses) { return Vec(losses.end() - far, losses.end()); };

  // xent: dlogits (bf16) and the losses of the far rows; the sum of every row's loss (the rows
  // left out lost nothing: their partials are zeros).
  Vec losses(T, kNaN), ref = lg, lref(far);
  double loss_sum = 0.25;
  const double sum = cpu::xent_forward_backward(ref.data(), lref.data(), far_targets.data(), far, V, scale);
  cuda::xent_forward_backward(dlogits.get(), DType::BF16, losses.data(), &loss_sum, logits.as<float>(),
                              targets.data(), T, V, scale, stream_);
  expect_close(gather(dlogits.get(), DType::BF16, at, n), ref, 1e-7 * scale, kU + 1e-4, "xent dlogits far rows");
  expect_close(far_losses(losses), lref, 1e-5, 1e-5, "xent losses far rows");
  EXPECT_NEAR(loss_sum, 0.25 + sum, 1e-5 * (0.25 + std::fabs(sum)));

  // row_logsumexp and the vocabulary-parallel cross-entropy over this shard.
  Vec lse(T, kNaN), lse_ref(far);
  cpu::row_logsumexp(lse_ref.data(), lg.data(), far, V);
  cuda::row_logsumexp(lse.data(), logits.as<float>(), T, V, stream_);
  expect_close(far_losses(lse), lse_ref, 1e-5, 1e-6, "row_logsumexp far rows");
  const int v0 = 12345, parts = 2;
  std::vector<std::int32_t> shard_targets = targets;
  shard_targets[T - 1] = v0 + 777;  // in this shard; row T - 2 is not predicted
  Vec lse_parts(std::size_t(parts) * T, 0.0f), far_parts(std::size_t(parts) * far);
  for (int t = 0; t < far; ++t) {
    lse_parts[std::size_t(T - far + t)] = lse_ref[t];
    lse_parts[std::size_t(T + T - far + t)] = lse_ref[t] + 0.5f;  // the other shard's
    far_parts[std::size_t(t)] = lse_ref[t], far_parts[std::size_t(far + t)] = lse_ref[t] + 0.5f;
  }
  const std::vector<std::int32_t> far_shard(shard_targets.end() - far, shard_targets.end());
  Vec sref(static_cast<std::size_t>(n)), slref(far);
  std::fill(losses.begin(), losses.end(), kNaN);
  loss_sum = 0.25;
  const double ssum =
      cpu::xent_shard(sref.data(), slref.data(), lg.data(), far_parts.data(), parts, far_shard.data(), far, V, v0, scale);
  cuda::xent_shard(dlogits.get(), DType::BF16, losses.data(), &loss_sum, logits.as<float>(), lse_parts.data(), parts,
                   shard_targets.data(), T, V, v0, scale, stream_);
  expect_close(gather(dlogits.get(), DType::BF16, at, n), sref, 1e-7 * scale, kU + 1e-4, "xent_shard far rows");
  expect_close(far_losses(losses), slref, 1e-5, 1e-5, "xent_shard losses far rows");
  EXPECT_NEAR(loss_sum, 0.25 + ssum, 1e-5 * (0.25 + std::fabs(ssum)));

  // softmax over rows (i64 rows), in place, then its backward.
  Vec p = lg, plse(far);
  cpu::softmax_rows(p.data(), plse.data(), far, V, false);
  std::fill(lse.begin(), lse.end(), kNaN);
  cuda::softmax_rows(logits.as<float>(), lse.data(), T, V, false, stream_);
  expect_close(gather(logits.get(), DType::F32, at, n), p, 1e-7, 1e-5, "softmax_rows far rows");
  expect_close(far_losses(lse), plse, 1e-5, 1e-6, "softmax_rows lse far rows");
  fill_random(dx.get(), DType::F32, at, n, rng_);
  Vec dref = gather(dx.get(), DType::F32, at, n);
  cpu::softmax_backward_rows(dref.data(), p.data(), far, V);
  cuda::softmax_backward_rows(dx.as<float>(), logits.as<float>(), T, V, stream_);
  expect_close(gather(dx.get(), DType::F32, at, n), dref, 1e-7, 1e-5, "softmax_backward_rows far rows");
}

// =============================================================================================
// Attention: rows of a stride that puts the last query, key and output rows past 2^31
// =============================================================================================

// Rows [0, rows) of a [rows, ld] buffer (columns [0, width)) against a dense reference, within
// atol_frac of its largest |value| plus rtol.
void expect_rows(const void* p, DType t, i64 ld, int rows, int width, const Vec& ref, double atol_frac, double rtol,
                 const std::string& what) {
  expect_close(gather_rows(p, t, ld, 0, rows, 0, width), ref, atol_frac * max_abs(ref), rtol, what);
}

// Causal self-attention of kRows queries and keys, Z = 2 query heads reading one key/value head,
// every row of q, k, v, out, dout, dq, dk, dv kLd apart (the last 16 past 2^31), the SIMT
// kernels in fp32 and the tensor-core kernels in bf16; every block runs (the grids are small)
// and every row is checked against the CPU's kernels.
void attention_strided_rows(DType t, cuda::AttnKernel kernel, std::mt19937& rng, cudaStream_t stream) {
  const int Z = 2, A = 64, T = kRows, W = Z * A;
  const std::string tag = t == DType::F32 ? "simt f32" : "tensor cores bf16";
  Sparse q(i64(T) * kLd, t), k(i64(T) * kLd, t), v(i64(T) * kLd, t), out(i64(T) * kLd, t), dout(i64(T) * kLd, t),
      dq(i64(T) * kLd, t), part_out(i64(T) * kLd, t);
  Sparse dk(i64(T) * kLd, DType::F32), dv(i64(T) * kLd, DType::F32);
  const Vec qs = rounded(randn(std::size_t(T) * W, rng), t), ks = rounded(randn(std::size_t(T) * A, rng), t),
            vs = rounded(randn(std::size_t(T) * A, rng), t), dos = rounded(randn(std::size_t(T) * W, rng), t),
            dq0 = rounded(randn(std::size_t(T) * W, rng), t), dk0 = randn(std::size_t(T) * A, rng),
            dv0 = randn(std::size_t(T) * A, rng);
  scatter_rows(q.get(), t, kLd, 0, T, 0, W, qs);
  scatter_rows(k.get(), t, kLd, 0, T, 0, A, ks);
  scatter_rows(v.get(), t, kLd, 0, T, 0, A, vs);
  scatter_rows(dout.get(), t, kLd, 0, T, 0, W, dos);
  scatter_rows(dq.get(), t, kLd, 0, T, 0, W, dq0);
  scatter_rows(dk.get(), DType::F32, kLd, 0, T, 0, A, dk0);
  scatter_rows(dv.get(), DType::F32, kLd, 0, T, 0, A, dv0);
  cpu::AttnDims cd;
  cd.Tq = T, cd.Z = Z, cd.A = A, cd.Zkv = 1;
  cuda::AttnDims gd;
  gd.Tq = T, gd.Z = Z, gd.A = A, gd.Zkv = 1;
  gd.ldq = gd.ldk = gd.ldv = gd.ldo = kLd;
  // Bounds (Note [Tolerances] in test_cuda_kernels.cpp, there per element): fp32 sums in two
  // orders; in bf16 the tensor cores round P and dS before multiplying, u times the sum of the
  // terms' magnitudes, here a few times the largest value. A row read from or written to the
  // wrong place is off by about the largest value.
  const double rtol = t == DType::BF16 ? kU + 1e-4 : 1e-4, atol = t == DType::BF16 ? 8 * kU : 1e-4;

  Vec ref(std::size_t(T) * W), lref(std::size_t(Z) * T), lse(std::size_t(Z) * T);
  cpu::attention_forward_blocks(ref.data(), lref.data(), qs.data(), {{ks.data(), vs.data(), nullptr, nullptr, T, 0}}, cd);
  cuda::attention_forward_blocks(out.get(), lse.data(), q.get(), {{k.get(), v.get(), nullptr, nullptr, T, 0}}, gd, t,
                                 stream, kernel);
  expect_rows(out.get(), t, kLd, T, W, ref, atol, rtol, "attention out " + tag);
  expect_close(lse, lref, 1e-3, 1e-4, "attention lse " + tag);

  // Backward from the CPU's lse and delta: dq, dk, dv accumulate.
  Vec delta(std::size_t(Z) * T), dgot(std::size_t(Z) * T), dref(std::size_t(Z) * T);
  cpu::attention_backward_delta(delta.data(), dos.data(), ref.data(), cd);
  cuda::attention_backward_delta(dgot.data(), dout.get(), out.get(), gd, t, stream);
  const Vec outs = gather_rows(out.get(), t, kLd, 0, T, 0, W);  // the GPU's delta is of the GPU's out
  cpu::attention_backward_delta(dref.data(), dos.data(), outs.data(), cd);
  expect_close(dgot, dref, 1e-6 * max_abs(dref), 1e-5, "attention delta " + tag);
  Vec dqr = dq0, dkr = dk0, dvr = dv0;
  cpu::attention_backward_blocks(dqr.data(), dos.data(), qs.data(), {{ks.data(), vs.data(), dkr.data(), dvr.data(), T, 0}},
                                 lref.data(), delta.data(), cd);
  cuda::attention_backward_blocks(dq.get(), dout.get(), q.get(), {{k.get(), v.get(), dk.as<float>(), dv.as<float>(), T, 0}},
                                  lref.data(), delta.data(), gd, t, stream, kernel);
  expect_rows(dq.get(), t, kLd, T, W, dqr, atol, rtol, "attention dq " + tag);
  expect_rows(dk.get(), DType::F32, kLd, T, A, dkr, atol, 1e-4, "attention dk " + tag);
  expect_rows(dv.get(), DType::F32, kLd, T, A, dvr, atol, 1e-4, "attention dv " + tag);

  // The merge of a partial result over other keys into out.
  const Vec part = rounded(randn(std::size_t(T) * W, rng), t), part_lse = randn(std::size_t(Z) * T, rng, 3.0f);
  scatter_rows(part_out.get(), t, kLd, 0, T, 0, W, part);
  Vec mref = gather_rows(out.get(), t, kLd, 0, T, 0, W), mlse = lse;
  cpu::attention_merge(mref.data(), mlse.data(), part.data(), part_lse.data(), cd);
  cuda::attention_merge(out.get(), lse.data(), part_out.get(), part_lse.data(), gd, t, stream);
  expect_rows(out.get(), t, kLd, T, W, rounded(mref, t), 1e-6, t == DType::BF16 ? kU + 1e-5 : 1e-5,
              "attention_merge " + tag);
  expect_close(lse, mlse, 1e-5, 1e-6, "attention_merge lse " + tag);
}

TEST_F(Cuda, Offsets64AttentionSimt) { attention_strided_rows(DType::F32, cuda::AttnKernel::Simt, rng_, stream_); }

TEST_F(Cuda, Offsets64AttentionTensorCores) {
  attention_strided_rows(DType::BF16, cuda::AttnKernel::TensorCore, rng_, stream_);
}

}  // namespace
}  // namespace sppo
