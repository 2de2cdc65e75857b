#include "runtime/executor.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <set>
#include <tuple>

#include "core/check.h"
#include "runtime/activation_store.h"
#include "runtime/grad_reduce.h"
#include "runtime/kv_store.h"
#include "runtime/msp.h"
#include "runtime/stage_messages.h"
#include "runtime/tensor_parallel.h"
#include "schedule/memory.h"
#include "model/tensor_parallel.h"

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
  std::unique_ptr<ActivationStore> act;                // saved tensors, offloaded copies, copy streams
  std::unique_ptr<KvStore> kv;                         // K/V, their dK/dV sums, how attention reaches them
  Buffer ids;                                          // [S + 1] token ids on the device
  Buffer loss_sum;                                     // one double on the device
  StepResult* result = nullptr;
  // The rows this rank holds of each subsequence: the whole of it, or its ring piece.
  std::vector<Subseq> rows;                            // [N]
  std::unique_ptr<TpGroup> tp;                         // the tensor-parallel group (tp > 1)
  int ring_piece = 0;                                  // this rank's piece of every subsequence (ring > 1)

  std::unique_ptr<StageMessages> messages;             // hidden states between stages, sends in flight

  std::unique_ptr<GradReduce> grads;                   // the gradient buckets' reduction
  std::unique_ptr<MspExchange> msp;                    // borrowed weights, MSP's messages
};

Runtime::Runtime(const ModelConfig& c, const RuntimeOptions& o)
    : config_(c),
      opts_(o),
      own_backend_(o.backend ? nullptr : make_backend("cpu")),
      be_(o.backend ? *o.backend : *own_backend_),
      act_(be_.act()),
      precision_(act_ == DType::F32 ? ActPrecision::F32 : ActPrecision::BF16),
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
  specs_ = parameter_specs(c, lb_, le_, o.tp);
  for (const auto& s : specs_) num_params_ += s.numel();
  buckets_ = param_buckets(specs_, {lb_, le_});
  shard_ = shard_buckets(buckets_, o.zero_index, o.zero_shards);
  for (const auto& piece : shard_) num_state_ += piece.count;
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

