// CUDA kernels of the GPT block except GEMM, embedding and attention (contract in
// backends/cuda/ops.h). Each mirrors its CPU kernel in kernels/ops.cpp formula for formula,
// so that fp32 mode agrees with the CPU to a few fp32 roundings; where the CPU sums in double,
// so does the GPU.
//
// Most of these are memory-bound passes. Row-local work (LayerNorm, softmax) gives a row to a
// warp or a block and walks it two or three times (the row stays in L1/L2); cross-row sums
// (LayerNorm's dw/db) go through per-block partials (common.cuh).
#include <algorithm>
#include <cmath>

#include "backends/cuda/common.cuh"
#include "backends/cuda/ops.h"
#include "core/adamw.h"

namespace sppo::cuda {

bool device_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

namespace {

// ---- block partials -----------------------------------------------------------------------

__global__ void add_block_partials_kernel(float* dst, const double* partials, int num_blocks,
                                          int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  double s = 0.0;
  for (int b = 0; b < num_blocks; ++b) s += partials[static_cast<i64>(b) * C + c];
  dst[c] += static_cast<float>(s);
}

// ---- element-wise -------------------------------------------------------------------------

template <typename D, typename S>
__global__ void convert_kernel(D* dst, const S* src, i64 n) {
  for (i64 i = blockIdx.x * i64{blockDim.x} + threadIdx.x; i < n; i += i64{gridDim.x} * blockDim.x)
    store_f(dst + i, load_f(src + i));
}

template <typename Y, typename X>
__global__ void add_kernel(Y* y, const X* x, i64 n) {
  for (i64 i = blockIdx.x * i64{blockDim.x} + threadIdx.x; i < n; i += i64{gridDim.x} * blockDim.x)
    store_f(y + i, load_f(y + i) + load_f(x + i));
}

// dst[t * ld_dst + c] = src[t * ld_src + c] for t < T, c < width (converted).
template <typename D, typename S>
__global__ void copy_2d_kernel(D* dst, i64 ld_dst, const S* src, i64 ld_src, int T, int width) {
  const i64 n = static_cast<i64>(T) * width;
  for (i64 i = blockIdx.x * i64{blockDim.x} + threadIdx.x; i < n;
       i += i64{gridDim.x} * blockDim.x) {
    const i64 t = i / width, c = i % width;
    store_f(dst + t * ld_dst + c, load_f(src + t * ld_src + c));
  }
}

// dst[t * ld_dst + c] += src[t * ld_src + c] for t < T, c < width.
template <typename D, typename S>
__global__ void add_2d_kernel(D* dst, i64 ld_dst, const S* src, i64 ld_src, int T, int width) {
  const i64 n = static_cast<i64>(T) * width;
  for (i64 i = blockIdx.x * i64{blockDim.x} + threadIdx.x; i < n;
       i += i64{gridDim.x} * blockDim.x) {
    const i64 t = i / width, c = i % width;
    store_f(dst + t * ld_dst + c, load_f(dst + t * ld_dst + c) + load_f(src + t * ld_src + c));
  }
}

template <typename T>
__global__ void zero_2d_kernel(T* dst, i64 ld, int rows, int width) {
  const i64 n = static_cast<i64>(rows) * width;
  for (i64 i = blockIdx.x * i64{blockDim.x} + threadIdx.x; i < n;
       i += i64{gridDim.x} * blockDim.x) {
    const i64 t = i / width, c = i % width;
    store_f(dst + t * ld + c, 0.0f);
  }
}

__global__ void scale_kernel(float* x, i64 n, float s) {
  for (i64 i = blockIdx.x * i64{blockDim.x} + threadIdx.x; i < n; i += i64{gridDim.x} * blockDim.x)
    x[i] *= s;
}

// ---- GeLU ---------------------------------------------------------------------------------
// 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), as on the CPU. The
// exponent is clamped to the CPU's exp_f32 range: exp(-2u) stays finite for x << 0, so the
// backward's e * s is 1, not inf * 0.
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;

__device__ __forceinline__ float exp_clamped(float x) {
  return expf(fminf(fmaxf(x, -87.3365f), 88.3762626f));
}

template <typename T>
__global__ void gelu_forward_kernel(T* out, const T* in, i64 n) {
  for (i64 i = blockIdx.x * i64{blockDim.x} + threadIdx.x; i < n;
       i += i64{gridDim.x} * blockDim.x) {
    const float x = load_f(in + i);
    const float u = kGeluK * (x + kGeluC * x * x * x);
    store_f(out + i, x / (1.0f + exp_clamped(-2.0f * u)));
  }
}

template <typename T>
__global__ void gelu_backward_kernel(T* din, const T* dout, const T* in, i64 n) {
  for (i64 i = blockIdx.x * i64{blockDim.x} + threadIdx.x; i < n;
       i += i64{gridDim.x} * blockDim.x) {
    const float x = load_f(in + i);
    const float u = kGeluK * (x + kGeluC * x * x * x);
    const float e = exp_clamped(-2.0f * u);
    const float s = 1.0f / (1.0f + e);
    const float du = kGeluK * (1.0f + 3.0f * kGeluC * x * x);
    store_f(din + i, load_f(dout + i) * (s + 2.0f * x * s * (e * s) * du));
  }
}

// ---- LayerNorm ----------------------------------------------------------------------------
constexpr int kLnWarps = 8;  // rows per block: one warp per row

// dx row by row (one warp per row), accumulating:
//   dx += rstd (g - mean_h(g) - xhat mean_h(g xhat)),  g = dout * w, xhat = (x - mean) rstd.
template <typename T>
__global__ void __launch_bounds__(kLnWarps * 32)
    layernorm_backward_dx_kernel(T* dx, const T* dout, const T* x, const float* w,
                                 const float* mean, const float* rstd, int rows, int H) {
  const int row = blockIdx.x * kLnWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  const i64 base = static_cast<i64>(row) * H;
  const float m = mean[row], r = rstd[row];
  double sum_g = 0.0, sum_gx = 0.0;
  for (int h = lane; h < H; h += 32) {
    const float g = load_f(dout + base + h) * w[h];
    const float xhat = (load_f(x + base + h) - m) * r;
    sum_g += g;
    sum_gx += g * xhat;
  }
  const float mean_g = static_cast<float>(warp_sum(sum_g) / H);
  const float mean_gx = static_cast<float>(warp_sum(sum_gx) / H);
  for (int h = lane; h < H; h += 32) {
    const float xhat = (load_f(x + base + h) - m) * r;
    const float d = r * (load_f(dout + base + h) * w[h] - mean_g - xhat * mean_gx);
    store_f(dx + base + h, load_f(dx + base + h) + d);
  }
}

// Per row block (kRowBlock rows) and column: dw_part = sum_t dout xhat, db_part = sum_t dout,
// in double, rows in order. partials: [num_blocks, H] each. Grid: (row block, column chunk),
// Note [Row blocks on the grid's x].
template <typename T>
__global__ void layernorm_param_partials_kernel(double* dw_part, double* db_part, const T* dout,
                                                const T* x, const float* mean, const float* rstd,
                                                int rows, int H) {
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  const int blk = blockIdx.x;
  if (c >= H) return;
  const int t_end = min(rows, (blk + 1) * kRowBlock);
  double dw = 0.0, db = 0.0;
  for (int t = blk * kRowBlock; t < t_end; ++t) {
    const i64 i = static_cast<i64>(t) * H + c;
    const float d = load_f(dout + i);
    const float xhat = (load_f(x + i) - mean[t]) * rstd[t];
    dw += d * xhat;
    db += d;
  }
  dw_part[static_cast<i64>(blk) * H + c] = dw;
  db_part[static_cast<i64>(blk) * H + c] = db;
}

// ---- RMSNorm ------------------------------------------------------------------------------
// As LayerNorm: one warp per row for the statistics and dx, row-block partials for dw.
// dx += rstd (g - xhat mean_h(g xhat)),  g = dout * w, xhat = x rstd (accumulating).
template <typename T>
__global__ void __launch_bounds__(kLnWarps * 32)
    rmsnorm_backward_dx_kernel(T* dx, const T* dout, const T* x, const float* w,
                               const float* rstd, int rows, int H) {
  const int row = blockIdx.x * kLnWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  const i64 base = static_cast<i64>(row) * H;
  const float r = rstd[row];
  double sum_gx = 0.0;
  for (int h = lane; h < H; h += 32)
    sum_gx += load_f(dout + base + h) * w[h] * (load_f(x + base + h) * r);
  const float mean_gx = static_cast<float>(warp_sum(sum_gx) / H);
  for (int h = lane; h < H; h += 32) {
    const float xhat = load_f(x + base + h) * r;
    const float d = r * (load_f(dout + base + h) * w[h] - xhat * mean_gx);
    store_f(dx + base + h, load_f(dx + base + h) + d);
  }
}

// Per row block (kRowBlock rows) and column: dw_part = sum_t dout xhat in double, rows in
// order. dw_part: [num_blocks, H]. Grid: (row block, column chunk), as layernorm's.
template <typename T>
__global__ void rmsnorm_param_partials_kernel(double* dw_part, const T* dout, const T* x,
                                              const float* rstd, int rows, int H) {
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  const int blk = blockIdx.x;
  if (c >= H) return;
  const int t_end = min(rows, (blk + 1) * kRowBlock);
  double dw = 0.0;
  for (int t = blk * kRowBlock; t < t_end; ++t) {
    const i64 i = static_cast<i64>(t) * H + c;
    dw += load_f(dout + i) * (load_f(x + i) * rstd[t]);
  }
  dw_part[static_cast<i64>(blk) * H + c] = dw;
}

// ---- the norms' forward, with the residual add before them ---------------------------------
// One warp per row, the statistics in double as on the CPU: LayerNorm (the mean, then the
// squared deviations) or RMSNorm (kRms: the sum of squares), of the row of y. With kAdd, y
// += x first, stored rounded as add_kernel stores it; the norm reads the stored values back
// (this lane's own stores), so that it gives the unfused add and norm to the bit.
template <typename T, bool kRms, bool kAdd>
__global__ void __launch_bounds__(kLnWarps * 32)
    norm_forward_kernel(T* out, float* mean, float* rstd, T* y, const T* x, const float* w,
                        const float* b, int rows, int H, float eps) {
  const int row = blockIdx.x * kLnWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;
  T* yr = y + static_cast<i64>(row) * H;
  T* outr = out + static_cast<i64>(row) * H;
  double sum = 0.0;  // LayerNorm: the sum; RMSNorm: the sum of squares
  for (int h = lane; h < H; h += 32) {
    if constexpr (kAdd) store_f(yr + h, load_f(yr + h) + load_f(x + static_cast<i64>(row) * H + h));
    const double v = load_f(yr + h);
    sum += kRms ? v * v : v;
  }
  if constexpr (kRms) {
    const float r = static_cast<float>(1.0 / sqrt(warp_sum(sum) / H + eps));
    for (int h = lane; h < H; h += 32) store_f(outr + h, load_f(yr + h) * r * w[h]);
    if (lane == 0 && rstd) rstd[row] = r;
  } else {
    const double mu = warp_sum(sum) / H;
    double ssq = 0.0;
    for (int h = lane; h < H; h += 32) {
      const double d = load_f(yr + h) - mu;
      ssq += d * d;
    }
    const float m = static_cast<float>(mu);
    const float r = static_cast<float>(1.0 / sqrt(warp_sum(ssq) / H + eps));
    for (int h = lane; h < H; h += 32) store_f(outr + h, (load_f(yr + h) - m) * r * w[h] + b[h]);
    if (lane == 0) {
      mean[row] = m;
      rstd[row] = r;
    }
  }
}

template <bool kRms, bool kAdd>
void norm_forward(void* out, float* mean, float* rstd, void* y, const void* x, const float* w,
                  const float* b, int T, int H, float eps, DType act, cudaStream_t stream,
                  const char* what) {
  if (T == 0) return;
  dispatch_act(act, what, [&](auto tag) {
    using E = decltype(tag);
    norm_forward_kernel<E, kRms, kAdd>
        <<<grid_x(ceil_div(T, kLnWarps), "norm"), kLnWarps * 32, 0, stream>>>(
            static_cast<E*>(out), mean, rstd, static_cast<E*>(y), static_cast<const E*>(x), w, b, T,
            H, eps);
    SPPO_CUDA_CHECK_LAUNCH();
  });
}

// ---- SwiGLU -------------------------------------------------------------------------------
// As the CPU: s = 1 / (1 + e), e = exp(-g) clamped as GeLU's; silu' = s (1 + g e s).
template <typename T>
__global__ void swiglu_forward_kernel(T* out, const T* gu, int F, i64 n) {
  for (i64 i = blockIdx.x * i64{blockDim.x} + threadIdx.x; i < n;
       i += i64{gridDim.x} * blockDim.x) {
    const i64 t = i / F, j = i % F;
    const T* row = gu + t * 2 * F;
    const float g = load_f(row + j);
    const float s = 1.0f / (1.0f + exp_clamped(-g));
    store_f(out + i, g * s * load_f(row + F + j));
  }
}

// In place: element (t, j) reads dgu[t, j] (d out), gu[t, j], gu[t, F + j] and writes
// dgu[t, j] (d gate) and dgu[t, F + j] (d up); no other thread touches those.
template <typename T>
__global__ void swiglu_backward_kernel(T* dgu, const T* gu, int F, i64 n) {
  for (i64 i = blockIdx.x * i64{blockDim.x} + threadIdx.x; i < n;
       i += i64{gridDim.x} * blockDim.x) {
    const i64 t = i / F, j = i % F;
    const T* row = gu + t * 2 * F;
    T* drow = dgu + t * 2 * F;
    const float g = load_f(row + j);
    const float e = exp_clamped(-g);
    const float s = 1.0f / (1.0f + e);
    const float d = load_f(drow + j);
    store_f(drow + F + j, d * (g * s));
    store_f(drow + j, d * load_f(row + F + j) * (s * (1.0f + g * (e * s))));
  }
}

// ---- RoPE ---------------------------------------------------------------------------------
// One thread per (row, frequency j); it rotates that pair in every head. The angle is formed
// and its sine and cosine taken in double (Note [RoPE angles] in kernels/ops.cpp: positions
// reach 10^6 and more), then scaled and rounded to float, as the CPU does. The table comes by
// value in the kernel's parameters (about 2 KB of constant memory), read once per thread.
template <typename T>
__global__ void rope_kernel(T* x, int rows, int Z, int A, i64 pos0, const RopeTable r, i64 ld,
                            float sign) {
  const int half = A / 2;
  const i64 n = static_cast<i64>(rows) * half;
  for (i64 i = blockIdx.x * i64{blockDim.x} + threadIdx.x; i < n;
       i += i64{gridDim.x} * blockDim.x) {
    const i64 t = i / half;
    const int j = static_cast<int>(i % half);
    const double angle = static_cast<double>(pos0 + t) * r.inv_freq[j];
    double sd, cd;
    sincos(angle, &sd, &cd);
    const float c = static_cast<float>(r.scale * cd);
    const float s = sign * static_cast<float>(r.scale * sd);
    T* row = x + t * ld;
    for (int z = 0; z < Z; ++z) {
      T* lo = row + static_cast<i64>(z) * A + j;
      T* hi = lo + half;
      const float a = load_f(lo), b = load_f(hi);
      store_f(lo, a * c - b * s);
      store_f(hi, b * c + a * s);
    }
  }
}

// ---- softmax cross-entropy ----------------------------------------------------------------
constexpr int kXentThreads = 512;  // one block per row of V logits

template <typename D>
__global__ void __launch_bounds__(kXentThreads)
    xent_kernel(D* dlogits, float* losses, double* row_loss, const float* logits,
                const std::int32_t* targets, int V, float grad_scale) {
  __shared__ double red[kXentThreads / 32];
  __shared__ float redf[kXentThreads / 32];
  const int row = blockIdx.x;
  const float* lr = logits + static_cast<i64>(row) * V;
  D* dr = dlogits + static_cast<i64>(row) * V;
  const int target = targets[row];
  if (target == -1) {  // kNoTarget: not predicted, no loss and no gradient
    for (int v = threadIdx.x; v < V; v += kXentThreads) store_f(dr + v, 0.0f);
    if (threadIdx.x == 0) {
      row_loss[row] = 0.0;
      losses[row] = 0.0f;
    }
    return;
  }
  if (target < 0 || target >= V) __trap();
  // Read before any thread overwrites the row (dlogits may be logits); block_max's barriers
  // order it before the writes below.
  const float target_logit = lr[target];
  float mx = -INFINITY;
  for (int v = threadIdx.x; v < V; v += kXentThreads) mx = fmaxf(mx, lr[v]);
  mx = block_max<kXentThreads>(mx, redf);
  double sum = 0.0;
  for (int v = threadIdx.x; v < V; v += kXentThreads) sum += expf(lr[v] - mx);
  sum = block_sum<kXentThreads>(sum, red);
  if (threadIdx.x == 0) red[0] = sum;
  __syncthreads();
  sum = red[0];
  const float scale = static_cast<float>(grad_scale / sum);
  for (int v = threadIdx.x; v < V; v += kXentThreads) {
    float d = expf(lr[v] - mx) * scale;
    if (v == target) d -= grad_scale;
    store_f(dr + v, d);
  }
  if (threadIdx.x == 0) {
    const double loss = log(sum) + static_cast<double>(mx) - target_logit;
    row_loss[row] = loss;
    losses[row] = static_cast<float>(loss);
  }
}

// ---- vocabulary-parallel cross-entropy: one block a row -------------------------------------
// lse = max + log(sum exp(x - max)), the sum in double (as the CPU); -inf for V = 0.
__global__ void __launch_bounds__(kXentThreads)
    row_logsumexp_kernel(float* lse, const float* logits, int V) {
  __shared__ double red[kXentThreads / 32];
  __shared__ float redf[kXentThreads / 32];
  const float* row = logits + static_cast<i64>(blockIdx.x) * V;
  float mx = -INFINITY;
  for (int v = threadIdx.x; v < V; v += kXentThreads) mx = fmaxf(mx, row[v]);
  mx = block_max<kXentThreads>(mx, redf);
  double sum = 0.0;
  for (int v = threadIdx.x; v < V; v += kXentThreads) sum += expf(row[v] - mx);
  sum = block_sum<kXentThreads>(sum, red);
  if (threadIdx.x == 0)
    lse[blockIdx.x] = V == 0 ? -INFINITY : static_cast<float>(static_cast<double>(mx) + log(sum));
}

// As cpu::xent_shard: the row's lse is the log-sum-exp of the parts' (in double); the gradient
// is exp(x - mx) * (grad_scale exp(mx - lse)), mx this shard's row max.
template <typename D>
__global__ void __launch_bounds__(kXentThreads)
    xent_shard_kernel(D* dlogits, float* losses, double* row_loss, const float* logits,
                      const float* lse_parts, int parts, const std::int32_t* targets, int T, int V,
                      int v0, float grad_scale) {
  __shared__ float redf[kXentThreads / 32];
  const int row = blockIdx.x;
  const float* lr = logits + static_cast<i64>(row) * V;
  D* dr = dlogits + static_cast<i64>(row) * V;
  const int target = targets[row];
  if (target == -1) {  // kNoTarget: not predicted, no loss and no gradient
    for (int v = threadIdx.x; v < V; v += kXentThreads) store_f(dr + v, 0.0f);
    if (threadIdx.x == 0) {
      row_loss[row] = 0.0;
      losses[row] = 0.0f;
    }
    return;
  }
  if (target < 0) __trap();
  const float* part = lse_parts + row;  // part p's lse of this row: part[p * T]
  double m = -INFINITY;
  for (int p = 0; p < parts; ++p) m = fmax(m, static_cast<double>(part[static_cast<i64>(p) * T]));
  double s = 0.0;
  for (int p = 0; p < parts; ++p) s += exp(static_cast<double>(part[static_cast<i64>(p) * T]) - m);
  const double lse = m + log(s);
  const i64 local = static_cast<i64>(target) - v0;
  const bool mine = local >= 0 && local < V;
  // Read before any thread overwrites the row (dlogits may be logits); block_max's barriers
  // order it before the writes below.
  const float target_logit = mine ? lr[local] : 0.0f;
  float mx = -INFINITY;
  for (int v = threadIdx.x; v < V; v += kXentThreads) mx = fmaxf(mx, lr[v]);
  mx = block_max<kXentThreads>(mx, redf);
  const float scale = static_cast<float>(grad_scale * exp(static_cast<double>(mx) - lse));
  for (int v = threadIdx.x; v < V; v += kXentThreads) {
    float d = expf(lr[v] - mx) * scale;
    if (mine && v == local) d -= grad_scale;
    store_f(dr + v, d);
  }
  if (threadIdx.x == 0) {
    const double loss = mine ? lse - static_cast<double>(target_logit) : 0.0;
    row_loss[row] = loss;
    losses[row] = static_cast<float>(loss);
  }
}

// ---- softmax over rows: one block a row ----------------------------------------------------
// The rows are i64 (the two-pass ring's materialised scores, Z T rows: runtime/ring.cpp), so
// each block walks rows blockIdx.x, blockIdx.x + gridDim.x, ... and any count launches; every
// row is computed alone.
__global__ void __launch_bounds__(kXentThreads)
    softmax_rows_kernel(float* x, float* lse, i64 rows, int cols, bool with_lse) {
  __shared__ double red[kXentThreads / 32];
  __shared__ float redf[kXentThreads / 32];
  for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
    float* row = x + r * cols;
    if (with_lse) {
      const float l = lse[r];
      for (int c = threadIdx.x; c < cols; c += kXentThreads) row[c] = expf(row[c] - l);
      continue;
    }
    float mx = -INFINITY;
    for (int c = threadIdx.x; c < cols; c += kXentThreads) mx = fmaxf(mx, row[c]);
    mx = block_max<kXentThreads>(mx, redf);
    double sum = 0.0;
    for (int c = threadIdx.x; c < cols; c += kXentThreads) sum += expf(row[c] - mx);
    sum = block_sum<kXentThreads>(sum, red);
    if (threadIdx.x == 0) red[0] = sum;
    __syncthreads();
    sum = red[0];
    __syncthreads();  // red is read before the next row's block_sum writes it
    const float inv = static_cast<float>(1.0 / sum);
    for (int c = threadIdx.x; c < cols; c += kXentThreads) row[c] = expf(row[c] - mx) * inv;
    if (threadIdx.x == 0) lse[r] = mx + static_cast<float>(log(sum));
  }
}

__global__ void __launch_bounds__(kXentThreads)
    softmax_backward_rows_kernel(float* dx, const float* p, i64 rows, int cols) {
  __shared__ double red[kXentThreads / 32];
  for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
    float* d = dx + r * cols;
    const float* pr = p + r * cols;
    double dot = 0.0;
    for (int c = threadIdx.x; c < cols; c += kXentThreads) dot += static_cast<double>(d[c]) * pr[c];
    dot = block_sum<kXentThreads>(dot, red);
    if (threadIdx.x == 0) red[0] = dot;
    __syncthreads();
    const float dotf = static_cast<float>(red[0]);
    __syncthreads();  // red is read before the next row's block_sum writes it
    for (int c = threadIdx.x; c < cols; c += kXentThreads) d[c] = pr[c] * (d[c] - dotf);
  }
}

