// CPU fp32 kernels of the GPT and Llama blocks, except attention (kernels/attention.h).
//
// Argument order (llm.c): outputs, saved-for-backward, inputs, weights, dims.
// Scratch: kernels that need some take it from the caller's Scratch (kernels/scratch.h) when
// given one, sized by their *_scratch function, and allocate their own otherwise.
//
// Accumulation rule: parameter gradients (dw, db, dembed) are ACCUMULATED (+=); activation
// gradients are WRITTEN (=) unless the comment says "accumulates" (layernorm's and rmsnorm's
// dx do, because they feed the residual stream). Every buffer comment names its shape with the
// letters of core/dims.h. All kernels are multi-threaded with OpenMP; GEMMs go to OpenBLAS.
#pragma once

#include <cstdint>

#include "core/dims.h"
#include "core/layout.h"
#include "core/rope.h"
#include "backends/cpu/scratch.h"

namespace sppo::cpu {

// ---- GEMM -----------------------------------------------------------------------------
// c[M, N] = alpha * op(a) @ op(b) + beta * c, row-major, op = transpose when trans_*.
// lda/ldb/ldc are row strides of the stored matrices.
void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* a, int lda,
          const float* b, int ldb, float beta, float* c, int ldc);

// Linear layer, PyTorch convention: w is [O, I].
// out[T, O] = in[T, I] @ w^T + b   (b may be null). ld_* are row strides (0 means dense).
void linear_forward(float* out, const float* in, const float* w, const float* b, int T, int I,
                    int O, int ld_out = 0, int ld_in = 0);
// din[T, I] = dout @ w (din may be null: skipped); dw[O, I] += dout^T @ in; db[O] += sum_t dout.
// Scratch: linear_backward_scratch(O) (the bias sum's block partials).
void linear_backward(float* din, float* dw, float* db, const float* dout, const float* in,
                     const float* w, int T, int I, int O, int ld_dout = 0, int ld_in = 0,
                     Scratch* scratch = nullptr);
KernelScratch linear_backward_scratch(int O);

// ---- embedding ------------------------------------------------------------------------
// out[T, H] = embed[ids[t]]
void embedding_forward(float* out, const std::int32_t* ids, const float* embed, int T, int H);
// dembed[V, H] += scatter of dout[T, H] by ids (deterministic: same result for any thread count)
void embedding_backward(float* dembed, const float* dout, const std::int32_t* ids, int T, int H,
                        int V);
// Vocabulary-parallel (one shard of the table): embed [Vr, H] holds rows [v0, v0 + Vr).
// out[T, H] = embed[ids[t] - v0] for ids in that range, 0 for every other row (the sum over
// the shards is embedding_forward over the whole table).
void embedding_shard_forward(float* out, const std::int32_t* ids, const float* embed, int T,
                             int H, int v0, int Vr);
// dembed[Vr, H] += scatter of the rows of dout[T, H] whose ids are in [v0, v0 + Vr); the other
// rows are skipped (deterministic as embedding_backward). Ids must be >= 0.
void embedding_shard_backward(float* dembed, const float* dout, const std::int32_t* ids, int T,
                              int H, int v0, int Vr);

// ---- LayerNorm (eps inside the sqrt, biased variance) ----------------------------------
// out[T, H], mean[T], rstd[T] <- x[T, H], w[H], b[H]
void layernorm_forward(float* out, float* mean, float* rstd, const float* x, const float* w,
                       const float* b, int T, int H, float eps);
// dx[T, H] accumulates; dw[H], db[H] accumulate. Scratch: layernorm_backward_scratch(H).
void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x,
                        const float* w, const float* mean, const float* rstd, int T, int H,
                        Scratch* scratch = nullptr);
KernelScratch layernorm_backward_scratch(int H);

// ---- RMSNorm (Llama family; eps inside the sqrt) --------------------------------------
// out[T, H], rstd[T] <- x[T, H], w[H]: out = x rstd w, rstd = 1 / sqrt(mean_h x^2 + eps)
// (rstd may be null: not stored).
void rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int T, int H,
                     float eps);
// dx[T, H] accumulates; dw[H] accumulates (as layernorm_backward).
// Scratch: rmsnorm_backward_scratch(H), or (rows_per_token, H) for rows_per_token rows of
// each of T tokens (a model's per-head norms: Z rows of A a token).
void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w,
                      const float* rstd, int T, int H, Scratch* scratch = nullptr);
KernelScratch rmsnorm_backward_scratch(int H, int rows_per_token = 1);

