// Embedding forward and its deterministic backward (contract in backends/cuda/ops.h).
//
// The backward is a scatter-add by token id. Float atomics would add a token's rows in whatever
// order the hardware runs them, so instead the (id, position) pairs are sorted by id with CUB's
// stable radix sort (positions of one id stay in token order), and one thread per (id, column)
// walks that id's positions in order, adding into dembed's element as the CPU kernel does:
// ((dembed + dout[t0]) + dout[t1]) + ... So fp32 results equal the CPU's bit for bit.
#include <cub/device/device_radix_sort.cuh>

#include "backends/cuda/common.cuh"
#include "backends/cuda/ops.h"

namespace sppo::cuda {
namespace {

template <typename T>
__global__ void embedding_forward_kernel(T* out, const std::int32_t* ids, const float* embed,
                                         int rows, int H, int V) {
  const i64 n = static_cast<i64>(rows) * H;
  for (i64 i = blockIdx.x * i64{blockDim.x} + threadIdx.x; i < n;
       i += i64{gridDim.x} * blockDim.x) {
    const i64 t = i / H, h = i % H;
    const int id = ids[t];
    if (id < 0 || id >= V) __trap();
    store_f(out + i, embed[static_cast<i64>(id) * H + h]);
  }
}

// The loops count in i64: an int index stepping past n would wrap for n near 2^31.
__global__ void iota_kernel(std::int32_t* x, int n) {
  for (i64 i = blockIdx.x * i64{blockDim.x} + threadIdx.x; i < n; i += i64{gridDim.x} * blockDim.x)
    x[i] = static_cast<std::int32_t>(i);
}

// Block (i, column chunk): if sorted position i starts a run of equal ids, its threads add the
// run's rows of dout, in token order, into that id's row of dembed. Other blocks return.
// kShard: ids are shard rows in [0, V) or V, the key of another shard's tokens, skipped.
template <typename T, bool kShard = false>
__global__ void embedding_backward_kernel(float* dembed, const T* dout, const unsigned* sorted_ids,
                                          const std::int32_t* positions, int rows, int H, int V) {
  const int i = blockIdx.x;
  const unsigned id = sorted_ids[i];
  if (i > 0 && sorted_ids[i - 1] == id) return;
  if (kShard && id == static_cast<unsigned>(V)) return;
  if (id >= static_cast<unsigned>(V)) __trap();
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= H) return;
  float* dst = dembed + static_cast<i64>(id) * H + c;
  float acc = *dst;
  for (int j = i; j < rows && sorted_ids[j] == id; ++j)
    acc += load_f(dout + static_cast<i64>(positions[j]) * H + c);
  *dst = acc;
}

// out = embed[id - v0] for ids in [v0, v0 + Vr), else 0.
template <typename T>
__global__ void embedding_shard_forward_kernel(T* out, const std::int32_t* ids, const float* embed,
                                               int rows, int H, int v0, int Vr) {
  const i64 n = static_cast<i64>(rows) * H;
  for (i64 i = blockIdx.x * i64{blockDim.x} + threadIdx.x; i < n;
       i += i64{gridDim.x} * blockDim.x) {
    const i64 t = i / H, h = i % H;
    const int id = ids[t];
    if (id < 0) __trap();
    const i64 r = static_cast<i64>(id) - v0;
    store_f(out + i, (r >= 0 && r < Vr) ? embed[r * H + h] : 0.0f);
  }
}

// keys[i] = ids[i] - v0 for an id of this shard, Vr for any other (sorted last, then skipped);
// positions[i] = i.
__global__ void shard_keys_kernel(unsigned* keys, std::int32_t* positions, const std::int32_t* ids,
                                  int n, int v0, int Vr) {
  for (i64 i = blockIdx.x * i64{blockDim.x} + threadIdx.x; i < n; i += i64{gridDim.x} * blockDim.x) {
    const int id = ids[i];
    if (id < 0) __trap();
    const i64 r = static_cast<i64>(id) - v0;
    keys[i] = (r >= 0 && r < Vr) ? static_cast<unsigned>(r) : static_cast<unsigned>(Vr);
    positions[i] = static_cast<std::int32_t>(i);
  }
}

}  // namespace

void embedding_forward(void* out, const std::int32_t* ids, const float* embed, int T, int H, int V,
                       DType act, cudaStream_t stream) {
  if (T == 0) return;
  dispatch_act(act, "embedding_forward", [&](auto tag) {
    using E = decltype(tag);
    embedding_forward_kernel<E>
        <<<grid_for(i64{T} * H), kThreads, 0, stream>>>(static_cast<E*>(out), ids, embed, T, H, V);
    SPPO_CUDA_CHECK_LAUNCH();
  });
}

