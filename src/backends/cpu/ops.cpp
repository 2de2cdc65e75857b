// CPU fp32 kernels of the GPT block (contract in kernels/ops.h).
//
// Most of these are memory-bound passes over [T, H] or [T, V] buffers, so each one reads
// and writes its operands once where it can: row-local work (LayerNorm, softmax) runs in
// two or three passes over a row that is still in cache, never over the whole buffer.
// Reductions across rows follow Note [Deterministic reductions]; transcendental functions
// in hot loops follow Note [Vectorised exp].
#include "backends/cpu/ops.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "backend/backend.h"
#include "core/adamw.h"
#include "core/check.h"
#include "backends/cpu/scratch.h"

namespace sppo::cpu {

// Note [Deterministic reductions]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every sum over rows (bias and LayerNorm parameter gradients, sum of squares, the total
// loss) is cut into blocks of a FIXED size, independent of the thread count. Each block
// is summed in order into its own double partial; the partials are then added in block
// order. The result is therefore bitwise identical for any number of threads, which keeps
// runs reproducible and lets tests compare layouts bit for bit. Sums into a gradient that
// is indexed by data (the embedding) are parallelised over columns instead: each element
// is owned by one thread and accumulated in token order, again independent of threads.
// Floating-point atomics are never used.

namespace {

// Rows per block of a cross-row reduction (Note [Deterministic reductions]).
constexpr int kRowBlock = 256;
// Elements per block of sum_squares (Note [Deterministic reductions]).
constexpr i64 kSumBlock = i64{1} << 16;
// Element-wise loops shorter than this run on one thread: a parallel region costs more.
constexpr i64 kSerialElems = i64{1} << 15;
// Rows of the RoPE angle table (Note [RoPE angles]).
constexpr int kRopeBlock = 16;
// Elements per task of an element-wise kernel.
constexpr i64 kChunk = i64{1} << 14;

std::size_t idx(i64 row, i64 ld, i64 col) { return static_cast<std::size_t>(row * ld + col); }

// Note [Vectorised exp]
// ~~~~~~~~~~~~~~~~~~~~~
// glibc's vector expf (libmvec) is only declared under -ffast-math, which the project
// does not use, so std::exp in a loop runs one element at a time. GeLU (T x 4H elements)
// and softmax (T x V elements) would then be bound by expf, not by memory. exp_f32 is
// Cephes' expf: range reduction by ln 2 in two parts, a degree-6 polynomial, and the
// exponent written into the bits; within about 1 ulp of exp on its domain (checked
// exhaustively against double), branch-free, so the compiler can vectorise the loops that
// call it. Inputs are clamped to the normal range:
// exp_f32(x) for x < -87.3 is about 1e-38 (not 0), and for x > 88.37 about 3.4e38 (not
// inf); the callers below are written so that neither matters.
inline float exp_f32(float x) {
  x = std::min(std::max(x, -87.3365f), 88.3762626f);
  // Round x / ln2 to nearest with the 1.5 * 2^23 trick (vectorises, no rounding mode).
  const float shifter = 12582912.0f;
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const std::int32_t bits = (static_cast<std::int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

// Runs body(begin, end) over [0, n) in chunks of kChunk, spread over the threads. The body's
// loop carries `#pragma omp simd`; GCC 12 compiles the GeLU loops several times slower
// under a combined `omp parallel for simd`.
template <typename Body>
void parallel_chunks(i64 n, const Body& body) {
  const i64 num_chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (num_chunks > 2)
  for (i64 c = 0; c < num_chunks; ++c) body(c * kChunk, std::min(n, (c + 1) * kChunk));
}

// dst[c] += sum over blocks b, in order, of partials[b * C + c].
void add_block_partials(float* dst, const double* partials, int num_blocks, int C) {
#pragma omp parallel for schedule(static) if (i64{num_blocks} * C > kSerialElems)
  for (int c = 0; c < C; ++c) {
    double s = 0.0;
    for (int b = 0; b < num_blocks; ++b) s += partials[idx(b, C, c)];
    dst[c] += static_cast<float>(s);
  }
}

// dst[c] += sum over rows t of x[t * ld + c], for every c < C, summed by fixed row blocks
// (Note [Deterministic reductions]).
// Doubles for block partials: from the caller's scratch when there is one, zeroed.
class Partials {
 public:
  Partials(std::size_t n, Scratch* scratch) : own_(scratch ? 0 : n), p_(scratch ? scratch->doubles(n) : own_.data()) {
    if (scratch) std::fill(p_, p_ + n, 0.0);
  }
  double* data() { return p_; }

 private:
  std::vector<double> own_;
  double* p_;
};

void accumulate_column_sums(float* dst, const float* x, int T, int C, int ld, Scratch* scratch) {
  const int num_blocks = (T + kRowBlock - 1) / kRowBlock;
  Partials partials(static_cast<std::size_t>(num_blocks) * C, scratch);
#pragma omp parallel for schedule(static) if (i64{T} * C > kSerialElems)
  for (int blk = 0; blk < num_blocks; ++blk) {
    double* part = partials.data() + idx(blk, C, 0);
    const int t_end = std::min(T, (blk + 1) * kRowBlock);
    for (int t = blk * kRowBlock; t < t_end; ++t) {
      const float* row = x + idx(t, ld, 0);
#pragma omp simd
      for (int c = 0; c < C; ++c) part[c] += row[c];
    }
  }
  add_block_partials(dst, partials.data(), num_blocks, C);
}

}  // namespace

// ---- GEMM -----------------------------------------------------------------------------

void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* a, int lda,
          const float* b, int ldb, float beta, float* c, int ldc) {
  SPPO_ASSERT_MSG(M >= 0 && N >= 0 && K >= 0, "gemm: M=" << M << " N=" << N << " K=" << K);
  // OpenBLAS reports bad strides on stderr and returns, leaving c unchanged: check first.
  SPPO_ASSERT_MSG(lda >= std::max(1, trans_a ? M : K) && ldb >= std::max(1, trans_b ? K : N) &&
                      ldc >= std::max(1, N),
                  "gemm: strides lda=" << lda << " ldb=" << ldb << " ldc=" << ldc << " for M=" << M
                                       << " N=" << N << " K=" << K);
  if (M == 0 || N == 0) return;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc);
}

void linear_forward(float* out, const float* in, const float* w, const float* b, int T, int I,
                    int O, int ld_out, int ld_in) {
  if (ld_out == 0) ld_out = O;
  if (ld_in == 0) ld_in = I;
  if (T == 0) return;
  float beta = 0.0f;
  if (b != nullptr) {
    // Pre-filling out with the bias and letting the GEMM add to it costs one write pass,
    // where adding the bias afterwards would cost a read and a write.
#pragma omp parallel for schedule(static) if (i64{T} * O > kSerialElems)
    for (int t = 0; t < T; ++t) std::copy(b, b + O, out + idx(t, ld_out, 0));
    beta = 1.0f;
  }
  gemm(false, true, T, O, I, 1.0f, in, ld_in, w, I, beta, out, ld_out);
}

void linear_backward(float* din, float* dw, float* db, const float* dout, const float* in,
                     const float* w, int T, int I, int O, int ld_dout, int ld_in, Scratch* scratch) {
  if (ld_dout == 0) ld_dout = O;
  if (ld_in == 0) ld_in = I;
  if (T == 0) return;
  if (din != nullptr) gemm(false, false, T, I, O, 1.0f, dout, ld_dout, w, I, 0.0f, din, I);
  gemm(true, false, O, I, T, 1.0f, dout, ld_dout, in, ld_in, 1.0f, dw, I);
  if (db != nullptr) accumulate_column_sums(db, dout, T, O, ld_dout, scratch);
}

// ---- embedding ------------------------------------------------------------------------

namespace {

void check_ids(const std::int32_t* ids, int T, int V, const char* component) {
  for (int t = 0; t < T; ++t) {
    SPPO_CHECK(ids[t] >= 0 && ids[t] < V, component)
        << "token id " << ids[t] << " at position " << t << " is outside the vocabulary [0, "
        << V << "); check that the data was tokenised with this model's vocabulary";
  }
}

}  // namespace

void embedding_forward(float* out, const std::int32_t* ids, const float* embed, int T, int H) {
#pragma omp parallel for schedule(static) if (i64{T} * H > kSerialElems)
  for (int t = 0; t < T; ++t) {
    const float* src = embed + idx(ids[t], H, 0);
    std::copy(src, src + H, out + idx(t, H, 0));
  }
}

void embedding_backward(float* dembed, const float* dout, const std::int32_t* ids, int T, int H,
                        int V) {
  check_ids(ids, T, V, "embedding");
  embedding_shard_backward(dembed, dout, ids, T, H, 0, V);  // the whole table is one shard
}

void embedding_shard_forward(float* out, const std::int32_t* ids, const float* embed, int T,
                             int H, int v0, int Vr) {
  SPPO_ASSERT_MSG(v0 >= 0 && Vr >= 0, "embedding_shard_forward: v0=" << v0 << " Vr=" << Vr);
#pragma omp parallel for schedule(static) if (i64{T} * H > kSerialElems)
  for (int t = 0; t < T; ++t) {
    float* dst = out + idx(t, H, 0);
    const i64 row = i64{ids[t]} - v0;
    if (row >= 0 && row < Vr) {
      const float* src = embed + idx(row, H, 0);
      std::copy(src, src + H, dst);
    } else {
      std::fill(dst, dst + H, 0.0f);  // another shard's row
    }
  }
}

void embedding_shard_backward(float* dembed, const float* dout, const std::int32_t* ids, int T,
                              int H, int v0, int Vr) {
  SPPO_ASSERT_MSG(v0 >= 0 && Vr >= 0, "embedding_shard_backward: v0=" << v0 << " Vr=" << Vr);
  for (int t = 0; t < T; ++t) {
    SPPO_CHECK(ids[t] >= 0, "embedding")
        << "token id " << ids[t] << " at position " << t
        << " is negative; check that the data was tokenised with this model's vocabulary";
  }
  // Each thread owns a band of columns of dembed and walks the tokens in order, skipping the
  // tokens of other shards, so every element sees the same additions in the same order for
  // any thread count.
  const int threads = (i64{T} * H > kSerialElems) ? omp_get_max_threads() : 1;
  const int per_thread = (H + threads - 1) / threads;
  const int band = std::max(16, (per_thread + 15) / 16 * 16);
  const int num_bands = (H + band - 1) / band;
#pragma omp parallel for schedule(static) if (num_bands > 1)
  for (int k = 0; k < num_bands; ++k) {
    const int h0 = k * band;
    const int h1 = std::min(H, h0 + band);
    for (int t = 0; t < T; ++t) {
      const i64 row = i64{ids[t]} - v0;
      if (row < 0 || row >= Vr) continue;
      float* dst = dembed + idx(row, H, 0);
      const float* src = dout + idx(t, H, 0);
#pragma omp simd
      for (int h = h0; h < h1; ++h) dst[h] += src[h];
    }
  }
}

// ---- LayerNorm ------------------------------------------------------------------------

void layernorm_forward(float* out, float* mean, float* rstd, const float* x, const float* w,
                       const float* b, int T, int H, float eps) {
#pragma omp parallel for schedule(static) if (i64{T} * H > kSerialElems)
  for (int t = 0; t < T; ++t) {
    const float* xr = x + idx(t, H, 0);
    float* outr = out + idx(t, H, 0);
    // Two passes over a row in cache: the mean, then the squared deviations (no
    // cancellation as with E[x^2] - E[x]^2), both accumulated in double.
    double sum = 0.0;
#pragma omp simd reduction(+ : sum)
    for (int h = 0; h < H; ++h) sum += xr[h];
    const double mu = sum / H;
    double ssq = 0.0;
#pragma omp simd reduction(+ : ssq)
    for (int h = 0; h < H; ++h) {
      const double d = xr[h] - mu;
      ssq += d * d;
    }
    const double rs = 1.0 / std::sqrt(ssq / H + eps);
    const float m = static_cast<float>(mu);
    const float r = static_cast<float>(rs);
#pragma omp simd
    for (int h = 0; h < H; ++h) outr[h] = (xr[h] - m) * r * w[h] + b[h];
    mean[t] = m;
    rstd[t] = r;
  }
}

void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x,
                        const float* w, const float* mean, const float* rstd, int T, int H,
                        Scratch* scratch) {
  // With xhat = (x - mean) rstd and g = dout * w:
  //   dx = rstd (g - mean_h(g) - xhat mean_h(g xhat)),  dw = sum_t dout xhat,  db = sum_t dout.
  // One sweep over the rows: dx row by row, dw/db into per-block partials (Note
  // [Deterministic reductions]).
  const int num_blocks = (T + kRowBlock - 1) / kRowBlock;
  Partials dw_part(static_cast<std::size_t>(num_blocks) * H, scratch);
  Partials db_part(static_cast<std::size_t>(num_blocks) * H, scratch);
#pragma omp parallel for schedule(static) if (i64{T} * H > kSerialElems)
  for (int blk = 0; blk < num_blocks; ++blk) {
    double* dwp = dw_part.data() + idx(blk, H, 0);
    double* dbp = db_part.data() + idx(blk, H, 0);
    const int t_end = std::min(T, (blk + 1) * kRowBlock);
    for (int t = blk * kRowBlock; t < t_end; ++t) {
      const float* xr = x + idx(t, H, 0);
      const float* dr = dout + idx(t, H, 0);
      float* dxr = dx + idx(t, H, 0);
      const float m = mean[t];
      const float r = rstd[t];
      double sum_g = 0.0;
      double sum_gx = 0.0;
#pragma omp simd reduction(+ : sum_g, sum_gx)
      for (int h = 0; h < H; ++h) {
        const float g = dr[h] * w[h];
        const float xhat = (xr[h] - m) * r;
        sum_g += g;
        sum_gx += g * xhat;
      }
      const float mean_g = static_cast<float>(sum_g / H);
      const float mean_gx = static_cast<float>(sum_gx / H);
#pragma omp simd
      for (int h = 0; h < H; ++h) {
        const float xhat = (xr[h] - m) * r;
        dxr[h] += r * (dr[h] * w[h] - mean_g - xhat * mean_gx);
        dwp[h] += dr[h] * xhat;
        dbp[h] += dr[h];
      }
    }
  }
  add_block_partials(dw, dw_part.data(), num_blocks, H);
  add_block_partials(db, db_part.data(), num_blocks, H);
}

