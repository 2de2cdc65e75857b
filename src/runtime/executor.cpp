#include "runtime/executor.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/check.h"
#include "model/tensor_parallel.h"
#include "runtime/activation_store.h"
#include "runtime/grad_reduce.h"
#include "runtime/kv_store.h"
#include "runtime/msp.h"
#include "runtime/op_rows.h"
#include "runtime/stage_messages.h"
#include "runtime/step_state.h"
#include "runtime/tensor_parallel.h"
#include "runtime/ulysses.h"

namespace sppo {

namespace {

std::vector<void*> ptrs(const std::vector<Buffer>& bufs) {
  std::vector<void*> p;
  for (const auto& b : bufs) p.push_back(b.data());
  return p;
}

std::vector<Buffer> alloc_specs(MemoryTier& tier, const std::vector<TensorSpec>& specs,
                                const std::string& prefix) {
  std::vector<Buffer> bufs;
  for (const auto& s : specs) bufs.push_back(tier.alloc(s.bytes(), prefix + s.name));
  return bufs;
}

// The kernels' scratch for one layer (or the head), from the device tier; none when the
// size is zero (the kernels then allocate their own).
class KernelScratchBuffer {
 public:
  KernelScratchBuffer() = default;
  KernelScratchBuffer(MemoryTier& tier, i64 bytes) {
    if (bytes > 0) buf_ = tier.alloc(bytes, "kernel scratch");
  }
  Workspace get() const { return {buf_.data(), std::size_t(buf_.bytes())}; }

