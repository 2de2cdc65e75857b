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

std::unique_ptr<Backend> make_backend(const std::string& name, const std::string& precision) {
  SPPO_CHECK(name == "cpu" || name == "cuda" || name == "auto", "backend")
      << "--backend '" << name << "' is unknown; use cpu, cuda or auto";
  SPPO_CHECK(precision.empty() || precision == "fp32" || precision == "bf16", "backend")
      << "--precision '" << precision << "' is unknown; use fp32 or bf16";
  const bool cuda = name == "cuda" || (name == "auto" && cuda_device_visible());
  if (!cuda) {
    SPPO_CHECK(precision != "bf16", "backend")
        << "the CPU backend computes in fp32; drop --precision bf16 or use --backend cuda";
    return make_cpu_backend();
  }
  return make_cuda_backend(precision == "fp32" ? DType::F32 : DType::BF16);
}

}  // namespace sppo
