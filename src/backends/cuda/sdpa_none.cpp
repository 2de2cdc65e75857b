// The CUDA backend's fused attention library where the build found no cuDNN or no
// cudnn-frontend headers (CMakeLists.txt: SPPO_CUDNN): every use says so.
#include "backends/cuda/sdpa.h"
#include "core/check.h"

namespace sppo::cuda {

namespace {
constexpr const char* kNotBuilt =
    "this sppo was built without cuDNN's fused attention (the build found no cuDNN or no cudnn-frontend headers: "
    "scripts/install-cudnn-frontend.sh, cmake -DSPPO_CUDNN=ON)";
}  // namespace

bool cudnn_sdpa_built() { return false; }

std::unique_ptr<SdpaLibrary> open_cudnn_sdpa() {
  SPPO_CHECK(false, "attention") << kNotBuilt << "; use --attention own";
  return nullptr;
}

std::string validate_cudnn_sdpa(const SdpaGraphKey&, int) { return kNotBuilt; }

}  // namespace sppo::cuda
