// Emulated CUDA runtime (tests/cuda/emulate): host memory stands in for device memory, streams
// are synchronous (kernels run to completion inside their launch).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>

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

enum cudaError_t { cudaSuccess = 0, cudaErrorMemoryAllocation = 2 };
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

inline cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
inline cudaError_t cudaMalloc(void** p, std::size_t n) {
  *p = std::malloc(n > 0 ? n : 1);
  if (*p == nullptr) return cudaErrorMemoryAllocation;
  std::memset(*p, 0x5A, n);  // never zeros
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
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorName(cudaError_t) { return "cudaError (emulated)"; }
inline const char* cudaGetErrorString(cudaError_t) { return "emulated runtime error"; }
template <typename T>
cudaError_t cudaFuncSetAttribute(T*, cudaFuncAttribute, int) {
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, 0); }