// ---- RMSNorm --------------------------------------------------------------------------

void rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int T, int H,
                     float eps) {
#pragma omp parallel for schedule(static) if (i64{T} * H > kSerialElems)
  for (int t = 0; t < T; ++t) {
    const float* xr = x + idx(t, H, 0);
    float* outr = out + idx(t, H, 0);
    double ssq = 0.0;  // in double, as LayerNorm's statistics
#pragma omp simd reduction(+ : ssq)
    for (int h = 0; h < H; ++h) ssq += static_cast<double>(xr[h]) * xr[h];
    const float r = static_cast<float>(1.0 / std::sqrt(ssq / H + eps));
#pragma omp simd
    for (int h = 0; h < H; ++h) outr[h] = xr[h] * r * w[h];
    if (rstd) rstd[t] = r;
  }
}

void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w,
                      const float* rstd, int T, int H, Scratch* scratch) {
  // With xhat = x rstd and g = dout * w (rstd depends on x through mean_h x^2):
  //   dx = rstd (g - xhat mean_h(g xhat)),  dw = sum_t dout xhat.
  // One sweep over the rows as layernorm_backward: dx row by row, dw into per-block partials
  // (Note [Deterministic reductions]).
  const int num_blocks = (T + kRowBlock - 1) / kRowBlock;
  Partials dw_part(static_cast<std::size_t>(num_blocks) * H, scratch);
#pragma omp parallel for schedule(static) if (i64{T} * H > kSerialElems)
  for (int blk = 0; blk < num_blocks; ++blk) {
    double* dwp = dw_part.data() + idx(blk, H, 0);
    const int t_end = std::min(T, (blk + 1) * kRowBlock);
    for (int t = blk * kRowBlock; t < t_end; ++t) {
      const float* xr = x + idx(t, H, 0);
      const float* dr = dout + idx(t, H, 0);
      float* dxr = dx + idx(t, H, 0);
      const float r = rstd[t];
      double sum_gx = 0.0;
#pragma omp simd reduction(+ : sum_gx)
      for (int h = 0; h < H; ++h) sum_gx += dr[h] * w[h] * (xr[h] * r);
      const float mean_gx = static_cast<float>(sum_gx / H);
#pragma omp simd
      for (int h = 0; h < H; ++h) {
        const float xhat = xr[h] * r;
        dxr[h] += r * (dr[h] * w[h] - xhat * mean_gx);
        dwp[h] += dr[h] * xhat;
      }
    }
  }
  add_block_partials(dw, dw_part.data(), num_blocks, H);
}