 private:
  Buffer buf_;
};

// A layer's workspace as the block takes it, and, on a Ulysses member, the exchanges' buffers
// that follow the block's own (block_workspace_specs with a UlyssesShard).
struct LayerWorkspace {
  BlockWorkspace block;
  UlyssesBuffers ulysses;
};
LayerWorkspace layer_workspace(const std::vector<Buffer>& ws, Workspace scratch, const MlpTiles& tiles, bool ulysses) {
  std::vector<void*> p = ptrs(ws);
  LayerWorkspace w;
  if (ulysses) {
    w.ulysses = ulysses_buffers_from(p);
    p.resize(p.size() - std::size_t(kUlyssesBuffers));
  }
  w.block = block_workspace_from(p, scratch, tiles);
  return w;
}

}  // namespace

Runtime::Runtime(const ModelConfig& c, const RuntimeOptions& o)
    : config_(c),
      opts_(o),
      own_backend_(o.backend ? nullptr : make_backend("cpu")),
      be_(o.backend ? *o.backend : *own_backend_),
      act_(be_.act()),
      precision_(act_ == DType::F32 ? ActPrecision::F32 : ActPrecision::BF16),
      rank_shard_{o.tp, o.ulysses},
      device_(std::make_unique<MemoryTier>(Tier::Device, o.device_budget, &be_)),
      host_(std::make_unique<MemoryTier>(Tier::Host, o.host_budget, &be_)) {
  c.validate();
  SPPO_CHECK(o.head_chunk >= 1, "runtime") << "head chunk must be positive";
  lb_ = o.layers.first;
  le_ = o.layers.second == 0 ? c.layers : o.layers.second;
  SPPO_CHECK(0 <= lb_ && lb_ < le_ && le_ <= c.layers, "runtime")
      << "owned layers [" << lb_ << ", " << le_ << ") are not inside the model's " << c.layers << " layers";
  SPPO_CHECK(o.zero_shards >= 1 && o.zero_index >= 0 && o.zero_index < o.zero_shards, "runtime")
      << "ZeRO shard " << o.zero_index << " of " << o.zero_shards << " does not exist";
  SPPO_CHECK(o.tp.size >= 1 && o.tp.index >= 0 && o.tp.index < o.tp.size, "runtime")
      << "tensor-parallel member " << o.tp.index << " of " << o.tp.size << " does not exist";
  SPPO_CHECK(o.ulysses.size >= 1 && o.ulysses.index >= 0 && o.ulysses.index < o.ulysses.size &&
                 !(o.ulysses.on() && o.tp.on()),
             "runtime")
      << "Ulysses member " << o.ulysses.index << " of " << o.ulysses.size << " does not exist"
      << (o.tp.on() ? " beside tensor parallelism" : "");
  specs_ = parameter_specs(c, lb_, le_, o.tp);
  for (const auto& s : specs_) num_params_ += s.numel();
  buckets_ = param_buckets(specs_, {lb_, le_});
  shard_ = shard_buckets(buckets_, o.zero_index, o.zero_shards);
  for (const auto& piece : shard_) num_state_ += piece.count;
  const i64 bytes = num_params_ * i64(sizeof(float));
  const i64 state_bytes = num_state_ * i64(sizeof(float));
  if (o.weights_host) {
    // Note [Weights on the host] (schedule/weights.h): every weight and gradient in the
    // host tier, where the optimizer's update reads and writes them; the device keeps the
    // embedding's, final norm's and head's, which every subsequence's first and last
    // layers' neighbours need.
    SPPO_CHECK(o.optimizer_host && o.zero_shards == 1 && !o.tp.on() && !o.recompute, "runtime")
        << "the layers' weights on the host (--weights host) are the optimizer's master there: they need "
           "--optimizer-state host, and run without --zero 1, --tp and --recompute";
    params_ = host_->alloc_zeroed(bytes, "weights (on the host)");
    grads_ = host_->alloc_zeroed(bytes, "gradients (on the host)");
    const i64 resident = lay_out_resident();
    resident_params_ = device_->alloc_zeroed(resident * i64(sizeof(float)), "embedding, final norm and head weights");
    resident_grads_ = device_->alloc_zeroed(resident * i64(sizeof(float)), "embedding, final norm and head gradients");
    if (act_ != DType::F32)
      resident_act_ = device_->alloc(resident * dtype_bytes(act_), "embedding, final norm and head working copy");
  } else if (o.weights_sharded()) {
    // Note [ZeRO-3] (schedule/weights.h): the rank's pieces of the fp32 weights (the AdamW
    // master) and of the reduced gradients, laid out as the AdamW state; the embedding's,
    // final norm's and head's weights and gradients whole; a layer's weights and gradient
    // while the step uses them (HostWeights), their views at reserved homes between.
    SPPO_CHECK(o.zero_shards > 1 && !o.weights_host && !o.tp.on() && !o.recompute && !o.inference, "runtime")
        << "ZeRO-3 shards the weights over the ranks that hold the same layers: it needs two or more of them, "
           "and runs without --weights host, --tp and --recompute";
    weight_home_ = std::make_unique<ReservedRange>(std::size_t(bytes));
    grad_home_ = std::make_unique<ReservedRange>(std::size_t(bytes));
    const i64 resident = lay_out_resident();
    resident_params_ = device_->alloc_zeroed(resident * i64(sizeof(float)), "embedding, final norm and head weights");
    resident_grads_ = device_->alloc_zeroed(resident * i64(sizeof(float)), "embedding, final norm and head gradients");
    if (act_ != DType::F32)
      resident_act_ = device_->alloc(resident * dtype_bytes(act_), "embedding, final norm and head working copy");
    param_shard_ = device_->alloc_zeroed(state_bytes, "weights' shard (ZeRO-3)");
    grad_shard_ = device_->alloc_zeroed(state_bytes, "gradients' shard (ZeRO-3)");
  } else if (o.grads_sharded()) {
    // Note [ZeRO-2] (schedule/weights.h): the weights whole; whole gradients of the
    // embedding, final norm and head, a layer's while the step uses it (HostWeights), and
    // the rank's reduced pieces of all in one compact array, laid out as the AdamW state.
    SPPO_CHECK(o.zero_shards > 1 && !o.tp.on() && !o.recompute && !o.inference, "runtime")
        << "ZeRO-2 shards the gradients over the ranks that hold the same layers: it needs two or more of them, "
           "and runs without --tp and --recompute";
    params_ = device_->alloc_zeroed(bytes, "parameters");
    grad_home_ = std::make_unique<ReservedRange>(std::size_t(bytes));
    const i64 resident = lay_out_resident();
    resident_grads_ = device_->alloc_zeroed(resident * i64(sizeof(float)), "embedding, final norm and head gradients");
    grad_shard_ = device_->alloc_zeroed(state_bytes, "gradients' shard (ZeRO-2)");
  } else {
    params_ = device_->alloc_zeroed(bytes, "parameters");
    if (!o.inference) grads_ = device_->alloc_zeroed(bytes, "gradients");
  }
  SPPO_CHECK(!o.inference || (!o.optimizer_host && !o.weights_host && !o.recompute), "runtime")
      << "an evaluation's runtime holds the weights on the device alone: it runs without --optimizer-state host, "
         "--weights host and --recompute";
  if (o.inference) {
    // No gradients or AdamW state: forward-only steps write none (their views alias the
    // weights, which nothing writes through them).
  } else if (o.optimizer_host) {
    HostOptimizer::HostArrays arrays{params_.f32(), grads_.f32(), {}};
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      arrays.device.push_back(o.weights_host && resident_at_[b] >= 0 ? resident_params_.f32() + resident_at_[b]
                                                                     : nullptr);
    // Under ZeRO-2 and 3 the device's gradients, and under ZeRO-3 its weights, are the
    // rank's pieces, laid out as the state (Notes [ZeRO-2], [ZeRO-3] in schedule/weights.h).
    host_opt_ = std::make_unique<HostOptimizer>(be_, *host_, buckets_, shard_, num_state_,
                                                o.weights_host ? &arrays : nullptr,
                                                HostOptimizer::Packing{o.grads_sharded(), o.weights_sharded()});
  } else {
    adam_m_ = device_->alloc_zeroed(state_bytes, "AdamW first moments");
    adam_v_ = device_->alloc_zeroed(state_bytes, "AdamW second moments");
  }
  // The GEMMs read the weights in the activation type: the masters themselves in fp32,
  // else a working copy refreshed after every update.
  // With the layers' weights on the host, a layer's comes with it (HostWeights) and the
  // rest's is resident_act_.
  if (act_ != DType::F32 && !o.weights_host && !o.weights_sharded())
    params_act_ = device_->alloc(num_params_ * dtype_bytes(act_), "weights' working copy");
  // Where the views start: the flat arrays, or the reserved homes of what comes and goes.
  float* const wbase = o.weights_sharded() ? weight_home_->f32() : params_.f32();
  float* const gbase = o.inference ? wbase : o.grads_sharded() ? grad_home_->f32() : grads_.f32();
  weights_ = param_view(c, wbase, lb_, le_, o.tp);
  dweights_ = param_view(c, gbase, lb_, le_, o.tp);
  matrices_ = matrix_view(c, params_act_ ? params_act_.data() : static_cast<void*>(wbase), act_, lb_, le_, o.tp);
  if (o.weights_host || o.weights_sharded()) {
    // The views of the embedding, final norm and head point at the device's copies; a
    // layer's, at the host's arrays (or the homes) until a step brings it (HostWeights).
    for (ParamView* v : {&weights_, &dweights_}) {
      const Buffer& dev = v == &weights_ ? resident_params_ : resident_grads_;
      const float* base = v == &weights_ ? wbase : gbase;
      for (float** p : {&v->embed, &v->lnf_w, &v->lnf_b, &v->head}) *p = resident(*p, base, dev);
    }
    matrices_.embed = resident_act(weights_.embed);
    matrices_.head = resident_act(weights_.head);
    host_layers_ = {wbase, gbase, &weights_, &dweights_, &matrices_, {}, {}, {}, {}, opts_.comm};
    if (o.weights_host) {
      host_layers_.ready = [this](std::size_t b) { take_bucket(b); };
    } else {
      host_layers_.grad_out = [this](std::size_t b, const float* g) { to_shard(b, g); };
      host_layers_.gather = [this](std::size_t b, float* dst, const comm::Group& group) {
        if (host_opt_) take_bucket(b);  // the host's update of the rank's piece is back
        return gather_layer(b, dst, group);
      };
    }
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      host_layers_.device_grads.push_back(resident_at_[b] >= 0 ? resident_grads_.f32() + resident_at_[b] : nullptr);
  } else if (o.grads_sharded()) {
    // The gradients' views of the embedding, final norm and head at the device's; a layer's
    // at the reserved home until a step's backward allocates it (HostWeights).
    for (float** p : {&dweights_.embed, &dweights_.lnf_w, &dweights_.lnf_b, &dweights_.head})
      *p = resident(*p, grad_home_->f32(), resident_grads_);
    host_layers_ = {params_.f32(), grad_home_->f32(), &weights_, &dweights_, &matrices_, {}, {},
                    [this](std::size_t b, const float* g) { to_shard(b, g); }, {}, nullptr};
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      host_layers_.device_grads.push_back(resident_at_[b] >= 0 ? resident_grads_.f32() + resident_at_[b] : nullptr);
  }
}

i64 Runtime::lay_out_resident() {
  i64 resident = 0;
  for (const ParamBucket& b : buckets_) {
    const bool stays = b.name == "embed" || b.name == "ln_f";
    resident_at_.push_back(stays ? resident : -1);
    if (stays) resident += b.count;
  }
  return resident;
}

comm::Request Runtime::gather_layer(std::size_t b, float* dst, const comm::Group& group) {
  const ShardSpan& sp = shard_[b];
  be_.copy_2d(dst + (sp.offset - buckets_[b].offset), 0, param_shard_.f32() + sp.state_offset, 0,
              sp.count * i64(sizeof(float)), 1);
  return comm::iallgather_pieces(*opts_.comm, dst, buckets_[b].count, group);
}

void Runtime::gather_updated_weights(comm::Comm& world, const comm::Group& group) {
  std::vector<comm::Request> reqs;
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    const ParamBucket& k = buckets_[b];
    if (!opts_.weights_sharded()) {
      reqs.push_back(comm::iallgather_pieces(world, params_.f32() + k.offset, k.count, group));
    } else if (resident_at_[b] >= 0) {  // ZeRO-3: the embedding's, final norm's and head's; a layer's comes as used
      reqs.push_back(gather_layer(b, resident_params_.f32() + resident_at_[b], group));
    }
  }
  for (comm::Request r : reqs) comm::wait(world, r, "the all-gather of the updated weights");
  refresh_weights();
}

