// The transformer layers' weights and gradients on the host (--weights host,
// Schedule::weights_host): when each layer's working copy comes to the device and goes, and
// when each layer's gradient is there. One pure function of the schedule, which the memory
// rules (schedule/memory.h), the simulator (sim/simulator.cpp) and the runtime
// (runtime/host_weights.h) all read, so that the three agree on every byte and every copy.
//
// Note [Weights on the host]: with the fp32 master weights, their gradients and AdamW m, v
// on the host (--optimizer-state host), what the device still holds of a layer between its
// uses is its weights (fp32, and in bf16 their working copy) and its fp32 gradient: 8 to 10
// B a parameter, every layer, all step. A layer's weights are read only by the F and B ops
// that run it, and its gradient is added to only by the B ops, so:
//  - Its fp32 weights come from the host's master on the host-to-device copy stream while
//    the layer before it computes (in bf16 the GEMMs' working copy is converted from them
//    on the device once they arrive, beside them: 6 B a parameter there, 4 B copied, and
//    no second copy on the host), and go when the op is done with them
//    unless the next use is of the same layer (a layer-major backward runs each layer over
//    every subsequence): at most the layer in use and the next are on the device. The
//    rank's first use waits for its copy.
//  - Its fp32 gradient is allocated at the first backward that touches the layer (zeroed,
//    or the host's copy when a step accumulates several sequences) and leaves at the end of
//    the last: all-reduced there over the replicas, then copied to the host's gradients on
//    the device-to-host copy stream while the next layer computes. Its device bytes are
//    released at the end of that next use, after the wait for the copy, or at once after
//    the rank's last use. Both are points of the program, not of the copies' timing, so the
//    peak is the same under every timing and the memory rules predict it to the byte (as
//    Note [Host copies leave at the wait] in schedule/memory.h does for offloads). In the
//    layer-major backward (Note [Layer-major backward] in builders.cpp) that is one layer's
//    gradient at a time (two while one leaves); in the paper's order every layer's lives
//    from the first backward to the last, which is allowed but saves only the weights.
//  - The embedding, the final norm and the LM head stay on the device (their weights in
//    both precisions and their gradients): the first and last layers' neighbours need them
//    at every subsequence, and a stage's head runs right after its last layer.
// What it costs: each F and B op brings each of its layers' weights in (2N copies of the
// model's layers a step, one in a layer-major backward, fp32) and each
// layer's gradient goes out once (fp32); the simulator prices them on the copy lanes and
// makes a layer's compute wait for weights that arrive late.
#pragma once

#include <array>
#include <cstddef>
#include <vector>

#include "schedule/ir.h"

