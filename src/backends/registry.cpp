// Which backends this program has, and making one by name (backend/backend.h).
#include <algorithm>

#include "backend/backend.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/cuda/cuda_backend.h"
#include "core/check.h"

namespace sppo {

std::vector<std::string> available_backends() {
  std::vector<std::string> names{"cpu"};
  if (cuda_device_visible()) names.push_back("cuda");
  return names;
}

AttentionKernels parse_attention_kernels(const std::string& word) {
  if (word == "auto") return AttentionKernels::Auto;
  if (word == "own") return AttentionKernels::Own;
  if (word == "cudnn") return AttentionKernels::Library;
  SPPO_CHECK(false, "backend") << "attention kernels '" << word
                               << "' are unknown; use auto, own (the backend's own kernels) or cudnn (cuDNN's fused "
                                  "attention, on --backend cuda)";
  return AttentionKernels::Auto;
}

std::unique_ptr<Backend> make_backend(const std::string& name, const std::string& precision,
                                      const std::string& attention, const DevicePlacement& place) {
  SPPO_CHECK(name == "cpu" || name == "cuda" || name == "auto", "backend")
      << "--backend '" << name << "' is unknown; use cpu, cuda or auto";
  SPPO_CHECK(precision.empty() || precision == "fp32" || precision == "bf16", "backend")
      << "--precision '" << precision << "' is unknown; use fp32 or bf16";
  const AttentionKernels kernels = parse_attention_kernels(attention);
  const bool cuda = name == "cuda" || (name == "auto" && cuda_device_visible());
  if (!cuda) {
    SPPO_CHECK(precision != "bf16", "backend")
        << "the CPU backend computes in fp32; drop --precision bf16 or use --backend cuda";
    SPPO_CHECK(kernels != AttentionKernels::Library, "backend")
        << "--attention cudnn is cuDNN's fused attention on the CUDA backend; the CPU backend runs its own (use "
           "--attention own or auto, or --backend cuda)";
    return make_cpu_backend();
  }
  return make_cuda_backend(precision == "fp32" ? DType::F32 : DType::BF16, kernels, place);
}

}  // namespace sppo
