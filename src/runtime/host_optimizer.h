// The optimizer state on the host (--optimizer-state host): ZeRO-Offload's shape (Ren et
// al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", 2021) on the runtime's
// memory tiers and copy streams.
//
// Contract: a HostOptimizer holds, in the host tier, the fp32 master weights, the AdamW
// moments m, v and a copy of the gradients of the parameters whose state the rank keeps
// (its ShardSpans, packed by state_offset). start() launches an update and returns at
// once; ready(b) returns when bucket b's updated weights are whole on the device; every
// bucket is made ready before the next update starts (the runtime's forward reads each
// one, Runtime::finish_update the rest). gradients_taken() returns when the gradients the
// update reads have left the device, so that they may be overwritten.
//
// Note [Optimizer state on the host]: what moves. The device keeps the fp32 weights in both
// precisions (in fp32 they are the GEMMs' weights; in bf16 the embedding and LayerNorm
// kernels read them, beside the GEMMs' bf16 working copy) and their fp32 gradients, which
// backward accumulates. What leaves it is the AdamW state, m and v: 8 B a parameter of the
// rank's shard. The host holds them with an fp32 master of the shard's weights and a copy
// of its gradients (16 B a parameter), so that a step moves the gradients down and the
// weights up once each, not the weights both ways; the master equals the device's weights
// between steps (they are copied from it). The update is the device path's term for term:
// the gradients are scaled, their global norm taken and clipped on the device as before,
// then AdamW runs on the host (Backend::host_adamw: on the CPU backend the kernel of its
// adamw itself, so losses equal the device path's bitwise; on CUDA to fp32 rounding).
//
// What overlaps. An update runs bucket by bucket (the embedding, each layer, the final
// LayerNorm: ParamBucket) in three stages, each on its own thread: the gradients' copy out
// (a copy stream; every bucket's is queued at once), the host's AdamW (this class's worker
// thread, a bucket once its gradients are in) and the weights' copy in (a second copy
// stream, a bucket once its update is done). So bucket k updates while bucket k - 1's
// weights come in and later buckets' gradients go out; and since start() returns at once,
// the next step begins while the update runs: each layer's forward waits only for its own
// bucket, so the first layers compute while later buckets still update. No update is
// delayed (a weight is read only after its update landed), so the losses are the device
// path's. What does not overlap: the norm and the clipping need every gradient, so an
// update starts only after the step's last backward and reduction; the next step zeroes
// its gradients only once every copy out is done; under ZeRO-1 each bucket's all-gather
// of the updated shards runs on the step's thread when the step first needs the bucket
// (collectives keep one order on every rank of the group), beside the later buckets'
// updates only; an MSP owner lends its weights whole, so its step waits for the whole
// update first. On CUDA a copy stream orders each copy after the compute work queued
// before it, so a bucket's weights come in only after the kernels the next step queued by
// then. On the CPU backend the "device" is the same processor: the worker's AdamW shares
// the cores with the step's kernels, so the overlap there is one of structure, not time.
//
// With the layers' weights on the host too (--weights host, Note [Weights on the host] in
// schedule/weights.h) nothing needs copying for them: the runtime's host arrays of the
// weights and gradients are this class's master and gradients' copy (HostArrays), the
// layers' gradients reached them during the step, and the next step brings each layer's
// weights from the master once ready(b) says its update is done. Only the embedding's,
// final norm's and head's weights, which stay on the device, go up after their update; the
// runtime copies their gradients down when the step ends, and the norm and clipping run on
// the host's copies (Backend::host_sum_squares, host_scale).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"
#include "runtime/grad_reduce.h"
#include "runtime/memory.h"

namespace sppo {

class HostOptimizer {
 public:
  // AdamW's settings of one update (backends/cpu/ops.h adamw_step).
  struct Settings {
    float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
    int t = 1;  // updates so far, this one included
  };
  // One AdamW call of an update: elements [offset, offset + count) of the flat weights
  // and gradients, in bucket `bucket`, whose state is at state_offset.
  struct Piece {
    std::size_t bucket = 0;
    i64 offset = 0, count = 0, state_offset = 0;
    float weight_decay = 0;
  };

