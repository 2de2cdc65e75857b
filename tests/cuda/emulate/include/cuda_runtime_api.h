// Emulated CUDA runtime (tests/cuda/emulate): host memory stands in for device memory, streams
// are synchronous (kernels run to completion inside their launch).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <functional>

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct float2 {
  float x, y;
};

enum cudaError_t { cudaSuccess = 0, cudaErrorMemoryAllocation = 2, cudaErrorInvalidConfiguration = 9 };
struct CUstream_st;
using cudaStream_t = CUstream_st*;
enum cudaMemcpyKind {
  cudaMemcpyHostToHost,
  cudaMemcpyHostToDevice,
  cudaMemcpyDeviceToHost,
  cudaMemcpyDeviceToDevice,
  cudaMemcpyDefault
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
constexpr unsigned cudaStreamNonBlocking = 1;

namespace emu {
// The error of the last launch refused for a grid or block past CUDA's limits (emu.h), which
// cudaGetLastError reports and clears, as CUDA's does.
inline cudaError_t g_launch_error = cudaSuccess;
// Which blocks of a launch run; null: all. The emulation runs every block on the CPU, so a test
// of a tensor past 2^31 elements runs only the blocks that reach its far end
// (tests/cuda/emulate/test_offsets64.cpp).
inline std::function<bool(const dim3& grid, const dim3& block, const uint3& index)> g_run_block;
// The byte new memory is filled with: never zeros, so that reading what no kernel wrote shows;
// 0 where blocks left out by g_run_block must leave a sum's partials at zero.
inline int g_alloc_fill = 0x5A;
}  // namespace emu

inline cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
inline cudaError_t cudaMalloc(void** p, std::size_t n) {
  *p = std::malloc(n > 0 ? n : 1);
  if (*p == nullptr) return cudaErrorMemoryAllocation;
  std::memset(*p, emu::g_alloc_fill, n);
  return cudaSuccess;
}
inline cudaError_t cudaFree(void* p) {
  std::free(p);
  return cudaSuccess;
}
inline cudaError_t cudaMallocAsync(void** p, std::size_t n, cudaStream_t) {
  return cudaMalloc(p, n);
}
inline cudaError_t cudaFreeAsync(void* p, cudaStream_t) { return cudaFree(p); }
inline cudaError_t cudaMemcpy(void* d, const void* s, std::size_t n, cudaMemcpyKind) {
  std::memcpy(d, s, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* d, const void* s, std::size_t n, cudaMemcpyKind, cudaStream_t = nullptr) {
  std::memcpy(d, s, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpy2DAsync(void* d, std::size_t dpitch, const void* s, std::size_t spitch, std::size_t width,
                                     std::size_t height, cudaMemcpyKind, cudaStream_t = nullptr) {
  for (std::size_t r = 0; r < height; ++r)
    std::memcpy(static_cast<char*>(d) + r * dpitch, static_cast<const char*>(s) + r * spitch, width);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* d, int v, std::size_t n, cudaStream_t = nullptr) {
  std::memset(d, v, n);
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  static int dummy;
  *s = reinterpret_cast<cudaStream_t>(&dummy);
  return cudaSuccess;
}
inline cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t cudaGetLastError() {
  const cudaError_t e = emu::g_launch_error;
  emu::g_launch_error = cudaSuccess;
  return e;
}
inline const char* cudaGetErrorName(cudaError_t e) {
  return e == cudaErrorInvalidConfiguration ? "cudaErrorInvalidConfiguration" : "cudaError (emulated)";
}
inline const char* cudaGetErrorString(cudaError_t) { return "emulated runtime error"; }
template <typename T>
cudaError_t cudaFuncSetAttribute(T*, cudaFuncAttribute, int) {
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, 0); }