// ---- GeLU -----------------------------------------------------------------------------
// 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3). The sigmoid form
// needs one exp and no tanh, and stays accurate where 1 + tanh(u) would cancel (x << 0).

namespace {

constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;

}  // namespace

void gelu_forward(float* out, const float* in, i64 n) {
  parallel_chunks(n, [=](i64 begin, i64 end) {
#pragma omp simd
    for (i64 i = begin; i < end; ++i) {
      const float x = in[i];
      const float u = kGeluK * (x + kGeluC * x * x * x);
      out[i] = x / (1.0f + exp_f32(-2.0f * u));
    }
  });
}

void gelu_backward(float* din, const float* dout, const float* in, i64 n) {
  // s = sigmoid(2u): gelu' = s + x * 2 s (1 - s) * du/dx, with 1 - s = e s (e = exp(-2u)),
  // which has no cancellation where s is close to 1.
  parallel_chunks(n, [=](i64 begin, i64 end) {
#pragma omp simd
    for (i64 i = begin; i < end; ++i) {
      const float x = in[i];
      const float u = kGeluK * (x + kGeluC * x * x * x);
      const float e = exp_f32(-2.0f * u);
      const float s = 1.0f / (1.0f + e);
      const float du = kGeluK * (1.0f + 3.0f * kGeluC * x * x);
      din[i] = dout[i] * (s + 2.0f * x * s * (e * s) * du);
    }
  });
}

