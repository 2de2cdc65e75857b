// NCCL between CUDA ranks (`--comm nccl`, and auto where every rank has a GPU of its own):
// comm/comm.h's interface over NCCL for device memory and over the host's communicator
// (MPI) for host memory. MPI starts the job and carries NCCL's unique id (rank 0 makes it, a
// broadcast shares it); every NCCL call runs on a communication stream that first waits for
// the work queued on the compute stream before the call (an event), and a request is done
// when an event after the call is.
//   - Collectives: one NCCL communicator per group (ncclCommSplit of the world's, made in
//     prepare_groups), on one collective stream, in the order posted (the same on every
//     member, as the interface asks). NCCL's reduce-scatter and all-gather take one count:
//     uneven blocks go as a reduce per block to its member, and as grouped sends and
//     receives; an all-to-all is grouped sends and receives. Every type has NCCL's own
//     (bf16: ncclBfloat16). Counts are size_t there: no limit of MPI's int.
//   - Messages: Note [Rendezvous] in comm/rendezvous.h: a notice and a grant over the host
//     match NCCL's untagged sends and receives to the runtime's tagged ones; each direction
//     between two ranks has its own communicator and stream (made in prepare_peers from the
//     schedule's pairs), so no order of posting deadlocks.
//   - Faults: wait() polls test(), which asks NCCL for asynchronous errors; abort() aborts
//     every NCCL communicator (releasing the GPU) before the host's ends the job.
// NCCL refuses two ranks of one communicator on one device (2.28): ranks that share a GPU
// take the staged transport (runtime/staged_comm.h).
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "comm/comm.h"

namespace sppo::cuda {

// Whether this program was built with NCCL.
bool nccl_built();
// Collective over `host`'s world: every rank calls it, each with the stream its kernels run on.
std::unique_ptr<comm::Comm> make_nccl_comm(comm::Comm& host, cudaStream_t compute);

}  // namespace sppo::cuda