void Runtime::forward(StepState& st, const sched::Op& op) {
  const int i = op.subseq, b = op.layer_begin, e = op.layer_end;
  const Subseq q = rows_of(*st.sched, op);
  const StageWeights wt = st.msp->weights_for(op);
  const int T = q.T, H = config_.hidden, L = config_.layers;
  const std::int32_t* ids = static_cast<const std::int32_t*>(st.ids.data());  // the whole step's
  const auto specs = block_saved_specs(config_, T, precision_, opts_.tp);
  if (b > 0) {  // the previous stage's output is this stage's first saved input
    st.act->unit(i, b)[0] = st.messages->take_input(input_key(op), q);
    SPPO_ASSERT_MSG(st.act->unit(i, b)[0], "forward of layers from " << b << " on subseq " << i << " without its input");
  }
  Buffer out;  // the stage's output
  for (int l = b; l < e; ++l) {
    auto& unit = st.act->unit(i, l);
    for (int k = 0; k < kSavedTensors; ++k)
      if (!unit[k]) unit[k] = device_->alloc(specs[k].bytes(), unit_name(l, i) + specs[k].name);
    auto ws = alloc_specs(*device_, block_workspace_specs(config_, T, precision_, opts_.tp), "workspace ");
    const BlockWorkspace w_ptrs = block_workspace_from(ptrs(ws));
    if (l == 0 && st.tp)
      embedding_forward_tp(be_, unit[0].data(), ids, wt.w->embed, w_ptrs.tp_full, w_ptrs.tp_pad, *st.tp, config_, q);
    else if (l == 0)
      for (const PosSpan& part : q.parts())
        be_.embedding_forward(act_at(unit[0].data(), i64(part.row0) * H, act_), ids + part.pos0, wt.w->embed,
                              part.rows, H, config_.vocab);
    KernelScratchBuffer scratch(*device_, opts_.block_scratch.bytes(T));
    // The block's output is the next block's saved input, or the stage's output.
    void* x_out;
    if (l + 1 < e) {
      st.act->unit(i, l + 1)[0] = device_->alloc(specs[0].bytes(), unit_name(l + 1, i) + "x");
      x_out = st.act->unit(i, l + 1)[0].data();
    } else {
      out = device_->alloc(specs[0].bytes(), e == L ? "final hidden" : "hidden for the next stage");
      x_out = out.data();
    }
    const LayerAttention attn = st.kv->attention(op, l, false);
    BlockSaved saved = block_saved_from(ptrs(unit));
    const BlockWorkspace w = block_workspace_from(ptrs(ws), scratch.get());
    if (st.tp)
      block_forward_tp(be_, x_out, saved, wt.w->blocks[l], wt.m->blocks[l], w, *attn, *st.tp, config_, q);
    else
      block_forward(be_, x_out, saved, wt.w->blocks[l], wt.m->blocks[l], w, *attn, config_, q);
    if (opts_.recompute)  // keep the block input only; backward recomputes the rest
      for (int k = 1; k < kSavedTensors; ++k) unit[k].reset();
    st.kv->after_forward(l, i, q);
    scratch = {};
    ws.clear();
    st.messages->poll();
  }
  if (e < L) {
    st.messages->produce({sched::Payload::Hidden, e, i}, std::move(out), q);
    return;
  }
  auto hw_bufs = alloc_specs(*device_, head_workspace_specs(config_, T, opts_.head_chunk, precision_, opts_.tp),
                             "head workspace ");
  KernelScratchBuffer scratch(*device_, opts_.head_scratch.bytes(T));
  const HeadWorkspace hw = head_workspace_from(ptrs(hw_bufs), opts_.head_chunk, scratch.get(), opts_.tp.on());
  Buffer& head_grad = st.act->head_grad(i);
  head_grad = device_->alloc(specs[0].bytes(), "subseq " + std::to_string(i) + " head_grad");
  if (st.tp) {
    head_forward_backward_tp(be_, head_grad.data(), static_cast<double*>(st.loss_sum.data()), out.data(),
                             st.targets, *wt.w, *wt.m, *wt.g, hw, *st.tp, config_, q, st.predicted);
    be_.synchronize();
    st.tp->all_reduce(hw.losses, T, "the per-position losses");  // each member has its vocabulary's part
    for (const PosSpan& part : q.parts())
      be_.to_host(st.result->losses.data() + part.pos0, hw.losses + part.row0, sizeof(float) * std::size_t(part.rows));
    return;
  }
  for (const PosSpan& part : q.parts()) {
    const i64 at = i64(part.row0) * H;
    head_forward_backward(be_, act_at(head_grad.data(), at, act_), static_cast<double*>(st.loss_sum.data()),
                          act_at(out.data(), at, act_), st.targets + part.pos0, *wt.w, *wt.m, *wt.g, hw,
                          config_, part.rows, st.predicted);
    be_.to_host(st.result->losses.data() + part.pos0, hw.losses, sizeof(float) * std::size_t(part.rows));
  }
}