// ---- SwiGLU ---------------------------------------------------------------------------
// silu(g) = g s, s = sigmoid(g) = 1 / (1 + e), e = exp(-g); silu'(g) = s (1 + g (1 - s)) with
// 1 - s = e s, which has no cancellation where s is close to 1. exp_f32's clamp keeps e finite
// for g << 0 (s is then about 1e-39 instead of e^g: both are 0 next to any other term).

void swiglu_forward(float* out, const float* gu, int T, int F) {
#pragma omp parallel for schedule(static) if (i64{T} * F > kSerialElems)
  for (int t = 0; t < T; ++t) {
    const float* gate = gu + idx(t, 2 * i64{F}, 0);
    const float* up = gate + F;
    float* o = out + idx(t, F, 0);
#pragma omp simd
    for (int j = 0; j < F; ++j) {
      const float g = gate[j];
      const float s = 1.0f / (1.0f + exp_f32(-g));
      o[j] = g * s * up[j];
    }
  }
}

void swiglu_backward(float* dgu, const float* gu, int T, int F) {
#pragma omp parallel for schedule(static) if (i64{T} * F > kSerialElems)
  for (int t = 0; t < T; ++t) {
    const float* gate = gu + idx(t, 2 * i64{F}, 0);
    const float* up = gate + F;
    float* dgate = dgu + idx(t, 2 * i64{F}, 0);  // d out on entry
    float* dup = dgate + F;
#pragma omp simd
    for (int j = 0; j < F; ++j) {
      const float g = gate[j];
      const float e = exp_f32(-g);
      const float s = 1.0f / (1.0f + e);
      const float d = dgate[j];
      dup[j] = d * (g * s);
      dgate[j] = d * up[j] * (s * (1.0f + g * (e * s)));
    }
  }
}

