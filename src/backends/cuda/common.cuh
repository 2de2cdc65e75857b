// Helpers shared by the CUDA kernels (internal to src/backends/cuda).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backends/cuda/check.h"
#include "core/check.h"
#include "core/dims.h"
#include "core/layout.h"

namespace sppo::cuda {

using bf16 = __nv_bfloat16;

constexpr unsigned kFullMask = 0xffffffffu;

// ---- element access: every kernel computes in fp32 and rounds a bf16 result once ----------
__device__ __forceinline__ float load_f(const float* p) { return *p; }
__device__ __forceinline__ float load_f(const bf16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store_f(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_f(bf16* p, float x) { *p = __float2bfloat16_rn(x); }

// Calls f(T{}) with T = float or bf16, the element type `t` names.
template <typename F>
void dispatch_act(DType t, const char* what, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); return;
    case DType::BF16: f(bf16{}); return;
    case DType::I32: break;
  }
  SPPO_CHECK(false, "cuda") << what << ": activations are F32 or BF16, got " << dtype_name(t);
}

// ---- reductions ---------------------------------------------------------------------------
// Butterfly reductions: every lane ends with the same value, summed in the same order.
__device__ __forceinline__ double warp_sum(double x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFullMask, x, o);
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFullMask, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, o));
  return x;
}

// Sum over the kThreads threads of a block, in a fixed order; the result is valid in thread 0.
// `smem` holds kThreads / 32 doubles. Ends with a barrier, so smem can be reused at once.
template <int kThreads>
__device__ double block_sum(double x, double* smem) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  x = warp_sum(x);
  if (lane == 0) smem[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < kThreads / 32 ? smem[lane] : 0.0;
    x = warp_sum(x);
  }
  __syncthreads();
  return x;
}

// Maximum over the block; the result is valid in every thread. smem: kThreads / 32 floats.
template <int kThreads>
__device__ float block_max(float x, float* smem) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  x = warp_max(x);
  if (lane == 0) smem[warp] = x;
  __syncthreads();
  float m = smem[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) m = fmaxf(m, smem[w]);
  __syncthreads();
  return m;
}

// ---- launch shapes ------------------------------------------------------------------------
constexpr int kThreads = 256;  // threads per block of the element-wise kernels

// Blocks for a grid-stride loop over n elements: enough to fill any current GPU, at most one
// element per thread. Results never depend on it (each element is computed alone).
inline unsigned grid_for(i64 n, int threads = kThreads) {
  const i64 blocks = (n + threads - 1) / threads;
  const i64 cap = i64{132} * 16;  // SMs of an H100/H200 times resident blocks of 256 threads
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks < cap ? blocks : cap));
}

inline i64 ceil_div(i64 a, i64 b) { return (a + b - 1) / b; }

// CUDA's limits on a grid: up to 2^31 - 1 blocks along x, 65535 along y and z.
constexpr i64 kMaxGridX = (i64{1} << 31) - 1;
constexpr i64 kMaxGridYZ = 65535;

// A grid's x extent of `blocks` blocks, checked against kMaxGridX (a count cast to unsigned
// past it would launch a wrong grid or none). `what` names the kernel in the message.
inline unsigned grid_x(i64 blocks, const char* what) {
  SPPO_CHECK(blocks >= 1 && blocks <= kMaxGridX, "cuda")
      << what << ": a grid of " << blocks << " blocks; CUDA launches 1 to 2^31 - 1 along x";
  return static_cast<unsigned>(blocks);
}

// ---- stream-ordered scratch -----------------------------------------------------------------
// Device memory from CUDA's stream-ordered pool, valid for the work enqueued on `stream`
// between construction and destruction (the free is enqueued after that work).
class Scratch {
 public:
  Scratch(std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes > 0) SPPO_CUDA_CHECK(cudaMallocAsync(&ptr_, bytes, stream));
  }
  ~Scratch() {
    if (ptr_ != nullptr) SPPO_CUDA_CHECK(cudaFreeAsync(ptr_, stream_));
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

// ---- deterministic column sums over row blocks (Note [Deterministic reductions]) -----------
// Rows per block of a cross-row reduction: the CPU kernels' kRowBlock, so both add the same
// partials in the same order.
constexpr int kRowBlock = 256;

// Note [Row blocks on the grid's x]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A cross-row reduction runs one block per (row block, chunk of kThreads columns). The row
// blocks go on the grid's x (up to 2^31 - 1) and the column chunks on its y (up to 65535, so up
// to 16.7M columns). With the row blocks on y, no call of more than 65535 * kRowBlock = 16.8M
// rows could launch, and the per-head norms (on T Z rows of A) pass that at 262K tokens of 64
// heads.
inline dim3 row_block_grid(int num_blocks, int columns) {
  const i64 chunks = ceil_div(columns, kThreads);
  SPPO_CHECK(chunks <= kMaxGridYZ, "cuda")
      << columns << " columns are more than a reduction over rows takes (" << kMaxGridYZ * kThreads << ")";
  return dim3(grid_x(num_blocks, "row-block reduction"), static_cast<unsigned>(chunks));
}

// dst[c] += sum over b < num_blocks of partials[b * C + c], in order of b, for c < C.
void add_block_partials(float* dst, const double* partials, int num_blocks, int C,
                        cudaStream_t stream);

}  // namespace sppo::cuda
