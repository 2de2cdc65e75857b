#include "runtime/host_weights.h"

#include <algorithm>
#include <initializer_list>
#include <string>

#include <sys/mman.h>

#include "core/check.h"

namespace sppo {

namespace {

// A block's views moved from one base to another: each pointer keeps its offset.
BlockParams rebased(const BlockParams& b, const float* from, float* to) {
  BlockParams r = b;
  for (float* BlockParams::*f :
       {&BlockParams::ln1_w, &BlockParams::ln1_b, &BlockParams::qkv_w, &BlockParams::qkv_b, &BlockParams::q_norm_w,
        &BlockParams::k_norm_w, &BlockParams::out_w, &BlockParams::out_b, &BlockParams::ln2_w, &BlockParams::ln2_b,
        &BlockParams::fc_w, &BlockParams::fc_b, &BlockParams::proj_w, &BlockParams::proj_b})
    if (b.*f) r.*f = to + (b.*f - from);
  return r;
}

// The same for the GEMMs' views, whose tensors are in the activation type: `from` and `to`
// are where the bucket starts in the old and the new array.
BlockMatrices rebased(const BlockMatrices& b, const char* from, char* to) {
  BlockMatrices r = b;
  for (const void* BlockMatrices::*f : {&BlockMatrices::qkv_w, &BlockMatrices::qkv_b, &BlockMatrices::out_w,
                                        &BlockMatrices::out_b, &BlockMatrices::fc_w, &BlockMatrices::fc_b,
                                        &BlockMatrices::proj_w, &BlockMatrices::proj_b})
    if (b.*f) r.*f = to + (static_cast<const char*>(b.*f) - from);
  return r;
}

}  // namespace

ReservedRange::ReservedRange(std::size_t bytes) : bytes_(std::max<std::size_t>(bytes, 1)) {
  base_ = mmap(nullptr, bytes_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  SPPO_CHECK(base_ != MAP_FAILED, "memory") << "cannot reserve " << bytes_ << " bytes of address space for the "
                                            << "gradients' views";
}

ReservedRange::~ReservedRange() { munmap(base_, bytes_); }

HostWeights::HostWeights(Backend& be, MemoryTier& device, const sched::Schedule& s, int rank,
                         std::pair<int, int> layers, const std::vector<ParamBucket>& buckets, const HostLayers* host,
                         CopyStream& h2d, CopyStream& d2h, GradReduce& grads, const StepControl& control,
                         StepResult& result)
    : be_(be),
      device_(device),
      host_(host),
      lb_(layers.first),
      buckets_(buckets),
      h2d_(h2d),
      d2h_(d2h),
      grads_(grads),
      control_(control),
      result_(result) {
  if (!host_) return;
  SPPO_ASSERT(s.place.weights_host() || sched::layer_grads_stream(s));
  SPPO_ASSERT(s.place.weights_host() == !host_->grad_out);
  SPPO_ASSERT(shards_weights(s.par.zero) == bool(host_->gather));
  uses_ = sched::LayerUses(s, rank);
  for (const sched::Op& op : s.ops.at(std::size_t(rank)))
    if (op.kind == sched::OpKind::AllGather) gathers_.push_back(&op);
  const std::size_t n = std::size_t(layers.second - layers.first);
  w_.resize(n);
  g_.resize(n);
  w_in_.resize(n);
  g_out_.resize(n);
  w_gather_.assign(n, comm::kDone);
  w_gathering_.assign(n, false);
  for (std::size_t b = 0; b < buckets.size(); ++b)
    if (host_->device_grads.at(b)) grads_.place(b, host_->device_grads[b]);
  for (int l = layers.first; l < layers.second; ++l) {
    host_w_.push_back(host_->w->blocks[std::size_t(l)]);
    host_g_.push_back(host_->g->blocks[std::size_t(l)]);
    host_m_.push_back(host_->m->blocks[std::size_t(l)]);
  }
}

HostWeights::~HostWeights() {
  // An error mid-step leaves copies in flight: they end before their buffers go, and the
  // views point at the host's arrays again.
  if (!host_) return;
  h2d_.synchronize();
  d2h_.synchronize();
  for (std::size_t j = 0; j < w_gather_.size(); ++j)
    if (w_gathering_[j]) comm::wait(*host_->comm, w_gather_[j], "a layer's all-gather, before its buffer goes");
  for (std::size_t j = 0; j < w_.size(); ++j) {
    point_views(lb_ + int(j), false);
    host_->g->blocks[std::size_t(lb_) + j] = host_g_[j];
  }
}

void HostWeights::point_views(int l, bool on_device) {
  const std::size_t j = std::size_t(l - lb_), at = std::size_t(l);
  const ParamBucket& b = bucket(l);
  const float* host_base = host_->params + b.offset;
  if (on_device) {
    // The GEMMs' views point at the working copy: the fp32 weights themselves, or in bf16
    // the converted copy after them (bring()); the host's views of it start from the same
    // base in the activation type (Runtime's matrix view).
    const std::size_t act = dtype_bytes(be_.act());
    const char* host_act = reinterpret_cast<const char*>(host_->params) + std::size_t(b.offset) * act;
    char* device_act = static_cast<char*>(w_[j].data()) + (act == sizeof(float) ? 0 : fp32_bytes(b.count));
    host_->w->blocks[at] = rebased(host_w_[j], host_base, w_[j].f32());
    host_->m->blocks[at] = rebased(host_m_[j], host_act, device_act);
  } else {
    host_->w->blocks[at] = host_w_[j];
    host_->m->blocks[at] = host_m_[j];
  }
}

void HostWeights::bring(int l) {
  const std::size_t j = std::size_t(l - lb_);
  const ParamBucket& b = bucket(l);
  SPPO_ASSERT_MSG(!w_[j], "layer " << l << "'s weights brought twice");
  // The update of the last step writes the host's weights bucket by bucket: this one's
  // must be done before it is read.
  if (host_->ready) host_->ready(grads_.bucket_of_layer(l));
  // In bf16 the GEMMs' working copy follows the fp32 weights, converted once they are here.
  const i64 copy = be_.act() == DType::F32 ? 0 : b.count * i64(dtype_bytes(be_.act()));
  if (host_->gather) {  // ZeRO-3: the layer group's pieces
    // The schedule's next gather (Note [ZeRO-3 gathers] in schedule/weights.h) is this one.
    SPPO_CHECK(next_gather_ < gathers_.size() && gathers_[next_gather_]->layer_begin == l, "runtime")
        << "the step gathers layer " << l << "'s weights where the schedule's next gather is "
        << (next_gather_ < gathers_.size() ? "'" + sched::to_string(*gathers_[next_gather_]) + "'" : "none");
    const sched::Op& op = *gathers_[next_gather_++];
    w_[j] = device_.alloc(i64(fp32_bytes(b.count)) + copy, "blocks." + std::to_string(l) + " weights gathered");
    w_gather_[j] = host_->gather(grads_.bucket_of_layer(l), w_[j].f32(), op.group);
    result_.collective_bytes += i64(fp32_bytes(b.count));
    w_gathering_[j] = true;
    return;
  }
  w_[j] = device_.alloc(i64(fp32_bytes(b.count)) + copy, "blocks." + std::to_string(l) + " weights from the host");
  w_in_[j] = h2d_.copy(w_[j].data(), host_->params + b.offset, fp32_bytes(b.count), {});
  copies_.push_back({"weights L" + std::to_string(l), w_in_[j]});
}

void HostWeights::arrive(int l) {
  const std::size_t j = std::size_t(l - lb_);
  if (w_gathering_[j]) {  // the trace shows a wait as the simulator's does its gather
    const double t0 = now_s();
    const double waited =
        comm::wait(*host_->comm, w_gather_[j], "the all-gather of layer " + std::to_string(l) + "'s weights");
    result_.comm_wait_s += waited;
    if (waited > kShownWaitS)
      add_span(result_, "wait gather L" + std::to_string(l), sched::OpKind::AllGather, Lane::Compute, t0, now_s());
    w_gather_[j] = comm::kDone;
    w_gathering_[j] = false;
  } else if (w_in_[j]) {
    result_.exposed_copy_s += w_in_[j]->wait();
    w_in_[j] = nullptr;
  } else {
    return;
  }
  if (be_.act() != DType::F32) {
    const i64 count = bucket(l).count;
    be_.to_act(static_cast<char*>(w_[j].data()) + fp32_bytes(count), w_[j].f32(), count);
  }
  point_views(l, true);
}

void HostWeights::begin(std::size_t index, int k) {
  if (!host_ || uses_.first(index) == uses_.last(index)) return;
  const sched::LayerUse& u = uses_.at(index, k);
  for (int l : {u.load_now, u.load_next, u.load_below})
    if (l >= 0) bring(l);
  arrive(u.layer);
  if (u.load_below >= 0) arrive(u.load_below);
  const std::size_t j = std::size_t(u.layer - lb_);
  if (u.grad_first) {
    const ParamBucket& b = bucket(u.layer);
    const std::string what = "blocks." + std::to_string(u.layer) + " gradients";
    if (control_.accumulate && !host_->grad_out) {  // the sum so far, to which this step adds (ZeRO-2: the shard's)
      g_[j] = device_.alloc(i64(fp32_bytes(b.count)), what);
      result_.exposed_copy_s += h2d_.copy(g_[j].data(), host_->grads + b.offset, fp32_bytes(b.count), {})->wait();
    } else {
      g_[j] = device_.alloc_zeroed(i64(fp32_bytes(b.count)), what);
    }
    host_->g->blocks[std::size_t(u.layer)] = rebased(host_g_[j], host_->grads + b.offset, g_[j].f32());
    grads_.place(grads_.bucket_of_layer(u.layer), g_[j].f32());
  }
}

void HostWeights::release_grad(int l) {
  const std::size_t j = std::size_t(l - lb_);
  SPPO_ASSERT_MSG(g_[j] && (g_out_[j] || host_->grad_out), "layer " << l << "'s gradients released before they left");
  if (g_out_[j]) result_.exposed_copy_s += g_out_[j]->wait();
  g_out_[j] = nullptr;
  g_[j].reset();
  host_->g->blocks[std::size_t(l)] = host_g_[j];
}

void HostWeights::end(std::size_t index, int k) {
  if (!host_ || uses_.first(index) == uses_.last(index)) return;
  const sched::LayerUse& u = uses_.at(index, k);
  const std::size_t j = std::size_t(u.layer - lb_);
  if (u.grad_last) {
    // Reduced over the replicas first (a step that reduces), then to the host's array, or
    // under ZeRO-2 the rank's reduced piece into its shard.
    const ParamBucket& b = bucket(u.layer);
    grads_.settle_layer(u.layer);
    grads_.place(grads_.bucket_of_layer(u.layer), host_->grads + b.offset);
    if (host_->grad_out) {
      host_->grad_out(grads_.bucket_of_layer(u.layer), g_[j].f32());
    } else {
      g_out_[j] = d2h_.copy(host_->grads + b.offset, g_[j].data(), fp32_bytes(b.count), {});
      copies_.push_back({"grads L" + std::to_string(u.layer), g_out_[j]});
    }
  }
  for (int l : u.grad_free)
    if (l >= 0) release_grad(l);
  if (u.weights_free) {
    SPPO_ASSERT(w_[j] && !w_in_[j] && !w_gathering_[j]);
    w_[j].reset();
    point_views(u.layer, false);
  }
}

void HostWeights::trace(StepResult& result) const {
  for (const auto& [name, ev] : copies_) {
    const bool in = name.rfind("weights", 0) == 0;
    add_span(result, name, in ? sched::OpKind::Prefetch : sched::OpKind::Offload, in ? Lane::CopyIn : Lane::CopyOut,
             ev->start_s(), ev->end_s());
  }
}

void HostWeights::check_empty() const {
  for (std::size_t j = 0; j < w_.size(); ++j)
    SPPO_ASSERT_MSG(!w_[j] && !g_[j], "layer " << lb_ + int(j) << "'s weights or gradients left on the device");
  SPPO_ASSERT_MSG(next_gather_ == gathers_.size(), "the step started " << next_gather_ << " of the schedule's "
                                                                       << gathers_.size() << " gathers");
}

}  // namespace sppo