// ---- RoPE -----------------------------------------------------------------------------

// Note [RoPE angles]
// ~~~~~~~~~~~~~~~~~~
// Positions reach 10^6 and more; in fp32, pos * freq has an absolute error of about
// pos * 6e-8 radians (0.06 at 10^6), so angles are formed in double. One double sincos per
// (row, frequency) would cost more than the rotation itself, so positions are split as
// p = base + k with base a multiple of kRopeBlock: sincos(base * f) is computed once per
// block of rows, sincos(k * f) comes from a table built once per call, and the two are
// combined by the angle-addition formulas in double (a few ulp of double). The split depends
// only on p, never on pos0 or on the thread count, so a row gets bitwise the same rotation
// whether its sequence is processed whole or in subsequences.

namespace {

void rope_apply(float* x, int T, int Z, int A, i64 pos0, const RopeTable& r, int ld, float sign) {
  SPPO_ASSERT_MSG(A > 0 && A % 2 == 0, "rope: head size " << A << " must be even");
  SPPO_ASSERT_MSG(r.half == A / 2,
                  "rope: a table of " << r.half << " frequencies for head size " << A);
  SPPO_ASSERT_MSG(pos0 >= 0 && ld >= Z * A, "rope: pos0=" << pos0 << " ld=" << ld);
  if (T == 0) return;
  const int half = A / 2;
  const double* inv_freq = r.inv_freq;
  std::vector<double> step_cos(static_cast<std::size_t>(kRopeBlock) * half);
  std::vector<double> step_sin(static_cast<std::size_t>(kRopeBlock) * half);
  for (int k = 0; k < kRopeBlock; ++k) {
    for (int j = 0; j < half; ++j) {
      step_cos[idx(k, half, j)] = std::cos(k * inv_freq[j]);
      step_sin[idx(k, half, j)] = std::sin(k * inv_freq[j]);
    }
  }
  const i64 first_block = pos0 / kRopeBlock;
  const i64 last_block = (pos0 + T - 1) / kRopeBlock;
  const i64 num_blocks = last_block - first_block + 1;
#pragma omp parallel if (i64{T} * Z * A > kSerialElems)
  {
    std::vector<double> base_cos(static_cast<std::size_t>(half));
    std::vector<double> base_sin(static_cast<std::size_t>(half));
    std::vector<float> c(static_cast<std::size_t>(half));
    std::vector<float> s(static_cast<std::size_t>(half));
#pragma omp for schedule(static)
    for (i64 blk = 0; blk < num_blocks; ++blk) {
      const i64 base = (first_block + blk) * kRopeBlock;
      // yarn's scale of cos and sin goes into the block's base (exact when it is 1).
      for (int j = 0; j < half; ++j) {
        const double angle = static_cast<double>(base) * inv_freq[j];
        base_cos[j] = r.scale * std::cos(angle);
        base_sin[j] = r.scale * std::sin(angle);
      }
      const i64 p_begin = std::max(base, pos0);
      const i64 p_end = std::min(base + kRopeBlock, pos0 + T);
      for (i64 p = p_begin; p < p_end; ++p) {
        const double* sc = step_cos.data() + idx(p - base, half, 0);
        const double* ss = step_sin.data() + idx(p - base, half, 0);
#pragma omp simd
        for (int j = 0; j < half; ++j) {
          c[j] = static_cast<float>(base_cos[j] * sc[j] - base_sin[j] * ss[j]);
          s[j] = sign * static_cast<float>(base_sin[j] * sc[j] + base_cos[j] * ss[j]);
        }
        float* row = x + idx(p - pos0, ld, 0);
        for (int z = 0; z < Z; ++z) {
          float* lo = row + idx(z, A, 0);
          float* hi = lo + half;
#pragma omp simd
          for (int j = 0; j < half; ++j) {
            const float a = lo[j];
            const float b = hi[j];
            lo[j] = a * c[j] - b * s[j];
            hi[j] = b * c[j] + a * s[j];
          }
        }
      }
    }
  }
}

}  // namespace