void Runtime::set_weights(const float* mine) {
  finish_update();
  if (!opts_.weights_sharded()) {
    write_device(params_.f32(), mine, num_params_);
  } else {
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      const ShardSpan& sp = shard_[b];
      be_.to_device(param_shard_.f32() + sp.state_offset, mine + sp.offset, std::size_t(sp.count) * sizeof(float));
      if (resident_at_[b] >= 0)
        be_.to_device(resident_params_.f32() + resident_at_[b], mine + buckets_[b].offset,
                      std::size_t(buckets_[b].count) * sizeof(float));
    }
  }
  refresh_weights();
}

void Runtime::to_shard(std::size_t b, const float* g) {
  const ShardSpan& sp = shard_[b];
  float* to = grad_shard_.f32() + sp.state_offset;
  const float* piece = g + (sp.offset - buckets_[b].offset);
  if (shard_adds_) be_.add_f32(to, piece, sp.count);
  else be_.copy_2d(to, 0, piece, 0, sp.count * i64(sizeof(float)), 1);
}

float* Runtime::resident(float* p, const float* base, const Buffer& device) const {
  if (!p) return nullptr;
  const i64 off = p - base;
  for (std::size_t b = 0; b < buckets_.size(); ++b)
    if (off >= buckets_[b].offset && off < buckets_[b].offset + buckets_[b].count) {
      SPPO_ASSERT(resident_at_[b] >= 0);
      return device.f32() + resident_at_[b] + (off - buckets_[b].offset);
    }
  SPPO_ASSERT_MSG(false, "a weight outside the rank's parameters");
  return nullptr;
}

const void* Runtime::resident_act(const float* p) const {
  if (!p || !resident_act_) return p;
  return act_at(resident_act_.data(), p - resident_params_.f32(), act_);
}

void Runtime::resident_to_act(std::size_t b) {
  if (!resident_act_ || resident_at_[b] < 0) return;
  be_.to_act(act_at(resident_act_.data(), resident_at_[b], act_), resident_params_.f32() + resident_at_[b],
             buckets_[b].count);
}

bool Runtime::in_host_arrays(const float* p) const {
  if (!opts_.weights_host) return false;
  for (const Buffer* b : {&params_, &grads_})
    if (p >= b->f32() && p < b->f32() + num_params_) return true;
  return false;
}

void Runtime::resident_grads_to_host() {
  finish_update();  // the last update has read the host's gradients
  for (std::size_t b = 0; b < buckets_.size(); ++b)
    if (resident_at_[b] >= 0)
      be_.to_host(grads_.f32() + buckets_[b].offset, resident_grads_.f32() + resident_at_[b],
                  std::size_t(buckets_[b].count) * sizeof(float));
}

float* Runtime::params() {
  finish_update();
  return opts_.weights_sharded() ? param_shard_.f32() : params_.f32();
}

float* Runtime::grads() {
  finish_update();
  return opts_.grads_sharded() ? grad_shard_.f32() : grads_.f32();
}

float* Runtime::adam_m() {
  finish_update();
  return host_opt_ ? host_opt_->m() : adam_m_.f32();
}

float* Runtime::adam_v() {
  finish_update();
  return host_opt_ ? host_opt_->v() : adam_v_.f32();
}

