// The runtime: executes one rank's op list of a schedule (schedule/ir.h) with real tensors
// on the CPU backend, and real messages through comm::Comm when the schedule has several
// ranks (pipeline stages, data-parallel replicas).
//
// Memory follows the rules the simulator models (schedule/memory.h): the rank's own
// parameters, gradients and AdamW moments are resident in the device tier (the moments,
// with an fp32 master, in the host tier under --optimizer-state host, whose update runs on
// the host beside the next step's start: runtime/host_optimizer.h; with --weights host the
// layers' weights and gradients too, each layer's on the device only around the F/B ops
// that run it: runtime/host_weights.h); F(i) allocates,
// per layer, the block's saved tensors (block_saved_specs) and its workspace (freed after
// the layer), then, on the last stage, the head's workspace and head_grad; O(i) moves a
// fraction of subsequence i's offloadable tensors to the host tier and frees their device
// bytes when each copy completes; P(i) allocates them again and copies back; B(i)
// allocates each layer's dK/dV accumulators the first time the backward touches the layer
// and frees K_i, V_i, dK_i, dV_i and the unit of (l, i) when layer l of subsequence i is
// done.
//
// Ring attention (context parallelism): in a schedule with ring > 1, each F/B op of a ring
// piece works on this rank's rows of the subsequence (contiguous or zigzag spans), and each
// layer's attention runs round the ring (runtime/ring.h); the RingStep ops that the
// simulator prices are the steps taken inside those layers, so the runtime passes over
// them.
//
// Tensor parallelism (a schedule with tp > 1, sched::expand_tensor_parallel): the members
// of a group run the same ops, each block and the head through model/tensor_parallel.h
// over the group's collectives (runtime/tensor_parallel.h); hidden-state messages carry
// the member's rows. At the end of a step that reduces, the gradients of the parameters
// every member holds whole (LayerNorm weights; tp_replicated) are summed over the group,
// as each member computed them from its own rows, and so are the loss and per-position
// losses, each member having the part of its vocabulary.
//
// Ulysses (a schedule with ulysses > 1, sched::expand_ulysses): the members of a group run
// the same ops, each block on the member's rows of the piece (sched::member_spans), its
// attention on every row of the piece for the member's heads, through the all-to-alls of
// runtime/ulysses.h; the AllToAll ops that the simulator prices are the exchanges taken inside
// those layers, so the runtime passes over them. The members' weights are whole and their
// gradients summed by the step's all-reduce with the layer group's other replicas.
//
// The interpreter: step() checks the schedule against the options, sets up the step's
// parts (runtime/step_state.h), runs the rank's ops one after another in a switch over
// their kind, and closes the step; forward() and backward() run one F or B op through
// the model's blocks. What each part owns and promises is in its own header: the saved
// activations with their offload and prefetch (activation_store.h); the K/V of every
// block, their dK/dV sums and how an attention reaches them (kv_store.h, with
// kv_stream.h for layers whose K/V live on the host); the hidden-state messages between
// stages and every send in flight (stage_messages.h); MSP's borrowed weights and
// messages (msp.h); the weight gradients' reduction in buckets, all-reduced or, with
// ZeRO-1, reduce-scattered over the data-parallel group (grad_reduce.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"
#include "core/config.h"
#include "model/gpt.h"
#include "runtime/grad_reduce.h"
#include "runtime/host_optimizer.h"
#include "runtime/host_weights.h"
#include "runtime/memory.h"
#include "runtime/step_io.h"
#include "runtime/ulysses.h"
#include "schedule/ir.h"

namespace sppo {

struct StageWeights;
struct StepState;

class Runtime {
 public:
  Runtime(const ModelConfig& c, const RuntimeOptions& o);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // Keep the device tier's timeline of the next steps (for traces).
  void record_memory(bool on) { opts_.record_memory = on; }