void rope_forward(float* x, int T, int Z, int A, i64 pos0, const RopeTable& r, int ld) {
  rope_apply(x, T, Z, A, pos0, r, ld, 1.0f);
}

// The transpose of scale R(angle) is scale R(-angle): the same cos, the sine negated.
void rope_backward(float* dx, int T, int Z, int A, i64 pos0, const RopeTable& r, int ld) {
  rope_apply(dx, T, Z, A, pos0, r, ld, -1.0f);
}

// ---- softmax over rows ----------------------------------------------------------------

void softmax_rows(float* x, float* lse, i64 rows, int cols, bool with_lse) {
#pragma omp parallel for schedule(static) if (rows * cols > kSerialElems)
  for (i64 r = 0; r < rows; ++r) {
    float* row = x + r * cols;
    if (with_lse) {
      for (int c = 0; c < cols; ++c) row[c] = std::exp(row[c] - lse[r]);
      continue;
    }
    float mx = row[0];
    for (int c = 1; c < cols; ++c) mx = row[c] > mx ? row[c] : mx;
    double sum = 0.0;
    for (int c = 0; c < cols; ++c) sum += (row[c] = std::exp(row[c] - mx));
    const float inv = static_cast<float>(1.0 / sum);
    for (int c = 0; c < cols; ++c) row[c] *= inv;
    lse[r] = mx + static_cast<float>(std::log(sum));
  }
}

void softmax_backward_rows(float* dx, const float* p, i64 rows, int cols) {
#pragma omp parallel for schedule(static) if (rows * cols > kSerialElems)
  for (i64 r = 0; r < rows; ++r) {
    float* d = dx + r * cols;
    const float* pr = p + r * cols;
    double dot = 0.0;
    for (int c = 0; c < cols; ++c) dot += double(d[c]) * pr[c];
    const float dotf = static_cast<float>(dot);
    for (int c = 0; c < cols; ++c) d[c] = pr[c] * (d[c] - dotf);
  }
}

// ---- softmax cross-entropy ------------------------------------------------------------

