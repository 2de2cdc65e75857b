#include "runtime/step_state.h"

#include <algorithm>

#include "core/check.h"
#include "runtime/op_rows.h"
#include "schedule/memory.h"
#include "schedule/validate.h"

namespace sppo {

void check_schedule(const sched::Schedule& sc, const StepContext& ctx) {
  const RuntimeOptions& o = ctx.opts;
  const ModelConfig& c = ctx.config;
  const DType act = ctx.be.act();
  const auto [lb, le] = ctx.layers;
  const int ranks = o.comm ? o.comm->size() : 1;
  SPPO_CHECK(sc.ranks() == ranks, "runtime") << "the schedule has " << sc.ranks() << " ranks but the job has "
                                           << ranks << "; start it with mpirun -np " << sc.ranks();
  SPPO_CHECK(o.rank >= 0 && o.rank < sc.ranks(), "runtime") << "rank " << o.rank << " is not in the schedule";
  const auto own = sc.owned.empty() ? std::pair<int, int>{0, c.layers} : sc.owned.at(o.rank);
  SPPO_CHECK(own.first == lb && own.second == le, "runtime")
      << "rank " << o.rank << " holds layers [" << lb << ", " << le << ") but its schedule gives it ["
      << own.first << ", " << own.second << ")";
  const std::string rebuilt = sched::rebuilt_inputs_error(sc);
  SPPO_CHECK(rebuilt.empty() && (!sc.place.any_input_rebuilt() || !o.recompute), "runtime")
      << (rebuilt.empty() ? "--recompute already recomputes whole blocks from their inputs; drop --rebuild-inputs"
                          : rebuilt);
  SPPO_CHECK(!o.inference || sc.forward_only, "runtime")
      << "an evaluation's runtime holds no gradients: it runs forward-only steps only";
  SPPO_CHECK(!sc.forward_only || sc.place.kv_layers(KvPlace::Recompute).empty(), "runtime")
      << "a forward-only step keeps no layer inputs to recompute K/V from; keep them on the device or the host";
  SPPO_CHECK(!o.recompute || sc.lengths.size() == 1, "runtime")
      << "full recomputation runs the whole sequence at once; use --subseqs 1";
  const auto& ops = sc.ops.at(o.rank);
  SPPO_CHECK(c.causal || sc.lengths.size() == 1, "runtime")
      << "a bidirectional model attends to later positions, which subsequences computed one after another cannot "
         "give; use --subseqs 1";
  SPPO_CHECK(!sc.par.rsa() || (!c.causal && act == DType::F32), "runtime")
      << "the two-pass RSA ring is for bidirectional models in fp32; use --ring flash";
  SPPO_CHECK(sc.par.cp == 1 || (o.comm && !o.recompute), "runtime")
      << "ring attention needs its ranks (mpirun) and cannot recompute";
  SPPO_CHECK(sc.par.tp == o.tp.size, "runtime")
      << "the schedule is tensor parallel over " << sc.par.tp << " ranks but this runtime holds shards of "
      << o.tp.size;
  if (sc.par.tp > 1) {
    SPPO_CHECK(o.comm && !o.recompute && act == DType::F32, "runtime")
        << "tensor parallelism needs its ranks (mpirun), fp32 activations, and no --recompute";
    for (i64 l : sc.lengths)
      SPPO_CHECK(l >= sc.par.tp, "runtime") << "a subsequence of " << l << " tokens cannot be split over " << sc.par.tp
                                        << " tensor-parallel ranks; use fewer --subseqs or a smaller --tp";
  }
  SPPO_CHECK(sc.par.ulysses == o.ulysses.size, "runtime")
      << "the schedule runs Ulysses over " << sc.par.ulysses << " ranks but this runtime is a member of "
      << o.ulysses.size;
  if (sc.par.ulysses > 1) {
    SPPO_CHECK(o.comm && !o.recompute && ulysses_runs(c, sc.par.ulysses), "runtime")
        << "Ulysses needs its ranks (mpirun), no --recompute, and heads it can split (core/layout.h ulysses_runs)";
    SPPO_CHECK(!(sc.place.recompute & kAttentionGroup) && !sc.par.rsa(), "runtime")
        << "Ulysses runs the attention once a layer between its all-to-alls: it runs without --recompute-tensors "
           "attention and --ring rsa";
  }
  const bool msp = std::any_of(ops.begin(), ops.end(), [](const sched::Op& op) { return !op.group.empty() && is_compute(op); });
  SPPO_CHECK(!msp || (o.comm && act == DType::F32 && !sc.par.rsa()), "runtime")
      << "multiplexed sequence partitioning (MSP) runs with pipeline, data, tensor and one-pass context parallelism "
         "on CPU ranks in fp32; drop --ring rsa, or use --msp off";
  SPPO_CHECK(sc.place.kv.empty() ||
                 (int(sc.place.kv.size()) == c.layers && !o.recompute && !sc.par.rsa()),
             "runtime")
      << "K/V on the host or recomputed (--kv-cache host, recompute) stream the blocks of a rank's own "
         "subsequences: they run without --ring rsa and --recompute, and name every layer";
  bool kv_recomputed = false;
  for (int l = 0; l < c.layers; ++l) kv_recomputed |= sc.place.kv_recomputed(l);
  SPPO_CHECK(!kv_recomputed || (sc.par.tp == 1 && sc.par.cp == 1 && sc.par.ulysses == 1 && !msp), "runtime")
      << "--kv-cache recompute recomputes K/V from a rank's whole rows of each layer's input: it runs without --tp, "
         "--cp, --ulysses and --msp on";
  SPPO_CHECK(sc.place.recompute == recompute_closure(sc.place.recompute) && !in_set(sc.place.recompute, kSavedX) &&
                 !in_set(sc.place.recompute, kSavedK) && !in_set(sc.place.recompute, kSavedV),
             "runtime")
      << "the schedule recomputes " << sc.place.recompute << ", which is not a set of whole groups of recomputable "
      << "tensors (core/layout.h)";
  SPPO_CHECK(sc.place.recompute == 0 || !o.recompute, "runtime")
      << "--recompute already recomputes whole blocks; drop --recompute-tensors";
  SPPO_CHECK(!(sc.place.recompute & kAttentionGroup) || (sc.par.cp == 1 && !msp), "runtime")
      << "recomputing the attention (--recompute-tensors attention) runs it again inside the backward, on a rank's "
         "whole rows: it runs without --cp and --msp on";
  SPPO_CHECK(!in_set(sc.place.recompute, kSavedHeadGrad) || !msp, "runtime")
      << "recomputing head_grad (--recompute-tensors head_grad) runs a stage's own LM head inside its last layer's "
         "backward: it runs without --msp on";
  SPPO_CHECK(sc.place.mlp_tile_rows >= 0, "runtime") << "MLP tiles of " << sc.place.mlp_tile_rows << " rows; use 0 (none) or more";
  SPPO_CHECK(sc.place.mlp_tile_rows == 0 || (sc.par.tp == 1 && !o.recompute), "runtime")
      << "MLP tiles (--mlp-tile-rows) run without --tp and --recompute";
  SPPO_CHECK(sc.place.weights_host() == o.weights_host, "runtime")
      << "the schedule keeps the layers' weights on the " << (sc.place.weights_host() ? "host" : "device")
      << " but this runtime holds them on the " << (o.weights_host ? "host" : "device")
      << "; build both with the same --weights";
  SPPO_CHECK(sc.par.zero == o.zero, "runtime")
      << "the schedule's ZeRO stage is " << stage_number(sc.par.zero) << " but this runtime's is "
      << stage_number(o.zero) << "; build both with the same --zero";
  SPPO_CHECK(!sc.place.weights_host() || (sc.par.tp == 1 && !msp && !o.recompute), "runtime")
      << "the layers' weights on the host (--weights host) run without --tp, --msp on and --recompute";
}

StepState::StepState(const StepContext& c, const sched::Schedule& sc, const StepControl& ctl, StepResult& res)
    : ctx(c),
      sched(sc),
      ops(sc.ops.at(c.opts.rank)),
      control(ctl),
      result(res),
      S(sc.seq_len()),
      tp(sc.par.tp > 1 ? std::make_unique<TpGroup>(*c.opts.comm, c.opts.rank - c.opts.tp.index, c.opts.tp,
                                               c.opts.tp.kv_replicas(c.config), &res.comm_wait_s)
                   : nullptr),
      act(c.be, c.device, c.host, c.config, c.precision, int(sc.lengths.size()), c.layers, sc.place.recompute,
          sc.place.inputs_rebuilt),
      kv(act, c.be, c.device, c.host, c.config, c.opts, sc, ops, c.layers, res),
      messages(c.opts.comm, c.opts.rank, c.be, c.device, c.config, sc, ops, c.sent_messages, res),
      grads(c.opts, ops, ctl.reduce, c.specs, c.buckets, c.shard, c.layers,
            c.host_layers ? c.host_layers->grads : c.own.grads.f32(), res),
      msp(c.opts.comm, c.be, c.device, c.config, c.opts.tp, sc, ops, c.layers, c.own, kv, messages, grads, loss_sum,
          res),
      weights(c.be, c.device, sc, c.opts.rank, c.layers, c.buckets, c.host_layers, act.h2d(), act.d2h(), grads, ctl,
              res) {
  const int L = c.config.layers;
  result.has_loss = c.layers.second == L;
  // An MSP helper of the last stage computes the loss of its rows too, and sends it home.
  const bool any_head = std::any_of(ops.begin(), ops.end(), [&](const sched::Op& op) {
    return op.kind == sched::OpKind::Forward && op.layer_end == L;
  });
  result.losses.assign(std::size_t(result.has_loss || any_head ? S : 0), 0.0f);
  if (sc.forward_only) result.hits.assign(result.losses.size(), 0);
}

StepState::~StepState() = default;

void StepState::load_inputs(const std::int32_t* tokens) {
  const ModelConfig& c = ctx.config;
  Backend& be = ctx.be;
  // The step's token ids and loss sum live on the device for the step (memory rules:
  // step_input_bytes).
  // A causal model's targets are its inputs shifted by one; a bidirectional model's
  // (masked tokens) come beside them.
  SPPO_CHECK(c.causal ? sched.targets_given() == (control.targets != nullptr) : control.targets != nullptr, "runtime")
      << (!c.causal ? "a bidirectional model trains on masked tokens (--objective mlm), which need targets"
          : control.targets ? "a causal model's targets are its next tokens, unless the schedule was built for "
                              "packed documents or labels"
                            : "a schedule built for packed documents or labels runs with the step's targets");
  SPPO_CHECK(!sched.packed || control.docs, "runtime")
      << "a schedule of packed documents runs with the step's documents";
  // Inputs, then the targets when they are not the inputs shifted by one.
  const i64 inputs = c.causal ? S + 1 : S;
  const i64 ids_count = sched::step_input_bytes(c, S, sched.targets_given()) / 4 - 2;
  ids = ctx.device.alloc(i64(sizeof(std::int32_t)) * ids_count, "token ids");
  be.to_device(ids.data(), tokens, sizeof(std::int32_t) * std::size_t(inputs));
  targets = static_cast<const std::int32_t*>(ids.data()) + (control.targets ? inputs : 1);
  predicted = S;
  if (control.targets) {
    be.to_device(static_cast<std::int32_t*>(ids.data()) + inputs, control.targets,
                 sizeof(std::int32_t) * std::size_t(S));
    predicted = std::count_if(control.targets, control.targets + S, [](std::int32_t t) { return t != kNoTarget; });
  }
  loss_tokens = control.loss_tokens > 0 ? control.loss_tokens : predicted;
  SPPO_CHECK(loss_tokens >= predicted, "runtime")
      << "the step's " << loss_tokens << " predicted positions cannot be fewer than this sequence's " << predicted;
  SPPO_CHECK(loss_tokens > 0, "runtime") << "no position of the step is predicted (every target is masked out)";
  loss_sum = ctx.device.alloc_zeroed(i64(sizeof(double)), "loss sum");
}

void StepState::start() {
  ctx.device.reset_peak();
  ctx.host.reset_peak();
  // An allocation over the budget first waits for the sends that will free bytes.
  ctx.device.set_reclaimer([this] { return messages.reclaim(); });
  const double t_start = now_s();
  sent_at_start = ctx.opts.comm ? ctx.opts.comm->bytes_sent() : 0;
  result.start_s = t_start;
  if (ctx.opts.record_memory) ctx.device.record_timeline(&now_s);
}

void StepState::finish() {
  messages.drain();
  if (!sched.forward_only) grads.reduce_replicated(ctx.be, tp.get(), ctx.config);
  ctx.device.set_reclaimer(nullptr);
  ctx.be.synchronize();
  act.synchronize();
  if (sched.forward_only) kv.drop_all();  // Note [Forward-only steps]: the K/V held to the end
  result.step_s = now_s() - result.start_s;
  if (ctx.opts.comm) result.sent_bytes = ctx.opts.comm->bytes_sent() - sent_at_start;
  result.exposed_copy_s += ctx.device.release_wait_s();
  result.comm_wait_s += result.ring_wait_s;
  act.trace(result);
  weights.trace(result);
  messages.check_empty();
  msp.check_empty();
  kv.check_empty();
  act.check_empty();
  weights.check_empty();
  if (ctx.opts.record_memory) {
    result.memory = ctx.device.take_timeline();
    ctx.device.record_timeline(nullptr);
    for (auto& [t, bytes] : result.memory) t = std::max(0.0, t - result.start_s);
  }
  double sum = 0;
  ctx.be.to_host(&sum, loss_sum.data(), sizeof sum);
  if (tp && result.has_loss) {  // each member has its vocabulary's part
    std::vector<double> parts{sum};
    comm::allreduce_sum(*ctx.opts.comm, parts, tp->group(), "the tensor-parallel sum of the loss");
    sum = parts[0];
  }
  result.loss = sum / double(loss_tokens);
  result.predicted = predicted;
  result.device = ctx.device.stats();
  result.host = ctx.host.stats();
}

}  // namespace sppo
