// The CUDA backend's attention calls (Backend::attention_forward, attention_backward: a query
// span against several key/value blocks at their global positions) run through a fused
// attention library (sdpa.h: cuDNN's SDPA), with the contract of the backend's own kernels:
// out/lse overwritten; dq and every block's fp32 dk/dv accumulated (+=); a row that sees no
// key gets out 0, lse -inf.
//
// A call is cut into library calls by backend/attention_pieces.h (Note [Attention pieces]):
// the forward runs each piece into scratch and merges it into out/lse by log-sum-exp (the
// first piece that covers every row is copied, not merged); the backward runs each piece
// from the final lse (Note [The library's backward from delta] in library_attention.cpp),
// sums dQ over the pieces in fp32 and adds each piece's dK, dV into its block's
// accumulators. Scratch comes from the Workspace the runtime carves from the device tier
// (Note [Library scratch] in backend/attention_pieces.h), or, when a caller passes none,
// from CUDA's stream-ordered pool.
#pragma once

#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "backend/backend.h"
#include "backends/cuda/sdpa.h"

namespace sppo::cuda {

class LibraryAttention {
 public:
  // length_classes: graphs per length class with padding (Note [Length classes]), else one
  // graph per exact length pair.
  LibraryAttention(std::unique_ptr<SdpaLibrary> lib, DType act, bool length_classes);

  SdpaLibrary& library() { return *lib_; }
  bool length_classes() const { return classes_; }

  // "" when the library takes the calls of a head layout (both masks, forward and backward,
  // at `rows` query and key rows), else its reason. Kept per layout.
  std::string check(const AttnShape& d, int rows = 1024);

  // False, with nothing run, where the library refuses a graph the call needs (refused()
  // says which and why): the caller runs its own kernels, or stops.
  bool forward(void* out, float* lse, const void* q, const std::vector<KVRef>& blocks, const AttnShape& d,
               const Workspace& ws, cudaStream_t stream);
  bool backward(void* dq, const void* dout, const void* q, const std::vector<KVRef>& blocks, const float* lse,
                const float* delta, const AttnShape& d, const Workspace& ws, cudaStream_t stream);
  const std::string& refused() const { return refused_; }

 private:
  struct Heads;
  struct CallPlan;
  struct Chunk;
  SdpaGraphKey key_of(bool backward, const Heads& h, int rows, int keys, PieceMask mask) const;
  CallPlan plan(bool backward, const Heads& h, const std::vector<KVRef>& blocks, int Tq, i64 q_pos0,
                std::size_t limit);
  bool chunks(bool backward, const Heads& h, const std::vector<KVRef>& blocks, int row0, int Tq, i64 q_pos0,
              std::size_t limit, std::vector<Chunk>& out);
  bool plan_call(bool backward, const Heads& h, const std::vector<KVRef>& blocks, int Tq, i64 q_pos0,
                 const Workspace& ws, std::vector<Chunk>& out);
  void forward_chunk(void* out, float* lse, const void* q, const Heads& h, const Chunk& c, const Workspace& ws,
                     cudaStream_t stream);
  void backward_chunk(void* dq, const void* dout, const void* q, const float* lse, const float* delta,
                      const Heads& h, const Chunk& c, const Workspace& ws, cudaStream_t stream);

  std::unique_ptr<SdpaLibrary> lib_;
  DType act_;
  bool classes_;
  std::map<std::tuple<int, int, int, i64, i64, i64, i64, int>, std::string> checked_;
  std::string refused_;
};

}  // namespace sppo::cuda