// *result += sum of x[n] in a fixed order: thread i sums x[i], x[i + 256], ..., then the block
// adds the 256 sums in a fixed tree.
__global__ void __launch_bounds__(kThreads)
    sum_doubles_kernel(double* result, const double* x, i64 n) {
  __shared__ double red[kThreads / 32];
  double s = 0.0;
  for (i64 i = threadIdx.x; i < n; i += kThreads) s += x[i];
  s = block_sum<kThreads>(s, red);
  if (threadIdx.x == 0) *result += s;
}

// ---- optimizer ----------------------------------------------------------------------------
constexpr i64 kSumBlock = i64{1} << 16;  // elements per partial of sum_squares, as on the CPU

__global__ void __launch_bounds__(kThreads)
    sum_squares_partials_kernel(double* partials, const float* g, i64 n) {
  __shared__ double red[kThreads / 32];
  const i64 begin = blockIdx.x * kSumBlock;
  const i64 end = min(n, begin + kSumBlock);
  double s = 0.0;
  for (i64 i = begin + threadIdx.x; i < end; i += kThreads) {
    const double x = g[i];
    s += x * x;
  }
  s = block_sum<kThreads>(s, red);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

__global__ void adamw_kernel(float* p, float* m, float* v, const float* g, i64 n, AdamwScalars k,
                             bf16* p_bf16) {
  for (i64 i = blockIdx.x * i64{blockDim.x} + threadIdx.x; i < n;
       i += i64{gridDim.x} * blockDim.x) {
    const float pn = adamw_update(p[i], m[i], v[i], g[i], k);
    p[i] = pn;
    if (p_bf16 != nullptr) p_bf16[i] = __float2bfloat16_rn(pn);
  }
}

// Note [AdamW over many tensors]: one launch updates up to kAdamwSpans tensors, each a grid-
// stride loop over its span in turn, so that a step's few hundred tensors cost a handful of
// launches instead of one each; every element runs adamw_update as adamw_kernel does.
constexpr int kAdamwSpans = 32;
struct AdamwTable {
  AdamwSpan span[kAdamwSpans];
  float decay[kAdamwSpans];  // lr * weight_decay, as adamw_scalars folds it
  int n;
};

__global__ void adamw_spans_kernel(float* p, float* m, float* v, const float* g, const AdamwTable tab,
                                   AdamwScalars k, bf16* p_bf16) {
  for (int j = 0; j < tab.n; ++j) {
    k.decay = tab.decay[j];
    const AdamwSpan s = tab.span[j];
    for (i64 i = blockIdx.x * i64{blockDim.x} + threadIdx.x; i < s.count;
         i += i64{gridDim.x} * blockDim.x) {
      const i64 pi = s.offset + i, si = s.state_offset + i, gi = s.grad_at() + i;
      const float pn = adamw_update(p[pi], m[si], v[si], g[gi], k);
      p[pi] = pn;
      if (p_bf16 != nullptr) p_bf16[pi] = __float2bfloat16_rn(pn);
    }
  }
}

}  // namespace

