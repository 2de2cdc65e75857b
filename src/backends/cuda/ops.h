// CUDA kernels of the GPT block, except attention (backends/cuda/attention.h). The same
// contracts as the CPU kernels of kernels/ops.h: same formulas, same accumulate-vs-overwrite
// rules, same argument order (llm.c: outputs, saved-for-backward, inputs, weights, dims), then
// the element type of the activations and the stream the kernel runs on.
//
// Precision. Activations (x, out, dout, din, dx, logits gradients) are either F32 or BF16, given
// by `act`; they are passed as void* and read or written as that type. Everything else is fp32:
// master weights, LayerNorm weights and statistics, weight gradients, AdamW state, dK/dV
// accumulators; the GEMM inputs take the activation type (in bf16 mode the bf16 working copy of
// the weights, made by convert()). Arithmetic is fp32 everywhere (reductions over rows in double,
// as on the CPU), and a BF16 result is rounded once, to nearest even, when it is stored.
//
// Accumulation rule: parameter gradients (dw, db, dembed) are ACCUMULATED (+=); activation
// gradients are WRITTEN (=) unless the comment says "accumulates" (layernorm's and rmsnorm's dx
// do, because they feed the residual stream). Buffers are row-major, shapes in the letters of
// core/dims.h.
//
// Determinism: every kernel gives the same bits for the same inputs on the same GPU model; no
// floating-point atomics. Reductions across rows use fixed blocks of rows and add the partials
// in a fixed order (Note [Deterministic reductions] in kernels/ops.cpp).
//
// Asynchrony: every function only enqueues work on `stream` and returns. Kernels that need
// scratch (embedding backward, the row-block partials of LayerNorm and bias gradients, the
// loss and sum-of-squares reductions) take it from CUDA's stream-ordered pool
// (cudaMallocAsync / cudaFreeAsync on `stream`); sizes are noted per kernel. Device scalars
// (loss sums, sums of squares) are double and accumulate, so several calls can sum into one
// without a synchronisation.
//
// Token ids must lie in [0, V): the caller checks them on the host, where the data loader has
// them. A kernel that meets one outside traps (the CUDA context reports an error at the next
// checked call) instead of reading or writing out of bounds.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "core/adamw.h"
#include "core/dims.h"
#include "core/layout.h"
#include "core/rope.h"

