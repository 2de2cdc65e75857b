// The CUDA backend (backend/backend.h) over the kernels of this folder: device memory is
// one cudaMalloc'd slab per process that the runtime's arena carves (so budgets and
// predicted peaks agree with the CPU's rules to the byte), the host tier is pinned memory,
// and the compute and copy streams are CUDA streams. A program built without CUDA links a
// stand-in (backends/cuda_stub.cpp) whose make_cuda_backend says so.
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"

namespace sppo {

// True when this program was built with CUDA and a GPU is visible.
bool cuda_device_visible();
// The GPUs this process sees (0 without CUDA), and one's identity, the same in every process
// of the machine that sees it (its UUID).
int cuda_device_count();
std::string cuda_device_id(int device);
// Whether this program was built with NCCL (the CUDA backend's --comm nccl).
bool cuda_nccl_built();
// act: F32 (fp32 everywhere, TF32 off: for exact comparisons with the CPU) or BF16.
// attention: whose kernels run attention (Library: cuDNN's fused attention, which must open).
// Throws sppo::Error when CUDA is not built in or no GPU is visible.
std::unique_ptr<Backend> make_cuda_backend(DType act, AttentionKernels attention = AttentionKernels::Auto,
                                           const DevicePlacement& place = {});

}  // namespace sppo