  const ModelConfig& config() const { return config_; }
  // The parameters this rank owns (parameter_specs(c, begin, end)), flat in that order.
  const std::vector<TensorSpec>& param_specs() const { return specs_; }
  const std::vector<ParamBucket>& buckets() const { return buckets_; }
  // The AdamW state this rank keeps: every parameter, or its ZeRO-1 pieces.
  const std::vector<ShardSpan>& shard() const { return shard_; }
  std::pair<int, int> layers() const { return {lb_, le_}; }
  i64 num_params() const { return num_params_; }
  i64 num_state() const { return num_state_; }  // elements of each AdamW moment
  // Device arrays (Backend memory): read and write them through read_device /
  // write_device, or with the backend's kernels. Each accessor first lets an update of
  // the optimizer state on the host that is in flight finish (finish_update).
  // The weights: flat (parameter_specs order), or under ZeRO-3 (weights_sharded()) the rank's
  // pieces, laid out as the AdamW state (ShardSpan::state_offset).
  float* params();
  // The gradients: flat as params(), or under ZeRO-2 and ZeRO-3 (grads_sharded()) the rank's
  // reduced pieces, laid out as the AdamW state.
  float* grads();
  bool grads_sharded() const { return opts_.grads_sharded(); }
  bool weights_sharded() const { return opts_.weights_sharded(); }
  // The rank's weights from a flat host array (its layers, its shards: parameter_specs
  // order), then refresh_weights; under ZeRO-3 its pieces and the embedding's, final
  // norm's and head's whole.
  void set_weights(const float* mine);
  // After an update of the rank's pieces (ZeRO-1, -2, -3 over `group`): every piece all-
  // gathered where the weights are whole (under ZeRO-3 the embedding's, final norm's and
  // head's), then refresh_weights.
  void gather_updated_weights(comm::Comm& world, const comm::Group& group);
  // The AdamW moments, in the state's tier (state_on_host()): read and write them through
  // read_state / write_state, or with the backend's adamw on the device.
  float* adam_m();
  float* adam_v();
  bool state_on_host() const { return host_opt_ != nullptr; }
  // With --weights host (RuntimeOptions::weights_host): params() and grads() are arrays in
  // the host tier (read and write them through read_device / write_device, or directly on
  // the host), and the device holds the embedding's, final norm's and head's weights and
  // gradients and, in a step, the layers' that the step is using (runtime/host_weights.h).
  bool weights_on_host() const { return opts_.weights_host; }
  Backend& backend() { return be_; }
  void read_device(float* host, const float* device, i64 n);
  void write_device(float* device, const float* host, i64 n);
  void read_state(float* host, const float* state, i64 n);
  void write_state(float* state, const float* host, i64 n);
  // After every change to params() from outside an update: copies the fp32 weights into
  // the GEMMs' working copy (a no-op in fp32) and, with the optimizer state on the host,
  // the rank's shard of them into its fp32 master; with the weights on the host, the
  // embedding's, final norm's and head's to the device.
  void refresh_weights();
  // With the optimizer state on the host: starts the update of `pieces` (the rank's
  // AdamW calls, in bucket order) from the gradients, which returns at once; the next
  // step's forward waits for each bucket's weights (Note [Optimizer state on the host]).
  // `zero`: the group that all-gathers the updated pieces (ZeRO-1 to 3; empty: none); under
  // ZeRO-3 only the embedding's, final norm's and head's, a layer's as the step gathers it.
  void start_host_update(std::vector<HostOptimizer::Piece> pieces, const HostOptimizer::Settings& s,
                         comm::Group zero);
  // Waits for an update of the optimizer state on the host to bring back every weight.
  void finish_update();
  // Bytes the last update of the optimizer state on the host copied (down and up).
  i64 host_update_bytes() const { return host_opt_ ? host_opt_->copied_bytes() : 0; }
  MemoryTier& device() { return *device_; }
  MemoryTier& host() { return *host_; }
  const RuntimeOptions& options() const { return opts_; }

  // One forward/backward of this rank's ops over S + 1 tokens (inputs tokens[0..S),
  // targets tokens[1..S]), or, for a bidirectional model, inputs tokens[0..S) and
  // control.targets. Gradients are zeroed first (unless accumulating) and hold the
  // gradient of the mean loss of this sequence afterwards, reduced over the schedule's
  // groups when control.reduce.
  StepResult step(const sched::Schedule& s, const std::int32_t* tokens, const StepControl& control = {});