namespace sppo::sched {

// One layer run by one F or B op of a rank.
struct LayerUse {
  std::size_t op = 0;  // the op's index in the rank's list
  int k = 0;           // its k-th layer: layer_begin + k in F, layer_end - 1 - k in B
  int layer = 0;
  bool backward = false;
  // At its start, in this order: the copy of this use's own layer is brought and waited
  // for (the rank's first use only; later uses find theirs brought by the use before);
  // the next use's layer is brought, when it is another; the layer's gradient is
  // allocated, at its first backward.
  int load_now = -1;
  int load_next = -1;
  // Then, on the first use of a run of a layer whose input is rebuilt (Note [Rebuilt layer
  // inputs] in builders.cpp), the layer below's copy, waited for too: its forward runs again
  // inside every use of the run, and it stays for its own run, which follows (so no use
  // brings it as its next).
  int load_below = -1;
  bool grad_first = false;
  // At its end, in this order: the gradient's copy to the host starts (its last backward);
  // the gradients in grad_free are released (the one that left at the previous use, and
  // at the rank's last use its own); this layer's copy goes, unless the next use is of it.
  bool grad_last = false;
  std::array<int, 2> grad_free{-1, -1};
  bool weights_free = false;
};

// Whether a step's layers' gradients live only from their first backward to the end of their
// last (each one's allocated there and leaving there): with the weights on the host (to the
// host's array), and under ZeRO-2 (Note [ZeRO-2]: reduce-scattered into the rank's shard),
// where the weights stay and only the uses' gradient half applies.
inline bool layer_grads_stream(const Schedule& s) {
  return s.place.weights_host() || shards_gradients(s.par.zero);
}
// Whether the layers' weights come to the device for each use and go after (LayerUses'
// loads): from the host's array (--weights host), or gathered from the layer group's shards
// under ZeRO-3 (Note [ZeRO-3]).
inline bool layer_weights_stream(const Schedule& s) {
  return s.place.weights_host() || shards_weights(s.par.zero);
}

// Note [ZeRO-2]: the ranks that hold the same layers (ParallelDims::layer_group) shard the
// gradients as ZeRO-1 shards the AdamW state: each rank keeps its pieces (shard_buckets) of
// every layer's gradient, summed over the group, in one compact array beside its AdamW m, v.
// A layer's whole gradient lives on the device only from its first backward to its last, as
// LayerUses says for the weights on the host: at its last backward it is reduce-scattered
// over the group (the reduction ZeRO-1 starts there too), the rank's piece copied into the
// shard, and its buffer released where the uses release a gradient. The embedding, final
// norm and head keep whole gradients on the device (their buckets reduce at the step's end,
// then their pieces join the shard). The weights stay whole on every rank. So in the
// layer-major backward (Note [Layer-major backward] in builders.cpp) one layer's gradient is
// whole at a time (two while one leaves), and the device holds 1/R of the rest; in the
// paper's order every layer's lives from the first backward to the last, which saves only
// after it. Every step reduces: where a replica runs several sequences an optimizer step
// (--batch above --dp), each one's pieces are added to the shard (StepControl::accumulate),
// rather than each layer's whole gradient kept to sum them before one reduction (ZeRO-1's
// order: the sums equal to fp32 rounding, a reduction a sequence more on the network).
//
// Note [ZeRO-3]: the weights sharded too. Each rank keeps its pieces of every bucket's fp32
// weights, the AdamW master, in one compact array laid out as the AdamW state; a layer's
// whole weights come for each use as LayerUses' loads say (one layer ahead, as from the
// host with --weights host; each an op of the schedule, Note [ZeRO-3 gathers]), each rank's piece copied into a buffer the size of the layer
// and the group all-gathering the rest into it (in bf16 the working copy converted after),
// and go where the uses free them. The embedding, final norm and head stay whole on every
// rank, updated in pieces and all-gathered after the update, as under ZeRO-1. The gradients
// go as under ZeRO-2. The device holds 1/R of the layers' weights, gradients and AdamW
// state and the layers in flight (two, three with a rebuilt input's layer below).

// The uses of a rank's own layers in program order (none unless layer_grads_stream(s)).
class LayerUses {
 public:
  LayerUses() = default;
  LayerUses(const Schedule& s, int rank);

  const std::vector<LayerUse>& uses() const { return uses_; }
  bool empty() const { return uses_.empty(); }
  // The uses of op `index`, [first, last) into uses(); first == last for an op that runs
  // no own layer.
  std::size_t first(std::size_t index) const { return index < first_.size() ? first_[index] : uses_.size(); }
  std::size_t last(std::size_t index) const { return index + 1 < first_.size() ? first_[index + 1] : uses_.size(); }
  // The use of op `index`'s k-th layer (ASSERT: there is one).
  const LayerUse& at(std::size_t index, int k) const;

 private:
  std::vector<LayerUse> uses_;
  std::vector<std::size_t> first_;  // [ops + 1]
};

// Note [ZeRO-3 gathers]: the gathers are ops of the schedule (OpKind::AllGather), one a
// layer gathered, over the rank's layer group (ParallelDims::layer_group), right before the
// F or B op that starts them (and before its all-to-all), in the order it starts them: its
// uses' load_now, load_next and load_below, use by use. The runtime starts each as the use
// says (one layer ahead, inside the op) and takes its group from the op; the simulator
// prices it there, drawn on the network lane, and counts its bytes (collective_bytes in
// schedule/memory.h); the validator (schedule/validate.h) checks that the ops are the uses'
// loads and that every member of the group meets them in one order. A forward-only step
// (to_forward_only) keeps its F ops' gathers, whose group it needs even where no gradient
// is reduced. with_weight_gathers (re)writes them from the uses: build_step and
// to_forward_only call it last.
Schedule with_weight_gathers(Schedule s);
// The layers that F or B op `index` of the uses' rank gathers, in the order it starts them
// (none unless ZeRO-3 streams the weights).
std::vector<int> gathered_layers(const LayerUses& uses, std::size_t index);


}  // namespace sppo::sched