void Runtime::backward(StepState& st, const sched::Op& op, std::size_t index) {
  const int i = op.subseq, b = op.layer_begin, e = op.layer_end;
  const Subseq q = rows_of(*st.sched, op);
  const StageWeights wt = st.msp->weights_for(op);
  const bool own = lb_ <= b && e <= le_;
  const int T = q.T, L = config_.layers;
  const int H = config_.hidden;
  const auto specs = block_saved_specs(config_, T, precision_, opts_.tp);
  // The residual gradient: the head's on the last stage, else the next stage's.
  Buffer d_buf = e == L ? std::move(st.act->head_grad(i)) : st.messages->take_input(input_key(op), q);
  SPPO_ASSERT_MSG(d_buf, "backward of subsequence " << i << " before its forward or its gradient arrived");
  void* d = d_buf.data();

  for (int l = e - 1; l >= b; --l) {
    // dK/dV accumulators of every subsequence this backward reaches, zeroed on first use
    // (on a host layer, this subsequence's own, which restore brings: the host holds the
    // others').
    st.kv->alloc_accumulators(l, i);
    auto& unit = st.act->unit(i, l);
    auto ws = alloc_specs(*device_, block_workspace_specs(config_, T, precision_, opts_.tp), "workspace ");
    KernelScratchBuffer scratch(*device_, opts_.block_scratch.bytes(T));
    const BlockWorkspace w = block_workspace_from(ptrs(ws), scratch.get());
    st.kv->restore(l, i);
    const LayerAttention attn = st.kv->attention(op, l, true);
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
      block_backward_tp(be_, d, wt.g->blocks[l], st.kv->dk(l, i).f32(), st.kv->dv(l, i).f32(), s, wt.w->blocks[l],
                        wt.m->blocks[l], w, *attn, *st.tp, config_, q);
      if (l == 0)  // while the layer's workspace is there to gather into
        embedding_backward_tp(be_, wt.g->embed, d, static_cast<const std::int32_t*>(st.ids.data()), w.tp_full,
                              w.tp_pad, *st.tp, config_, q);
    } else {
      block_backward(be_, d, wt.g->blocks[l], st.kv->dk(l, i).f32(), st.kv->dv(l, i).f32(), s, wt.w->blocks[l],
                     wt.m->blocks[l], w, *attn, config_, q);
    }
    for (auto& buf : unit) buf.reset();
    st.kv->release(l, i);
    scratch = {};
    ws.clear();
    if (own) st.grads->layer_done(index, l);
    st.messages->poll();
  }
  if (b > 0) {
    st.messages->produce({sched::Payload::HiddenGrad, b, i}, std::move(d_buf), q);
    return;
  }
  if (st.tp) return;  // the embedding's gradient came with layer 0
  const std::int32_t* ids = static_cast<const std::int32_t*>(st.ids.data());
  for (const PosSpan& part : q.parts())
    be_.embedding_backward(wt.g->embed, act_at(d, i64(part.row0) * H, act_), ids + part.pos0, part.rows, H,
                           config_.vocab);
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
  const bool msp = std::any_of(ops.begin(), ops.end(), [](const sched::Op& op) { return !op.group.empty() && is_compute(op); });
  SPPO_CHECK(!msp || (sc.tp == 1 && sc.ring == 1 && opts_.comm && act_ == DType::F32), "runtime")
      << "multiplexed sequence partitioning (MSP) runs with pipeline and data parallelism on CPU ranks in fp32; drop "
         "--tp and --cp, or use --msp off";
  SPPO_CHECK(sc.kv_host.empty() || (int(sc.kv_host.size()) == config_.layers && sc.ring == 1 && !msp &&
                                     !opts_.recompute),
             "runtime")
      << "K/V on the host (--kv-cache host) streams the blocks of one rank's subsequences: it runs without --cp, "
         "--msp on and --recompute, and names every layer";
  StepResult result;
  StepState st;
  st.sched = &sc;
  st.ops = &ops;
  st.tokens = tokens;
  st.control = control;
  st.S = sc.seq_len();
  st.N = int(sc.lengths.size());
  const int L = config_.layers, N = st.N;
  st.act = std::make_unique<ActivationStore>(be_, *device_, *host_, config_, precision_, N, std::pair{lb_, le_});
  st.kv = std::make_unique<KvStore>(*st.act, be_, *device_, *host_, config_, opts_, sc, ops, std::pair{lb_, le_},
                                    result);
  st.messages = std::make_unique<StageMessages>(opts_.comm, opts_.rank, be_, *device_, config_, sc, ops, sends_, result);
  if (sc.tp > 1) st.tp = std::make_unique<TpGroup>(*opts_.comm, opts_.rank - opts_.tp.index, opts_.tp,
                                                   &result.comm_wait_s);
  st.result = &result;
  result.has_loss = le_ == L;
  // An MSP helper of the last stage computes the loss of its rows too, and sends it home.
  const bool any_head = std::any_of(ops.begin(), ops.end(), [&](const sched::Op& op) {
    return op.kind == sched::OpKind::Forward && op.layer_end == L;
  });
  result.losses.assign(std::size_t(result.has_loss || any_head ? st.S : 0), 0.0f);

  st.grads = std::make_unique<GradReduce>(opts_, ops, control.reduce, specs_, buckets_, shard_, std::pair{lb_, le_},
                                         grads_.f32(), result);
  st.msp = std::make_unique<MspExchange>(opts_.comm, be_, *device_, config_, sc, ops, std::pair{lb_, le_},
                                         OwnWeights{params_, grads_, num_params_, {&weights_, &dweights_, &matrices_}},
                                         *st.kv, *st.messages, *st.grads, st.loss_sum, result);

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
  host_->reset_peak();
  // An allocation over the budget first waits for the sends that will free bytes.
  device_->set_reclaimer([&st] { return st.messages->reclaim(); });
  const double t_start = now_s();
  st.t_start = t_start;
  const i64 sent_at_start = opts_.comm ? opts_.comm->bytes_sent() : 0;
  result.start_s = t_start;
  if (opts_.record_memory) device_->record_timeline(&now_s);
  auto span = [&](const std::string& name, sched::OpKind kind, Lane lane, double t0, double t1) {
    result.trace.push_back({name, kind, lane, t0 - t_start, t1 - t0});
  };
  for (std::size_t k = 0; k < ops.size(); ++k) {
    const sched::Op& op = ops[k];
    if (opts_.comm) comm::set_activity("op " + std::to_string(k) + " '" + sched::to_string(op) + "'");
    st.messages->post_receives(k);
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
        result.offloaded_bytes += st.act->offload(i, op.fraction);
        break;
      case sched::OpKind::Prefetch:
        st.act->prefetch(i);
        break;
      case sched::OpKind::WaitOffload:
        result.exposed_copy_s += st.act->wait_offload(i);
        break;
      case sched::OpKind::WaitPrefetch: {
        const double waited = st.act->wait_prefetch(i);
        result.exposed_copy_s += waited;
        if (waited > kShownWaitS) span("wait P" + std::to_string(i), op.kind, Lane::Compute, t0, now_s());
        break;
      }
      case sched::OpKind::Send:
        if (is_hidden_message(op))
          st.messages->send(op);
        else
          st.msp->send(op);
        break;
      case sched::OpKind::Recv: {
        double waited = 0;
        if (is_hidden_message(op)) {
          waited = st.messages->wait_receive(k);
        } else {
          waited = st.msp->receive(op, k);
        }
        result.comm_wait_s += waited;
        if (waited > kShownWaitS) span("wait " + sched::to_string(op), op.kind, Lane::Compute, t0, now_s());
        break;
      }
      case sched::OpKind::AllReduce:
        if (control.reduce) st.grads->reduce(op, k);
        break;
      case sched::OpKind::RingStep:
        break;  // ring attention runs inside each layer of F and B (runtime/ring.h)
    }
    st.msp->end_lease(k);
    st.messages->poll();
  }
  st.messages->drain();
  st.grads->reduce_replicated(be_, st.tp.get());
  device_->set_reclaimer(nullptr);
  be_.synchronize();
  st.act->synchronize();
  result.step_s = now_s() - t_start;
  if (opts_.comm) result.sent_bytes = opts_.comm->bytes_sent() - sent_at_start;
  result.exposed_copy_s += device_->release_wait_s();
  result.comm_wait_s += result.ring_wait_s;
  st.act->trace(result);
  st.messages->check_empty();
  st.msp->check_empty();
  st.kv->check_empty();
  st.act->check_empty();
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
  result.host = host_->stats();
  return result;
}

}  // namespace sppo
