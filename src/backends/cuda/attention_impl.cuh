// What the attention kernels share (internal to src/backends/cuda): the call's parameters and
// the block table, both passed by value as kernel parameters, and the tensor-core launchers.
#pragma once

#include "backends/cuda/attention.h"
#include "backends/cuda/common.cuh"

namespace sppo::cuda {

// The key/value blocks of one call. Kernel parameters live in the constant bank; indexing the
// arrays with a block number compiles to indexed constant loads, no copy (12.3 KB, within the
// 32 KB parameter limit of CUDA 12.1+ on sm_70 and later).
struct KVTable {
  int n = 0;
  const void* k[kMaxKVBlocks];
  const void* v[kMaxKVBlocks];
  float* dk[kMaxKVBlocks];
  float* dv[kMaxKVBlocks];
  i64 pos[kMaxKVBlocks];  // k_pos0
  int len[kMaxKVBlocks];  // Tk
  // Backward, one thread block per key tile of the size the kernel uses: block b's tiles (those
  // some query sees) are [tile_start[b], tile_start[b + 1]).
  int tile_start[kMaxKVBlocks + 1];
};

struct AttnParams {
  const void* q = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  const void* dout = nullptr;
  void* dq = nullptr;
  const float* delta = nullptr;
  int Tq = 0, Z = 0, A = 0;
  int Zkv = 0;    // key/value heads (resolved: Z without grouped-query attention)
  int share = 1;  // query heads per key/value head: Z / Zkv; query head z reads z / share
  i64 q_pos0 = 0;
  i64 ldq = 0, ldk = 0, ldv = 0, ldo = 0, lddq = 0;  // resolved strides (elements)
  float scale = 0.0f;                                // 1 / sqrt(A)
  float scale_log2 = 0.0f;                           // scale * log2(e): scores to base-2 exponents
};

constexpr float kLog2e = 1.4426950408889634f;

// Keys of block b that some query up to position qp_last sees: a prefix of the block.
__device__ __forceinline__ int visible_keys(const KVTable& kv, int b, i64 qp_last) {
  const i64 n = qp_last - kv.pos[b] + 1;
  return static_cast<int>(n < 0 ? 0 : (n < kv.len[b] ? n : kv.len[b]));
}

// Fills tile_start for key tiles of `tile` rows, counting the keys a query up to qp_last sees.
// Returns the number of tiles.
int fill_tile_starts(KVTable& kv, i64 qp_last, int tile);

// Tensor-core kernels (attention_tc.cu): bf16, A = 64 or 128.
bool tc_head_size_supported(int A);
void tc_forward(const AttnParams& p, const KVTable& kv, cudaStream_t stream);
void tc_backward(const AttnParams& p, KVTable& kv, cudaStream_t stream);

}  // namespace sppo::cuda
