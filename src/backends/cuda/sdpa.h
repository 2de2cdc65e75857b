// A fused attention library's calls, as plain data: cuDNN's scaled dot-product attention
// (through cudnn-frontend's graph API, sdpa_cudnn.cpp) behind a small interface, so that the
// CUDA backend's use of it (library_attention.h) is written once and tested on the CPU
// against a naive stand-in with the same semantics (tests/cuda/emulate).
//
// One call is one sequence (batch 1): `rows` query rows of Z heads against `keys` key/value
// rows of Zkv heads (query head z reads key/value head z / (Z / Zkv)), head size A, scores
// scaled by 1/sqrt(A), mask None or BottomRight (backend/attention_pieces.h). q, k, v and
// dO are read in place at their row strides (head z at columns z*A ..); every output is a
// dense scratch buffer: O and dQ [rows, Z A], dK and dV [keys, Zkv A], Stats [Z, rows] (the
// natural log-sum-exp of each row's scaled scores, fp32). The backward OVERWRITES dQ, dK,
// dV from Q, K, V, O, dO and Stats; it uses O only for rowsum(dO * O).
//
// Note [Length classes]
// ~~~~~~~~~~~~~~~~~~~~~
// A library graph is built for fixed lengths, and building one costs far more than running
// it (cuDNN picks and finalises an engine, and may compile a kernel). A step's calls come in
// many lengths (a subsequence's earlier blocks, streamed chunks, ring pieces, documents), so
// a graph is built for a length class, `sdpa_length_class(n)`: n rounded up to 1/8 of its
// power of two (64 at least), so that a call is at most 12.5% shorter than its graph; the
// call passes its actual lengths (a padding mask: rows and keys past them are neither seen
// nor written), and its outputs are scratch buffers of the class's rows. A library that is
// given the exact lengths instead (SPPO_CUDNN_LENGTHS=exact) builds a graph per length
// pair, for comparison.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <string>
#include <tuple>

#include "backend/attention_pieces.h"
#include "core/layout.h"

namespace sppo::cuda {

// What a graph is built for.
struct SdpaGraphKey {
  bool backward = false;
  int Z = 0, Zkv = 0, A = 0;
  i64 ldq = 0, ldk = 0, ldv = 0;  // row strides of q, k, v (elements)
  i64 ld_dout = 0;                // of dO (backward)
  int rows = 0, keys = 0;         // the graph's lengths
  bool padded = false;            // calls pass actual lengths up to rows and keys
  PieceMask mask = PieceMask::None;
  DType act = DType::BF16;

  auto tie() const { return std::tie(backward, Z, Zkv, A, ldq, ldk, ldv, ld_dout, rows, keys, padded, mask, act); }
  bool operator<(const SdpaGraphKey& o) const { return tie() < o.tie(); }
  bool operator==(const SdpaGraphKey& o) const { return tie() == o.tie(); }
};

std::string describe(const SdpaGraphKey& key);

// One call's tensors (device pointers). seq_lens: device int32 [2], the call's actual rows
// and keys, for a padded graph (else unused).
struct SdpaForwardCall {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;          // [rows, Z A]
  float* stats = nullptr;     // [Z, rows]
  const int* seq_lens = nullptr;
};
struct SdpaBackwardCall {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* o = nullptr;    // [rows, Z A]
  const void* dout = nullptr;  // at ld_dout
  const float* stats = nullptr;  // [Z, rows]
  void* dq = nullptr;         // [rows, Z A]
  void* dk = nullptr;         // [keys, Zkv A]
  void* dv = nullptr;
  const int* seq_lens = nullptr;
};

class SdpaLibrary {
 public:
  virtual ~SdpaLibrary() = default;
  virtual std::string name() const = 0;  // e.g. "cuDNN 9.19.0"
  // "" when the library takes graphs of this key, else its reason (checked once per key).
  virtual std::string check(const SdpaGraphKey& key) = 0;
  // Device bytes a call of this graph needs beside its tensors; builds the graph on first use.
  virtual std::size_t workspace_bytes(const SdpaGraphKey& key) = 0;
  virtual void forward(const SdpaGraphKey& key, const SdpaForwardCall& c, void* workspace, cudaStream_t stream) = 0;
  virtual void backward(const SdpaGraphKey& key, const SdpaBackwardCall& c, void* workspace, cudaStream_t stream) = 0;

  // Graphs built so far and the seconds their builds took (the first one's apart).
  struct BuildStats {
    int graphs = 0;
    double seconds = 0, first_seconds = 0;
  };
  virtual BuildStats build_stats() const = 0;
};

// Whether this program was built with cuDNN's fused attention (SPPO_CUDNN).
bool cudnn_sdpa_built();

// cuDNN's fused attention on this process's GPU, or sppo::Error saying why there is none
// (built without cuDNN, its library missing or older than the build's, the GPU's
// architecture).
std::unique_ptr<SdpaLibrary> open_cudnn_sdpa();

// The library's verdict on a graph, decided on the host without a GPU for the given SM
// version (90: H100, H200): "" when its description validates, else why not.
std::string validate_cudnn_sdpa(const SdpaGraphKey& key, int sm_version);

}  // namespace sppo::cuda
