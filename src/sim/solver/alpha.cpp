// Pass 4 of the search (search.h): alpha. Takes a search's candidates with their bounds
// and order (passes 2 and 3); simulates, in that order, each candidate that its bounds and
// the plans found so far do not rule out, for its best alpha under the budget (evaluate:
// solve_alpha.cpp), and gives, in the SearchState, the candidates that fit, the closest
// miss, and the floors and alpha = 0 steps that prune candidates after them, in this search
// and the next. Only a simulation tells whether a candidate fits and how fast it runs; this
// pass spends them where a faster plan may still be found (Note [Pruning the search]).
#include <algorithm>
#include <map>

#include "sim/solver/search.h"

namespace sppo::sim::solver {

namespace {

// The layout's sequence parallelism in words, for the reasons a search gives.
std::string sp_text(const plan::Plan& p) {
  if (p.par.tp == 1 && p.par.cp == 1 && p.par.ulysses == 1) return "no sequence parallelism";
  ParallelDims sp;  // the layout's sequence parallelism alone
  sp.tp = p.par.tp;
  sp.ulysses = p.par.ulysses;
  sp.cp = p.par.cp;
  const std::string text = layout_text(sp);
  return text.substr(0, text.find(" pp "));
}

// The most AdamW bytes of one rank of layout p (what a floor drops by with the state on
// the host).
i64 state_bound(const SearchContext& ctx, const plan::Plan& p) {
  i64 most = 0;
  int first = 0;
  for (int n : p.stage_layers) {
    const int end = first + n;
    const TpShard tp{0, p.par.tp};
    const int shards = p.par.zero_shards();  // plan_rules(p, ..., Replicas::One): shard 0 everywhere
    const i64 state = shards > 1 ? sched::zero_state_params(ctx.c, first, end, shards, 0, tp)
                                 : sched::param_count(ctx.c, first, end, tp);
    // With the layers' weights on the host their weights, working copies and gradients
    // leave too (less the two layers in flight: not subtracted, so this stays a bound).
    const i64 layers = p.place.weights_host() ? i64(n) * sched::layer_params(ctx.c, tp) *
                                                 (ctx.rules.weight_bytes() + ctx.rules.weight_copy_bytes +
                                                  ctx.rules.grad_bytes)
                                           : 0;
    most = std::max(most, state * ctx.rules.optimizer_bytes + layers);
    first = end;
  }
  return most;
}

}  // namespace

// The alpha pass. Takes a search's candidates with their bounds and order; simulates, in
// that order, each one that its bounds and what the search has found so far do not rule
// out, for its best alpha under the budget (evaluate). Gives, in `st`: the candidates that
// fit, the closest miss, and the floors and alpha = 0 steps that prune later candidates.
// `state`: where this search keeps the optimizer state; off the device, the floors the
// device-state search kept rule candidates out (Note [Optimizer state under a budget],
// continued). `best_tput`: the tokens/GPU/s a candidate must beat to be of use (0: none
// yet); it rises as candidates fit.
void alpha_pass(const SearchContext& ctx, const std::vector<SearchCandidate>& cands, const BoundedCandidates& b,
                StateTier state, SearchState& st, double best_tput) {
  const i64 budget = ctx.budget;
  // Note [Pruning the search], continued: the wider search first simulates each group's
  // highest level; a group where that does not fit is dropped whole, and a level that does
  // not fit drops the levels below it.
  std::map<GroupKey, std::size_t> fails_below;  // group -> levels under this do not fit
  std::vector<char> done(cands.size(), 0);
  // Whether candidate k cannot fit by its bounds (and why, kept for the error).
  auto out_of_bounds = [&](std::size_t k) {
    const plan::Plan& p = cands[k].plan;
    const Bounds& bk = b.bound[k];
    if (ctx.host_limit > 0 && bk.host > ctx.host_limit) {
      st.miss(double(bk.host), double(ctx.host_limit), [&] {
        return "with " + sp_text(p) + " and " + std::to_string(p.par.pp) +
               " stages, the activations, K/V and dK/dV sums that do not fit the device need at least " +
               format_bytes(double(bk.host)) + " of host memory, over its " + format_bytes(double(ctx.host_limit)) +
               " (more --gpus, or a larger --host-budget where the host has it)";
      });
      return true;
    }
    if (bk.mem > budget) {
      st.miss(double(bk.mem), double(budget), [&] {
        return "weights, the K/V cache and the dK/dV accumulators alone need " + format_bytes(double(bk.mem)) +
               " with " + sp_text(p) + " and " + std::to_string(p.par.pp) + " stages";
      });
      return true;
    }
    return false;
  };
  // Simulates candidate k (no_use_s as below); false when it does not fit.
  auto try_candidate = [&](std::size_t k, double no_use_s) {
    const SearchCandidate& ck = cands[k];
    const plan::Plan& p = ck.plan;
    done[k] = 1;
    auto mark_failed = [&] {
      std::size_t& below = fails_below[ck.group];
      below = std::max(below, ck.level + 1);
      return false;
    };
    if (state != StateTier::Device) {
      const auto kept = st.device_floors.find(ck.key);
      const i64 lower = kept == st.device_floors.end() ? 0 : kept->second - state_bound(ctx, p);
      if (lower > budget) {
        st.miss(double(lower), double(budget), [&] {
          return "with " + sp_text(p) + ", " + std::to_string(p.par.pp) + " stages and N = " +
                 std::to_string(p.subseqs) + ": peak device memory of at least " + bytes_text(lower) +
                 " with the optimizer state on the host exceeds the budget of " + bytes_text(budget);
        });
        return mark_failed();
      }
    }
    Candidate cand = evaluate(ctx.req, p, ctx.cost, budget, no_use_s);
    if (state == StateTier::Device && cand.alpha.floor_bytes > 0) st.device_floors[ck.key] = cand.alpha.floor_bytes;
    if (cand.alpha.least_step_s > 0)
      st.least_steps[ck.key.variant].push_back(
          {ck.pl.kv, p.place.recompute, p.place.mlp_tile_rows, p.par.msp.reach, cand.alpha.least_step_s});
    if (cand.alpha.slow) {
      st.settled.insert(ck.key);
      return true;
    }
    if (cand.alpha.fits) {
      st.settled.insert(ck.key);
      best_tput = std::max(best_tput, ctx.tput(p, cand.alpha.step_time_s));
      st.fits.push_back(std::move(cand));
      return true;
    }
    // A miss over the host's memory, not the device's, is measured against the host's.
    const bool host_miss = cand.alpha.peak_device_bytes <= budget && ctx.host_limit > 0 &&
                           cand.alpha.host_bytes > ctx.host_limit;
    st.miss(double(host_miss ? cand.alpha.host_bytes : cand.alpha.peak_device_bytes),
            double(host_miss ? ctx.host_limit : budget), [&] {
              return "with " + sp_text(p) + ", " + std::to_string(p.par.pp) + " stages and N = " +
                     std::to_string(p.subseqs) + ": " + cand.alpha.reason;
            });
    return mark_failed();
  };
  std::map<GroupKey, std::size_t> top;  // group -> its candidate of the highest level
  for (std::size_t k = 0; k < cands.size(); ++k) {
    auto [it, fresh] = top.try_emplace(cands[k].group, k);
    if (!fresh && cands[k].level > cands[it->second].level) it->second = k;
  }
  auto no_use_s = [&](const plan::Plan& p) {
    return best_tput > 0 ? double(ctx.S) * p.par.dp / (ctx.G * best_tput) * (1 + 1e-9) : 0.0;
  };
  auto dropped = [&](std::size_t k) {
    auto f = fails_below.find(cands[k].group);
    return f != fails_below.end() && cands[k].level < f->second;
  };
  // Whether a placement of k's layout that k adds to is already no faster than the best.
  auto outrun = [&](std::size_t k) {
    const plan::Plan& p = cands[k].plan;
    const double limit = no_use_s(p);
    const auto seen = st.least_steps.find(cands[k].key.variant);
    if (limit == 0 || seen == st.least_steps.end()) return false;
    for (const LeastStep& l : seen->second)
      if (l.step_s >= limit && l.reach == p.par.msp.reach &&
          (l.kv == KvPlace::Device || l.kv == cands[k].pl.kv) && (l.recompute & p.place.recompute) == l.recompute &&
          (l.tiles == 0 || l.tiles == p.place.mlp_tile_rows))
        return true;
    return false;
  };
  for (const std::size_t k : b.order) {
    if (done[k] || dropped(k)) continue;
    const plan::Plan& p = cands[k].plan;
    if (out_of_bounds(k)) continue;
    if (b.bound[k].tput <= best_tput || outrun(k)) continue;
    // The group's highest level first: where it does not fit, nothing of the group does.
    const std::size_t t = top.at(cands[k].group);
    if (t != k && !done[t] && !out_of_bounds(t) && !outrun(t)) {
      try_candidate(t, no_use_s(cands[t].plan));
      if (dropped(k)) continue;
    }
    // Note [Pruning the search], continued: alpha = 0 is a layout's fastest alpha (copies
    // only add), so a layout whose alpha = 0 step is already slower than the best found, by
    // more than rounding, is dropped after that one simulation.
    try_candidate(k, no_use_s(p));
  }
}

}  // namespace sppo::sim::solver