double xent_forward_backward(float* logits, float* losses, const std::int32_t* targets, int T,
                             int V, float grad_scale, Scratch* scratch) {
  for (int t = 0; t < T; ++t)
    SPPO_CHECK(targets[t] == kNoTarget || (targets[t] >= 0 && targets[t] < V), "loss")
        << "target id " << targets[t] << " at position " << t << " is outside the vocabulary [0, " << V
        << "); check that the data was tokenised with this model's vocabulary";
  Partials row_loss_buf(static_cast<std::size_t>(T), scratch);
  double* row_loss = row_loss_buf.data();
  // Passes over a row that stays in cache: max; exp(x - max) written in place; its sum in
  // double; scale to the gradient.
#pragma omp parallel for schedule(static) if (i64{T} * V > kSerialElems)
  for (int t = 0; t < T; ++t) {
    float* row = logits + idx(t, V, 0);
    const int target = targets[t];
    if (target == kNoTarget) {  // not predicted: no loss, no gradient
      std::fill(row, row + V, 0.0f);
      row_loss[t] = 0.0;
      losses[t] = 0.0f;
      continue;
    }
    const float target_logit = row[target];
    float mx = row[0];
    // A ternary, not std::max: GCC does not vectorise this reduction with std::max.
#pragma omp simd reduction(max : mx)
    for (int v = 0; v < V; ++v) mx = row[v] > mx ? row[v] : mx;
    // Arguments are <= 0, so exp_f32's clamp only turns exp(< -87) into 1e-38: a
    // probability far below what fp32 resolves next to the others. Two loops, not one:
    // GCC 12 does not vectorise exp_f32 fused with a double reduction.
    for (int v = 0; v < V; ++v) row[v] = exp_f32(row[v] - mx);
    double sum = 0.0;
#pragma omp simd reduction(+ : sum)
    for (int v = 0; v < V; ++v) sum += row[v];
    const float scale = static_cast<float>(grad_scale / sum);
#pragma omp simd
    for (int v = 0; v < V; ++v) row[v] *= scale;
    row[target] -= grad_scale;
    const double loss = std::log(sum) + static_cast<double>(mx) - target_logit;
    row_loss[t] = loss;
    losses[t] = static_cast<float>(loss);
  }
  double total = 0.0;
  for (int t = 0; t < T; ++t) total += row_loss[t];
  return total;
}

// ---- vocabulary-parallel cross-entropy ------------------------------------------------

namespace {

// Columns per tile of row_logsumexp's exp pass: the exps go to a small buffer on the stack, so
// that exp_f32 and the double sum each vectorise (GCC 12 fuses neither) with the logits read only.
constexpr int kExpTile = 256;

}  // namespace

void row_logsumexp(float* lse, const float* logits, int T, int V) {
#pragma omp parallel for schedule(static) if (i64{T} * V > kSerialElems)
  for (int t = 0; t < T; ++t) {
    if (V == 0) {
      lse[t] = -std::numeric_limits<float>::infinity();
      continue;
    }
    const float* row = logits + idx(t, V, 0);
    float mx = row[0];
#pragma omp simd reduction(max : mx)
    for (int v = 0; v < V; ++v) mx = row[v] > mx ? row[v] : mx;
    // Arguments <= 0: exp_f32's clamp only turns exp(< -87) into 1e-38 (as in xent).
    double sum = 0.0;
    float tile[kExpTile];
    for (int c0 = 0; c0 < V; c0 += kExpTile) {
      const int n = std::min(kExpTile, V - c0);
#pragma omp simd
      for (int j = 0; j < n; ++j) tile[j] = exp_f32(row[c0 + j] - mx);
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < n; ++j) sum += tile[j];
    }
    lse[t] = static_cast<float>(static_cast<double>(mx) + std::log(sum));
  }
}

