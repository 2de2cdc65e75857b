// The CPU backend: the fp32 kernels of this folder (OpenBLAS and OpenMP), host memory as the
// "device" (the runtime's budgeted arena stands for a GPU's memory), and worker threads as
// copy streams. What tests and CI run everywhere.
#pragma once

#include <memory>

#include "backend/backend.h"

namespace sppo {

std::unique_ptr<Backend> make_cpu_backend();

}  // namespace sppo
