// Checked calls into the CUDA runtime and cuBLASLt (docs/design.md, Conventions 6: every
// foreign call is checked).
//
//   SPPO_CUDA_CHECK(cudaMemsetAsync(p, 0, n, stream));
//   SPPO_CUBLAS_CHECK(cublasLtMatmul(...));
//   kernel<<<grid, block, smem, stream>>>(...); SPPO_CUDA_CHECK_LAUNCH();
//
// A failed call aborts with file:line, the call's text and the error's name and description.
// It does not throw: CUDA errors from kernels are sticky (the context is unusable after one), so
// there is nothing a caller could do but stop.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

namespace sppo::cuda::detail {

[[noreturn]] void cuda_fail(const char* call, const char* file, int line, cudaError_t err);
[[noreturn]] void cublas_fail(const char* call, const char* file, int line, cublasStatus_t status);

}  // namespace sppo::cuda::detail

#define SPPO_CUDA_CHECK(call)                                                     \
  do {                                                                            \
    const cudaError_t sppo_cuda_err_ = (call);                                    \
    if (sppo_cuda_err_ != cudaSuccess)                                            \
      ::sppo::cuda::detail::cuda_fail(#call, __FILE__, __LINE__, sppo_cuda_err_); \
  } while (0)

#define SPPO_CUBLAS_CHECK(call)                                                          \
  do {                                                                                   \
    const cublasStatus_t sppo_cublas_status_ = (call);                                   \
    if (sppo_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                    \
      ::sppo::cuda::detail::cublas_fail(#call, __FILE__, __LINE__, sppo_cublas_status_); \
  } while (0)

// The launch error of the kernel launched just before (bad grid, too much shared memory).
#define SPPO_CUDA_CHECK_LAUNCH() SPPO_CUDA_CHECK(cudaGetLastError())
