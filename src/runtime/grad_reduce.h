// The reduction of the weight gradients over a schedule's groups.
//
// Contract: a rank's parameters are reduced in buckets, contiguous runs in parameter
// order: the embedding, each layer, the final LayerNorm (param_buckets). In a step that
// reduces, each bucket's all-reduce over the data-parallel group starts as soon as the
// last backward op that adds to it is done (layer_done; on an MSP stage's owner, once its
// helpers' gradients are added too, helpers_added), and the AllReduce op waits for them
// all (reduce). With ZeRO-1 the buckets are reduce-scattered instead: rank k of the group
// keeps the sum of piece k of every bucket (shard_buckets), and holds AdamW state for
// those pieces only. A TiedGrads AllReduce sums the embedding's gradient of the first and
// the last stage. Under tensor parallelism the gradients of the parameters every member
// holds whole are summed over the tensor-parallel group (reduce_replicated).
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"
#include "core/layout.h"
#include "runtime/step_io.h"
#include "runtime/tensor_parallel.h"
#include "schedule/ir.h"

namespace sppo {

// A contiguous run of parameters reduced as one message: the embedding, one layer, or the
// final LayerNorm, in parameter order.
struct ParamBucket {
  std::string name;      // "embed", "blocks.3", "ln_f"
  i64 offset = 0;        // into the rank's flat parameter array
  i64 count = 0;
};

// Under ZeRO-1, the part of a bucket whose AdamW state this rank keeps (one per bucket, in
// bucket order; without ZeRO, the whole bucket).
struct ShardSpan {
  i64 offset = 0;        // into the flat parameter / gradient array
  i64 count = 0;
  i64 state_offset = 0;  // into the AdamW moments
};

// The buckets of the parameters `specs` (parameter_specs of layers [layers.first,
// layers.second)).
std::vector<ParamBucket> param_buckets(const std::vector<TensorSpec>& specs, std::pair<int, int> layers);
// The pieces whose AdamW state member `index` of `shards` keeps, their moments packed in
// bucket order.
std::vector<ShardSpan> shard_buckets(const std::vector<ParamBucket>& buckets, int index, int shards);

class GradReduce {
 public:
  // `ops`: this rank's; `reduce`: whether this step runs their AllReduce ops
  // (StepControl::reduce). `grads`: the rank's flat gradients, of the parameters `specs`.
  GradReduce(const RuntimeOptions& o, const std::vector<sched::Op>& ops, bool reduce,
             const std::vector<TensorSpec>& specs, const std::vector<ParamBucket>& buckets,
             const std::vector<ShardSpan>& shard, std::pair<int, int> layers, float* grads, StepResult& result);

  // The backward of B op `index` is done with layer l, one of the rank's own.
  void layer_done(std::size_t index, int l);
  // The bucket of own layer l.
  std::size_t bucket_of_layer(int l) const { return first_layer_bucket_ + std::size_t(l - lb_); }
  // Bucket b's gradient is at `data` from now on (a layer's device buffer, with the
  // layers' weights on the host: Note [Weights on the host] in schedule/weights.h), not in
  // the flat array.
  void place(std::size_t b, float* data) { data_[b] = data; }
  // In a step that reduces: waits for own layer l's reduction (done with its last
  // backward), so that its gradient can leave the device.
  void settle_layer(int l);
  // MSP: Recv op `index` added the helpers' gradients.
  void helpers_added(std::size_t index);
  // AllReduce op `op`, the `index`-th.
  void reduce(const sched::Op& op, std::size_t index);
  // Under tensor parallelism (tp not null), in a step that reduces: sums the replicated
  // parameters' gradients over the group, and those of key/value heads that several
  // members hold over their holders (Note [Replicated key/value heads]).
  void reduce_replicated(Backend& be, TpGroup* tp, const ModelConfig& c);

 private:
  void start(std::size_t b);

  const RuntimeOptions& opts_;
  bool reduce_;
  const std::vector<TensorSpec>& specs_;
  const std::vector<ParamBucket>& buckets_;
  const std::vector<ShardSpan>& shard_;
  int lb_;
  int layer_count_;
  float* grads_;
  std::vector<float*> data_;  // where each bucket's gradient is (place)
  StepResult& result_;
  std::size_t first_layer_bucket_;  // the bucket of layer lb_
  // The all-reduce (reduce-scatter) op of this rank, when it reduces, and after which op
  // each bucket's gradient is final.
  const sched::Op* reduce_op_ = nullptr;
  std::vector<std::size_t> bucket_ready_;
  std::vector<comm::Request> bucket_req_;
  std::vector<bool> bucket_started_;
  double reduce_start_ = -1;
};

}  // namespace sppo
