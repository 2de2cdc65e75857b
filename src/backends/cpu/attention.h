// Causal flash attention on the CPU (fp32), the kernel the whole engine is built around.
//
// One call computes attention of a block of queries against ONE block of keys/values (or, in
// the _blocks forms, against SEVERAL key/value blocks, each its own buffer), each at its own
// global position offset. A subsequence calls the _blocks forms once with its KV cache blocks
// and its own keys; ring attention calls the single-block forms once per ring step with the
// block that just arrived and merges the partial results by log-sum-exp. No Tq x Tk score matrix is ever materialised:
// scores live in cache-sized tiles, fully masked tiles are skipped, softmax is fused.
//
// Layout: row t of q holds Z heads of A dims at columns z*A .. z*A+A-1 (row stride ldq);
// likewise out (stride ldo), and k, v with Zkv heads (strides ldk, ldv). lse is [Z, Tq]
// (head-major, dense). Grouped-query attention: query head z reads key/value head
// z / (Z / Zkv), so Z / Zkv query heads share one key/value head (Zkv = Z: plain multi-head).
// Query row t has global position q_pos0 + t, key row s has k_pos0 + s; key s is visible to
// query t iff k_pos0 + s <= q_pos0 + t. Scores are scaled by 1/sqrt(A).
//
// Threads: every call runs on omp_get_max_threads() OpenMP threads (one, when called inside a
// parallel region). Results are bit-identical from run to run at a given thread count; the
// forward's do not depend on the thread count at all. Scratch: about 230 KiB per thread in the
// forward (A = 64), and 3 * Tq * A floats per thread in the backward (more with fewer key/value
// heads than 4 * threads: Note [Deterministic backward] in attention.cpp), taken from the caller's Scratch
// when given (its size from the *_scratch functions), else allocated per call.
#pragma once

#include <vector>

#include "core/dims.h"
#include "core/layout.h"
#include "backends/cpu/scratch.h"

namespace sppo::cpu {

struct AttnDims {
  int Tq = 0;      // query rows
  int Tk = 0;      // key/value rows
  int Z = 0;       // heads
  int A = 0;       // head size
  i64 q_pos0 = 0;  // global position of query row 0
  i64 k_pos0 = 0;  // global position of key row 0
  int ldq = 0, ldk = 0, ldv = 0, ldo = 0;  // row strides (0 means Z*A; for k, v Zkv*A)
  int Zkv = 0;     // key/value heads, a divisor of Z (0 means Z)
};

// merge == false: out[Tq, Z*A] and lse[Z, Tq] are overwritten with this block's result.
//   A query row that sees no key gets out = 0 and lse = -inf.
// merge == true: out/lse already hold the result over other key blocks; the result over the
//   union (the existing blocks and this one) replaces them, combined by log-sum-exp.
void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       const AttnDims& d, bool merge, Scratch* scratch = nullptr);

// out/lse (over some keys) and part_out/part_lse (the same queries over other keys) ->
// out/lse over the union, by log-sum-exp (the merge step of ring attention). Rows that see
// no key on either side stay out = 0, lse = -inf.
void attention_merge(float* out, float* lse, const float* part_out, const float* part_lse, const AttnDims& d);

// delta[Z, Tq] = rowsum(dout * out) per head: computed once per query block, shared by every
// key block's backward call.
void attention_backward_delta(float* delta, const float* dout, const float* out,
                              const AttnDims& d);

// Backward of one (query block, key block) pair, given the FINAL out's lse and delta
// (over all key blocks). dq[Tq, .] (stride ldq), dk[Tk, .] (stride ldk), dv[Tk, .] (stride
// ldv) all ACCUMULATE (+=), so a query block's dq sums over its key blocks and a key block's
// dk/dv sum over the query blocks that see it (and over the Z / Zkv query heads that share
// each key/value head). dout has stride ldo.
void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                        const float* k, const float* v, const float* lse, const float* delta,
                        const AttnDims& d, Scratch* scratch = nullptr);

// One key/value block of a multi-block call: rows k[Tk, .] (stride ldk), v[Tk, .] (stride ldv)
// at global positions k_pos0 .. k_pos0 + Tk - 1; dk, dv (same strides) accumulate (+=) its
// gradients in the backward and are unused in the forward.
struct KVBlock {
  const float* k = nullptr;
  const float* v = nullptr;
  float* dk = nullptr;
  float* dv = nullptr;
  int Tk = 0;
  i64 k_pos0 = 0;
};

// attention_forward(merge == false) of the queries against the union of `blocks`, in one
// parallel region and one online softmax per query: no merge pass. d gives Tq, Z, A, q_pos0
// and the strides (ldk, ldv shared by every block); d.Tk and d.k_pos0 are ignored.
// The result equals one call over the keys of all blocks.
void attention_forward_blocks(float* out, float* lse, const float* q,
                              const std::vector<KVBlock>& blocks, const AttnDims& d,
                              Scratch* scratch = nullptr);

// attention_backward of the queries against every block at once: dq and each block's dk/dv
// ACCUMULATE (+=). One parallel region; dk/dv of a key tile are written by the one task that
// owns it and dq is summed deterministically, as in the single-block backward. d as in
// attention_forward_blocks.
void attention_backward_blocks(float* dq, const float* dout, const float* q,
                               const std::vector<KVBlock>& blocks, const float* lse,
                               const float* delta, const AttnDims& d, Scratch* scratch = nullptr);

// The scratch the calls above take on `threads` OpenMP threads, as bounds in the query rows
// Tq (kernels/scratch.h); a call given a Scratch takes every buffer from it. Zkv as in
// AttnDims (0 means Z): the backward's tasks are per key/value head.
KernelScratch attention_forward_scratch(int A, int threads);
KernelScratch attention_backward_scratch(int Z, int A, int threads, int Zkv = 0);

}  // namespace sppo::cpu