void embedding_backward(float* dembed, const void* dout, const std::int32_t* ids, int T, int H,
                        int V, DType act, cudaStream_t stream) {
  SPPO_ASSERT_MSG(V > 0 && H > 0, "embedding_backward: V=" << V << " H=" << H);
  if (T == 0) return;
  // Sort only the bits an id in [0, V) can have.
  int end_bit = 1;
  while (end_bit < 31 && (1u << end_bit) < static_cast<unsigned>(V)) ++end_bit;
  const unsigned* keys_in = reinterpret_cast<const unsigned*>(ids);  // ids >= 0: same order
  std::size_t temp_bytes = 0;
  SPPO_CUDA_CHECK(
      cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, static_cast<unsigned*>(nullptr),
                                      static_cast<const std::int32_t*>(nullptr),
                                      static_cast<std::int32_t*>(nullptr), T, 0, end_bit, stream));
  const std::size_t n = static_cast<std::size_t>(T);
  Scratch pairs(sizeof(std::int32_t) * 3 * n, stream);
  unsigned* keys_out = pairs.as<unsigned>();
  std::int32_t* values_in = reinterpret_cast<std::int32_t*>(keys_out + n);
  std::int32_t* values_out = values_in + n;
  Scratch temp(temp_bytes, stream);
  iota_kernel<<<grid_for(T), kThreads, 0, stream>>>(values_in, T);
  SPPO_CUDA_CHECK_LAUNCH();
  SPPO_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.as<void>(), temp_bytes, keys_in, keys_out,
                                                  values_in, values_out, T, 0, end_bit, stream));
  dispatch_act(act, "embedding_backward", [&](auto tag) {
    using E = decltype(tag);
    const dim3 grid(grid_x(T, "embedding_backward"), static_cast<unsigned>(ceil_div(H, kThreads)));
    embedding_backward_kernel<E><<<grid, kThreads, 0, stream>>>(dembed, static_cast<const E*>(dout),
                                                                keys_out, values_out, T, H, V);
    SPPO_CUDA_CHECK_LAUNCH();
  });
}

void embedding_shard_forward(void* out, const std::int32_t* ids, const float* embed, int T, int H,
                             int v0, int Vr, DType act, cudaStream_t stream) {
  SPPO_ASSERT_MSG(v0 >= 0 && Vr >= 0, "embedding_shard_forward: v0=" << v0 << " Vr=" << Vr);
  if (T == 0 || H == 0) return;
  dispatch_act(act, "embedding_shard_forward", [&](auto tag) {
    using E = decltype(tag);
    embedding_shard_forward_kernel<E><<<grid_for(i64{T} * H), kThreads, 0, stream>>>(
        static_cast<E*>(out), ids, embed, T, H, v0, Vr);
    SPPO_CUDA_CHECK_LAUNCH();
  });
}

void embedding_shard_backward(float* dembed, const void* dout, const std::int32_t* ids, int T,
                              int H, int v0, int Vr, DType act, cudaStream_t stream) {
  SPPO_ASSERT_MSG(v0 >= 0 && Vr >= 0 && H > 0,
                  "embedding_shard_backward: v0=" << v0 << " Vr=" << Vr << " H=" << H);
  if (T == 0 || Vr == 0) return;
  // Keys lie in [0, Vr] (Vr: another shard's token): sort only the bits they can have.
  int end_bit = 1;
  while (end_bit < 31 && (1u << end_bit) <= static_cast<unsigned>(Vr)) ++end_bit;
  std::size_t temp_bytes = 0;
  SPPO_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, temp_bytes, static_cast<const unsigned*>(nullptr), static_cast<unsigned*>(nullptr),
      static_cast<const std::int32_t*>(nullptr), static_cast<std::int32_t*>(nullptr), T, 0, end_bit,
      stream));
  const std::size_t n = static_cast<std::size_t>(T);
  Scratch pairs(sizeof(std::int32_t) * 4 * n, stream);
  unsigned* keys_in = pairs.as<unsigned>();
  unsigned* keys_out = keys_in + n;
  std::int32_t* values_in = reinterpret_cast<std::int32_t*>(keys_out + n);
  std::int32_t* values_out = values_in + n;
  Scratch temp(temp_bytes, stream);
  shard_keys_kernel<<<grid_for(T), kThreads, 0, stream>>>(keys_in, values_in, ids, T, v0, Vr);
  SPPO_CUDA_CHECK_LAUNCH();
  SPPO_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.as<void>(), temp_bytes, keys_in, keys_out,
                                                  values_in, values_out, T, 0, end_bit, stream));
  dispatch_act(act, "embedding_shard_backward", [&](auto tag) {
    using E = decltype(tag);
    const dim3 grid(grid_x(T, "embedding_backward"), static_cast<unsigned>(ceil_div(H, kThreads)));
    embedding_backward_kernel<E, true><<<grid, kThreads, 0, stream>>>(
        dembed, static_cast<const E*>(dout), keys_out, values_out, T, H, Vr);
    SPPO_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace sppo::cuda
