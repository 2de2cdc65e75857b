// `sppo profile`: measures this machine as a hardware profile (planner/profile.h) — the
// GEMM rate on transformer shapes, the attention kernel's rate, elementwise bandwidth,
// copy bandwidth, and the fixed cost per layer — so the planner, the adaptive offload and
// the simulator price this machine's ops from measurements.
#pragma once

#include "planner/profile.h"

namespace sppo {

// quick: smaller shapes and fewer repetitions (about a second), for `train --offload
// adaptive` when no --hardware profile is given.
plan::HardwareProfile measure_cpu_profile(bool quick);

// The profile --hardware names (a preset, a file, or "" for a quick measurement here,
// taken once per process).
plan::HardwareProfile resolve_cpu_profile(const std::string& hardware);

// A fixed profile with round CPU-like rates: enough for memory predictions, which do not
// depend on rates, without spending time measuring.
plan::HardwareProfile nominal_cpu_profile();

}  // namespace sppo