// ---- host wrappers ------------------------------------------------------------------------

void add_block_partials(float* dst, const double* partials, int num_blocks, int C,
                        cudaStream_t stream) {
  if (C == 0) return;
  add_block_partials_kernel<<<grid_x(ceil_div(C, kThreads), "add_block_partials"), kThreads, 0, stream>>>(
      dst, partials, num_blocks, C);
  SPPO_CUDA_CHECK_LAUNCH();
}

void convert(void* dst, DType dst_type, const void* src, DType src_type, i64 n,
             cudaStream_t stream) {
  if (n == 0) return;
  dispatch_act(dst_type, "convert", [&](auto d) {
    dispatch_act(src_type, "convert", [&](auto s) {
      using D = decltype(d);
      using S = decltype(s);
      convert_kernel<D, S><<<grid_for(n), kThreads, 0, stream>>>(static_cast<D*>(dst),
                                                                 static_cast<const S*>(src), n);
      SPPO_CUDA_CHECK_LAUNCH();
    });
  });
}

void add_inplace(void* y, DType y_type, const void* x, DType x_type, i64 n, cudaStream_t stream) {
  if (n == 0) return;
  dispatch_act(y_type, "add_inplace", [&](auto yt) {
    dispatch_act(x_type, "add_inplace", [&](auto xt) {
      using Y = decltype(yt);
      using X = decltype(xt);
      add_kernel<Y, X>
          <<<grid_for(n), kThreads, 0, stream>>>(static_cast<Y*>(y), static_cast<const X*>(x), n);
      SPPO_CUDA_CHECK_LAUNCH();
    });
  });
}

