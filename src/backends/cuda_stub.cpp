// The CUDA backend's stand-in for a program built without CUDA (MLX's shape: the same
// declaration, a body that says what is missing).
#include "backends/cuda/cuda_backend.h"
#include "core/check.h"

namespace sppo {

bool cuda_device_visible() { return false; }
int cuda_device_count() { return 0; }
bool cuda_nccl_built() { return false; }
std::string cuda_device_id(int) { return ""; }

std::unique_ptr<Backend> make_cuda_backend(DType, AttentionKernels, const DevicePlacement&) {
  SPPO_CHECK(false, "backend") << "this sppo was built without CUDA (no nvcc when it was configured); rebuild on a "
                                  "machine with the CUDA toolkit (cmake -DSPPO_CUDA=ON) to use --backend cuda";
  return nullptr;
}

}  // namespace sppo