void Runtime::refresh_weights() {
  finish_update();
  if (opts_.weights_sharded()) {  // the layers' are made from the shards as steps reach them
    for (std::size_t b = 0; b < buckets_.size(); ++b) resident_to_act(b);
    if (host_opt_) host_opt_->load_master(param_shard_.f32());
    return;
  }
  if (opts_.weights_host) {  // the layers' come from the host's array as steps reach them
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      if (resident_at_[b] >= 0) {
        be_.to_device(resident_params_.f32() + resident_at_[b], params_.f32() + buckets_[b].offset,
                      std::size_t(buckets_[b].count) * sizeof(float));
        resident_to_act(b);
      }
    return;
  }
  if (params_act_) be_.to_act(params_act_.data(), params_.f32(), num_params_);
  if (host_opt_) host_opt_->load_master(params_.f32());
}

void Runtime::read_device(float* host, const float* device, i64 n) {
  if (in_host_arrays(device)) std::copy(device, device + n, host);
  else be_.to_host(host, device, std::size_t(n) * sizeof(float));
}

void Runtime::write_device(float* device, const float* host, i64 n) {
  if (in_host_arrays(device)) std::copy(host, host + n, device);
  else be_.to_device(device, host, std::size_t(n) * sizeof(float));
}

void Runtime::read_state(float* host, const float* state, i64 n) {
  if (host_opt_) std::copy(state, state + n, host);
  else read_device(host, state, n);
}

void Runtime::write_state(float* state, const float* host, i64 n) {
  if (host_opt_) std::copy(host, host + n, state);
  else write_device(state, host, n);
}

void Runtime::start_host_update(std::vector<HostOptimizer::Piece> pieces, const HostOptimizer::Settings& s,
                                comm::Group zero) {
  SPPO_ASSERT(host_opt_);
  if (opts_.weights_host) {  // the gradients are on the host; the resident weights go where HostArrays say
    host_opt_->start(nullptr, nullptr, std::move(pieces), s, opts_.comm, std::move(zero));
  } else if (opts_.weights_sharded()) {  // the pieces go up to the shard; take_bucket gathers what stays whole
    update_group_ = std::move(zero);
    host_opt_->start(param_shard_.f32(), grad_shard_.f32(), std::move(pieces), s, opts_.comm, {});
  } else {
    host_opt_->start(params_.f32(), opts_.grads_sharded() ? grad_shard_.f32() : grads_.f32(), std::move(pieces), s,
                     opts_.comm, std::move(zero));
  }
}

void Runtime::take_bucket(std::size_t b) {
  if (!host_opt_->ready(b)) return;
  if (opts_.weights_host) {  // the update wrote the resident weights on the device; a layer's converts as it comes
    resident_to_act(b);
    return;
  }
  if (opts_.weights_sharded()) {  // ZeRO-3: the embedding, final norm and head whole again; a layer's comes as used
    if (resident_at_[b] < 0) return;
    comm::wait(*opts_.comm, gather_layer(b, resident_params_.f32() + resident_at_[b], update_group_),
               "the all-gather of the updated weights");
    resident_to_act(b);
    return;
  }
  if (!params_act_) return;
  const ParamBucket& k = buckets_[b];
  be_.to_act(act_at(params_act_.data(), k.offset, act_), params_.f32() + k.offset, k.count);
}

void Runtime::finish_update() {
  if (!host_opt_) return;
  for (std::size_t b = 0; b < buckets_.size(); ++b) take_bucket(b);
}

void Runtime::await_weights(int l) {
  if (!host_opt_ || !host_opt_->in_flight()) return;
  const bool embed = buckets_.front().name == "embed", ln_f = buckets_.back().name == "ln_f";
  if (l == config_.layers) {
    if (ln_f) take_bucket(buckets_.size() - 1);
    if (embed) take_bucket(0);
    return;
  }
  if (l == 0 && embed) take_bucket(0);
  take_bucket(std::size_t(l - lb_) + (embed ? 1 : 0));
}

Runtime::~Runtime() = default;

namespace {

// A recompute layer's weights for its K/V stream (KvStore::attention); none elsewhere (an
// MSP helper's borrowed layers have no gradients before their backward).
HostKvCache::LayerWeights layer_weights(const StepState& st, const StageWeights& wt, int l) {
  if (!st.sched.place.kv_recomputed(l)) return {};
  return {&wt.w->blocks[l], &wt.m->blocks[l], &wt.g->blocks[l]};
}

// A recomputed fc_pre under MLP tiles is never whole: the tiles make it a tile at a time
// in the workspace (Note [MLP tiles] in core/layout.h).
bool tiled_away(const MlpTiles& tiles, int k) { return k == kSavedFcPre && tiles.on() && tiles.fc_pre_recomputed; }

}  // namespace

