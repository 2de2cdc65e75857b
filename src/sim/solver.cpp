// The solver's entry points (sim/solver.h): the planner's search for system "sppo"
// (solve_sppo, its passes in sim/solver/, search.h), the baselines' (solve_baseline) behind
// solve_plan, MSP weighed for one layout (choose_msp), and a plan's memory rules, schedule and
// simulation. The alpha of one schedule is in sim/solver/solve_alpha.cpp.
#include "sim/solver.h"

#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "core/check.h"
#include "sim/baselines.h"
#include "sim/solver/search.h"

namespace sppo::sim {

using sched::MemoryRules;
using sched::Schedule;

MemoryRules memory_rules(const ModelConfig& c, ActPrecision precision) {
  MemoryRules m;
  m.model = c;
  m.precision = precision;
  m.weight_copy_bytes = precision == ActPrecision::BF16 ? 2 : 0;
  return m;
}

MemoryRules memory_rules(const ModelConfig& c, ActPrecision precision, const StepShape& shape,
                         sched::Replicas replicas) {
  MemoryRules m = memory_rules(c, precision);
  m.zero = shape.par.zero != ZeroStage::None;
  m.zero_shards = m.zero && replicas == sched::Replicas::One ? shape.par.zero_shards() : 0;
  m.optimizer_host = shape.place.optimizer_host();
  m.block_scratch = shape.block_scratch;
  m.head_scratch = shape.head_scratch;
  if (shape.forward_only) {  // an evaluation's runtime holds the fp32 weights (and their working copy) alone
    m.param_state_bytes = 4;
    m.optimizer_bytes = m.grad_bytes = 0;
    m.zero = m.optimizer_host = false;
    m.zero_shards = 0;
  }
  return m;
}

ActPrecision precision_of(const HardwareProfile& hw) {
  return hw.precision == "f32" ? ActPrecision::F32 : ActPrecision::BF16;
}

namespace solver {
namespace {

// One search over every layout in each of `pls`: the placements, bounds and alpha passes
// (MSP as `options` say, SearchOptions). Adds what it finds to `st`.
void search(const SearchContext& ctx, const std::vector<plan::Plan>& layouts, const std::vector<Placement>& pls,
            SearchState& st, const SearchOptions& options = {}) {
  const StateTier where = layouts.empty() ? StateTier::Device : state_tier(layouts.front());
  const std::vector<SearchCandidate> cands =
      placement_pass(ctx, layouts, pls, options, where, st.placements_tried, st.settled);
  const BoundedCandidates b = bound_pass(ctx, cands);
  double best_tput = 0;
  if (options.prune_by_fits)
    for (const Candidate& f : st.fits) best_tput = std::max(best_tput, ctx.tput(f.plan, f.alpha.step_time_s));
  alpha_pass(ctx, cands, b, where, st, best_tput);
  st.layouts_tried += int(cands.size());
}

// Note [Megatron-LM's layouts in the search]: a Megatron-LM plan (Note [Megatron-LM as a
// schedule] in solver/megatron.cpp) is an SPPO plan of one subsequence, nothing offloaded and
// full recomputation, on layouts the search does not lay out (rings across nodes, N = 1). Where
// the request leaves those choices to the planner (the offload adaptive or none, MSP not on,
// K/V, recomputed tensors and backward order auto, the weights and optimizer state not on the
// host; an explicit --backward-order asks for the search's own plans, as the paper's
// ablations are run), the fastest of them that fits is weighed
// against the search's plan, so that SPPO's plan is never slower than Megatron-LM's as sppo
// prices both (gpt-7b at 1M on 32 A100s: tp 4 cp 8 at one subsequence, 171.8 tokens/GPU/s,
// against the search's 170.1).
PlanOutcome with_megatron_layouts(const PlanRequest& req, PlanOutcome out) {
  const PlacementRequest& pl = req.place;
  const bool free = (req.offload == OffloadMode::Adaptive || req.offload == OffloadMode::None) && req.msp != true &&
                    pl.kv != KvPlace::Host && pl.kv != KvPlace::Recompute && !pl.recompute && !pl.backward &&
                    pl.optimizer_state != Tier::Host && pl.weights != Tier::Host &&
                    pl.residual_grads != Tier::Host &&
                    (pl.rebuild.kind == RebuildRequest::Kind::Auto || pl.rebuild.kind == RebuildRequest::Kind::None);
  if (!free) return out;
  PlanRequest m = req;
  m.system = plan::System::Megatron;
  PlanOutcome meg = solve_megatron(m);
  if (!meg.ok || (out.ok && meg.plan.predicted.tokens_per_gpu_per_s <= out.plan.predicted.tokens_per_gpu_per_s))
    return out;
  plan::Plan p = std::move(meg.plan);
  char buf[160];
  if (out.ok)
    std::snprintf(buf, sizeof buf, "%.1f tokens/GPU/s against %.1f for the search's best (%s)",
                  p.predicted.tokens_per_gpu_per_s, out.plan.predicted.tokens_per_gpu_per_s,
                  plan::layout_text(out.plan).c_str());
  else
    std::snprintf(buf, sizeof buf, "%.1f tokens/GPU/s, where the search's layouts found nothing that fits",
                  p.predicted.tokens_per_gpu_per_s);
  p.system = plan::System::Sppo;
  p.notes = {"Megatron-LM's layout, one subsequence and nothing offloaded, " +
             recompute_tensors_text(p.place.recompute) + " recomputed (Note [Megatron-LM's layouts in the search]): " +
             buf};
  out.ok = true;
  out.plan = std::move(p);
  out.error.clear();
  return out;
}

// The planner's search for system "sppo" (docs/design.md 5), pass by pass (sim/solver/search.h).
PlanOutcome solve_sppo(const PlanRequest& req) {
  const SearchContext ctx(req);
  if (std::optional<std::string> error = weights_alone_error(ctx)) {
    PlanOutcome out;
    out.error = *error;
    return out;
  }
  if (req.zero && shards_gradients(*req.zero) && ctx.G < 2) {
    PlanOutcome out;
    out.error = "--zero " + std::to_string(stage_number(*req.zero)) +
                " shards over the ranks that hold the same layers (a stage's dp, cp and Ulysses ranks): one device "
                "has none to shard over; use --zero auto, 0 or 1, or more --gpus";
    return out;
  }
  std::vector<plan::Plan> layouts = layout_pass(ctx);
  if (req.place.weights == Tier::Host) layouts = weights_on_host(req, layouts);
  const PlacementSets placements = placement_sets(req);
  const Placement& first = placements.first;
  const std::vector<Placement>& wider = placements.wider;
  const std::vector<Placement>& layered = placements.layered;
  SearchState st;
  search(ctx, layouts, {first}, st, {.weigh_msp = true});
  double first_best = 0;  // tokens/GPU/s of the best plan of the first placement, as searched
  for (const Candidate& f : st.fits) first_best = std::max(first_best, ctx.tput(f.plan, f.alpha.step_time_s));
  if (!wider.empty()) search(ctx, layouts, wider, st, {.msp_tasks = st.fits.empty() ? 0 : kMspWiderTasks});
  if (!layered.empty()) search(ctx, layouts, layered, st, {.prune_by_fits = true});
  // Note [ZeRO in the search] (solver/layouts.cpp): the layouts sharding more, against the
  // plans found.
  const bool zero_auto = !req.zero;
  const auto sharding_more = [&](const std::vector<plan::Plan>& from, const std::string& what) {
    for (ZeroStage z : {ZeroStage::Gradients, ZeroStage::Weights}) {
      const std::vector<plan::Plan> sharded = zero_sharded(from, z);
      if (sharded.empty()) continue;
      st.another_placement(what.empty() ? std::string(z == ZeroStage::Weights ? "ZeRO-3" : "ZeRO-2")
                                        : what + (z == ZeroStage::Weights ? " under ZeRO-3" : " under ZeRO-2"));
      search(ctx, sharded, {first}, st, {.prune_by_fits = true});
      if (!wider.empty()) search(ctx, sharded, wider, st, {.prune_by_fits = true});
      if (!layered.empty()) search(ctx, sharded, layered, st, {.prune_by_fits = true});
    }
  };
  if (zero_auto) sharding_more(layouts, "");
  // Where nothing fitted: the same placements again over layouts that keep less on the device.
  const auto search_again = [&](const std::vector<plan::Plan>& moved, const std::string& what) {
    if (moved.empty()) return;
    st.another_placement(what);
    search(ctx, moved, {first}, st);
    if (st.fits.empty() && !wider.empty()) search(ctx, moved, wider, st);
    if (st.fits.empty() && !layered.empty()) search(ctx, moved, layered, st, {.prune_by_fits = true});
  };
  // The layouts searched, each keeping less on the device than the one before.
  std::vector<std::pair<std::vector<plan::Plan>, std::string>> tiers = {{layouts, ""}};
  if (st.fits.empty() && req.place.optimizer_state == kAuto) {  // Note [Optimizer state under a budget]
    for (plan::Plan& p : layouts) p.place.optimizer_state = Tier::Host;
    search_again(layouts, "the optimizer state on the host");
    tiers.push_back({layouts, "the optimizer state on the host"});
    if (zero_auto) sharding_more(layouts, "the optimizer state on the host");
  }
  // Note [Weights in the search]
  if (st.fits.empty() && req.place.weights == kAuto && req.place.optimizer_state != Tier::Device) {
    tiers.push_back({weights_on_host(req, layouts), "the optimizer state and the layers' weights on the host"});
    search_again(tiers.back().first, tiers.back().second);
  }
  // Note [Rebuilt inputs in the search]: where nothing fits keeping every layer's input,
  // every other layer's rebuilt, over each tier of layouts in turn; where the plans that
  // fit already run the layer-major order, over the last tier, against them.
  const auto layer_major = [](const Candidate& f) { return f.plan.place.layer_major(); };
  if (!st.fits.empty() && std::any_of(st.fits.begin(), st.fits.end(), layer_major) && !tiers.back().first.empty())
    search(ctx, tiers.back().first, placements.rebuilt, st, {.prune_by_fits = true});
  for (const auto& [tier, what] : tiers) {
    if (!st.fits.empty() || placements.rebuilt.empty() || tier.empty()) break;
    st.another_placement(what.empty() ? "every other layer's input rebuilt"
                                      : what + " and every other layer's input rebuilt");
    search(ctx, tier, placements.rebuilt, st, {.prune_by_fits = true});
  }
  return with_megatron_layouts(req, rank_pass(ctx, st, first_best));
}

}  // namespace
}  // namespace solver

MspChoice choose_msp(const PlanRequest& req, const plan::Plan& layout) {
  using solver::Candidate, solver::evaluate, solver::msp_possible, solver::plan_hardware, solver::predict;
  using solver::seconds_text, solver::with_msp;
  const HardwareProfile hw = plan_hardware(req.hw, req.gpus_per_node);
  const ActPrecision prec = precision_of(hw);
  const CostModel cost(hw, layout.model, prec);
  const i64 budget = layout.budget > 0 ? layout.budget : hw.usable_memory();
  MspChoice m;
  plan::Plan off = layout, on = layout;
  off.par.msp.on = false;
  off.par.msp.reach = 0;
  on = with_msp(on);
  Candidate c_off = evaluate(req, off, cost, budget);
  m.off = c_off.plan;
  predict(&m.off, hw);
  m.off_fits = c_off.alpha.fits && m.off.predicted.peak_device_bytes <= budget;
  if (msp_possible(on)) {
    Candidate c_on = evaluate(req, on, cost, budget);
    m.on = c_on.plan;
    predict(&m.on, hw);
    m.on_fits = c_on.alpha.fits && m.on.predicted.peak_device_bytes <= budget;
  }
  const double t_off = m.off.predicted.step_time_s, t_on = m.on.predicted.step_time_s;
  const bool use_on = m.on_fits && (req.msp == true || !m.off_fits || t_on < t_off);
  const bool neither = !m.on_fits && !m.off_fits;
  m.chosen = neither ? (layout.par.msp.on && msp_possible(on) ? m.on : m.off) : use_on ? m.on : m.off;
  std::string note;
  if (!msp_possible(on))
    note = "MSP off: it needs N >= P and every subsequence at least P x cp x tp tokens";
  else if (use_on)
    note = std::string(req.msp == true ? "MSP on (--msp on): " : "MSP on: ") + seconds_text(t_on) +
           " per step, against " +
           (m.off_fits ? seconds_text(t_off) + " without it"
                       : "no plan without it that fits (peak " +
                             format_bytes(double(m.off.predicted.peak_device_bytes)) + ")") +
           " (both simulated)";
  else if (m.off_fits)
    note = "MSP off: " + seconds_text(t_off) + " per step, against " +
           (m.on_fits ? seconds_text(t_on) + " with it" : "a peak of " +
                                                              format_bytes(double(m.on.predicted.peak_device_bytes)) +
                                                              " with it, over the budget") +
           " (both simulated)";
  else
    note = "MSP: neither with it (" + seconds_text(t_on) + ") nor without it (" + seconds_text(t_off) +
           ") fits";
  m.note = note;
  m.chosen.notes.push_back(note);
  return m;
}

MemoryRules plan_rules(const plan::Plan& p, ActPrecision prec, sched::Replicas replicas) {
  return memory_rules(p.model, prec, p, replicas);
}

Schedule plan_schedule(const plan::Plan& p) { return sched::build_step(p.model, p.lengths, p.alpha, p); }

SimResult simulate_plan(const plan::Plan& p, const HardwareProfile& hw_in, const SimOptions& options) {
  const HardwareProfile hw = solver::plan_hardware(hw_in, p.gpus_per_node);
  const ActPrecision prec = precision_of(hw);
  return simulate(plan_schedule(p), CostModel(hw, p.model, prec), plan_rules(p, prec), options);
}

PlanOutcome solve_plan(const PlanRequest& req) {
  SPPO_CHECK(req.seq_len >= 1, "planner") << "--seq-len must be positive";
  SPPO_CHECK(req.gpus >= 1 && req.gpus_per_node >= 1, "planner") << "--gpus and --gpus-per-node must be positive";
  SPPO_CHECK(req.gpus <= req.gpus_per_node || req.gpus % req.gpus_per_node == 0, "planner")
      << "--gpus " << req.gpus << " is not a whole number of nodes of " << req.gpus_per_node;
  if (req.system == plan::System::Sppo) {
    // Note [MSP in bf16]: the runtime runs MSP's pieces with fp32 activations only (its
    // helpers borrow a stage's fp32 weights and return fp32 gradients, and no GPU has run
    // them), so a plan for a profile whose activations are bf16 does not use MSP: every plan
    // returned is one `train --plan` runs on that hardware.
    if (precision_of(solver::plan_hardware(req.hw, req.gpus_per_node)) == ActPrecision::BF16) {
      SPPO_CHECK(req.msp != true, "planner")
          << "--msp on: train runs MSP's pieces with fp32 activations only (CPU ranks), and the profile "
          << req.hardware << " computes in bf16; use --msp off or auto (auto leaves MSP off on this profile)";
      PlanRequest off = req;
      off.msp = false;
      PlanOutcome out = solver::solve_sppo(off);
      for (std::string& note : out.plan.notes)
        if (note == solver::kMspOffNote)
          note = "MSP off: train runs MSP's pieces with fp32 activations only, and this profile computes in bf16";
      return out;
    }
    return solver::solve_sppo(req);
  }
  if (req.system == plan::System::Megatron) return solver::solve_megatron(req);
  if (req.system == plan::System::Deepspeed) return solver::solve_deepspeed(req);
  SPPO_ASSERT(false);
  return {};
}

}  // namespace sppo::sim