 private:
  // F op `op`, the `index`-th: every layer it runs, then, after the model's last layer, the head.
  void forward(StepState& st, const sched::Op& op, std::size_t index);
  // The Ulysses exchanges of F/B op `op` at one layer (runtime/ulysses.h): buffers `buf`, the
  // piece's K, V of this member's heads at k, v, and in backward their sums at dk, dv.
  UlyssesContext ulysses_context(const StepState& st, const sched::Op& op, const UlyssesBuffers& buf, void* k,
                                 void* v, float* dk = nullptr, float* dv = nullptr) const;
  // The LM head on the final hidden state `out` of rows q: the loss, the per-position
  // losses and head_grad, with its weights' gradients (+=).
  void head(StepState& st, const sched::Op& op, const Subseq& q, const StageWeights& wt, const Buffer& out);
  // B op `op`, the `index`-th: every layer it runs, in reverse, then the embedding.
  void backward(StepState& st, const sched::Op& op, std::size_t index);
  // Before B op `op` runs layer l, whose input the forward did not keep: that input again
  // (Note [Rebuilt layer inputs] in schedule/builders.cpp).
  void rebuild_input(StepState& st, const sched::Op& op, int l, const Subseq& q, const Subseq& blocks,
                     const StageWeights& wt);
  // With an update of the host's optimizer state in flight: waits until the weights the
  // forward of owned layer l reads are back (its block's, and before layer 0 the
  // embedding's), or with l == L the head's (the final LayerNorm and the tied embedding).
  void await_weights(int l);
  void take_bucket(std::size_t b);  // HostOptimizer::ready, then the bucket's working copy
  // With the weights on the host: where `p`, in the host array `base`, has its copy on the
  // device (the embedding, final norm and head; null stays null).
  float* resident(float* p, const float* base, const Buffer& device) const;
  // Under ZeRO-2: the rank's piece of bucket b's reduced gradient `g` (the bucket's, on the
  // device) into its place in the shard, or added to it in a step that accumulates.
  void to_shard(std::size_t b, const float* g);
  bool shard_adds_ = false;  // this step's pieces are added to the shard (StepControl::accumulate)
  // resident_at_ for the embedding's and final norm's (and head's) buckets; their count.
  i64 lay_out_resident();
  // Under ZeRO-3: the rank's piece of bucket b's weights into `dst` (the bucket's, on the
  // device), and the all-gather of the rest over `group` started.
  comm::Request gather_layer(std::size_t b, float* dst, const comm::Group& group);
  // In bf16: where resident weight `p` (on the device) has its working copy, and that copy
  // of bucket b remade from the fp32 weights (nothing for a layer's bucket, or in fp32).
  const void* resident_act(const float* p) const;
  void resident_to_act(std::size_t b);
  // A pointer into the host arrays of the weights on the host (read_device and
  // write_device copy those on the host).
  bool in_host_arrays(const float* p) const;
  // With the weights on the host, at the end of a step: the embedding's, final norm's and
  // head's gradients join the layers' in the host array.
  void resident_grads_to_host();

  ModelConfig config_;
  RuntimeOptions opts_;
  std::unique_ptr<Backend> own_backend_;
  Backend& be_;
  DType act_;                 // activations
  ActPrecision precision_;    // the layout tables' name for it
  RankShard rank_shard_;      // what this rank holds of each layer (options' tp, ulysses)
  int lb_ = 0, le_ = 0;  // owned layers
  std::vector<TensorSpec> specs_;
  std::vector<ParamBucket> buckets_;
  std::vector<ShardSpan> shard_;
  i64 num_params_ = 0, num_state_ = 0;
  int sends_ = 0;  // messages sent by this runtime (for runtime/fault.h)
  std::unique_ptr<MemoryTier> device_, host_;
  Buffer params_, grads_, adam_m_, adam_v_;
  Buffer params_act_;         // the weights' working copy in the activation type (bf16)
  // With the weights on the host (params_, grads_ in the host tier): the device's copies of
  // the embedding's, final norm's and head's weights and gradients, and where each bucket's
  // are in them (-1: a layer's, on the host).
  Buffer resident_params_, resident_grads_;
  Buffer resident_act_;  // in bf16, their working copy
  std::vector<i64> resident_at_;
  HostLayers host_layers_;
  // Under ZeRO-2 (RuntimeOptions::grads_sharded()): the rank's reduced pieces of every
  // bucket's gradient, laid out as the AdamW state (ShardSpan::state_offset), and the home of
  // the layers' gradient views between their turns.
  Buffer grad_shard_;
  std::unique_ptr<ReservedRange> grad_home_;
  // Under ZeRO-3 (RuntimeOptions::weights_sharded()): the rank's pieces of the fp32 weights,
  // laid out as grad_shard_, and the home of the layers' weight views between their turns.
  Buffer param_shard_;
  std::unique_ptr<ReservedRange> weight_home_;
  // Under ZeRO-3 with the state on the host: the group whose pieces of the embedding's, final
  // norm's and head's updated weights take_bucket all-gathers (start_host_update's `zero`).
  comm::Group update_group_;
  ParamView weights_, dweights_;
  MatrixView matrices_;
  std::unique_ptr<HostOptimizer> host_opt_;  // the optimizer state on the host; null: on the device
};

}  // namespace sppo