void Runtime::forward(StepState& st, const sched::Op& op, std::size_t index) {
  const int i = op.subseq, b = op.layer_begin, e = op.layer_end;
  const Subseq q = rows_of(st.sched, op);
  // The rows the blocks run on: the piece's, or a Ulysses member's (their attention runs on
  // the piece's, runtime/ulysses.h).
  const Subseq mine = rank_shard_.ulysses.on() ? member_rows(st.sched, op, opts_.rank) : q;
  const Subseq blocks = with_docs(mine, st.control.docs);
  const StageWeights wt = st.msp.weights_for(op);
  const int T = q.T, H = config_.hidden, L = config_.layers;
  const std::int32_t* ids = static_cast<const std::int32_t*>(st.ids.data());  // the whole step's
  const auto specs = block_saved_specs(config_, T, precision_, rank_shard_);
  if (b > 0) {  // the previous stage's output is this stage's first saved input
    st.act.unit(i, b)[0] = st.messages.take_input(sched::input_id(op), member_rows(st.sched, op, opts_.rank));
    SPPO_ASSERT_MSG(st.act.unit(i, b)[0], "forward of layers from " << b << " on subseq " << i << " without its input");
  }
  const bool own = lb_ <= b && e <= le_;  // else an MSP helper's, on borrowed weights
  const MlpTiles tiles = st.sched.place.mlp_tiles();
  Buffer out;  // the stage's output
  for (int l = b; l < e; ++l) {
    st.weights.begin(index, l - b);  // with the weights on the host, this layer's (and the next's on the way)
    if (own) await_weights(l);
    auto& unit = st.act.unit(i, l);
    for (int k = 0; k < int(specs.size()); ++k)
      if (!unit[k] && !tiled_away(tiles, k)) unit[k] = device_->alloc(specs[k].bytes(), unit_name(l, i) + specs[k].name);
    auto ws = alloc_specs(*device_, block_workspace_specs(config_, T, precision_, rank_shard_, tiles), "workspace ");
    KernelScratchBuffer scratch(*device_, opts_.block_scratch.bytes(T));
    const LayerWorkspace w = layer_workspace(ws, scratch.get(), tiles, rank_shard_.ulysses.on());
    if (l == 0 && st.tp)
      embedding_forward_tp(be_, unit[0].data(), ids, wt.w->embed, w.block.tp_full, w.block.tp_pad, *st.tp, config_, q);
    else if (l == 0)
      for (const PosSpan& part : mine.parts())
        be_.embedding_forward(act_at(unit[0].data(), i64(part.row0) * H, act_), ids + part.pos0, wt.w->embed,
                              part.rows, H, config_.vocab);
    // The block's output is the next block's saved input, or the stage's output.
    void* x_out;
    if (l + 1 < e) {
      st.act.unit(i, l + 1)[0] = device_->alloc(specs[0].bytes(), unit_name(l + 1, i) + "x");
      x_out = st.act.unit(i, l + 1)[0].data();
    } else {
      out = device_->alloc(specs[0].bytes(), e == L ? "final hidden" : "hidden for the next stage");
      x_out = out.data();
    }
    const LayerAttention attn = st.kv.attention(op, l, false, layer_weights(st, wt, l));
    BlockSaved saved = block_saved_from(ptrs(unit));
    if (st.tp) {
      block_forward_tp(be_, x_out, saved, wt.w->blocks[l], wt.m->blocks[l], w.block, *attn, *st.tp, config_, blocks);
    } else if (rank_shard_.ulysses.on()) {  // the block's K, V of its rows; the unit's are the piece's of its heads
      UlyssesAttention heads(ulysses_context(st, op, w.ulysses, unit[kK].data(), unit[kV].data()), *attn);
      saved.k = w.ulysses.k;
      saved.v = w.ulysses.v;
      block_forward(be_, x_out, saved, wt.w->blocks[l], wt.m->blocks[l], w.block, heads, config_, blocks);
    } else {
      block_forward(be_, x_out, saved, wt.w->blocks[l], wt.m->blocks[l], w.block, *attn, config_, blocks);
    }
    if (opts_.recompute)  // keep the block input only; backward recomputes the rest
      for (int k = 1; k < int(specs.size()); ++k) unit[k].reset();
    for (int k = 0; k < int(specs.size()); ++k)  // what backward recomputes (Note [Recomputed tensors])
      if (in_set(st.sched.place.recompute, k)) unit[k].reset();
    st.kv.after_forward(l, i, q);
    if (st.sched.forward_only) {  // Note [Forward-only steps]: nothing is saved for a backward but K, V
      for (int k = 0; k < int(specs.size()); ++k)
        if (k != kK && k != kV) unit[k].reset();
    } else if (st.sched.place.input_rebuilt(l)) {
      unit[kSavedX].reset();  // Note [Rebuilt layer inputs]
    }
    scratch = {};
    ws.clear();
    st.weights.end(index, l - b);
    st.messages.poll();
  }
  if (e < L) {
    st.messages.produce({sched::Payload::Hidden, e, i}, std::move(out), member_rows(st.sched, op, opts_.rank));
  } else {
    if (own) await_weights(L);
    // Note [The loss in backward] (core/layout.h): else the backward runs the head.
    if (!in_set(st.sched.place.recompute, kSavedHeadGrad) || st.sched.forward_only)
      head(st, op, rank_shard_.ulysses.on() ? mine : q, wt, out);
  }
}

UlyssesContext Runtime::ulysses_context(const StepState& st, const sched::Op& op, const UlyssesBuffers& buf,
                                        void* k, void* v, float* dk, float* dv) const {
  const sched::Schedule& sc = st.sched;
  const UlyssesShard u = rank_shard_.ulysses;
  UlyssesContext x;
  x.comm = opts_.comm;
  x.members = sc.par.ulysses_group(opts_.rank);
  x.me = u.index;
  const int m = u.heads().kv_replicas(config_), first = u.index / m * m;  // Note [Replicated key/value heads]
  x.replicas.assign(x.members.begin() + first, x.members.begin() + first + m);
  x.model = config_;
  x.piece = with_docs(rows_of(sc, op), st.control.docs);
  for (int j = 0; j < u.size; ++j) x.rows.push_back(with_docs(member_rows(sc, op, j, u.size), st.control.docs));
  x.buf = buf;
  x.k_cache = k;
  x.v_cache = v;
  x.dk_cache = dk;
  x.dv_cache = dv;
  x.waited_s = &st.result.comm_wait_s;
  return x;
}

