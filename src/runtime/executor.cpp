#include "runtime/executor.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>

#include "core/check.h"
#include "runtime/fault.h"
#include "runtime/ring.h"
#include "runtime/tensor_parallel.h"
#include "model/tensor_parallel.h"

namespace sppo {

namespace {

// Seconds on the steady clock, which every process on a machine shares, so that the
// spans of several ranks line up in one trace.
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr int kSavedTensors = 14;      // block_saved_specs() entries
constexpr double kShownWaitS = 1e-4;   // waits shorter than this stay out of the trace

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

std::string unit_name(int l, int i) {
  return "blocks." + std::to_string(l) + " subseq " + std::to_string(i) + " ";
}

bool is_compute(const sched::Op& op) {
  return op.kind == sched::OpKind::Forward || op.kind == sched::OpKind::Backward;
}

bool is_hidden_message(const sched::Op& op) {
  return (op.kind == sched::OpKind::Send || op.kind == sched::OpKind::Recv) &&
         (op.payload == sched::Payload::Hidden || op.payload == sched::Payload::HiddenGrad);
}

constexpr std::size_t kNever = std::size_t(-1);

// The rows of subsequence i that `piece` of `pieces` holds, at their global positions.
Subseq rows_of(const sched::Schedule& sc, int i, int piece, int pieces) {
  const i64 o = sc.offset(i);
  if (pieces == 1) return Subseq{o, int(sc.lengths[i])};
  Subseq q;
  for (const auto& [b, e] : sched::piece_spans(sc.lengths[i], piece, pieces, sc.ring_layout)) {
    q.spans.push_back({o + b, int(e - b), q.T});
    q.T += int(e - b);
  }
  q.offset = q.spans.front().pos0;
  return q;
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

}  // namespace

struct Runtime::StepState {
  const sched::Schedule* sched = nullptr;
  const std::vector<sched::Op>* ops = nullptr;
  const std::int32_t* tokens = nullptr;
  StepControl control;
  i64 S = 0;
  i64 predicted = 0;                   // positions whose token is predicted (the loss's mean)
  const std::int32_t* targets = nullptr;  // on the device: [S] target of every position
  int N = 0;
  double t_start = 0;
  std::vector<std::vector<std::vector<Buffer>>> dev;   // [N][L][kSavedTensors] device copies
  std::vector<std::vector<std::vector<Buffer>>> host;  // same shape: offloaded parts
  std::vector<Buffer> head_grad, head_grad_host;       // [N]
  std::vector<std::vector<Buffer>> dk, dv;             // [L][N] dK/dV accumulators
  std::vector<std::shared_ptr<Event>> offload_first, offload_last;    // [N]
  std::vector<std::shared_ptr<Event>> prefetch_first, prefetch_last;  // [N]
  std::vector<Role> roles;                             // of the saved tensors
  Buffer ids;                                          // [S + 1] token ids on the device
  Buffer loss_sum;                                     // one double on the device
  StepResult* result = nullptr;
  std::unique_ptr<CopyStream> d2h, h2d;
  // The rows this rank holds of each subsequence: the whole of it, or its ring piece.
  std::vector<Subseq> rows;                            // [N]
  std::unique_ptr<TpGroup> tp;                         // the tensor-parallel group (tp > 1)
  int ring_piece = 0;                                  // this rank's piece of every subsequence (ring > 1)

  // Hidden states from the previous stage (gradients from the next), received before
  // their F (B), and the ones this stage produced, waiting for their Send.
  struct Incoming {
    Buffer buf;
    comm::Request req = comm::kDone;
  };
  std::vector<Incoming> in_hidden, in_grad;            // [N]
  std::vector<Buffer> out_hidden, out_grad;            // [N]
  struct Outgoing {
    Buffer buf;
    comm::Request req;
    double start;
    std::string name;
  };
  std::vector<Outgoing> sends;
  std::vector<std::vector<std::size_t>> posts;         // op index -> receives posted as it starts

