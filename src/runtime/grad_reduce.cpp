#include "runtime/grad_reduce.h"

#include <algorithm>

#include "core/check.h"

namespace sppo {

namespace {

constexpr std::size_t kNever = std::size_t(-1);

}  // namespace

std::vector<ParamBucket> param_buckets(const std::vector<TensorSpec>& specs, std::pair<int, int> layers) {
  std::vector<ParamBucket> buckets;
  i64 off = 0;
  std::size_t k = 0;
  auto take = [&](std::string name, auto&& belongs) {
    ParamBucket b{std::move(name), off, 0};
    while (k < specs.size() && belongs(specs[k].name)) b.count += specs[k++].numel();
    off += b.count;
    if (b.count > 0) buckets.push_back(b);
  };
  take("embed", [](const std::string& n) { return n == "embed.weight"; });
  for (int l = layers.first; l < layers.second; ++l) {
    const std::string prefix = "blocks." + std::to_string(l) + ".";
    take("blocks." + std::to_string(l), [&](const std::string& n) { return n.rfind(prefix, 0) == 0; });
  }
  take("ln_f", [](const std::string& n) { return n.rfind("ln_f.", 0) == 0 || n == "lm_head.weight"; });
  SPPO_ASSERT(k == specs.size());
  return buckets;
}

std::vector<ShardSpan> shard_buckets(const std::vector<ParamBucket>& buckets, int index, int shards) {
  std::vector<ShardSpan> shard;
  i64 state = 0;
  for (const auto& b : buckets) {
    const auto [pb, pe] = piece_range(b.count, index, shards);
    shard.push_back({b.offset + pb, pe - pb, state});
    state += pe - pb;
  }
  return shard;
}

GradReduce::GradReduce(const RuntimeOptions& o, const std::vector<sched::Op>& ops, bool reduce,
                       const std::vector<TensorSpec>& specs, const std::vector<ParamBucket>& buckets,
                       const std::vector<ShardSpan>& shard, std::pair<int, int> layers, float* grads,
                       StepResult& result)
    : opts_(o),
      reduce_(reduce),
      specs_(specs),
      buckets_(buckets),
      shard_(shard),
      lb_(layers.first),
      layer_count_(layers.second - layers.first),
      grads_(grads),
      result_(result),
      first_layer_bucket_(!buckets.empty() && buckets[0].name == "embed" ? 1 : 0) {
  for (const ParamBucket& b : buckets) data_.push_back(grads + b.offset);
  // Gradient buckets: each starts after the last op that adds to it.
  for (const sched::Op& op : ops)
    if (sched::reduces_weight_grads(op) && reduce)
      reduce_op_ = &op;
  if (!reduce_op_) return;
  const auto& g = reduce_op_->group;
  SPPO_CHECK(o.zero_shards == 1 || (int(g.size()) == o.zero_shards && g[std::size_t(o.zero_index)] == o.rank),
             "runtime")
      << "ZeRO shards the optimizer over " << o.zero_shards << " ranks but the gradient group has " << g.size();
  SPPO_CHECK((reduce_op_->kind == sched::OpKind::ReduceScatter) == (o.zero_shards > 1), "runtime")
      << "the schedule's '" << sched::to_string(*reduce_op_) << "' where this runtime shards over " << o.zero_shards
      << " ranks";
  bucket_ready_.assign(buckets.size(), kNever);
  bucket_req_.assign(buckets.size(), comm::kDone);
  bucket_started_.assign(buckets.size(), false);
  for (std::size_t k = 0; k < ops.size(); ++k) {
    const sched::Op& op = ops[k];
    if (op.kind == sched::OpKind::Backward && layers.first <= op.layer_begin && op.layer_end <= layers.second)
      for (int l = op.layer_begin; l < op.layer_end; ++l) bucket_ready_[first_layer_bucket_ + std::size_t(l - lb_)] = k;
  }
  // MSP helpers' weight gradients are added to the owner's first.
  for (std::size_t k = 0; k < ops.size(); ++k)
    if (ops[k].kind == sched::OpKind::Recv && ops[k].payload == sched::Payload::WeightGrads)
      for (auto& ready : bucket_ready_)
        if (ready != kNever) ready = std::max(ready, k);
}

void GradReduce::layer_done(std::size_t index, int l) {
  const std::size_t bucket = first_layer_bucket_ + std::size_t(l - lb_);
  if (reduce_op_ && bucket_ready_[bucket] == index) start(bucket);
}

void GradReduce::settle_layer(int l) {
  if (!reduce_op_) return;
  const std::size_t b = bucket_of_layer(l);
  start(b);
  const double t0 = now_s();
  const std::string what = "the reduction of layer " + std::to_string(l) + "'s gradients before they leave the device";
  const double waited = comm::wait(*opts_.comm, bucket_req_[b], what);
  bucket_req_[b] = comm::kDone;
  result_.comm_wait_s += waited;
  if (waited > kShownWaitS) add_span(result_, "wait " + what, sched::OpKind::AllReduce, Lane::Compute, t0, now_s());
}

void GradReduce::helpers_added(std::size_t index) {
  if (reduce_op_)
    for (std::size_t k = 0; k < buckets_.size(); ++k)
      if (bucket_ready_[k] == index) start(k);
}

void GradReduce::start(std::size_t b) {
  if (bucket_started_[b]) return;
  bucket_started_[b] = true;
  if (reduce_start_ < 0) reduce_start_ = now_s();
  const ParamBucket& k = buckets_[b];
  const comm::Group& g = reduce_op_->group;
  float* data = data_[b];
  result_.collective_bytes += i64(fp32_bytes(k.count));
  bucket_req_[b] = reduce_op_->kind == sched::OpKind::ReduceScatter
                       ? comm::ireduce_scatter_pieces(*opts_.comm, data, k.count, g)
                       : opts_.comm->iallreduce(data, k.count, comm::Type::F32, g);
}

void GradReduce::reduce(const sched::Op& op, std::size_t index) {
  const double t0 = now_s();
  const std::string what = "op " + std::to_string(index) + " '" + sched::to_string(op) + "'";
  double waited = 0;
  if (op.payload == sched::Payload::TiedGrads) {
    // The embedding is the first bucket of both stages; under ZeRO both hold the same
    // piece of it (their positions in their data-parallel groups are equal).
    SPPO_ASSERT(!buckets_.empty() && buckets_[0].name == "embed");
    const ShardSpan& piece = shard_[0];
    float* data = data_[0] + (piece.offset - buckets_[0].offset);
    result_.collective_bytes += i64(fp32_bytes(piece.count));
    waited = comm::wait(*opts_.comm, opts_.comm->iallreduce(data, piece.count, comm::Type::F32, op.group), what);
    add_span(result_, sched::to_string(op), op.kind, Lane::Network, t0, now_s());
  } else {
    for (std::size_t b = 0; b < buckets_.size(); ++b) start(b);
    for (std::size_t b = 0; b < buckets_.size(); ++b) waited += comm::wait(*opts_.comm, bucket_req_[b], what);
    add_span(result_, sched::to_string(op), op.kind, Lane::Network, reduce_start_, now_s());
  }
  result_.comm_wait_s += waited;
  if (waited > kShownWaitS) add_span(result_, "wait " + sched::to_string(op), op.kind, Lane::Compute, t0, now_s());
}

void GradReduce::reduce_replicated(Backend& be, TpGroup* tp, const ModelConfig& c) {
  if (!tp || !reduce_) return;
  // Each member's LayerNorm gradients come from its own rows (Note [Sequence-parallel
  // regions]), its query/key norms' from its own heads (Note [Query/key norms]): the sum
  // over the group is the whole gradient. Sums commute, so this may follow the
  // data-parallel reduction.
  be.synchronize();
  i64 off = 0;
  for (const TensorSpec& spec : specs_) {
    const bool layernorm = spec.name.rfind("ln_f.", 0) == 0 || spec.name.find(".ln") != std::string::npos ||
                           spec.name.find("_norm.") != std::string::npos;
    if (layernorm) tp->all_reduce(grads_ + off, spec.numel(), spec.name);
    off += spec.numel();
  }
  if (tp->shard().kv_replicas(c) == 1) return;
  // The k and v rows of each layer sit side by side: one sum a run of them.
  const auto slices = param_slices(c, lb_, lb_ + layer_count_, tp->shard());
  for (std::size_t k = 0; k < slices.size();) {
    if (!slices[k].kv_replica) { ++k; continue; }
    const i64 from = slices[k].local;
    i64 to = from;
    for (; k < slices.size() && slices[k].kv_replica && slices[k].local == to; ++k) to += slices[k].count;
    tp->all_reduce_kv_replicas(grads_ + from, to - from, "key/value projection gradients");
  }
}

}  // namespace sppo