void Runtime::head(StepState& st, const sched::Op& op, const Subseq& q, const StageWeights& wt, const Buffer& out) {
  const int i = op.subseq, T = q.T, H = config_.hidden;
  // q: the rows the head runs on (a Ulysses member's; a tensor-parallel member's piece).
  auto hw_bufs = alloc_specs(*device_, head_workspace_specs(config_, T, opts_.head_chunk, precision_, opts_.tp),
                             "head workspace ");
  KernelScratchBuffer scratch(*device_, opts_.head_scratch.bytes(T));
  const HeadWorkspace hw = head_workspace_from(ptrs(hw_bufs), opts_.head_chunk, scratch.get(), opts_.tp.on());
  Buffer& head_grad = st.act.head_grad(i);
  // A forward-only step computes the loss alone, and with labels which of their rows it gets
  // right (on the host: only where there are labels to score).
  const bool fwd = st.sched.forward_only;
  std::uint8_t* hits = fwd && st.sched.labeled ? st.result.hits.data() : nullptr;
  if (!fwd) head_grad = device_->alloc(out.bytes(), "subseq " + std::to_string(i) + " head_grad");  // [T, H] as out
  if (st.tp) {
    head_forward_backward_tp(be_, fwd ? nullptr : head_grad.data(), static_cast<double*>(st.loss_sum.data()),
                             out.data(), st.targets, *wt.w, *wt.m, *wt.g, hw, *st.tp, config_, q, st.loss_tokens,
                             hits);
    be_.synchronize();
    st.tp->all_reduce(hw.losses, T, "the per-position losses");  // each member has its vocabulary's part
    for (const PosSpan& part : q.parts())
      be_.to_host(st.result.losses.data() + part.pos0, hw.losses + part.row0, sizeof(float) * std::size_t(part.rows));
    return;
  }
  for (const PosSpan& part : q.parts()) {
    const i64 at = i64(part.row0) * H;
    head_forward_backward(be_, fwd ? nullptr : act_at(head_grad.data(), at, act_),
                          static_cast<double*>(st.loss_sum.data()), act_at(out.data(), at, act_),
                          st.targets + part.pos0, *wt.w, *wt.m, *wt.g, hw, config_, part.rows, st.loss_tokens,
                          hits ? hits + part.pos0 : nullptr);
    be_.to_host(st.result.losses.data() + part.pos0, hw.losses, sizeof(float) * std::size_t(part.rows));
  }
}

// Note [Rebuilt layer inputs] (schedule/builders.cpp): layer l-1's forward again on the
// op's subsequence, from its kept input (copied into a buffer of its own, from the device
// or the host), with a copy of its saved tensors and the attention of its K/V; x of layer
// l is its output, and everything else goes.
void Runtime::rebuild_input(StepState& st, const sched::Op& op, int l, const Subseq& q, const Subseq& blocks,
                            const StageWeights& wt) {
  const int i = op.subseq, below = l - 1, T = q.T, H = config_.hidden;
  const auto specs = block_saved_specs(config_, T, precision_, rank_shard_);
  const MlpTiles tiles = st.sched.place.mlp_tiles();
  Buffer& x = st.act.unit(i, l)[kSavedX];
  SPPO_ASSERT_MSG(!x, "layer " << l << "'s input of subsequence " << i << " was kept");
  x = device_->alloc(specs[kSavedX].bytes(), unit_name(l, i) + "x");
  std::vector<Buffer> again(specs.size());
  for (int k = 0; k < int(specs.size()); ++k)
    if (!tiled_away(tiles, k)) again[k] = device_->alloc(specs[k].bytes(), unit_name(below, i) + specs[k].name + " again");
  const auto [device, host] = st.act.saved_input(i, below, &st.result.exposed_copy_s);
  if (device)
    be_.copy_cols(again[kSavedX].data(), device, blocks.T, H, H, 0);
  else
    be_.to_device(again[kSavedX].data(), host, std::size_t(specs[kSavedX].bytes()));
  auto ws = alloc_specs(*device_, block_workspace_specs(config_, T, precision_, rank_shard_, tiles), "workspace ");
  KernelScratchBuffer scratch(*device_, opts_.block_scratch.bytes(T));
  const LayerWorkspace w = layer_workspace(ws, scratch.get(), tiles, rank_shard_.ulysses.on());
  const LayerAttention attn = st.kv.attention(op, below, false, layer_weights(st, wt, below));
  BlockSaved saved = block_saved_from(ptrs(again));
  if (rank_shard_.ulysses.on()) {
    UlyssesAttention heads(ulysses_context(st, op, w.ulysses, again[kK].data(), again[kV].data()), *attn);
    saved.k = w.ulysses.k;
    saved.v = w.ulysses.v;
    block_forward(be_, x.data(), saved, wt.w->blocks[below], wt.m->blocks[below], w.block, heads, config_, blocks);
    return;
  }
  block_forward(be_, x.data(), saved, wt.w->blocks[below], wt.m->blocks[below], w.block, *attn, config_, blocks);
}