namespace sppo::cuda {

// True when a CUDA device is visible (cudaGetDeviceCount succeeds and finds at least one).
bool device_available();

// ---- GEMM -----------------------------------------------------------------------------
// cuBLASLt state shared by the GEMMs of one device: the handle, one workspace per stream that
// has run a GEMM (kWorkspaceBytes each, allocated on first use), and a cache of matmul
// descriptors, layouts and the heuristic's algorithm, keyed by shape, strides, types, epilogue
// and pointer alignments. Thread-safe. Destroy it only when its streams are idle.
class Blas {
 public:
  static constexpr std::size_t kWorkspaceBytes = std::size_t{32} << 20;  // cuBLASLt on Hopper
  // bias_epilogue: add linear_forward's bias in cuBLASLt's epilogue; when false (or when the
  // heuristic has no such algorithm) the output is first filled with the bias and the GEMM
  // adds to it, as the CPU kernel does. Same result either way; tests run both.
  explicit Blas(bool bias_epilogue = true);
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// c[M, N] = alpha * op(a) @ op(b) + beta * c, row-major, op = transpose when trans_*, as
// cpu::gemm. lda/ldb/ldc are row strides of the stored matrices (elements).
// Types (ab for a and b, cd for c): F32/F32 (fp32 compute, TF32 off), BF16/BF16 or BF16/F32
// (bf16 inputs, fp32 compute; an F32 c with beta = 1 accumulates weight gradients in fp32).
void gemm(Blas& blas, bool trans_a, bool trans_b, int M, int N, int K, float alpha, const void* a,
          int lda, const void* b, int ldb, float beta, void* c, int ldc, DType ab, DType cd,
          cudaStream_t stream);

// Linear layer, PyTorch convention: w is [O, I], all of out, in, w, b in `act`.
// out[T, O] = in[T, I] @ w^T + b   (b may be null). ld_* are row strides (0 means dense).
void linear_forward(Blas& blas, void* out, const void* in, const void* w, const void* b, int T,
                    int I, int O, DType act, cudaStream_t stream, int ld_out = 0, int ld_in = 0);
// din[T, I] = dout @ w (act; din may be null: skipped); dw[O, I] += dout^T @ in (fp32);
// db[O] += sum_t dout (fp32, may be null; scratch: ceil(T/256) * O doubles).
void linear_backward(Blas& blas, void* din, float* dw, float* db, const void* dout, const void* in,
                     const void* w, int T, int I, int O, DType act, cudaStream_t stream,
                     int ld_dout = 0, int ld_in = 0);

// ---- conversion, copies, residual -----------------------------------------------------
// dst[n] = src[n] converted (F32 <-> BF16, or a plain copy); e.g. the bf16 working copy of
// the fp32 master weights.
void convert(void* dst, DType dst_type, const void* src, DType src_type, i64 n,
             cudaStream_t stream);
// y[n] += x[n]: the residual add (both act), or adding a gradient into an fp32 accumulator
// (y F32, x either type).
void add_inplace(void* y, DType y_type, const void* x, DType x_type, i64 n, cudaStream_t stream);
// Columns [col, col + width) of the [T, ld_src] buffer src -> the dense [T, width] buffer dst.
void copy_cols(void* dst, DType dst_type, const void* src, DType src_type, int T, int width,
               int ld_src, int col, cudaStream_t stream);
// The dense [T, width] buffer src -> columns [col, col + width) of the [T, ld_dst] buffer dst:
// e.g. the fp32 dK/dV accumulators into the bf16 dqkv gradient.
void put_cols(void* dst, DType dst_type, const void* src, DType src_type, int T, int width,
              int ld_dst, int col, cudaStream_t stream);
// Columns [col, col + width) of the [T, ld] buffer dst = 0 (the dq columns before attention's
// backward accumulates into them).
void zero_cols(void* dst, DType type, int T, int width, int ld, int col, cudaStream_t stream);
// dst[t * ld_dst + c] = src[t * ld_src + c] (converted), and += it, for t < T, c < width:
// e.g. a fused attention library's dense outputs into the strided buffers they belong to.
void copy_rows(void* dst, DType dst_type, i64 ld_dst, const void* src, DType src_type, i64 ld_src, int T, int width,
               cudaStream_t stream);
void add_rows(void* dst, DType dst_type, i64 ld_dst, const void* src, DType src_type, i64 ld_src, int T, int width,
              cudaStream_t stream);

// ---- embedding ------------------------------------------------------------------------
// out[T, H] (act) = embed[ids[t]] (fp32 master weights, [V, H]; V only bounds the ids).
void embedding_forward(void* out, const std::int32_t* ids, const float* embed, int T, int H, int V,
                       DType act, cudaStream_t stream);
// dembed[V, H] += scatter of dout[T, H] by ids. Deterministic: ids are sorted with CUB's stable
// radix sort, and each id's rows are added into its row of dembed in token order, the order of
// the CPU kernel. Scratch: 3 * T int32 and CUB's temporary storage.
void embedding_backward(float* dembed, const void* dout, const std::int32_t* ids, int T, int H,
                        int V, DType act, cudaStream_t stream);
// Vocabulary-parallel, as cpu::embedding_shard_forward: embed [Vr, H] holds rows [v0, v0 + Vr);
// out[T, H] (act) = embed[ids[t] - v0] for ids in that range, 0 for the others. Ids must be >= 0.
void embedding_shard_forward(void* out, const std::int32_t* ids, const float* embed, int T, int H,
                             int v0, int Vr, DType act, cudaStream_t stream);
// dembed[Vr, H] += scatter of the rows of dout[T, H] whose ids are in [v0, v0 + Vr); the others
// are skipped. Deterministic as embedding_backward (ids of other shards sort last and are
// skipped). Scratch: 4 * T int32 and CUB's temporary storage.
void embedding_shard_backward(float* dembed, const void* dout, const std::int32_t* ids, int T,
                              int H, int v0, int Vr, DType act, cudaStream_t stream);

// ---- LayerNorm (eps inside the sqrt, biased variance) ----------------------------------
// out[T, H] (act), mean[T], rstd[T] <- x[T, H] (act), w[H], b[H] (fp32).
void layernorm_forward(void* out, float* mean, float* rstd, const void* x, const float* w,
                       const float* b, int T, int H, float eps, DType act, cudaStream_t stream);
// dx[T, H] (act) accumulates; dw[H], db[H] accumulate (scratch: 2 * ceil(T/256) * H doubles).
void layernorm_backward(void* dx, float* dw, float* db, const void* dout, const void* x,
                        const float* w, const float* mean, const float* rstd, int T, int H,
                        DType act, cudaStream_t stream);

// ---- RMSNorm (Llama family; eps inside the sqrt) --------------------------------------
// out[T, H] (act), rstd[T] <- x[T, H] (act), w[H] (fp32): out = x rstd w,
// rstd = 1 / sqrt(mean_h x^2 + eps) (the sum of squares in double, as on the CPU; rstd
// may be null: not stored).
void rmsnorm_forward(void* out, float* rstd, const void* x, const float* w, int T, int H,
                     float eps, DType act, cudaStream_t stream);
// dx[T, H] (act) accumulates; dw[H] accumulates (scratch: ceil(T/256) * H doubles).
void rmsnorm_backward(void* dx, float* dw, const void* dout, const void* x, const float* w,
                      const float* rstd, int T, int H, DType act, cudaStream_t stream);

// ---- the residual add and the norm after it, fused ----------------------------------------
// y[T, H] += x[T, H] (act), then out = the norm of the new y: RMSNorm when rms (mean and b
// unused), else LayerNorm, with mean and rstd as the norm's own kernel stores them. One pass
// over y instead of add_inplace's and the norm's; the results equal theirs to the bit.
void add_norm_forward(void* y, const void* x, void* out, float* mean, float* rstd, const float* w,
                      const float* b, int T, int H, float eps, bool rms, DType act,
                      cudaStream_t stream);

// ---- GeLU, tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) -----------------
void gelu_forward(void* out, const void* in, i64 n, DType act, cudaStream_t stream);
// din = dout * gelu'(in); din may alias dout.
void gelu_backward(void* din, const void* dout, const void* in, i64 n, DType act,
                   cudaStream_t stream);

// ---- SwiGLU (Llama family), as cpu::swiglu_forward / swiglu_backward ----------------------
// gu[T, 2F] (act) holds each row's gate (columns [0, F)) and up ([F, 2F)):
// out[T, F] (act) = silu(gate) up, silu(g) = g / (1 + e^-g), computed in fp32.
void swiglu_forward(void* out, const void* gu, int T, int F, DType act, cudaStream_t stream);
// In place: on entry columns [0, F) of dgu[T, 2F] (act) hold d out; on exit dgu holds
// d gate | d up (written). gu as in forward.
void swiglu_backward(void* dgu, const void* gu, int T, int F, DType act, cudaStream_t stream);

// ---- RoPE, rotate-half form, in place -------------------------------------------------
// x: T rows of stride ld; each row holds Z heads of A dims in its first Z*A columns.
// Row t has global position pos0 + t. For j < A/2 (r.half == A/2), angle = pos * r.inv_freq[j]
// (core/rope.h; in double), cos and sin scaled by r.scale:
//   (x_j, x_{j+A/2}) -> (x_j cos - x_{j+A/2} sin, x_{j+A/2} cos + x_j sin).
void rope_forward(void* x, int T, int Z, int A, i64 pos0, const RopeTable& r, int ld, DType act,
                  cudaStream_t stream);
// The transpose rotation (the same scale), applied to a gradient in place.
void rope_backward(void* dx, int T, int Z, int A, i64 pos0, const RopeTable& r, int ld, DType act,
                   cudaStream_t stream);

// ---- softmax cross-entropy, fused with its gradient ------------------------------------
// logits[T, V] (fp32, a chunk of rows) -> dlogits[T, V] = (softmax(logits) - onehot(targets))
// * grad_scale in dlogits_type (F32: dlogits may be logits itself, overwritten in place; BF16:
// a separate buffer, the input of the bf16 GEMMs that follow). losses[T] receives
// -log softmax(logits)[target] per row, and *loss_sum (one double on the device) ACCUMULATES
// their sum, added in a fixed order (scratch: T doubles).
void xent_forward_backward(void* dlogits, DType dlogits_type, float* losses, double* loss_sum,
                           const float* logits, const std::int32_t* targets, int T, int V,
                           float grad_scale, cudaStream_t stream);

// ---- vocabulary-parallel cross-entropy (as cpu::row_logsumexp, cpu::xent_shard) -------------
// lse[T] = log sum_v exp(logits[t, v]) over the V columns of fp32 logits [T, V] (read only).
void row_logsumexp(float* lse, const float* logits, int T, int V, cudaStream_t stream);
// This rank holds vocabulary columns [v0, v0 + V) as logits [T, V] (fp32); lse_parts [parts, T]
// every rank's row_logsumexp. dlogits (dlogits_type; F32 may be logits itself) =
// (exp(logits - lse) - onehot(targets - v0)) * grad_scale with lse the log-sum-exp of the parts;
// losses[t] = lse - logits[t, target - v0] for a target in this rank's range, else 0;
// *loss_sum ACCUMULATES their sum in a fixed order (scratch: T doubles). kNoTarget rows: loss
// 0, gradient 0.
void xent_shard(void* dlogits, DType dlogits_type, float* losses, double* loss_sum,
                const float* logits, const float* lse_parts, int parts, const std::int32_t* targets,
                int T, int V, int v0, float grad_scale, cudaStream_t stream);

// ---- softmax over rows (as cpu::softmax_rows, softmax_backward_rows) ------------------------
void softmax_rows(float* x, float* lse, i64 rows, int cols, bool with_lse, cudaStream_t stream);
void softmax_backward_rows(float* dx, const float* p, i64 rows, int cols, cudaStream_t stream);

// ---- optimizer ------------------------------------------------------------------------
// *result (one double on the device) ACCUMULATES the sum of squares of g[n], summed in double
// in fixed blocks and added in a fixed order (scratch: ceil(n / 2^16) doubles).
void sum_squares(double* result, const float* g, i64 n, cudaStream_t stream);
void scale_inplace(float* x, i64 n, float s, cudaStream_t stream);
// AdamW (decoupled weight decay), step t >= 1, as cpu::adamw_step:
//   m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//   p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps) + lr * wd * p
// p_bf16 (may be null): also writes the updated p rounded to bf16 (the working copy).
void adamw_step(float* p, float* m, float* v, const float* g, i64 n, float lr, float beta1,
                float beta2, float eps, float weight_decay, int t, cudaStream_t stream,
                void* p_bf16 = nullptr);
// adamw_step on each of n spans (core/adamw.h), p_bf16 (may be null) indexed as p: one kernel a
// kAdamwSpans spans, their table in the kernel's parameters.
void adamw_spans(float* p, float* m, float* v, const float* g, const AdamwSpan* spans, int n,
                 float lr, float beta1, float beta2, float eps, int t, cudaStream_t stream,
                 void* p_bf16);

}  // namespace sppo::cuda