  // Gradient buckets: the all-reduce (reduce-scatter) op of this rank, when it reduces,
  // and after which op each bucket's gradient is final.
  const sched::Op* reduce_op = nullptr;
  std::vector<std::size_t> bucket_ready;
  std::vector<comm::Request> bucket_req;
  std::vector<bool> bucket_started;
  double reduce_start = -1;
};

Runtime::Runtime(const ModelConfig& c, const RuntimeOptions& o)
    : config_(c),
      opts_(o),
      own_backend_(o.backend ? nullptr : make_backend("cpu")),
      be_(o.backend ? *o.backend : *own_backend_),
      act_(be_.act()),
      precision_(act_ == DType::F32 ? ActPrecision::F32 : ActPrecision::BF16),
      device_(std::make_unique<MemoryTier>(Tier::Device, o.device_budget, &be_)),
      host_(std::make_unique<MemoryTier>(Tier::Host, 0, &be_)) {
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
  specs_ = parameter_specs(c, lb_, le_, o.tp);
  for (const auto& s : specs_) num_params_ += s.numel();
  // Buckets: the embedding, each layer, the final LayerNorm, in parameter order.
  {
    i64 off = 0;
    std::size_t k = 0;
    auto take = [&](std::string name, auto&& belongs) {
      ParamBucket b{std::move(name), off, 0};
      while (k < specs_.size() && belongs(specs_[k].name)) b.count += specs_[k++].numel();
      off += b.count;
      if (b.count > 0) buckets_.push_back(b);
    };
    take("embed", [](const std::string& n) { return n == "embed.weight"; });
    for (int l = lb_; l < le_; ++l) {
      const std::string prefix = "blocks." + std::to_string(l) + ".";
      take("blocks." + std::to_string(l), [&](const std::string& n) { return n.rfind(prefix, 0) == 0; });
    }
    take("ln_f", [](const std::string& n) { return n.rfind("ln_f.", 0) == 0; });
    SPPO_ASSERT(off == num_params_ && k == specs_.size());
  }
  for (const auto& b : buckets_) {
    const auto [pb, pe] = piece_range(b.count, o.zero_index, o.zero_shards);
    shard_.push_back({b.offset + pb, pe - pb, num_state_});
    num_state_ += pe - pb;
  }
  const i64 bytes = num_params_ * i64(sizeof(float));
  const i64 state_bytes = num_state_ * i64(sizeof(float));
  params_ = device_->alloc_zeroed(bytes, "parameters");
  grads_ = device_->alloc_zeroed(bytes, "gradients");
  adam_m_ = device_->alloc_zeroed(state_bytes, "AdamW first moments");
  adam_v_ = device_->alloc_zeroed(state_bytes, "AdamW second moments");
  // The GEMMs read the weights in the activation type: the masters themselves in fp32,
  // else a working copy refreshed after every update.
  if (act_ != DType::F32) params_act_ = device_->alloc(num_params_ * dtype_bytes(act_), "weights' working copy");
  weights_ = param_view(c, params_.f32(), lb_, le_, o.tp);
  dweights_ = param_view(c, grads_.f32(), lb_, le_, o.tp);
  matrices_ = matrix_view(c, params_act_ ? params_act_.data() : params_.data(), act_, lb_, le_, o.tp);
}

void Runtime::refresh_weights() {
  if (params_act_) be_.to_act(params_act_.data(), params_.f32(), num_params_);
}

void Runtime::read_device(float* host, const float* device, i64 n) {
  be_.to_host(host, device, std::size_t(n) * sizeof(float));
}

void Runtime::write_device(float* device, const float* host, i64 n) {
  be_.to_device(device, host, std::size_t(n) * sizeof(float));
}

Runtime::~Runtime() = default;

void Runtime::poll(StepState& st) {
  if (!opts_.comm) return;
  opts_.comm->progress();
  for (auto it = st.sends.begin(); it != st.sends.end();) {
    if (opts_.comm->test(it->req)) {
      const double end = now_s();
      st.result->trace.push_back({it->name, sched::OpKind::Send, Lane::Network, it->start - st.t_start, end - it->start});
      it = st.sends.erase(it);  // the buffer is released here, as the send has completed
    } else {
      ++it;
    }
  }
}

void Runtime::post_receive(StepState& st, const sched::Op& op) {
  const int i = op.subseq;
  auto& in = (op.payload == sched::Payload::Hidden ? st.in_hidden : st.in_grad)[i];
  SPPO_ASSERT_MSG(!in.buf, "a second receive of " << sched::to_string(op) << " before the first was used");
  const i64 bytes = (op.tokens > 0 ? op.tokens : st.sched->lengths[i]) * config_.hidden * dtype_bytes(act_);
  in.buf = device_->alloc(bytes, "received " + std::string(sched::to_string(op.payload)) + " of subseq " +
                                     std::to_string(i));
  in.req = opts_.comm->irecv(in.buf.data(), bytes, op.peer, sched::message_tag(op));
}

void Runtime::send(StepState& st, const sched::Op& op) {
  Buffer& out = (op.payload == sched::Payload::Hidden ? st.out_hidden : st.out_grad)[op.subseq];
  SPPO_ASSERT_MSG(out, "send of " << sched::to_string(op) << " before its data was computed");
  const FaultPlan& fault = fault_plan();
  if (fault.kind == FaultPlan::Kind::Drop && fault.rank == opts_.rank && ++sends_ == fault.count) {
    out.reset();  // the message that never arrives
    return;
  }
  SPPO_ASSERT(op.tokens == 0 || out.bytes() == op.tokens * config_.hidden * dtype_bytes(act_));
  const comm::Request req = opts_.comm->isend(out.data(), out.bytes(), op.peer, sched::message_tag(op));
  st.sends.push_back({std::move(out), req, now_s(), sched::to_string(op)});
}

void Runtime::start_bucket(StepState& st, std::size_t b) {
  if (st.bucket_started[b]) return;
  st.bucket_started[b] = true;
  if (st.reduce_start < 0) st.reduce_start = now_s();
  const ParamBucket& k = buckets_[b];
  const comm::Group& g = st.reduce_op->group;
  float* data = grads_.f32() + k.offset;
  st.bucket_req[b] = opts_.zero_shards > 1 ? opts_.comm->ireduce_scatter(data, k.count, g)
                                           : opts_.comm->iallreduce(data, k.count, g);
}

void Runtime::reduce(StepState& st, const sched::Op& op, std::size_t index) {
  const double t0 = now_s();
  const std::string what = "op " + std::to_string(index) + " '" + sched::to_string(op) + "'";
  double waited = 0;
  if (op.payload == sched::Payload::TiedGrads) {
    // The embedding is the first bucket of both stages; under ZeRO both hold the same
    // piece of it (their positions in their data-parallel groups are equal).
    SPPO_ASSERT(!buckets_.empty() && buckets_[0].name == "embed");
    const ShardSpan& piece = shard_[0];
    waited = comm::wait(*opts_.comm, opts_.comm->iallreduce(grads_.f32() + piece.offset, piece.count, op.group), what);
    st.result->trace.push_back({sched::to_string(op), op.kind, Lane::Network, t0 - st.t_start, now_s() - t0});
  } else {
    for (std::size_t b = 0; b < buckets_.size(); ++b) start_bucket(st, b);
    for (std::size_t b = 0; b < buckets_.size(); ++b) waited += comm::wait(*opts_.comm, st.bucket_req[b], what);
    st.result->trace.push_back(
        {sched::to_string(op), op.kind, Lane::Network, st.reduce_start - st.t_start, now_s() - st.reduce_start});
  }
  st.result->comm_wait_s += waited;
  if (waited > kShownWaitS)
    st.result->trace.push_back({"wait " + sched::to_string(op), op.kind, Lane::Compute, t0 - st.t_start, now_s() - t0});
}

KVBlocks Runtime::past_blocks(StepState& st, int l, int i, bool grads) {
  KVBlocks past;
  const i64 H = opts_.tp.local_hidden(config_);  // the K/V cache's width
  for (int j = 0; j < i; ++j)
    for (const PosSpan& part : st.rows[j].parts()) {
      const i64 at = i64(part.row0) * H;
      past.k.push_back(act_at(st.dev[j][l][5].data(), at, act_));
      past.v.push_back(act_at(st.dev[j][l][6].data(), at, act_));
      if (grads) {
        past.dk.push_back(st.dk[l][j].f32() + at);
        past.dv.push_back(st.dv[l][j].f32() + at);
      }
      past.offsets.push_back(part.pos0);
      past.lengths.push_back(part.rows);
    }
  return past;
}

std::unique_ptr<BlockAttention> Runtime::attention(StepState& st, const sched::Op& op, int l, const KVBlocks& past) {
  if (op.pieces == 1) return std::make_unique<LocalAttention>(past);
  // A ring piece: the ring's members are ranks tp apart in piece order, each with this
  // rank's tensor-parallel index (sched::PipelineSpec::rank_of, expand_tensor_parallel).
  const auto& sc = *st.sched;
  const int R = op.pieces, i = op.subseq, tp = opts_.tp.size;
  RingContext ctx;
  ctx.comm = opts_.comm;
  for (int h = 0; h < R; ++h) {
    ctx.members.push_back(opts_.rank + (h - op.piece) * tp);
    ctx.spans.push_back(rows_of(sc, i, h, R).parts());
    i64 first = rows_of(sc, i, h, R).parts().front().pos0;
    for (int j = 0; j < i; ++j) first = std::min(first, rows_of(sc, j, h, R).parts().front().pos0);
    ctx.first_key.push_back(first);
  }
  ctx.me = op.piece;
  ctx.subseq = i;
  ctx.layer = l;
  ctx.causal = config_.causal;
  ctx.device = device_.get();
  ctx.waited_s = &st.result->ring_wait_s;
  if (opts_.ring_rsa) return std::make_unique<RsaAttention>(ctx);
  return std::make_unique<RingAttention>(ctx, past);
}

void Runtime::forward(StepState& st, const sched::Op& op) {
  const int i = op.subseq, b = op.layer_begin, e = op.layer_end;
  const Subseq& q = st.rows[i];
  const int T = q.T, H = config_.hidden, L = config_.layers;
  const std::int32_t* ids = static_cast<const std::int32_t*>(st.ids.data());  // the whole step's
  const auto specs = block_saved_specs(config_, T, precision_, opts_.tp);
  if (b > 0) {  // the previous stage's output is this stage's first saved input
    auto& in = st.in_hidden[i];
    SPPO_ASSERT_MSG(in.buf, "forward of layers from " << b << " on subseq " << i << " without its input");
    st.dev[i][b][0] = std::move(in.buf);
    in = {};
  }
  Buffer out;  // the stage's output
  for (int l = b; l < e; ++l) {
    auto& unit = st.dev[i][l];
    for (int k = 0; k < kSavedTensors; ++k)
      if (!unit[k]) unit[k] = device_->alloc(specs[k].bytes(), unit_name(l, i) + specs[k].name);
    auto ws = alloc_specs(*device_, block_workspace_specs(config_, T, precision_, opts_.tp), "workspace ");
    const BlockWorkspace w_ptrs = block_workspace_from(ptrs(ws));
    if (l == 0 && st.tp)
      embedding_forward_tp(be_, unit[0].data(), ids, weights_.embed, w_ptrs.tp_full, w_ptrs.tp_pad, *st.tp, config_, q);
    else if (l == 0)
      for (const PosSpan& part : q.parts())
        be_.embedding_forward(act_at(unit[0].data(), i64(part.row0) * H, act_), ids + part.pos0, weights_.embed,
                              part.rows, H, config_.vocab);
    KernelScratchBuffer scratch(*device_, opts_.block_scratch.bytes(T));
    // The block's output is the next block's saved input, or the stage's output.
    void* x_out;
    if (l + 1 < e) {
      st.dev[i][l + 1][0] = device_->alloc(specs[0].bytes(), unit_name(l + 1, i) + "x");
      x_out = st.dev[i][l + 1][0].data();
    } else {
      out = device_->alloc(specs[0].bytes(), e == L ? "final hidden" : "hidden for the next stage");
      x_out = out.data();
    }
    const KVBlocks past = past_blocks(st, l, i, false);
    const auto attn = attention(st, op, l, past);
    BlockSaved saved = block_saved_from(ptrs(unit));
    const BlockWorkspace w = block_workspace_from(ptrs(ws), scratch.get());
    if (st.tp)
      block_forward_tp(be_, x_out, saved, weights_.blocks[l], matrices_.blocks[l], w, *attn, *st.tp, config_, q);
    else
      block_forward(be_, x_out, saved, weights_.blocks[l], matrices_.blocks[l], w, *attn, config_, q);
    if (opts_.recompute)  // keep the block input only; backward recomputes the rest
      for (int k = 1; k < kSavedTensors; ++k) unit[k].reset();
    scratch = {};
    ws.clear();
    poll(st);
  }
  if (e < L) {
    st.out_hidden[i] = std::move(out);
    return;
  }
  auto hw_bufs = alloc_specs(*device_, head_workspace_specs(config_, T, opts_.head_chunk, precision_, opts_.tp),
                             "head workspace ");
  KernelScratchBuffer scratch(*device_, opts_.head_scratch.bytes(T));
  const HeadWorkspace hw = head_workspace_from(ptrs(hw_bufs), opts_.head_chunk, scratch.get(), opts_.tp.on());
  st.head_grad[i] = device_->alloc(specs[0].bytes(), "subseq " + std::to_string(i) + " head_grad");
  if (st.tp) {
    head_forward_backward_tp(be_, st.head_grad[i].data(), static_cast<double*>(st.loss_sum.data()), out.data(),
                             st.targets, weights_, matrices_, dweights_, hw, *st.tp, config_, q, st.predicted);
    be_.synchronize();
    st.tp->all_reduce(hw.losses, T, "the per-position losses");  // each member has its vocabulary's part
    for (const PosSpan& part : q.parts())
      be_.to_host(st.result->losses.data() + part.pos0, hw.losses + part.row0, sizeof(float) * std::size_t(part.rows));
    return;
  }
  for (const PosSpan& part : q.parts()) {
    const i64 at = i64(part.row0) * H;
    head_forward_backward(be_, act_at(st.head_grad[i].data(), at, act_), static_cast<double*>(st.loss_sum.data()),
                          act_at(out.data(), at, act_), st.targets + part.pos0, weights_, matrices_, dweights_, hw,
                          config_, part.rows, st.predicted);
    be_.to_host(st.result->losses.data() + part.pos0, hw.losses, sizeof(float) * std::size_t(part.rows));
  }
}

void Runtime::backward(StepState& st, const sched::Op& op, std::size_t index) {
  const int i = op.subseq, b = op.layer_begin, e = op.layer_end;
  const Subseq& q = st.rows[i];
  const int T = q.T, L = config_.layers;
  const int H = config_.hidden, kv_width = opts_.tp.local_hidden(config_);
  const auto specs = block_saved_specs(config_, T, precision_, opts_.tp);
  // The residual gradient: the head's on the last stage, else the next stage's.
  Buffer d_buf = e == L ? std::move(st.head_grad[i]) : std::move(st.in_grad[i].buf);
  st.in_grad[i] = {};
  SPPO_ASSERT_MSG(d_buf, "backward of subsequence " << i << " before its forward or its gradient arrived");
  void* d = d_buf.data();
  const std::size_t first_layer_bucket = buckets_[0].name == "embed" ? 1 : 0;

  for (int l = e - 1; l >= b; --l) {
    // dK/dV accumulators of every subsequence this backward reaches, zeroed on first use.
    for (int j = 0; j <= i; ++j)
      if (!st.dk[l][j]) {
        const i64 bytes = i64(st.rows[j].T) * kv_width * i64(sizeof(float));
        st.dk[l][j] = device_->alloc_zeroed(bytes, unit_name(l, j) + "dK");
        st.dv[l][j] = device_->alloc_zeroed(bytes, unit_name(l, j) + "dV");
      }
    auto& unit = st.dev[i][l];
    auto ws = alloc_specs(*device_, block_workspace_specs(config_, T, precision_, opts_.tp), "workspace ");
    KernelScratchBuffer scratch(*device_, opts_.block_scratch.bytes(T));
    const BlockWorkspace w = block_workspace_from(ptrs(ws), scratch.get());
    const KVBlocks past = past_blocks(st, l, i, true);
    const auto attn = attention(st, op, l, past);
    if (opts_.recompute) {
      for (int k = 1; k < kSavedTensors; ++k)
        unit[k] = device_->alloc(specs[k].bytes(), unit_name(l, i) + specs[k].name);
      Buffer out = device_->alloc(specs[0].bytes(), "recomputed block output");
      BlockSaved s = block_saved_from(ptrs(unit));
      block_forward(be_, out.data(), s, weights_.blocks[l], matrices_.blocks[l], w, *attn, config_, q);
    }
    for (int k = 0; k < kSavedTensors; ++k)
      SPPO_ASSERT_MSG(unit[k], "saved tensor " << specs[k].name << " of layer " << l
                                               << " subseq " << i << " is not on the device");
    const BlockSaved s = block_saved_from(ptrs(unit));
    if (st.tp) {
      block_backward_tp(be_, d, dweights_.blocks[l], st.dk[l][i].f32(), st.dv[l][i].f32(), s, weights_.blocks[l],
                        matrices_.blocks[l], w, *attn, *st.tp, config_, q);
      if (l == 0)  // while the layer's workspace is there to gather into
        embedding_backward_tp(be_, dweights_.embed, d, static_cast<const std::int32_t*>(st.ids.data()), w.tp_full,
                              w.tp_pad, *st.tp, config_, q);
    } else {
      block_backward(be_, d, dweights_.blocks[l], st.dk[l][i].f32(), st.dv[l][i].f32(), s, weights_.blocks[l],
                     matrices_.blocks[l], w, *attn, config_, q);
    }
    for (auto& buf : unit) buf.reset();
    st.dk[l][i].reset();
    st.dv[l][i].reset();
    scratch = {};
    ws.clear();
    const std::size_t bucket = first_layer_bucket + std::size_t(l - lb_);
    if (st.reduce_op && st.bucket_ready[bucket] == index) start_bucket(st, bucket);
    poll(st);
  }
  if (b > 0) {
    st.out_grad[i] = std::move(d_buf);
    return;
  }
  if (st.tp) return;  // the embedding's gradient came with layer 0
  const std::int32_t* ids = static_cast<const std::int32_t*>(st.ids.data());
  for (const PosSpan& part : q.parts())
    be_.embedding_backward(dweights_.embed, act_at(d, i64(part.row0) * H, act_), ids + part.pos0, part.rows, H,
                           config_.vocab);
}

void Runtime::offload(StepState& st, int i, double fraction) {
  if (fraction <= 0) return;
  // The same walk as the simulator's: the rank's layers in order (the first is needed
  // last in backward), each layer's offloadable tensors in table order, head_grad last.
  std::vector<std::pair<Buffer*, Buffer*>> tensors;
  std::vector<i64> sizes;
  for (int l = lb_; l < le_; ++l)
    for (int k = 0; k < kSavedTensors; ++k)
      if (st.roles[k] == Role::Offloadable) {
        tensors.push_back({&st.dev[i][l][k], &st.host[i][l][k]});
        sizes.push_back(st.dev[i][l][k].bytes());
      }
  if (le_ == config_.layers) {
    tensors.push_back({&st.head_grad[i], &st.head_grad_host[i]});
    sizes.push_back(st.head_grad[i].bytes());
  }
  std::vector<bool> take;
  st.result->offloaded_bytes += select_offload(sizes, fraction, &take);
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    if (!take[t]) continue;
    Buffer& dev = *tensors[t].first;
    Buffer& host = *tensors[t].second;
    SPPO_ASSERT(dev);
    host = host_->alloc(dev.bytes(), "subseq " + std::to_string(i) + " host copy");
    device_->expect_release(dev.bytes());
    // The device bytes are really released when the copy completes.
    auto ev = st.d2h->copy(host.data(), dev.data(), std::size_t(dev.bytes()), [&dev, tier = device_.get()] {
      const i64 bytes = dev.bytes();
      dev.reset();
      tier->settle(bytes);
    });
    if (!st.offload_first[i]) st.offload_first[i] = ev;
    st.offload_last[i] = ev;
  }
}

void Runtime::prefetch(StepState& st, int i) {
  auto move_in = [&](Buffer& dev, Buffer& host, const std::string& what) {
    if (!host) return;
    dev = device_->alloc(host.bytes(), what);
    auto ev = st.h2d->copy(dev.data(), host.data(), std::size_t(host.bytes()), [&host] { host.reset(); });
    if (!st.prefetch_first[i]) st.prefetch_first[i] = ev;
    st.prefetch_last[i] = ev;
  };
  move_in(st.head_grad[i], st.head_grad_host[i], "head_grad");
  for (int l = le_ - 1; l >= lb_; --l)
    for (int k = 0; k < kSavedTensors; ++k) move_in(st.dev[i][l][k], st.host[i][l][k], unit_name(l, i));
}

StepResult Runtime::step(const sched::Schedule& sc, const std::int32_t* tokens, const StepControl& control) {
  const int ranks = opts_.comm ? opts_.comm->size() : 1;
  SPPO_CHECK(sc.ranks == ranks, "runtime") << "the schedule has " << sc.ranks << " ranks but the job has "
                                           << ranks << "; start it with mpirun -np " << sc.ranks;
  SPPO_CHECK(opts_.rank >= 0 && opts_.rank < sc.ranks, "runtime") << "rank " << opts_.rank << " is not in the schedule";
  const auto own = sc.owned.empty() ? std::pair<int, int>{0, config_.layers} : sc.owned.at(opts_.rank);
  SPPO_CHECK(own.first == lb_ && own.second == le_, "runtime")
      << "rank " << opts_.rank << " holds layers [" << lb_ << ", " << le_ << ") but its schedule gives it ["
      << own.first << ", " << own.second << ")";
  SPPO_CHECK(!opts_.recompute || sc.lengths.size() == 1, "runtime")
      << "full recomputation runs the whole sequence at once; use --subseqs 1";
  const auto& ops = sc.ops.at(opts_.rank);
  SPPO_CHECK(config_.causal || sc.lengths.size() == 1, "runtime")
      << "a bidirectional model attends to later positions, which subsequences computed one after another cannot "
         "give; use --subseqs 1";
  SPPO_CHECK(!opts_.ring_rsa || (!config_.causal && act_ == DType::F32), "runtime")
      << "the two-pass RSA ring is for bidirectional models in fp32; use --ring flash";
  SPPO_CHECK(sc.ring == 1 || (opts_.comm && !opts_.recompute), "runtime")
      << "ring attention needs its ranks (mpirun) and cannot recompute";
  SPPO_CHECK(sc.tp == opts_.tp.size, "runtime")
      << "the schedule is tensor parallel over " << sc.tp << " ranks but this runtime holds shards of "
      << opts_.tp.size;
  if (sc.tp > 1) {
    SPPO_CHECK(opts_.comm && !opts_.recompute && act_ == DType::F32, "runtime")
        << "tensor parallelism needs its ranks (mpirun), fp32 activations, and no --recompute";
    for (i64 l : sc.lengths)
      SPPO_CHECK(l >= sc.tp, "runtime") << "a subsequence of " << l << " tokens cannot be split over " << sc.tp
                                        << " tensor-parallel ranks; use fewer --subseqs or a smaller --tp";
  }
  for (const sched::Op& op : ops) {
    const bool message = op.kind == sched::OpKind::Send || op.kind == sched::OpKind::Recv;
    // Ring pieces run (one per ring member); pieces of a subsequence split over several
    // stage groups (MSP) do not yet.
    const bool piece_ok = op.pieces == 1 || (op.pieces == sc.ring && op.piece < sc.ring);
    const bool supported = piece_ok && (!message || is_hidden_message(op));
    SPPO_CHECK(supported, "runtime") << "op '" << sched::to_string(op)
                                     << "' belongs to multiplexed sequence partitioning (MSP), which the runtime "
                                        "does not run yet; use --msp off";
  }

  StepResult result;
  StepState st;
  st.sched = &sc;
  st.ops = &ops;
  st.tokens = tokens;
  st.control = control;
  st.S = sc.seq_len();
  st.N = int(sc.lengths.size());
  const int L = config_.layers, N = st.N;
  st.dev.resize(N);
  st.host.resize(N);
  for (int i = 0; i < N; ++i) {
    st.dev[i].resize(L);
    st.host[i].resize(L);
  }
  for (int i = 0; i < N; ++i)
    for (int l = 0; l < L; ++l) {
      st.dev[i][l].resize(kSavedTensors);
      st.host[i][l].resize(kSavedTensors);
    }
  st.head_grad.resize(N);
  st.head_grad_host.resize(N);
  st.dk.resize(L);
  st.dv.resize(L);
  for (int l = 0; l < L; ++l) {
    st.dk[l].resize(N);
    st.dv[l].resize(N);
  }
  st.offload_first.resize(N);
  st.offload_last.resize(N);
  st.prefetch_first.resize(N);
  st.prefetch_last.resize(N);
  st.in_hidden.resize(N);
  st.in_grad.resize(N);
  st.out_hidden.resize(N);
  st.out_grad.resize(N);
  for (const auto& s : block_saved_specs(config_, 1, precision_)) st.roles.push_back(s.role);
  SPPO_ASSERT(int(st.roles.size()) == kSavedTensors);
  st.rows.resize(N);
  for (int i = 0; i < N; ++i) st.rows[i] = rows_of(sc, i, 0, 1);
  for (const sched::Op& op : ops)
    if (op.kind == sched::OpKind::Forward) st.rows[op.subseq] = rows_of(sc, op.subseq, op.piece, op.pieces);
  if (sc.tp > 1) st.tp = std::make_unique<TpGroup>(*opts_.comm, opts_.rank - opts_.tp.index, opts_.tp,
                                                   &result.comm_wait_s);
  st.result = &result;
  result.has_loss = le_ == L;
  result.losses.assign(std::size_t(result.has_loss ? st.S : 0), 0.0f);
  st.d2h = be_.make_copy_stream();
  st.h2d = be_.make_copy_stream();

  // Receives are posted as the compute op before them starts (schedule/memory.h).
  st.posts.assign(ops.size(), {});
  {
    std::size_t post = 0;
    for (std::size_t k = 0; k < ops.size(); ++k) {
      if (is_compute(ops[k])) post = k;
      if (ops[k].kind == sched::OpKind::Recv) st.posts[post].push_back(k);
    }
  }
  // Gradient buckets: each starts after the last op that adds to it.
  for (const sched::Op& op : ops)
    if (op.kind == sched::OpKind::AllReduce && op.payload == sched::Payload::WeightGrads && control.reduce)
      st.reduce_op = &op;
  if (st.reduce_op) {
    const auto& g = st.reduce_op->group;
    SPPO_CHECK(opts_.zero_shards == 1 ||
                   (int(g.size()) == opts_.zero_shards && g[std::size_t(opts_.zero_index)] == opts_.rank),
               "runtime")
        << "ZeRO shards the optimizer over " << opts_.zero_shards << " ranks but the gradient group has "
        << g.size();
    st.bucket_ready.assign(buckets_.size(), kNever);
    st.bucket_req.assign(buckets_.size(), comm::kDone);
    st.bucket_started.assign(buckets_.size(), false);
    const std::size_t first_layer_bucket = buckets_[0].name == "embed" ? 1 : 0;
    for (std::size_t k = 0; k < ops.size(); ++k) {
      const sched::Op& op = ops[k];
      if (op.kind == sched::OpKind::Backward)
        for (int l = op.layer_begin; l < op.layer_end; ++l) st.bucket_ready[first_layer_bucket + std::size_t(l - lb_)] = k;
    }
  }

  if (!control.accumulate) be_.fill_zero(grads_.data(), std::size_t(grads_.bytes()));
  // The step's token ids and loss sum live on the device for the step (memory rules:
  // step_input_bytes).
  // A causal model's targets are its inputs shifted by one; a bidirectional model's
  // (masked tokens) come beside them.
  SPPO_CHECK(config_.causal == (control.targets == nullptr), "runtime")
      << (config_.causal ? "a causal model predicts the next token; masked-token targets need --attention bidirectional"
                         : "a bidirectional model trains on masked tokens (--objective mlm), which need targets");
  const i64 ids_count = config_.causal ? st.S + 1 : 2 * st.S;
  st.ids = device_->alloc(i64(sizeof(std::int32_t)) * ids_count, "token ids");
  be_.to_device(st.ids.data(), tokens, sizeof(std::int32_t) * std::size_t(config_.causal ? st.S + 1 : st.S));
  st.targets = static_cast<const std::int32_t*>(st.ids.data()) + (config_.causal ? 1 : st.S);
  st.predicted = st.S;
  if (control.targets) {
    be_.to_device(static_cast<std::int32_t*>(st.ids.data()) + st.S, control.targets,
                  sizeof(std::int32_t) * std::size_t(st.S));
    st.predicted = std::count_if(control.targets, control.targets + st.S, [](std::int32_t t) { return t != kNoTarget; });
    SPPO_CHECK(st.predicted > 0, "runtime") << "no position of the sequence is predicted (every target is masked out)";
  }
  st.loss_sum = device_->alloc_zeroed(i64(sizeof(double)), "loss sum");
  device_->reset_peak();
  // An allocation over the budget first waits for the sends that will free bytes.
  device_->set_reclaimer([&st, this] {
    if (st.sends.empty()) return false;
    comm::wait(*opts_.comm, st.sends.front().req, "the send '" + st.sends.front().name + "' to free its memory");
    st.sends.front().req = comm::kDone;
    poll(st);
    return true;
  });
  const double t_start = now_s();
  st.t_start = t_start;
  result.start_s = t_start;
  if (opts_.record_memory) device_->record_timeline(&now_s);
  auto span = [&](const std::string& name, sched::OpKind kind, Lane lane, double t0, double t1) {
    result.trace.push_back({name, kind, lane, t0 - t_start, t1 - t0});
  };
  for (std::size_t k = 0; k < ops.size(); ++k) {
    const sched::Op& op = ops[k];
    if (opts_.comm) comm::set_activity("op " + std::to_string(k) + " '" + sched::to_string(op) + "'");
    for (std::size_t j : st.posts[k]) post_receive(st, ops[j]);
    const double t0 = now_s();
    const int i = op.subseq;
    switch (op.kind) {
      case sched::OpKind::Forward:
        forward(st, op);
        result.compute_s += now_s() - t0;
        span("F" + std::to_string(i), op.kind, Lane::Compute, t0, now_s());
        break;
      case sched::OpKind::Backward:
        backward(st, op, k);
        result.compute_s += now_s() - t0;
        span("B" + std::to_string(i), op.kind, Lane::Compute, t0, now_s());
        break;
      case sched::OpKind::Offload:
        offload(st, i, op.fraction);
        break;
      case sched::OpKind::Prefetch:
        prefetch(st, i);
        break;
      case sched::OpKind::WaitOffload:
        if (st.offload_last[i]) result.exposed_copy_s += st.offload_last[i]->wait();
        break;
      case sched::OpKind::WaitPrefetch:
        if (st.prefetch_last[i]) {
          const double waited = st.prefetch_last[i]->wait();
          result.exposed_copy_s += waited;
          if (waited > kShownWaitS) span("wait P" + std::to_string(i), op.kind, Lane::Compute, t0, now_s());
        }
        break;
      case sched::OpKind::Send:
        send(st, op);
        break;
      case sched::OpKind::Recv: {
        auto& in = (op.payload == sched::Payload::Hidden ? st.in_hidden : st.in_grad)[i];
        const double waited =
            comm::wait(*opts_.comm, in.req, "op " + std::to_string(k) + " '" + sched::to_string(op) + "'");
        in.req = comm::kDone;
        result.comm_wait_s += waited;
        if (waited > kShownWaitS) span("wait " + sched::to_string(op), op.kind, Lane::Compute, t0, now_s());
        break;
      }
      case sched::OpKind::AllReduce:
        if (control.reduce) reduce(st, op, k);
        break;
      case sched::OpKind::RingStep:
        break;  // ring attention runs inside each layer of F and B (runtime/ring.h)
    }
    poll(st);
  }
  while (!st.sends.empty()) {
    comm::wait(*opts_.comm, st.sends.front().req, "the send '" + st.sends.front().name + "' at the end of the step");
    st.sends.front().req = comm::kDone;
    poll(st);
  }
  if (st.tp && control.reduce) {
    // Each member's LayerNorm gradients come from its own rows (Note [Sequence-parallel
    // regions]): the sum over the group is the whole gradient. Sums commute, so this may
    // follow the data-parallel reduction.
    be_.synchronize();
    i64 off = 0;
    for (const TensorSpec& spec : specs_) {
      const bool layernorm = spec.name.rfind("ln_f.", 0) == 0 || spec.name.find(".ln") != std::string::npos;
      if (layernorm)
        st.tp->all_reduce(grads_.f32() + off, spec.numel(), spec.name);
      off += spec.numel();
    }
  }
  device_->set_reclaimer(nullptr);
  be_.synchronize();
  st.d2h->synchronize();
  st.h2d->synchronize();
  result.step_s = now_s() - t_start;
  result.exposed_copy_s += device_->release_wait_s();
  result.comm_wait_s += result.ring_wait_s;
  for (int i = 0; i < N; ++i) {
    if (st.offload_first[i])
      span("O" + std::to_string(i), sched::OpKind::Offload, Lane::CopyOut, st.offload_first[i]->start_s(),
           st.offload_last[i]->end_s());
    if (st.prefetch_first[i])
      span("P" + std::to_string(i), sched::OpKind::Prefetch, Lane::CopyIn, st.prefetch_first[i]->start_s(),
           st.prefetch_last[i]->end_s());
  }
  for (int i = 0; i < N; ++i) {
    SPPO_ASSERT_MSG(!st.in_hidden[i].buf && !st.in_grad[i].buf && !st.out_hidden[i] && !st.out_grad[i],
                    "a message buffer of subseq " << i << " is left over after the step");
    for (int l = 0; l < L; ++l)
      for (int k = 0; k < kSavedTensors; ++k)
        SPPO_ASSERT_MSG(!st.dev[i][l][k] && !st.host[i][l][k],
                        "tensor left over after the step: layer " << l << " subseq " << i);
  }
  if (opts_.record_memory) {
    result.memory = device_->take_timeline();
    device_->record_timeline(nullptr);
    for (auto& [t, bytes] : result.memory) t = std::max(0.0, t - t_start);
  }
  double loss_sum = 0;
  be_.to_host(&loss_sum, st.loss_sum.data(), sizeof loss_sum);
  if (st.tp && result.has_loss) {
    std::vector<double> parts{loss_sum};
    comm::allreduce_sum(*opts_.comm, parts, st.tp->group(), "the tensor-parallel sum of the loss");
    loss_sum = parts[0];
  }
  result.loss = loss_sum / double(st.predicted);
  result.predicted = st.predicted;
  result.device = device_->stats();
  return result;
}

}  // namespace sppo
