// The helpers more than one of the search's passes uses (search.h): a layout's alpha and its
// prediction as a whole plan, MSP as the search runs it, and a layer's seconds on its busiest
// ring piece.
#include "sim/solver/search.h"

#include <algorithm>
#include <cstdio>

#include "sim/baselines.h"

namespace sppo::sim::solver {

HardwareProfile plan_hardware(const HardwareProfile& hw_in, int gpus_per_node) {
  HardwareProfile hw = hw_in;
  hw.devices_per_node = gpus_per_node;
  return hw;
}

std::string bytes_text(i64 b) { return format_bytes(double(b)); }

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g s", s);
  return buf;
}

Candidate evaluate(const PlanRequest& req, plan::Plan p, const CostModel& cost, i64 budget, double no_use_s) {
  // Replicas are identical: the search simulates one, the final check all, and the weight
  // gradients' all-reduce as the whole plan runs it, over every replica (across nodes where
  // they are), even where one replica's own group is a single rank.
  CostModel priced = cost;
  priced.price_replicas(p.par.dp, p.par.ranks() / p.par.dp);
  const MemoryRules rules = plan_rules(p, cost.precision(), sched::Replicas::One);
  auto build = [&](const std::vector<double>& a) {
    return sched::build_step(p.model, p.lengths, a, p, sched::Replicas::One);
  };
  Candidate c{p, solve_alpha(build, p.subseqs, priced, rules, budget, req.offload, no_use_s)};
  c.plan.alpha = c.alpha.alpha;
  c.plan.alpha_rule = c.alpha.rule;
  return c;
}

void predict(plan::Plan* p, const HardwareProfile& hw) {
  const SimResult r = simulate_plan(*p, hw);
  p->predicted = {r.step_time_s,    r.tokens_per_device_per_s, r.bubble_ratio, r.peak_device_bytes,
                  r.exposed_copy_s, r.peak_host_bytes,         r.host_update_s};
}

int msp_search_reach(const plan::Plan& p) {
  const bool saving = !p.place.kv_layers(KvPlace::Host).empty() || !p.place.kv_layers(KvPlace::Recompute).empty() ||
                      p.place.recompute != 0 || p.place.mlp_tile_rows > 0;
  return saving || p.par.cp > 1 || p.par.pp > kMspEveryGroupStages ? 2 : 0;
}

plan::Plan with_msp(plan::Plan p) {
  p.par.msp.on = true;
  p.par.msp.reach = msp_search_reach(p);
  return p;
}

LayoutKey layout_key(const plan::Plan& p) {
  const ParallelDims& d = p.par;
  return {d.tp, d.ulysses, d.cp, d.pp, d.dp, p.subseqs, shards_gradients(d.zero) ? d.zero : ZeroStage::None};
}

bool msp_possible(const plan::Plan& p) {
  // The runtime runs MSP's pieces as one ring over the stage groups' cp ranks (Note [MSP
  // pieces]), each piece's rows over the group's TP members. Recomputed K/V and the
  // attention recomputed in backward need a rank's whole rows, head_grad recomputed a
  // stage's own head: not under MSP. Nor ZeRO-2 or 3: a helper returns a stage's gradients
  // whole (Note [ZeRO-2] in schedule/weights.h).
  if (p.par.pp == 1 || shards_gradients(p.par.zero) || p.subseqs < p.par.pp || p.par.ulysses > 1 || !p.place.kv_layers(KvPlace::Recompute).empty() ||
      (p.place.recompute & (kAttentionGroup | kHeadGradGroup)))
    return false;
  for (i64 l : p.lengths)
    if (l < i64(p.par.cp) * p.par.pp * p.par.tp) return false;
  return true;
}