void Runtime::backward(StepState& st, const sched::Op& op, std::size_t index) {
  const int i = op.subseq, b = op.layer_begin, e = op.layer_end;
  const Subseq q = rows_of(st.sched, op);
  const Subseq mine = rank_shard_.ulysses.on() ? member_rows(st.sched, op, opts_.rank) : q;  // as in forward
  const Subseq blocks = with_docs(mine, st.control.docs);
  const StageWeights wt = st.msp.weights_for(op);
  const bool own = lb_ <= b && e <= le_;
  const int T = q.T, L = config_.layers;
  const int H = config_.hidden;
  const auto specs = block_saved_specs(config_, T, precision_, rank_shard_);
  const MlpTiles tiles = st.sched.place.mlp_tiles();
  // The residual gradient: the head's on the last stage (Note [The loss in backward]: made
  // below, with the last layer's output), the layer above's in a layer-major backward
  // (kept where head_grad was: Note [Layer-major backward] in schedule/builders.cpp), else
  // the next stage's.
  const bool loss_here = e == L && in_set(st.sched.place.recompute, kSavedHeadGrad);
  const bool carried = own && e < le_;
  // Note [Residual gradients on the host] (schedule/builders.cpp): back first.
  const sched::ResidualMove moves = sched::residual_move(st.sched, opts_.rank, op);
  if (moves.in) st.act.residual_back(i, &st.result.exposed_copy_s);
  Buffer d_buf = e == L || carried
                     ? std::move(st.act.head_grad(i))
                     : st.messages.take_input(sched::input_id(op), member_rows(st.sched, op, opts_.rank));
  SPPO_ASSERT_MSG(d_buf || loss_here,
                  "backward of subsequence " << i << " before its forward or its gradient arrived");
  void* d = d_buf.data();

  for (int l = e - 1; l >= b; --l) {
    st.weights.begin(index, e - 1 - l);  // with the weights on the host: this layer's weights and gradient
    if (st.sched.place.input_rebuilt(l)) rebuild_input(st, op, l, q, blocks, wt);
    // dK/dV accumulators of every subsequence this backward reaches, zeroed on first use
    // (on a host layer, this subsequence's own, which restore brings: the host holds the
    // others').
    st.kv.alloc_accumulators(l, i);
    auto& unit = st.act.unit(i, l);
    auto ws = alloc_specs(*device_, block_workspace_specs(config_, T, precision_, rank_shard_, tiles), "workspace ");
    KernelScratchBuffer scratch(*device_, opts_.block_scratch.bytes(T));
    const LayerWorkspace lw = layer_workspace(ws, scratch.get(), tiles, rank_shard_.ulysses.on());
    const BlockWorkspace& w = lw.block;
    st.kv.restore(l, i);
    // Note [Recomputed tensors]: the tensors the schedule recomputes, and on a layer that
    // recomputes K/V this subsequence's own K, V, made again before the backward. A
    // recomputed attention runs its forward again, on a layer whose K/V stream through a
    // forward window of its own, released before the backward's opens (the earlier
    // blocks stream twice).
    const bool kv = st.sched.place.kv_recomputed(l);
    if (st.sched.place.recompute || kv) {
      for (int k = 0; k < int(specs.size()); ++k)
        if ((in_set(st.sched.place.recompute, k) && !tiled_away(tiles, k)) || (kv && (k == kK || k == kV)))
          unit[k] = device_->alloc(specs[k].bytes(), unit_name(l, i) + specs[k].name);
      BlockSaved s = block_saved_from(ptrs(unit));
      const bool attention = (st.sched.place.recompute & kAttentionGroup) != 0;
      const LayerAttention again =
          attention ? st.kv.attention(op, l, false, layer_weights(st, wt, l)) : LayerAttention{};
      BlockAttention* a = attention ? &*again : nullptr;
      if (st.tp)
        block_recompute_tp(be_, s, st.sched.place.recompute, kv, wt.w->blocks[l], wt.m->blocks[l], w, a, *st.tp, config_,
                           blocks);
      else
        block_recompute(be_, s, st.sched.place.recompute, kv, wt.w->blocks[l], wt.m->blocks[l], w, a, config_, blocks);
    }
    if (loss_here && l == L - 1) {  // the last layer's output again, and the head on it
      Buffer out = device_->alloc(specs[0].bytes(), "final hidden");
      if (st.tp)
        block_output_tp(be_, out.data(), block_saved_from(ptrs(unit)), wt.m->blocks[l], w, *st.tp, config_, T);
      else
        block_output(be_, out.data(), block_saved_from(ptrs(unit)), wt.m->blocks[l], w, config_, mine.T);
      head(st, op, mine, wt, out);
      d_buf = std::move(st.act.head_grad(i));
      d = d_buf.data();
    }
    const LayerAttention attn = st.kv.attention(op, l, true, layer_weights(st, wt, l));
    if (opts_.recompute) {
      for (int k = 1; k < int(specs.size()); ++k)
        unit[k] = device_->alloc(specs[k].bytes(), unit_name(l, i) + specs[k].name);
      Buffer out = device_->alloc(specs[0].bytes(), "recomputed block output");
      BlockSaved s = block_saved_from(ptrs(unit));
      block_forward(be_, out.data(), s, weights_.blocks[l], matrices_.blocks[l], w, *attn, config_, blocks);
    }
    for (int k = 0; k < int(specs.size()); ++k)
      SPPO_ASSERT_MSG(unit[k] || tiled_away(tiles, k), "saved tensor " << specs[k].name << " of layer " << l
                                               << " subseq " << i << " is not on the device");
    const BlockSaved s = block_saved_from(ptrs(unit));
    if (st.tp) {
      block_backward_tp(be_, d, wt.g->blocks[l], st.kv.dk(l, i).f32(), st.kv.dv(l, i).f32(), s, wt.w->blocks[l],
                        wt.m->blocks[l], w, *attn, *st.tp, config_, blocks);
      if (l == 0)  // while the layer's workspace is there to gather into
        embedding_backward_tp(be_, wt.g->embed, d, static_cast<const std::int32_t*>(st.ids.data()), w.tp_full,
                              w.tp_pad, *st.tp, config_, q);
    } else if (rank_shard_.ulysses.on()) {
      // The piece's dK, dV of its heads accumulate in the K/V store's sums; its rows' complete
      // ones come back into the workspace for the projection's backward.
      UlyssesAttention heads(ulysses_context(st, op, lw.ulysses, unit[kK].data(), unit[kV].data(),
                                             st.kv.dk(l, i).f32(), st.kv.dv(l, i).f32()),
                             *attn);
      block_backward(be_, d, wt.g->blocks[l], lw.ulysses.dk, lw.ulysses.dv, s, wt.w->blocks[l], wt.m->blocks[l], w,
                     heads, config_, blocks);
    } else {
      block_backward(be_, d, wt.g->blocks[l], st.kv.dk(l, i).f32(), st.kv.dv(l, i).f32(), s, wt.w->blocks[l],
                     wt.m->blocks[l], w, *attn, config_, blocks, kv ? st.kv.du(l, i).f32() : nullptr);
    }
    for (auto& buf : unit) buf.reset();
    st.kv.release(l, i);
    scratch = {};
    ws.clear();
    if (own) st.grads.layer_done(index, l);
    st.weights.end(index, e - 1 - l);
    st.messages.poll();
  }
  if (own && b > lb_) {  // the layers below run later (a layer-major backward)
    st.act.head_grad(i) = std::move(d_buf);
    if (moves.out) st.act.residual_to_host(i, &st.result.exposed_copy_s);
    return;
  }
  if (b > 0) {
    st.messages.produce({sched::Payload::HiddenGrad, b, i}, std::move(d_buf), member_rows(st.sched, op, opts_.rank));
    return;
  }
  if (st.tp) return;  // the embedding's gradient came with layer 0
  const std::int32_t* ids = static_cast<const std::int32_t*>(st.ids.data());
  for (const PosSpan& part : mine.parts())
    be_.embedding_backward(wt.g->embed, act_at(d, i64(part.row0) * H, act_), ids + part.pos0, part.rows, H,
                           config_.vocab);
}