// ---- GeLU, tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) -----------------
void gelu_forward(float* out, const float* in, i64 n);
// din = dout * gelu'(in); din may alias dout.
void gelu_backward(float* din, const float* dout, const float* in, i64 n);

// ---- SwiGLU (Llama family) --------------------------------------------------------------
// gu[T, 2F] holds each row's gate (columns [0, F)) and up ([F, 2F)):
// out[T, F] = silu(gate) up, silu(g) = g / (1 + e^-g).
void swiglu_forward(float* out, const float* gu, int T, int F);
// In place: on entry columns [0, F) of dgu[T, 2F] hold d out (columns [F, 2F) are free); on
// exit dgu holds d gate | d up (written, not accumulated). gu as in forward.
void swiglu_backward(float* dgu, const float* gu, int T, int F);

// ---- RoPE, rotate-half form, in place -------------------------------------------------
// x: T rows of stride ld; each row holds Z heads of A dims in its first Z*A columns.
// Row t has global position pos0 + t. For j < A/2 (r.half == A/2), angle = pos * r.inv_freq[j]
// (core/rope.h), cos and sin scaled by r.scale:
//   (x_j, x_{j+A/2}) -> (x_j cos - x_{j+A/2} sin, x_{j+A/2} cos + x_j sin).
void rope_forward(float* x, int T, int Z, int A, i64 pos0, const RopeTable& r, int ld);
// The transpose rotation (the same scale), applied to a gradient in place: the inverse when
// r.scale is 1.
void rope_backward(float* dx, int T, int Z, int A, i64 pos0, const RopeTable& r, int ld);

// ---- softmax over rows (the two-pass ring attention's materialised scores) ----------------
// with_lse false: x[rows, cols] becomes softmax(x) per row, lse[rows] its log-sum-exp (sum in
// double); true: x becomes exp(x - lse) from the given lse.
void softmax_rows(float* x, float* lse, i64 rows, int cols, bool with_lse);
// dx = p * (dx - rowsum(dx * p)) per row (the softmax's backward; rowsum in double).
void softmax_backward_rows(float* dx, const float* p, i64 rows, int cols);

// ---- softmax cross-entropy, fused with its gradient --------------------------------------
// logits[T, V] is overwritten by dlogits = (softmax(logits) - onehot(targets)) * grad_scale.
// losses[T] receives -log softmax(logits)[target] per row. Returns the sum of losses (double).
// A row whose target is -1 (kNoTarget, backend/backend.h) gets loss 0 and gradient 0.
// Scratch: xent_scratch(T).
double xent_forward_backward(float* logits, float* losses, const std::int32_t* targets, int T,
                             int V, float grad_scale, Scratch* scratch = nullptr);
KernelScratch xent_scratch(int rows);

// ---- vocabulary-parallel cross-entropy (the vocabulary split over `parts` shards) ----------
// lse[T] = log sum_v exp(logits[t, v]) over the V columns of logits [T, V] (read only; the sum
// in double after the row max; -inf when V is 0).
void row_logsumexp(float* lse, const float* logits, int T, int V);
// This shard holds vocabulary columns [v0, v0 + V) as logits [T, V]; lse_parts [parts, T] holds
// every shard's row_logsumexp (part p's T values contiguous), whose log-sum-exp is the row's lse.
// dlogits[T, V] = (exp(logits - lse) - onehot(targets - v0)) * grad_scale, the onehot only for a
// target in [v0, v0 + V); dlogits may be logits itself. losses[t] = lse - logits[t, target - v0]
// for a target in this shard, else 0 (the shards' losses sum to the row's). Returns the sum of
// losses (double). A target of kNoTarget: loss 0 and a zero gradient row; other targets must be
// >= 0. Scratch: xent_scratch(T).
double xent_shard(float* dlogits, float* losses, const float* logits, const float* lse_parts,
                  int parts, const std::int32_t* targets, int T, int V, int v0, float grad_scale,
                  Scratch* scratch = nullptr);

// ---- optimizer ------------------------------------------------------------------------
// Sum of squares of g[n], accumulated in double, deterministic for any thread count.
double sum_squares(const float* g, i64 n);
void scale_inplace(float* x, i64 n, float s);
// AdamW (decoupled weight decay), step t >= 1 (bias correction uses t):
//   m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//   p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps) + lr * wd * p
void adamw_step(float* p, float* m, float* v, const float* g, i64 n, float lr, float beta1,
                float beta2, float eps, float weight_decay, int t);

}  // namespace sppo::cpu
