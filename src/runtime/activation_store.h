// The activations a step keeps for its backward: the saved tensors of each (subsequence,
// layer) unit (block_saved_specs, core/layout.h) and the head's gradient of each
// subsequence, on the device or, in part, offloaded to the host.
//
// Contract: the store owns these buffers for one step; F and B ops allocate and free them
// in place (unit(), head_grad()). O(i) copies a fraction of subsequence i's offloadable
// tensors to the host tier on the device-to-host stream, and each device buffer is
// released when its copy completes; P(i) allocates them on the device again and copies
// them back on the host-to-device stream, each host copy released when its copy
// completes. Both walk the tensors in the simulator's order (schedule/memory.h), so the
// bytes each moves are the predicted ones; tensors the schedule recomputes
// (Schedule::recompute) are not among them. The two copy streams are the step's (the host
// K/V cache copies through them too, runtime/kv_stream.h); they are drained before any
// buffer they copy is freed. At the end of a step every unit is empty (check_empty).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "core/config.h"
#include "core/layout.h"
#include "runtime/memory.h"
#include "runtime/step_io.h"

namespace sppo {

inline constexpr int kK = kSavedK, kV = kSavedV;  // where k and v are among block_saved_specs() (core/layout.h)

// The prefix of the names of unit (l, i)'s buffers in the tiers' accounting.
std::string unit_name(int l, int i);

class ActivationStore {
 public:
  // `layers`: the rank's own layers [begin, end), the ones O and P move; units exist for
  // every layer of the model (an MSP helper runs another stage's).
  ActivationStore(Backend& be, MemoryTier& device, MemoryTier& host, const ModelConfig& c, ActPrecision precision,
                  int subseqs, std::pair<int, int> layers, SavedSet recompute,
                  std::vector<bool> inputs_rebuilt = {});
  ~ActivationStore();

  // [block_saved_count(c)] the saved tensors of subsequence i at layer l, in table order; a
  // tensor not on the device is an empty Buffer.
  std::vector<Buffer>& unit(int i, int l) { return dev_[i][l]; }
  // [T, H] the gradient of the loss at subsequence i's final hidden state (the head's).
  Buffer& head_grad(int i) { return head_grad_[i]; }
  CopyStream& d2h() { return *d2h_; }
  CopyStream& h2d() { return *h2d_; }

  // O(i): returns the bytes it copies to the host.
  i64 offload(int i, double fraction);
  // Where unit (i, l)'s layer input x is for a later subsequence that recomputes K/V from
  // it (runtime/kv_stream.h): on the device (never offloaded, or brought back by P(i),
  // whose copies are waited for), or its host copy, once O(i)'s copy of it is done. The
  // seconds waited add to *waited_s. Called on the compute thread, which alone issues O
  // and P, so the buffers it reads are not changing under it.
  std::pair<const void*, const void*> saved_input(int i, int l, double* waited_s);
  // P(i): every tensor of subsequence i on the host comes back; with a layer range (a
  // layer-major backward's), those of layers [b, e), with head_grad where e is the last.
  void prefetch(int i);
  void prefetch(int i, int b, int e);
  // The seconds spent waiting for O(i)'s (P(i)'s, of layers [b, e)) last copy; 0 if it
  // copied nothing.
  double wait_offload(int i);
  double wait_prefetch(int i);
  double wait_prefetch(int i, int b, int e);
  // Note [Residual gradients on the host] (schedule/builders.cpp): subsequence i's residual
  // gradient (head_grad(i), which carries it between a layer-major backward's layers) to a
  // host buffer and back, each copy waited for; the seconds waited add to *waited_s.
  void residual_to_host(int i, double* waited_s);
  void residual_back(int i, double* waited_s);
  // Waits for every copy on both streams.
  void synchronize();
  // Adds the span of each O(i) and P(i) to the timeline: its first copy's start to its
  // last one's end.
  void trace(StepResult& result) const;
  // Every tensor freed (ASSERT).
  void check_empty() const;

 private:
  MemoryTier& device_;
  MemoryTier& host_;
  const ModelConfig& config_;
  int lb_, le_;
  std::vector<std::vector<std::vector<Buffer>>> dev_;   // [N][L][block_saved_count] device copies
  std::vector<std::vector<std::vector<Buffer>>> host_copies_;  // same shape: offloaded parts
  std::vector<Buffer> head_grad_, head_grad_host_;      // [N]
  std::vector<Buffer> residual_host_;                    // [N] residual gradients waiting on the host
  std::vector<std::shared_ptr<Event>> offload_first_, offload_last_;    // [N]
  std::vector<std::shared_ptr<Event>> prefetch_first_, prefetch_last_;  // [N]
  std::vector<Role> roles_;                             // of the saved tensors
  SavedSet recompute_;                                  // tensors recomputed in backward: never offloaded
  std::vector<bool> rebuilt_;                           // layers whose x is not kept (Schedule::inputs_rebuilt)
  // Per unit, its x's host copy and the copy's event, from O(i) ([N][L]; null: not
  // offloaded), and the last copy of the P that brought it back ([N][L]; null: none yet).
  std::vector<std::vector<const void*>> x_host_;
  std::vector<std::vector<std::shared_ptr<Event>>> x_copied_, x_back_;
  // Declared last, so destroyed first: their pending copies finish before the buffers go.
  std::unique_ptr<CopyStream> d2h_, h2d_;
};

}  // namespace sppo