StepResult Runtime::step(const sched::Schedule& sc, const std::int32_t* tokens, const StepControl& control) {
  const StepContext ctx{config_,
                        opts_,
                        be_,
                        *device_,
                        *host_,
                        precision_,
                        {lb_, le_},
                        specs_,
                        buckets_,
                        shard_,
                        {params_, grads_, num_params_, {&weights_, &dweights_, &matrices_}},
                        opts_.weights_host || opts_.grads_sharded() ? &host_layers_ : nullptr,
                        sends_};
  check_schedule(sc, ctx);
  StepResult result;
  StepState st(ctx, sc, control, result);
  if (host_opt_) {
    // An MSP owner lends its weights whole; every other step takes them bucket by bucket
    // as its forward reaches them (Note [Optimizer state on the host]).
    const bool lends = std::any_of(st.ops.begin(), st.ops.end(), [](const sched::Op& op) {
      return op.kind == sched::OpKind::Send && op.payload == sched::Payload::Weights;
    });
    if (lends) finish_update();
    host_opt_->gradients_taken();
  }
  // With the weights on the host each layer's gradient starts at its first backward
  // (HostWeights); the device's are the embedding's, final norm's and head's.
  SPPO_CHECK(!opts_.grads_sharded() || control.reduce || sc.forward_only, "runtime")
      << "ZeRO-2 reduces every step's gradients into the shards; a step that does not reduce would keep them whole";
  // Under ZeRO-2 and 3 each step's reduced pieces are added to the shard's sum
  // (StepControl::accumulate), so the device's whole gradients start from zero every step.
  shard_adds_ = control.accumulate;
  Buffer& zeroed = opts_.weights_host || opts_.grads_sharded() ? resident_grads_ : grads_;
  if ((!control.accumulate || opts_.grads_sharded()) && !sc.forward_only)
    be_.fill_zero(zeroed.data(), std::size_t(zeroed.bytes()));
  st.load_inputs(tokens);
  st.start();
  for (std::size_t k = 0; k < st.ops.size(); ++k) {
    const sched::Op& op = st.ops[k];
    if (opts_.comm) comm::set_activity("op " + std::to_string(k) + " '" + sched::to_string(op) + "'");
    st.messages.post_receives(k);
    const double t0 = now_s();
    const int i = op.subseq;
    double waited = 0;  // on a copy or a message, in a wait the trace shows
    switch (op.kind) {
      case sched::OpKind::Forward:
        forward(st, op, k);
        result.compute_s += now_s() - t0;
        add_span(result, "F" + std::to_string(i), op.kind, Lane::Compute, t0, now_s());
        break;
      case sched::OpKind::Backward:
        backward(st, op, k);
        result.compute_s += now_s() - t0;
        add_span(result, "B" + std::to_string(i), op.kind, Lane::Compute, t0, now_s());
        break;
      case sched::OpKind::Offload:
        result.offloaded_bytes += st.act.offload(i, op.fraction);
        break;
      case sched::OpKind::Prefetch:
        if (op.layer_end > op.layer_begin)  // one layer's part (a layer-major backward)
          st.act.prefetch(i, op.layer_begin, op.layer_end);
        else
          st.act.prefetch(i);
        break;
      case sched::OpKind::WaitOffload:
        result.exposed_copy_s += st.act.wait_offload(i);
        break;
      case sched::OpKind::WaitPrefetch:
        waited = op.layer_end > op.layer_begin ? st.act.wait_prefetch(i, op.layer_begin, op.layer_end)
                                               : st.act.wait_prefetch(i);
        result.exposed_copy_s += waited;
        if (waited > kShownWaitS) add_span(result, "wait P" + std::to_string(i), op.kind, Lane::Compute, t0, now_s());
        break;
      case sched::OpKind::Send:
        if (sched::is_hidden_message(op))
          st.messages.send(op);
        else
          st.msp.send(op);
        break;
      case sched::OpKind::Recv:
        waited = sched::is_hidden_message(op) ? st.messages.wait_receive(k) : st.msp.receive(op, k);
        result.comm_wait_s += waited;
        if (waited > kShownWaitS) add_span(result, "wait " + sched::to_string(op), op.kind, Lane::Compute, t0, now_s());
        break;
      case sched::OpKind::AllReduce:
      case sched::OpKind::ReduceScatter:
        if (control.reduce) st.grads.reduce(op, k);
        break;
      case sched::OpKind::RingStep:
        break;  // ring attention runs inside each layer of F and B (runtime/ring.h)
      case sched::OpKind::AllToAll:
        break;  // Ulysses' exchanges run inside each layer of F and B (runtime/ulysses.h)
      case sched::OpKind::AllGather:
        break;  // ZeRO-3's gathers start inside the layers of the F or B that follows (HostWeights)
    }
    st.msp.end_lease(k);
    st.messages.poll();
  }
  st.finish();
  if (opts_.weights_host) resident_grads_to_host();
  if (opts_.grads_sharded() && !sc.forward_only)  // the embedding's, final norm's and head's pieces join the layers'
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      if (resident_at_[b] >= 0) to_shard(b, resident_grads_.f32() + resident_at_[b]);
  return result;
}

}  // namespace sppo
