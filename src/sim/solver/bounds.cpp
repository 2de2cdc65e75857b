// Pass 3 of the search (search.h): bounds. Takes a search's candidates (pass 2); gives each
// one's bounds, worked out without simulating it (the least device and host memory any
// alpha leaves it, the most tokens/GPU/s it can reach), and the order the alpha pass tries
// the candidates in: the highest throughput bound first. A bound costs arithmetic where a
// candidate's alpha costs simulations of its whole step; a bound over the budget rules a
// candidate out unsimulated, and tried in this order the first plans found prune most of
// the rest (Note [Pruning the search]).
#include <algorithm>

#include "schedule/msp.h"
#include "sim/solver/search.h"

namespace sppo::sim::solver {

// Note [Pruning the search]: two bounds skip simulations that cannot win.
//  - memory: at the end of B(N-1) a stage holds its weights, the K/V of every other
//    subsequence and the dK/dV accumulators of every layer, whatever alpha is (with
//    K/V streamed, the weights alone on the device); and what of those (K/V not at all
//    where they are recomputed) and of the other subsequences' kept activations the
//    device cannot hold must fit the host memory;
//  - time: a step takes at least its compute (forward + backward of the stage's layers
//    on every subsequence, on the busiest ring piece, with what it recomputes and, with
//    the K/V streamed, what the attention does not hide of the earlier rows' chunks)
//    times 1 + (P-1)/N without MSP.
// Candidates are tried in order of the time bound, so the second prunes most of the rest.

namespace {

// The bounds of candidate p, placed by pl.
Bounds candidate_bounds(const SearchContext& ctx, const plan::Plan& p, const Placement& pl) {
  const ModelConfig& c = ctx.c;
  const MemoryRules& rules = ctx.rules;
  const int n_s = *std::max_element(p.stage_layers.begin(), p.stage_layers.end());
  const int shards = p.par.zero_shards();
  const i64 heads_share = TpShard{0, p.par.tp}.local_heads(c);
  // A Ulysses member keeps its key/value heads of every row, its rows of the rest (the
  // first member, with the most of both, bounds them all from below as the whole share).
  const int U = p.par.ulysses;
  const double kv_share = double(TpShard{0, U}.local_kv_width(c)) / double(c.kv_width());
  const i64 before_last = (ctx.S - p.lengths.back()) / p.par.cp;
  // The paper's backward order holds every layer's dK/dV sums at the end of B(N-1); the
  // layer-major one, one layer's (and every layer's K/V) at the end of B(L-1, N-1).
  const bool layer_major = pl.backward == BackwardOrder::Layer;
  const bool on_device = pl.kv == KvPlace::Device;
  const i64 kv_dev = !on_device ? 0 : U > 1 ? i64(double(ctx.kv_pt) * kv_share) : ctx.kv_pt * heads_share / c.heads;
  const i64 acc_dev = !on_device ? 0 : U > 1 ? i64(double(ctx.acc_pt) * kv_share) : ctx.acc_pt * heads_share / c.heads;
  // A Recompute layer keeps no K/V, and sums its dK/dV into the layer input's gradient
  // (H fp32 a position, not 2H).
  const bool kv_kept = pl.kv != KvPlace::Recompute;
  const i64 sums_pt = kv_kept ? ctx.acc_pt : i64(c.hidden) * rules.accum_bytes;
  const i64 per_token = ctx.unit_pt(p.place.recompute) + (kv_kept ? ctx.kv_pt : 0) + (layer_major ? 0 : sums_pt);
  // A token's sums of the one layer alive; with rebuilt inputs a rebuilt layer's K/V are
  // on the host, its sums those of a Host layer (the lesser of the two kinds counts).
  const i64 once_pt = !layer_major ? 0 : pl.rebuilt && !kv_kept ? std::min(sums_pt, ctx.acc_pt) : sums_pt;
  // Note [Rebuilt layer inputs]: a rebuilt layer keeps no x but keeps its K/V (those the
  // placement recomputes, on the host).
  const i64 rebuilt_pt = i64(c.hidden) * rules.act_bytes() - (kv_kept ? 0 : ctx.kv_pt);
  const auto rebuilt_of = [&](int n) { return pl.rebuilt ? i64(n / 2) : 0; };
  const i64 head_grad_pt = in_set(p.place.recompute, kSavedHeadGrad) ? 0 : i64(c.hidden) * rules.act_bytes();
  // Stage by stage: its weights (tensor parallelism divides them and the K/V by heads;
  // member 0's shards are the largest); the device holds them with the K/V and the
  // dK/dV accumulators, whatever alpha is. What cannot be on the device is on the host:
  // when B(N-1) ends, a stage holds the saved activations, K/V and dK/dV sums of every
  // other subsequence, at least their share a member (the last stage with their head
  // gradients), less what the device holds beside its weights. Under MSP helpers hold
  // the pieces of a stage's split subsequences (msp_phases: its first pp - 1 - st and last
  // st), so the host bound counts its steady ones alone, which it holds whole once its
  // forwards end.
  i64 mem = 0, host = 0;
  int first = 0;
  const Tier state = p.place.optimizer_state;
  const int N = p.subseqs;
  for (std::size_t st = 0; st < p.stage_layers.size(); ++st) {
    const int n = p.stage_layers[st], end = first + n;
    const i64 params = p.par.tp > 1 ? sched::param_count(c, first, end, TpShard{0, p.par.tp})
                                : sched::param_count(c, first, end, first == 0, end == c.layers);
    // With the layers' weights on the host the device keeps the embedding's, final norm's
    // and head's (and the two layers in flight, not counted: this is a bound).
    const i64 layers_host = p.place.weights_host() ? i64(n) * sched::layer_params(c, TpShard{0, p.par.tp}) : 0;
    const i64 weights = ctx.device_fixed(params - layers_host, shards, state);
    mem = std::max(mem, weights + (i64(n) * kv_dev + (layer_major ? 1 : n) * acc_dev) * before_last);
    i64 held = before_last;
    if (p.par.msp.on) {
      held = 0;
      for (int k : sched::msp_phases(p.par.pp, N, int(st), p.par.msp.reach).steady)
        if (k < N - 1) held += p.lengths[std::size_t(k)];
      held /= p.par.cp;
    }
    const i64 saved =
        (i64(n) * per_token - rebuilt_of(n) * rebuilt_pt + once_pt + (end == c.layers ? head_grad_pt : 0)) * held /
        (p.par.tp * U);
    const i64 spilled = std::max<i64>(0, weights + saved - ctx.budget);
    host = std::max(host, ctx.host_fixed(params, shards, state) + spilled);
    first = end;
  }
  double compute = 0;
  i64 o = 0;
  const bool kv_rc = pl.kv == KvPlace::Recompute;
  for (std::size_t i = 0; i < p.lengths.size(); ++i) {
    const i64 l = p.lengths[i];
    // An MSP helper keeps its pieces on the device: no stream where tasks may split.
    const KvPlace streamed = p.par.msp.on ? KvPlace::Device : pl.kv;
    double layer = busiest_piece_s(ctx.cost, o, l, p.par.cp, ctx.req.ring_layout,
                                   {.tp = p.par.tp,
                                    .ulysses = U,
                                    .kv = streamed,
                                    .last = i + 1 == p.lengths.size()});
    if (p.place.recompute || kv_rc) {
      const sched::Spans whole{{0, l}};
      const SavedSet groups = p.place.recompute;
      layer += (ctx.cost.layer_recompute_s(o, whole, groups, {.kv = kv_rc}, p.par.tp) +
                ctx.cost.layer_recompute_s(o, whole, groups, {.kv = kv_rc, .backward = true}, p.par.tp)) /
               (p.par.cp * U);
    }
    // A rebuilt layer's backward runs the layer below's forward again.
    compute += n_s * layer + double(rebuilt_of(n_s)) * ctx.cost.layer_forward_s(o, l);
    o += l;
  }
  const double step = compute * (p.par.msp.on ? 1.0 : 1.0 + double(p.par.pp - 1) / p.subseqs);
  return {mem, ctx.tput(p, step), host};
}

}  // namespace

// The bounds pass. Takes a search's candidates; gives each one's bounds (by index) and the
// order the alpha pass tries them in: the highest throughput bound first, ties in the
// candidates' order.
BoundedCandidates bound_pass(const SearchContext& ctx, const std::vector<SearchCandidate>& cands) {
  BoundedCandidates b;
  b.bound.resize(cands.size());
  b.order.resize(cands.size());
  for (std::size_t k = 0; k < cands.size(); ++k) {
    b.bound[k] = candidate_bounds(ctx, cands[k].plan, cands[k].pl);
    b.order[k] = k;
  }
  std::stable_sort(b.order.begin(), b.order.end(),
                   [&](std::size_t i, std::size_t j) { return b.bound[i].tput > b.bound[j].tput; });
  return b;
}

}  // namespace sppo::sim::solver