double busiest_piece_s(const CostModel& cost, i64 o, i64 l, int cp, RingLayout layout, const PieceOptions& run) {
  const int tp = run.tp;
  double most = 0;
  for (int r = 0; r < cp; ++r) {
    const sched::Spans piece = sched::piece_spans(l, r, cp, cp > 1 ? layout : RingLayout::Contiguous);
    const double overhead = 2 * cost.hw().layer_overhead;
    double t = cost.layer_forward_s(o, piece, l) + cost.layer_backward_s(o, piece, l) - overhead;
    if (run.ulysses > 1) {  // the busiest member: the first, with the most rows and heads
      const double attention = 3.5 * cost.attention_s(o, piece, l);
      const double rows = double(UlyssesShard{0, run.ulysses}.row_count(sched::span_tokens(piece))) /
                          double(sched::span_tokens(piece));
      const double heads = double(TpShard{0, run.ulysses}.local_heads(cost.model())) / cost.model().heads;
      t = (t - attention) * rows + attention * heads;
      // Its all-to-alls, which hide behind nothing (CostModel::alltoall_s): the forward's two
      // and the backward's two, each U - 1 messages inside the node.
      const i64 T = sched::span_tokens(piece);
      const UlyssesShard first{0, run.ulysses};
      i64 sent = 0;
      for (UlyssesExchange x : {UlyssesExchange::Heads, UlyssesExchange::Rows, UlyssesExchange::GradHeads,
                                UlyssesExchange::GradRows})
        sent += ulysses_sent_bytes(cost.model(), T, cost.precision(), first, x);
      const HardwareProfile& hw = cost.hw();
      t += 4.0 * (run.ulysses - 1) * hw.intra_node_latency + double(sent) / hw.intra_node_bw;
    }
    double streamed = 0;
    if (run.kv != KvPlace::Device) {
      const bool rc = run.kv == KvPlace::Recompute;
      const CostModel::StreamedLayer forward{.recompute_kv = rc};
      const CostModel::StreamedLayer backward{.recompute_kv = rc, .backward = true, .sums_back = !run.last};
      // A Ulysses member streams its heads' K/V of every row: as tp members split them.
      const int split = std::max(tp, run.ulysses);
      streamed =
          cost.layer_stream_s(o, piece, l, cp, split, forward) + cost.layer_stream_s(o, piece, l, cp, split, backward);
    }
    most = std::max(most, t / tp + overhead + 10 * cost.tp_collective_s(sched::span_tokens(piece), tp) + streamed);
  }
  return most;
}

BaselinePick::BaselinePick(const PlanRequest& req)
    : req_(req), hw_(plan_hardware(req.hw, req.gpus_per_node)), budget_(req.budget > 0 ? req.budget : hw_.usable_memory()) {}

plan::Plan unplanned(const PlanRequest& req, i64 budget, ActPrecision prec) {
  plan::Plan p;
  p.system = req.system;
  p.model_name = req.model_name;
  p.model = req.model;
  p.hardware = req.hardware;
  p.seq_len = req.seq_len;
  p.gpus = req.gpus;
  p.gpus_per_node = req.gpus_per_node;
  p.budget = budget;
  p.precision = prec;
  p.block_scratch = req.block_scratch;
  p.head_scratch = req.head_scratch;
  return p;
}

plan::Plan BaselinePick::start() const {
  return unplanned(req_, budget_, precision_of(hw_));
}

void BaselinePick::consider(plan::Plan p) {
  predict(&p, req_.hw);
  const i64 host_limit = hw_.host_memory;
  const double device = double(p.predicted.peak_device_bytes) / double(budget_);
  const double host = host_limit > 0 ? double(p.predicted.peak_host_bytes) / double(host_limit) : 0.0;
  if (device > 1 || host > 1) {
    if (closest_ == 0 || std::max(device, host) < closest_) {
      closest_ = std::max(device, host);
      closest_text_ = plan::layout_text(p) + ": " +
                      (device >= host ? format_bytes(double(p.predicted.peak_device_bytes)) + " of device memory"
                                      : format_bytes(double(p.predicted.peak_host_bytes)) + " of host memory");
    }
    return;
  }
  if (p.predicted.tokens_per_gpu_per_s <= best_tput_) return;
  best_tput_ = p.predicted.tokens_per_gpu_per_s;
  best_ = std::move(p);
}

PlanOutcome BaselinePick::outcome(const std::string& how, const std::string& none) const {
  const PlanOutcome formula = solve_baseline(req_);
  char buf[64] = "nothing fits";
  if (formula.ok)
    std::snprintf(buf, sizeof buf, "%.1f tokens/GPU/s", formula.plan.predicted.tokens_per_gpu_per_s);
  const std::string own =
      std::string(to_string(req_.system)) + "'s own accounting, by the closed form (Note [Baseline models]): " +
      (formula.ok ? plan::layout_text(formula.plan) + " at " + buf + ", peak " +
                        format_bytes(double(formula.plan.predicted.peak_device_bytes))
                  : std::string(buf));
  PlanOutcome out;
  if (best_tput_ == 0) {
    out.error = std::string(to_string(req_.system)) + ": no layout of " + std::to_string(req_.gpus) + " devices fits " +
                std::to_string(req_.seq_len) + " tokens in " + format_bytes(double(budget_)) +
                " per device as sppo runs it (" + (closest_text_.empty() ? none : "the closest, " + closest_text_) +
                "); " + own;
    return out;
  }
  out.ok = true;
  out.plan = best_;
  out.plan.notes.push_back(how);
  out.plan.notes.push_back(own);
  return out;
}

}  // namespace sppo::sim::solver
