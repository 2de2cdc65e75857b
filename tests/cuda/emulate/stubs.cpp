// What the emulation cannot run (cuBLASLt, CUB): the emulated test program leaves out the tests
// that call these (run.sh's filter), and the stubs stop loudly if one is called anyway.
#include <cstdio>
#include <cstdlib>

#include "backends/cuda/ops.h"

namespace sppo::cuda {
namespace {
[[noreturn]] void not_emulated(const char* what) {
  std::fprintf(stderr, "emu: %s is not emulated (cuBLASLt / CUB)\n", what);
  std::abort();
}
}  // namespace

struct Blas::Impl {};
Blas::Blas(bool) { not_emulated("Blas"); }
Blas::~Blas() = default;
void gemm(Blas&, bool, bool, int, int, int, float, const void*, int, const void*, int, float, void*,
          int, DType, DType, cudaStream_t) {
  not_emulated("gemm");
}
void linear_forward(Blas&, void*, const void*, const void*, const void*, int, int, int, DType,
                    cudaStream_t, int, int) {
  not_emulated("linear_forward");
}
void linear_backward(Blas&, void*, float*, float*, const void*, const void*, const void*, int, int,
                     int, DType, cudaStream_t, int, int) {
  not_emulated("linear_backward");
}
void embedding_forward(void*, const std::int32_t*, const float*, int, int, int, DType,
                       cudaStream_t) {
  not_emulated("embedding_forward");
}
void embedding_backward(float*, const void*, const std::int32_t*, int, int, int, DType,
                        cudaStream_t) {
  not_emulated("embedding_backward");
}

}  // namespace sppo::cuda