double xent_shard(float* dlogits, float* losses, const float* logits, const float* lse_parts,
                  int parts, const std::int32_t* targets, int T, int V, int v0, float grad_scale,
                  Scratch* scratch) {
  SPPO_ASSERT_MSG(parts >= 1 && V >= 0 && v0 >= 0,
                  "xent_shard: parts=" << parts << " V=" << V << " v0=" << v0);
  for (int t = 0; t < T; ++t)
    SPPO_CHECK(targets[t] == kNoTarget || targets[t] >= 0, "loss")
        << "target id " << targets[t] << " at position " << t
        << " is negative; check that the data was tokenised with this model's vocabulary";
  Partials row_loss_buf(static_cast<std::size_t>(T), scratch);
  double* row_loss = row_loss_buf.data();
#pragma omp parallel for schedule(static) if (i64{T} * V > kSerialElems)
  for (int t = 0; t < T; ++t) {
    const float* in = logits + idx(t, V, 0);
    float* out = dlogits + idx(t, V, 0);  // may be `in`
    const int target = targets[t];
    if (target == kNoTarget) {  // not predicted: no loss, no gradient
      std::fill(out, out + V, 0.0f);
      row_loss[t] = 0.0;
      losses[t] = 0.0f;
      continue;
    }
    // The row's lse over every shard, in double: log sum_p exp(lse_p).
    double m = -std::numeric_limits<double>::infinity();
    for (int p = 0; p < parts; ++p) m = std::max(m, static_cast<double>(lse_parts[idx(p, T, t)]));
    double s = 0.0;
    for (int p = 0; p < parts; ++p) s += std::exp(static_cast<double>(lse_parts[idx(p, T, t)]) - m);
    const double lse = m + std::log(s);
    const i64 local = i64{target} - v0;
    const bool mine = local >= 0 && local < V;
    const double target_logit = mine ? in[local] : 0.0;  // read before the row is overwritten
    if (V > 0) {
      // exp(x - lse) = exp(x - mx) exp(mx - lse), mx the shard's row max: the fp32 argument is
      // exact and <= 0, and exp(mx - lse) <= 1 comes from double (as xent's grad_scale / sum).
      float mx = in[0];
#pragma omp simd reduction(max : mx)
      for (int v = 0; v < V; ++v) mx = in[v] > mx ? in[v] : mx;
      const float scale = static_cast<float>(grad_scale * std::exp(static_cast<double>(mx) - lse));
#pragma omp simd
      for (int v = 0; v < V; ++v) out[v] = exp_f32(in[v] - mx) * scale;
      if (mine) out[local] -= grad_scale;
    }
    const double loss = mine ? lse - target_logit : 0.0;
    row_loss[t] = loss;
    losses[t] = static_cast<float>(loss);
  }
  double total = 0.0;
  for (int t = 0; t < T; ++t) total += row_loss[t];
  return total;
}

// ---- optimizer ------------------------------------------------------------------------

double sum_squares(const float* g, i64 n) {
  const i64 num_blocks = (n + kSumBlock - 1) / kSumBlock;
  std::vector<double> partials(static_cast<std::size_t>(num_blocks));
#pragma omp parallel for schedule(static) if (num_blocks > 1)
  for (i64 blk = 0; blk < num_blocks; ++blk) {
    const i64 end = std::min(n, (blk + 1) * kSumBlock);
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (i64 i = blk * kSumBlock; i < end; ++i) s += static_cast<double>(g[i]) * g[i];
    partials[blk] = s;
  }
  double total = 0.0;
  for (double p : partials) total += p;
  return total;
}

void scale_inplace(float* x, i64 n, float s) {
  parallel_chunks(n, [=](i64 begin, i64 end) {
#pragma omp simd
    for (i64 i = begin; i < end; ++i) x[i] *= s;
  });
}

void adamw_step(float* p, float* m, float* v, const float* g, i64 n, float lr, float beta1,
                float beta2, float eps, float weight_decay, int t) {
  const AdamwScalars k = adamw_scalars(lr, beta1, beta2, eps, weight_decay, t);
  // Without -fno-math-errno GCC keeps sqrtf, and so this loop, scalar; at 28 bytes of
  // traffic per element it is close to memory-bound all the same.
  parallel_chunks(n, [=](i64 begin, i64 end) {
#pragma omp simd
    for (i64 i = begin; i < end; ++i) p[i] = adamw_update(p[i], m[i], v[i], g[i], k);
  });
}

// Block partials of ceil(T / kRowBlock) rows of C doubles, as a bound in T.
KernelScratch partials_scratch(i64 C, int copies) {
  const i64 per_token = (copies * C * i64(sizeof(double)) + kRowBlock - 1) / kRowBlock;
  return {copies * (C * i64(sizeof(double)) + i64(Scratch::kAlign)), per_token};
}

KernelScratch linear_backward_scratch(int O) { return partials_scratch(O, 1); }
KernelScratch layernorm_backward_scratch(int H) { return partials_scratch(H, 2); }
KernelScratch rmsnorm_backward_scratch(int H, int rows_per_token) {
  // ceil(n T / kRowBlock) row blocks of H doubles: at most n T H doubles / kRowBlock and
  // one block more.
  const i64 row = H * i64(sizeof(double));
  return {row + i64(Scratch::kAlign), (rows_per_token * row + kRowBlock - 1) / kRowBlock};
}
KernelScratch xent_scratch(int rows) { return {i64(Scratch::cost(std::size_t(rows) * sizeof(double))), 0}; }

}  // namespace sppo::cpu
