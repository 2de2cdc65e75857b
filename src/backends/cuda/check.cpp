#include "backends/cuda/check.h"

#include <cstdio>
#include <cstdlib>

namespace sppo::cuda::detail {

void cuda_fail(const char* call, const char* file, int line, cudaError_t err) {
  std::fprintf(stderr, "%s:%d: CUDA error: %s: %s (%s)\n", file, line, call, cudaGetErrorName(err),
               cudaGetErrorString(err));
  std::fflush(stderr);
  std::abort();
}

void cublas_fail(const char* call, const char* file, int line, cublasStatus_t status) {
  std::fprintf(stderr, "%s:%d: cuBLASLt error: %s: %s (%s)\n", file, line, call,
               cublasLtGetStatusName(status), cublasLtGetStatusString(status));
  std::fflush(stderr);
  std::abort();
}

}  // namespace sppo::cuda::detail
