// Causal flash attention on CUDA: the contract of cpu::attention_forward_blocks,
// attention_backward_delta and attention_backward_blocks (kernels/attention.h), for fp32 or bf16
// activations.
//
// One call computes attention of a block of queries at global positions [q_pos0, q_pos0 + Tq)
// against SEVERAL key/value blocks, each its own buffer at its own global position. Query row t
// sees key row s of a block iff k_pos0 + s <= q_pos0 + t: causal, aligned bottom-right, so a
// subsequence at offset o attends to keys [0, o + T) given the earlier subsequences' blocks and
// its own. Scores are scaled by 1/sqrt(A). No Tq x Tk matrix is ever stored: an online softmax
// runs over key tiles, and tiles no query of a query tile sees are skipped.
//
// Layout: row t of q holds Z heads of A dims at columns z*A .. z*A+A-1 (row stride ldq); likewise
// out and dout (stride ldo), dq (stride lddq), and every block's k, v with Zkv heads (strides ldk,
// ldv, shared by all blocks). Grouped-query attention: query head z reads key/value head
// z / (Z / Zkv) (Zkv = Z: plain multi-head). lse and delta are [Z, Tq], head-major, dense, fp32.
// q, k, v, out, dout, dq have the activation type `act` (F32 or BF16); lse, delta and the dk/dv
// accumulators are fp32.
//
// Two implementations (Note [Attention kernels] in attention.cu):
//   TensorCore  bf16 only, A = 64 or 128, every pointer 16-byte aligned and every stride a
//               multiple of 8: FlashAttention-2's partition with mma.sync m16n8k16 (bf16 in,
//               fp32 accumulate), on sm_80 and sm_90.
//   Simt        any even A <= 256, fp32 or bf16: plain fp32 FMA, one warp per query (or key)
//               row. The exact path for fp32 comparisons with the CPU.
// AttnKernel::Auto takes TensorCore where it applies, else Simt.
//
// Determinism: no floating-point atomics. The backward runs two kernels: one per (key tile,
// key/value head) that owns its tile's dk/dv and sums the terms of every query head that reads
// it, and one per (query tile, head) that owns its rows of dq (Note [Deterministic backward] in
// attention.cu). Results are the same bits on every run.
#pragma once

#include <cuda_runtime_api.h>

#include <vector>

#include "core/dims.h"
#include "core/layout.h"

namespace sppo::cuda {

struct AttnDims {
  int Tq = 0;                              // query rows
  int Z = 0;                               // heads
  int A = 0;                               // head size
  i64 q_pos0 = 0;                          // global position of query row 0
  int ldq = 0, ldk = 0, ldv = 0, ldo = 0;  // row strides in elements (0 means Z*A; k, v: Zkv*A)
  int lddq = 0;                            // row stride of dq (0 means ldq)
  int Zkv = 0;                             // key/value heads, a divisor of Z (0 means Z)
};

// One key/value block: rows k[Tk, .] (stride ldk), v[Tk, .] (stride ldv) at global positions
// k_pos0 .. k_pos0 + Tk - 1, in the activation type; dk, dv (fp32, same strides as k and v)
// accumulate (+=) its gradients in the backward and are unused in the forward.
struct KVBlock {
  const void* k = nullptr;
  const void* v = nullptr;
  float* dk = nullptr;
  float* dv = nullptr;
  int Tk = 0;
  i64 k_pos0 = 0;
};

// Blocks per call: the block table travels in the kernels' parameters.
constexpr int kMaxKVBlocks = 256;

enum class AttnKernel { Auto, TensorCore, Simt };

// out[Tq, .] and lse[Z, Tq] are overwritten with the attention of the queries over the union of
// `blocks`. A query row that sees no key gets out = 0 and lse = -inf.
void attention_forward_blocks(void* out, float* lse, const void* q,
                              const std::vector<KVBlock>& blocks, const AttnDims& d, DType act,
                              cudaStream_t stream, AttnKernel kernel = AttnKernel::Auto);

// out/lse joined with part_out/part_lse (the same queries over a disjoint key set) by
// log-sum-exp, as the CPU kernel (backends/cpu/attention.h).
void attention_merge(void* out, float* lse, const void* part_out, const float* part_lse, const AttnDims& d,
                     DType act, cudaStream_t stream);

// delta[Z, Tq] = rowsum(dout * out) per head (summed in double), once per query block.
void attention_backward_delta(float* delta, const void* dout, const void* out, const AttnDims& d,
                              DType act, cudaStream_t stream);

// The backward of attention_forward_blocks given the FINAL lse and delta: dq[Tq, .] (act, stride
// lddq) and every block's dk, dv ACCUMULATE (+=). Each dq element is read, added to once and
// written once (one rounding in bf16).
void attention_backward_blocks(void* dq, const void* dout, const void* q,
                               const std::vector<KVBlock>& blocks, const float* lse,
                               const float* delta, const AttnDims& d, DType act,
                               cudaStream_t stream, AttnKernel kernel = AttnKernel::Auto);

// ---- around a fused attention library's calls (library_attention.cpp) ----------------------
// attention_merge over rows with their own strides: out [Tq, ldo] and lse [Z, ld_lse] joined
// with part_out [Tq, ld_part] and part_lse [Z, ld_part_lse].
void attention_merge_rows(void* out, float* lse, const void* part_out, const float* part_lse, int Tq, int Z, int A,
                          i64 ldo, i64 ld_part, i64 ld_lse, i64 ld_part_lse, DType act, cudaStream_t stream);
// out [Tq, ldo] = 0 (Z A columns) and lse [Z, ld_lse] = -inf: rows that see no key.
void attention_unseen_rows(void* out, float* lse, int Tq, int Z, int A, i64 ldo, i64 ld_lse, DType act,
                           cudaStream_t stream);
// o [Tq, Z A] (dense) = dout [Tq, ld_dout] * delta[z, t] / |dout[t, z, :]|^2 per row and head
// (0 where dout is 0): an output whose rowsum with dout is delta [Z, ld_delta].
void attention_synthetic_out(void* o, const void* dout, const float* delta, int Tq, int Z, int A, i64 ld_dout,
                             i64 ld_delta, DType act, cudaStream_t stream);
// p[0] = rows, p[1] = keys, in stream order (a library call's actual lengths).
void attention_set_lengths(int* p, int rows, int keys, cudaStream_t stream);

}  // namespace sppo::cuda
