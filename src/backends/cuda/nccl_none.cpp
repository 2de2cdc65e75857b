// The CUDA backend's NCCL transport where the build found no NCCL (CMakeLists.txt: SPPO_NCCL):
// every use says so.
#include "backends/cuda/nccl_comm.h"
#include "core/check.h"

namespace sppo::cuda {

bool nccl_built() { return false; }

std::unique_ptr<comm::Comm> make_nccl_comm(comm::Comm&, cudaStream_t) {
  SPPO_CHECK(false, "comm") << "this sppo was built without NCCL (the build found no nccl.h or libnccl); use "
                               "--comm mpi (messages staged through host memory), or rebuild with NCCL";
  return nullptr;
}

}  // namespace sppo::cuda