namespace {

void copy_2d(void* dst, DType dst_type, i64 ld_dst, const void* src, DType src_type, i64 ld_src,
             int T, int width, cudaStream_t stream) {
  if (T == 0 || width == 0) return;
  dispatch_act(dst_type, "copy_cols", [&](auto d) {
    dispatch_act(src_type, "copy_cols", [&](auto s) {
      using D = decltype(d);
      using S = decltype(s);
      copy_2d_kernel<D, S><<<grid_for(i64{T} * width), kThreads, 0, stream>>>(
          static_cast<D*>(dst), ld_dst, static_cast<const S*>(src), ld_src, T, width);
      SPPO_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace

void copy_rows(void* dst, DType dst_type, i64 ld_dst, const void* src, DType src_type, i64 ld_src, int T, int width,
               cudaStream_t stream) {
  copy_2d(dst, dst_type, ld_dst, src, src_type, ld_src, T, width, stream);
}

void add_rows(void* dst, DType dst_type, i64 ld_dst, const void* src, DType src_type, i64 ld_src, int T, int width,
              cudaStream_t stream) {
  if (T == 0 || width == 0) return;
  dispatch_act(dst_type, "add_rows", [&](auto d) {
    dispatch_act(src_type, "add_rows", [&](auto s) {
      using D = decltype(d);
      using S = decltype(s);
      add_2d_kernel<D, S><<<grid_for(i64{T} * width), kThreads, 0, stream>>>(
          static_cast<D*>(dst), ld_dst, static_cast<const S*>(src), ld_src, T, width);
      SPPO_CUDA_CHECK_LAUNCH();
    });
  });
}

void copy_cols(void* dst, DType dst_type, const void* src, DType src_type, int T, int width,
               int ld_src, int col, cudaStream_t stream) {
  SPPO_ASSERT_MSG(col >= 0 && col + width <= ld_src,
                  "copy_cols: columns [" << col << ", " << col + width << ") of ld " << ld_src);
  const char* s = static_cast<const char*>(src) + static_cast<i64>(col) * dtype_bytes(src_type);
  copy_2d(dst, dst_type, width, s, src_type, ld_src, T, width, stream);
}

void put_cols(void* dst, DType dst_type, const void* src, DType src_type, int T, int width,
              int ld_dst, int col, cudaStream_t stream) {
  SPPO_ASSERT_MSG(col >= 0 && col + width <= ld_dst,
                  "put_cols: columns [" << col << ", " << col + width << ") of ld " << ld_dst);
  char* d = static_cast<char*>(dst) + static_cast<i64>(col) * dtype_bytes(dst_type);
  copy_2d(d, dst_type, ld_dst, src, src_type, width, T, width, stream);
}

void zero_cols(void* dst, DType type, int T, int width, int ld, int col, cudaStream_t stream) {
  SPPO_ASSERT_MSG(col >= 0 && col + width <= ld,
                  "zero_cols: columns [" << col << ", " << col + width << ") of ld " << ld);
  if (T == 0 || width == 0) return;
  dispatch_act(type, "zero_cols", [&](auto tag) {
    using T_ = decltype(tag);
    zero_2d_kernel<T_><<<grid_for(i64{T} * width), kThreads, 0, stream>>>(
        static_cast<T_*>(dst) + col, ld, T, width);
    SPPO_CUDA_CHECK_LAUNCH();
  });
}

void layernorm_forward(void* out, float* mean, float* rstd, const void* x, const float* w,
                       const float* b, int T, int H, float eps, DType act, cudaStream_t stream) {
  norm_forward<false, false>(out, mean, rstd, const_cast<void*>(x), nullptr, w, b, T, H, eps, act,
                             stream, "layernorm_forward");
}

void layernorm_backward(void* dx, float* dw, float* db, const void* dout, const void* x,
                        const float* w, const float* mean, const float* rstd, int T, int H,
                        DType act, cudaStream_t stream) {
  if (T == 0) return;
  const int num_blocks = static_cast<int>(ceil_div(T, kRowBlock));
  Scratch partials(sizeof(double) * 2 * static_cast<std::size_t>(num_blocks) * H, stream);
  double* dw_part = partials.as<double>();
  double* db_part = dw_part + static_cast<i64>(num_blocks) * H;
  dispatch_act(act, "layernorm_backward", [&](auto tag) {
    using E = decltype(tag);
    const E* dout_e = static_cast<const E*>(dout);
    const E* x_e = static_cast<const E*>(x);
    layernorm_backward_dx_kernel<E>
        <<<grid_x(ceil_div(T, kLnWarps), "norm"), kLnWarps * 32, 0, stream>>>(
            static_cast<E*>(dx), dout_e, x_e, w, mean, rstd, T, H);
    SPPO_CUDA_CHECK_LAUNCH();
    const dim3 grid = row_block_grid(num_blocks, H);
    layernorm_param_partials_kernel<E>
        <<<grid, kThreads, 0, stream>>>(dw_part, db_part, dout_e, x_e, mean, rstd, T, H);
    SPPO_CUDA_CHECK_LAUNCH();
  });
  add_block_partials(dw, dw_part, num_blocks, H, stream);
  add_block_partials(db, db_part, num_blocks, H, stream);
}

void rmsnorm_forward(void* out, float* rstd, const void* x, const float* w, int T, int H,
                     float eps, DType act, cudaStream_t stream) {
  norm_forward<true, false>(out, nullptr, rstd, const_cast<void*>(x), nullptr, w, nullptr, T, H,
                            eps, act, stream, "rmsnorm_forward");
}

void rmsnorm_backward(void* dx, float* dw, const void* dout, const void* x, const float* w,
                      const float* rstd, int T, int H, DType act, cudaStream_t stream) {
  if (T == 0) return;
  const int num_blocks = static_cast<int>(ceil_div(T, kRowBlock));
  Scratch partials(sizeof(double) * static_cast<std::size_t>(num_blocks) * H, stream);
  double* dw_part = partials.as<double>();
  dispatch_act(act, "rmsnorm_backward", [&](auto tag) {
    using E = decltype(tag);
    const E* dout_e = static_cast<const E*>(dout);
    const E* x_e = static_cast<const E*>(x);
    rmsnorm_backward_dx_kernel<E>
        <<<grid_x(ceil_div(T, kLnWarps), "norm"), kLnWarps * 32, 0, stream>>>(
            static_cast<E*>(dx), dout_e, x_e, w, rstd, T, H);
    SPPO_CUDA_CHECK_LAUNCH();
    const dim3 grid = row_block_grid(num_blocks, H);
    rmsnorm_param_partials_kernel<E>
        <<<grid, kThreads, 0, stream>>>(dw_part, dout_e, x_e, rstd, T, H);
    SPPO_CUDA_CHECK_LAUNCH();
  });
  add_block_partials(dw, dw_part, num_blocks, H, stream);
}

void add_norm_forward(void* y, const void* x, void* out, float* mean, float* rstd, const float* w,
                      const float* b, int T, int H, float eps, bool rms, DType act,
                      cudaStream_t stream) {
  if (rms) norm_forward<true, true>(out, mean, rstd, y, x, w, b, T, H, eps, act, stream, "add_norm_forward");
  else norm_forward<false, true>(out, mean, rstd, y, x, w, b, T, H, eps, act, stream, "add_norm_forward");
}

void swiglu_forward(void* out, const void* gu, int T, int F, DType act, cudaStream_t stream) {
  const i64 n = static_cast<i64>(T) * F;
  if (n == 0) return;
  dispatch_act(act, "swiglu_forward", [&](auto tag) {
    using E = decltype(tag);
    swiglu_forward_kernel<E><<<grid_for(n), kThreads, 0, stream>>>(
        static_cast<E*>(out), static_cast<const E*>(gu), F, n);
    SPPO_CUDA_CHECK_LAUNCH();
  });
}

void swiglu_backward(void* dgu, const void* gu, int T, int F, DType act, cudaStream_t stream) {
  const i64 n = static_cast<i64>(T) * F;
  if (n == 0) return;
  dispatch_act(act, "swiglu_backward", [&](auto tag) {
    using E = decltype(tag);
    swiglu_backward_kernel<E><<<grid_for(n), kThreads, 0, stream>>>(
        static_cast<E*>(dgu), static_cast<const E*>(gu), F, n);
    SPPO_CUDA_CHECK_LAUNCH();
  });
}

void gelu_forward(void* out, const void* in, i64 n, DType act, cudaStream_t stream) {
  if (n == 0) return;
  dispatch_act(act, "gelu_forward", [&](auto tag) {
    using E = decltype(tag);
    gelu_forward_kernel<E>
        <<<grid_for(n), kThreads, 0, stream>>>(static_cast<E*>(out), static_cast<const E*>(in), n);
    SPPO_CUDA_CHECK_LAUNCH();
  });
}

void gelu_backward(void* din, const void* dout, const void* in, i64 n, DType act,
                   cudaStream_t stream) {
  if (n == 0) return;
  dispatch_act(act, "gelu_backward", [&](auto tag) {
    using E = decltype(tag);
    gelu_backward_kernel<E><<<grid_for(n), kThreads, 0, stream>>>(
        static_cast<E*>(din), static_cast<const E*>(dout), static_cast<const E*>(in), n);
    SPPO_CUDA_CHECK_LAUNCH();
  });
}

namespace {

void rope_apply(void* x, int T, int Z, int A, i64 pos0, const RopeTable& r, int ld, DType act,
                float sign, cudaStream_t stream) {
  SPPO_ASSERT_MSG(A > 0 && A % 2 == 0, "rope: head size " << A << " must be even");
  SPPO_ASSERT_MSG(r.half == A / 2,
                  "rope: a table of " << r.half << " frequencies for head size " << A);
  SPPO_ASSERT_MSG(pos0 >= 0 && ld >= Z * A, "rope: pos0=" << pos0 << " ld=" << ld);
  if (T == 0) return;
  dispatch_act(act, "rope", [&](auto tag) {
    using E = decltype(tag);
    rope_kernel<E><<<grid_for(i64{T} * (A / 2)), kThreads, 0, stream>>>(static_cast<E*>(x), T, Z, A,
                                                                        pos0, r, ld, sign);
    SPPO_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace

void rope_forward(void* x, int T, int Z, int A, i64 pos0, const RopeTable& r, int ld, DType act,
                  cudaStream_t stream) {
  rope_apply(x, T, Z, A, pos0, r, ld, act, 1.0f, stream);
}

// The transpose of scale R(angle) is scale R(-angle): the same cos, the sine negated.
void rope_backward(void* dx, int T, int Z, int A, i64 pos0, const RopeTable& r, int ld, DType act,
                   cudaStream_t stream) {
  rope_apply(dx, T, Z, A, pos0, r, ld, act, -1.0f, stream);
}

void xent_forward_backward(void* dlogits, DType dlogits_type, float* losses, double* loss_sum,
                           const float* logits, const std::int32_t* targets, int T, int V,
                           float grad_scale, cudaStream_t stream) {
  SPPO_CHECK(dlogits_type == DType::F32 || dlogits != static_cast<const void*>(logits), "loss")
      << "a BF16 gradient cannot overwrite the F32 logits in place; pass a separate buffer";
  if (T == 0) return;
  Scratch row_loss(sizeof(double) * static_cast<std::size_t>(T), stream);
  dispatch_act(dlogits_type, "xent_forward_backward", [&](auto tag) {
    using E = decltype(tag);
    xent_kernel<E><<<grid_x(T, "cross-entropy"), kXentThreads, 0, stream>>>(
        static_cast<E*>(dlogits), losses, row_loss.as<double>(), logits, targets, V, grad_scale);
    SPPO_CUDA_CHECK_LAUNCH();
  });
  sum_doubles_kernel<<<1, kThreads, 0, stream>>>(loss_sum, row_loss.as<double>(), T);
  SPPO_CUDA_CHECK_LAUNCH();
}

void row_logsumexp(float* lse, const float* logits, int T, int V, cudaStream_t stream) {
  SPPO_ASSERT_MSG(V >= 0, "row_logsumexp: V=" << V);
  if (T == 0) return;
  row_logsumexp_kernel<<<grid_x(T, "cross-entropy"), kXentThreads, 0, stream>>>(lse, logits, V);
  SPPO_CUDA_CHECK_LAUNCH();
}

void xent_shard(void* dlogits, DType dlogits_type, float* losses, double* loss_sum,
                const float* logits, const float* lse_parts, int parts, const std::int32_t* targets,
                int T, int V, int v0, float grad_scale, cudaStream_t stream) {
  SPPO_CHECK(dlogits_type == DType::F32 || dlogits != static_cast<const void*>(logits), "loss")
      << "a BF16 gradient cannot overwrite the F32 logits in place; pass a separate buffer";
  SPPO_ASSERT_MSG(parts >= 1 && V >= 0 && v0 >= 0,
                  "xent_shard: parts=" << parts << " V=" << V << " v0=" << v0);
  if (T == 0) return;
  Scratch row_loss(sizeof(double) * static_cast<std::size_t>(T), stream);
  dispatch_act(dlogits_type, "xent_shard", [&](auto tag) {
    using E = decltype(tag);
    xent_shard_kernel<E><<<grid_x(T, "cross-entropy"), kXentThreads, 0, stream>>>(
        static_cast<E*>(dlogits), losses, row_loss.as<double>(), logits, lse_parts, parts, targets,
        T, V, v0, grad_scale);
    SPPO_CUDA_CHECK_LAUNCH();
  });
  sum_doubles_kernel<<<1, kThreads, 0, stream>>>(loss_sum, row_loss.as<double>(), T);
  SPPO_CUDA_CHECK_LAUNCH();
}

void sum_squares(double* result, const float* g, i64 n, cudaStream_t stream) {
  if (n == 0) return;
  const i64 num_blocks = ceil_div(n, kSumBlock);
  Scratch partials(sizeof(double) * static_cast<std::size_t>(num_blocks), stream);
  sum_squares_partials_kernel<<<grid_x(num_blocks, "sum_squares"), kThreads, 0, stream>>>(
      partials.as<double>(), g, n);
  SPPO_CUDA_CHECK_LAUNCH();
  sum_doubles_kernel<<<1, kThreads, 0, stream>>>(result, partials.as<double>(), num_blocks);
  SPPO_CUDA_CHECK_LAUNCH();
}

void softmax_rows(float* x, float* lse, i64 rows, int cols, bool with_lse, cudaStream_t stream) {
  if (rows == 0) return;
  softmax_rows_kernel<<<grid_x(std::min(rows, kMaxGridX), "softmax_rows"), kXentThreads, 0, stream>>>(
      x, lse, rows, cols, with_lse);
  SPPO_CUDA_CHECK_LAUNCH();
}

void softmax_backward_rows(float* dx, const float* p, i64 rows, int cols, cudaStream_t stream) {
  if (rows == 0) return;
  softmax_backward_rows_kernel<<<grid_x(std::min(rows, kMaxGridX), "softmax_backward_rows"), kXentThreads, 0,
                                 stream>>>(dx, p, rows, cols);
  SPPO_CUDA_CHECK_LAUNCH();
}

void scale_inplace(float* x, i64 n, float s, cudaStream_t stream) {
  if (n == 0) return;
  scale_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, n, s);
  SPPO_CUDA_CHECK_LAUNCH();
}

void adamw_step(float* p, float* m, float* v, const float* g, i64 n, float lr, float beta1,
                float beta2, float eps, float weight_decay, int t, cudaStream_t stream,
                void* p_bf16) {
  const AdamwScalars k = adamw_scalars(lr, beta1, beta2, eps, weight_decay, t);
  if (n == 0) return;
  adamw_kernel<<<grid_for(n), kThreads, 0, stream>>>(p, m, v, g, n, k, static_cast<bf16*>(p_bf16));
  SPPO_CUDA_CHECK_LAUNCH();
}

void adamw_spans(float* p, float* m, float* v, const float* g, const AdamwSpan* spans, int n,
                 float lr, float beta1, float beta2, float eps, int t, cudaStream_t stream,
                 void* p_bf16) {
  const AdamwScalars k = adamw_scalars(lr, beta1, beta2, eps, 0.0f, t);
  for (int j0 = 0; j0 < n; j0 += kAdamwSpans) {
    AdamwTable tab{};
    tab.n = std::min(kAdamwSpans, n - j0);
    i64 widest = 0;
    for (int j = 0; j < tab.n; ++j) {
      tab.span[j] = spans[j0 + j];
      tab.decay[j] = adamw_scalars(lr, beta1, beta2, eps, spans[j0 + j].weight_decay, t).decay;
      widest = std::max<i64>(widest, tab.span[j].count);
    }
    if (widest == 0) continue;
    adamw_spans_kernel<<<grid_for(widest), kThreads, 0, stream>>>(p, m, v, g, tab, k,
                                                                  static_cast<bf16*>(p_bf16));
    SPPO_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace sppo::cuda
