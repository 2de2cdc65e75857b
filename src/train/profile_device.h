// `sppo profile --backend NAME`: a hardware profile (planner/profile.h) measured through the
// backend interface, so that a GPU is measured the way the CPU is (train/profile_machine.h
// measures the CPU with its own kernels directly): GEMM rate in the activation type on a
// large product and on a block's shapes by hidden size, attention forward + backward rate
// by head size (and for queries after a prefix), elementwise bandwidth, copy bandwidth each
// way, both ways at once, and while the compute stream works; on a device with a fused
// attention library, each attention shape class with both kernels (the faster recorded).
#pragma once

#include <nlohmann/json.hpp>
#include <vector>

#include "backend/backend.h"
#include "planner/profile.h"

namespace sppo {

// quick: smaller shapes and fewer repetitions. `details` receives what the profile's fields
// do not hold (the prefix pattern's rate, copies under compute), for the record.
plan::HardwareProfile measure_backend_profile(Backend& be, bool quick, nlohmann::json* details = nullptr);

// The measured attention classes of a profile (Note [Attention kernels by shape class] in
// planner/profile.h) as the backend's --attention auto takes them.
std::vector<AttentionClassChoice> attention_classes(const plan::HardwareProfile& p);

// The quick profile of this backend's device, measured on the first call of the process
// and kept: what train and grads price adaptive choices with on a device when no
// --hardware is given.
const plan::HardwareProfile& measured_device_profile(Backend& be);

}  // namespace sppo
