// The layers' weights and gradients on the host (--weights host): the runtime's side of
// Note [Weights on the host] (schedule/weights.h), whose LayerUses the memory rules and the
// simulator read too; and its gradient half alone under ZeRO-2 (Note [ZeRO-2] there), the
// gradients leaving into the rank's shard (HostLayers::grad_out) instead of to the host.
//
// Contract: the Runtime keeps every owned parameter's fp32 weights and gradients in host
// arrays (HostLayers) and on the device only the embedding's, final norm's and head's. In
// a step, begin(op, k) at the start of own layer k of F/B op `op` and end(op, k) at its end
// do what the layer's use says, in its order:
//  - a layer's working copy is allocated and copied from the host's weights on the step's
//    host-to-device stream, after HostLayers::ready(b) says its bucket's update is done; a
//    use waits for its own layer's copy, then the views' blocks[l] point at it until it is
//    released;
//  - a layer's gradient is allocated at its first backward, zeroed, or when the step
//    accumulates (StepControl::accumulate) holding the host's copy, so that the sum is the
//    one the device would make; the gradient view's blocks[l] and the reduction's bucket
//    point at it; at its last backward it is reduced over the replicas (a step that
//    reduces), then copied to the host's array on the step's device-to-host stream, and
//    released (after the wait for that copy) where the uses say.
// A layer on the device is its fp32 weights, laid out as the host array's bucket; in bf16
// the GEMMs' working copy follows them, converted on the device once they arrive (the
// host keeps no second copy, and the conversion is the one a device-resident model's
// refresh makes). At the end of a step nothing of it is on the device (check_empty).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"
#include "core/config.h"
#include "model/gpt.h"
#include "runtime/grad_reduce.h"
#include "runtime/memory.h"
#include "runtime/step_io.h"
#include "schedule/weights.h"

namespace sppo {

// Where the layers' weights live with --weights host, as the Runtime holds them.
struct HostLayers {
  float* params = nullptr;  // host tier: every owned parameter, flat (parameter_specs order)
  float* grads = nullptr;   // and its gradient, which each layer's leaves into
  ParamView* w = nullptr;   // the views F and B read: blocks[l] at the device's copies while there
  ParamView* g = nullptr;
  MatrixView* m = nullptr;
  std::function<void(std::size_t)> ready;  // waits until bucket b's weights are updated (may be empty)
  // Per bucket: the device's gradient of the embedding, final norm and head, which the
  // reduction reduces there (null: a layer's).
  std::vector<float*> device_grads;
  // Under ZeRO-2 (Note [ZeRO-2] in schedule/weights.h) the weights stay on the device and
  // only the gradients come and go: `params` and `grads` are then a home for the views
  // that holds no data (ReservedRange), and a layer's reduced gradient leaves through
  // grad_out(bucket, its device buffer), which takes the rank's piece, instead of to the host.
  std::function<void(std::size_t, const float*)> grad_out;
  // Under ZeRO-3 (Note [ZeRO-3]) a layer's weights come by gather(bucket, its device buffer,
  // the layer group): an all-gather over the group, waited for through `comm`, instead of
  // a copy from the host.
  std::function<comm::Request(std::size_t, float*, const comm::Group&)> gather;
  comm::Comm* comm = nullptr;
};

// Address space reserved and never backed (mmap PROT_NONE): the home that views of data
// living elsewhere in turns point into between their turns (Note [ZeRO-2]); a read or a
// write there faults, so a view used out of its turn cannot go unseen.
class ReservedRange {
 public:
  explicit ReservedRange(std::size_t bytes);
  ~ReservedRange();
  ReservedRange(const ReservedRange&) = delete;
  ReservedRange& operator=(const ReservedRange&) = delete;
  float* f32() const { return static_cast<float*>(base_); }

 private:
  void* base_ = nullptr;
  std::size_t bytes_ = 0;
};

class HostWeights {
 public:
  // `host` null: the weights are on the device and this does nothing. `ops`: the rank's.
  HostWeights(Backend& be, MemoryTier& device, const sched::Schedule& s, int rank, std::pair<int, int> layers,
              const std::vector<ParamBucket>& buckets, const HostLayers* host, CopyStream& h2d, CopyStream& d2h,
              GradReduce& grads, const StepControl& control, StepResult& result);
  ~HostWeights();
  HostWeights(const HostWeights&) = delete;
  HostWeights& operator=(const HostWeights&) = delete;

  // The start and the end of F/B op `index`'s k-th layer (nothing for another stage's).
  void begin(std::size_t index, int k);
  void end(std::size_t index, int k);
  // Nothing of the layers left on the device (ASSERT).
  void check_empty() const;
  // Adds each copy of a layer's weights in and gradient out to the timeline.
  void trace(StepResult& result) const;

 private:
  const ParamBucket& bucket(int l) const { return buckets_[grads_.bucket_of_layer(l)]; }
  void bring(int l);               // the working copy of layer l, on its way
  void arrive(int l);              // waits for layer l's copy, if one is on its way; its views to it
  void release_grad(int l);        // after its copy to the host
  void point_views(int l, bool on_device);

  Backend& be_;
  MemoryTier& device_;
  const HostLayers* host_;
  int lb_;
  const std::vector<ParamBucket>& buckets_;
  CopyStream& h2d_;
  CopyStream& d2h_;
  GradReduce& grads_;
  StepControl control_;
  StepResult& result_;
  sched::LayerUses uses_;
  // Per own layer (index l - lb_): its working copy and the copy bringing it, its gradient
  // and the copy taking it to the host, and the views' blocks at the host arrays.
  std::vector<Buffer> w_, g_;
  std::vector<std::shared_ptr<Event>> w_in_, g_out_;
  // Under ZeRO-3: a layer's all-gather, and whether one was started and not yet waited for
  // (a request may be complete already).
  std::vector<comm::Request> w_gather_;
  std::vector<bool> w_gathering_;
  std::vector<const sched::Op*> gathers_;  // the rank's AllGather ops, and the next to start
  std::size_t next_gather_ = 0;
  std::vector<BlockParams> host_w_, host_g_;
  std::vector<BlockMatrices> host_m_;
  std::vector<std::pair<std::string, std::shared_ptr<Event>>> copies_;  // for trace()
};

}  // namespace sppo