  // With the layers' weights on the host: the runtime's host arrays of every parameter
  // (flat, parameter_specs order; no ZeRO-1 shards), which are the master and the
  // gradients' copy, and per bucket the device's copy of its weights that an update brings
  // up (null: none, a layer's).
  struct HostArrays {
    float* master = nullptr;
    float* grads = nullptr;
    std::vector<float*> device;
  };

  // Where the device's arrays hold a shard span: at its offset in a flat array of every
  // parameter (false), or at its state_offset in a compact one laid out as the AdamW state
  // (true): ZeRO-2's gradients, ZeRO-3's weights (Notes [ZeRO-2], [ZeRO-3] in
  // schedule/weights.h).
  struct Packing {
    bool grads = false;
    bool weights = false;
  };

  // The host arrays of the state `shard` of `buckets` (state elements in all), from the
  // host tier; with `arrays` (or null), only m and v (the master and gradients are those).
  HostOptimizer(Backend& be, MemoryTier& host, const std::vector<ParamBucket>& buckets,
                const std::vector<ShardSpan>& shard, i64 state, const HostArrays* arrays, Packing packing);
  // Lets an update in flight finish its copies (not its ZeRO-1 all-gathers).
  ~HostOptimizer();
  HostOptimizer(const HostOptimizer&) = delete;
  HostOptimizer& operator=(const HostOptimizer&) = delete;

  // Host arrays of `state` elements, packed as the shard's state_offset says. Not while
  // an update is in flight.
  float* master() { return master_p_; }
  float* m() { return m_.f32(); }
  float* v() { return v_.f32(); }

  // The master from the device's weights `params` (the rank's array, as Packing says),
  // after they were set from outside (initialisation, a checkpoint).
  void load_master(const float* params);

  // Starts the update of `pieces` (in bucket order) from the device's gradients `grads`
  // into the device's weights `params` (each as Packing says), and returns. `zero`: the
  // group over which each bucket's updated pieces of the flat weights are all-gathered
  // (ZeRO-1 and 2), through `comm`; empty: none. With
  // HostArrays, `params` and `grads` are unused (null): the gradients are on the host and
  // the weights go where HostArrays::device says.
  void start(float* params, const float* grads, std::vector<Piece> pieces, const Settings& s, comm::Comm* comm,
             comm::Group zero);
  bool in_flight() const { return in_flight_; }
  // Waits until bucket b's updated weights are whole on the device; true the first time
  // after start() (the caller then refreshes what it derives from them), false when no
  // update is in flight or b was ready before.
  bool ready(std::size_t b);
  // Waits until the gradients of the update in flight are on the host.
  void gradients_taken();
  // Bytes the last update copied: gradients down and weights up.
  i64 copied_bytes() const { return copied_bytes_; }

 private:
  struct Update {
    float* params;
    std::vector<Piece> pieces;
    Settings settings;
  };
  void work();
  void run(const Update& u);

  Backend& be_;
  const std::vector<ParamBucket>& buckets_;
  const std::vector<ShardSpan>& shard_;
  Buffer master_, m_, v_, grads_;  // [state] each, host tier (master_, grads_ not with HostArrays)
  float* master_p_ = nullptr;      // the master and the gradients' copy: those, or HostArrays'
  float* grads_p_ = nullptr;
  std::vector<float*> device_;     // HostArrays::device; empty: every bucket goes up to params
  Packing packing_;
  std::unique_ptr<CopyStream> down_, up_;
  i64 copied_bytes_ = 0;
  // The update in flight, on the calling thread: its gradients' copies out, which buckets
  // ready() returned, the ZeRO-1 group.
  bool in_flight_ = false;
  float* params_ = nullptr;
  std::vector<std::shared_ptr<Event>> down_done_;
  std::vector<bool> taken_;
  comm::Comm* comm_ = nullptr;
  comm::Group zero_;
  // Shared with the worker: the update it is to run, and each bucket's copy in once queued.
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Update> next_;
  std::vector<std::shared_ptr<Event>> up_done_;  // null where nothing goes up
  std::vector<char> updated_;                    // the worker is done with bucket b
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread worker_;  // last: it starts once the members above exist
};

}  // namespace sppo
