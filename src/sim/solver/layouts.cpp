// Pass 1 of the search (search.h): layouts. Takes the context; gives every layout the
// search considers, as plans with no placement: (tp, ulysses, cp, dp, pp) over the devices
// (Note [Sequence parallelism in the search]), the N of
// each at a few sizes of subsequence per device, its FLOPs-balanced lengths, and a stage
// split that gives the last stage fewer layers for the LM head. The later passes place,
// bound and simulate these and no others. Beside it, what comes before and after it in
// solve_sppo: whether any layout can hold even the weights (weights_alone_error), and the
// layouts again with the layers' weights on the host (weights_on_host, Note [Weights in the
// search]).
#include <algorithm>

#include "planner/partition.h"
#include "sim/solver/search.h"

namespace sppo::sim::solver {

using plan::divisors;

// Takes the context; gives the error when no layout can hold even the weights: an even
// split over the most stages possible, optimizer state sharded over the rest of the
// devices when ZeRO-1 may be used.
std::optional<std::string> weights_alone_error(const SearchContext& ctx) {
  const ModelConfig& c = ctx.c;
  const int max_pp = std::min(ctx.G, c.layers);
  const int most_shards = ctx.req.zero == ZeroStage::None ? 1 : ctx.G / max_pp;
  // With the layers' weights on the host (Note [Weights in the search]), the embedding and
  // head alone.
  const bool layers_host = ctx.host_allowed && ctx.req.place.weights != Tier::Device;
  const i64 least_params =
      sched::param_count(c, 0, layers_host ? 0 : (c.layers + max_pp - 1) / max_pp, true, max_pp == 1);
  const Tier state = ctx.host_allowed ? Tier::Host : Tier::Device;  // where the optimizer state may go
  const i64 least_weights = ctx.device_fixed(least_params, layers_host ? 1 : most_shards, state);
  if (least_weights <= ctx.budget) return std::nullopt;
  return std::string(layers_host          ? "the embedding's and LM head's weights and gradients alone need "
                     : ctx.host_allowed ? "weights and gradients alone (the optimizer state on the host) need "
                                        : "weights, gradients and optimizer state alone need ") +
         format_bytes(double(least_weights)) + " per device even over " + std::to_string(max_pp) +
         " pipeline stages, more than the budget of " + format_bytes(double(ctx.budget));
}

namespace {

// The LM head in layers' worth of compute, over the whole sequence (Note [Stage split]:
// the last stage runs it after every forward, so it gets fewer layers); each piece's rows
// over run's tensor-parallel or Ulysses ranks.
double head_layers(const SearchContext& ctx, const std::vector<i64>& lengths, int cp, const PieceOptions& run) {
  double layer = 0, head = 0;
  i64 o = 0;
  for (i64 l : lengths) {
    layer += busiest_piece_s(ctx.cost, o, l, cp, ctx.req.ring_layout, run);
    const i64 rows = (l + cp - 1) / cp;
    head += run.ulysses > 1 ? ctx.cost.head_flops(UlyssesShard{0, run.ulysses}.row_count(rows)) / ctx.hw.gemm_flops
                            : ctx.cost.head_flops(rows) / ctx.hw.gemm_flops / run.tp;
    o += l;
  }
  return layer > 0 ? head / layer : 0.0;
}

// The ways the search splits a sequence's tokens over the devices of a stage (Note
// [Sequence parallelism in the search]): (tp, ulysses, cp).
struct SequenceSplit {
  int tp = 1, ulysses = 1, cp = 1;
};

// Note [Sequence parallelism in the search]: tensor parallelism (tp, the paper's SP) and
// ring attention (cp) together inside a node (§6.1), as the paper pairs them; and Ulysses
// (ulysses, U ranks inside a node, at most the key/value heads or a multiple of them whose
// ranks share each head's queries: ulysses_runs), never beside tp (both split the heads):
// alone at every U a node runs, and at the widest such U under a ring of 2 to 8 members
// that may cross nodes (USP as its authors lay it out: ulysses 8 inside a node and cp 2
// across). Narrower Ulysses groups under a ring would put ring traffic where all-to-alls
// run faster, and searching them too took gpt-7b at 1M on 32 A100s from 6.9 s to 11.5 s.
// A USP stage has U x cp ranks, of which the search simulates the first member of each
// Ulysses group (Note [One Ulysses member in the search] in schedule/builders.cpp): with
// every member, gpt-7b at 8M on 128 H200s took 18.5 s against 9.7 without Ulysses (its
// plan, ulysses 8 cp 4 dp 4, runs 70.4 tokens/GPU/s against the ring's 69.0). Ulysses holds what tp would divide whole
// (every weight), but keeps 1/U of the K/V cache without cutting a GEMM, moves no prefix,
// and runs the placements a ring does not (recomputed attention aside): rebuilt inputs, and
// MLP tiles.
std::vector<SequenceSplit> sequence_splits(const SearchContext& ctx) {
  const ModelConfig& c = ctx.c;
  const int G = ctx.G, node = std::min(ctx.G, ctx.gpn);
  std::vector<SequenceSplit> out;
  for (int tp : divisors(node))
    for (int cp : divisors(node / tp)) {
      if (G % (cp * tp) || tp > c.heads) continue;
      if (c.llama() && !sched::llama_tp_runs(c, tp)) continue;
      out.push_back({tp, 1, cp});
    }
  int widest = 1;  // the most Ulysses ranks a node runs
  for (int U : divisors(node)) {
    if (U == 1 || !ulysses_runs(c, U)) continue;
    out.push_back({1, U, 1});
    widest = U;
  }
  if (widest > 1)
    for (int cp : divisors(G / widest))
      if (cp > 1 && cp <= kMaxRing) out.push_back({1, widest, cp});
  return out;
}

}  // namespace

// The layouts pass. Takes the context; gives every layout the search considers, as plans
// with no placement: (tp, ulysses, cp, dp, pp), and N at a few sizes of subsequence per device,
// each with its FLOPs-balanced lengths and stage split. Empty where every layout needs
// more subsequences than the search allows.
std::vector<plan::Plan> layout_pass(const SearchContext& ctx) {
  const PlanRequest& req = ctx.req;
  const ModelConfig& c = ctx.c;
  const i64 S = ctx.S;
  const int G = ctx.G;
  std::vector<plan::Plan> layouts;
  for (const SequenceSplit& sp : sequence_splits(ctx)) {
    const int tp = sp.tp, U = sp.ulysses, cp = sp.cp, split = tp * U * cp;
    for (int dp : divisors(G / split)) {
      const int pp = G / split / dp;
      if (pp > c.layers) continue;
      for (i64 per_device : {kMaxTokensPerSubseq, i64(8192), i64(4096), i64(2048)}) {
        const i64 n64 = std::max<i64>(1, S / (i64(split) * per_device));
        if (n64 > kMaxPlanSubseqs || n64 * split > S) continue;
        const int N = int(n64);
        plan::Plan p = unplanned(req, ctx.budget, ctx.prec);
        p.system = plan::System::Sppo;
        p.par.cp = cp;
        p.par.tp = tp;
        p.par.ulysses = U;
        p.par.pp = pp;
        p.par.dp = dp;
        p.subseqs = N;
        p.lengths = plan::partition_flops(c, S, N);
        if (p.lengths.back() < i64(split)) continue;
        // ZeRO over a group of one shards nothing: no stage there (2 and 3 not that layout).
        p.par.zero = cp * U * dp > 1 ? req.zero.value_or(ZeroStage::OptimizerState) : ZeroStage::None;
        if (shards_gradients(req.zero.value_or(ZeroStage::None)) && p.par.zero_sharding_refused()) continue;
        p.place.optimizer_state = req.place.optimizer_state == Tier::Host ? Tier::Host : Tier::Device;
        p.par.ring_layout = req.ring_layout;
        p.offload = req.offload;
        p.stage_layers =
            plan::balanced_stage_layers(c.layers, pp, head_layers(ctx, p.lengths, cp, {.tp = tp, .ulysses = U}));
        const LayoutKey key = layout_key(p);
        if (std::any_of(layouts.begin(), layouts.end(), [&](const plan::Plan& q) { return layout_key(q) == key; }))
          continue;
        layouts.push_back(p);
      }
    }
  }
  return layouts;
}

// Note [Weights in the search]: the layers' weights and gradients go to the host (Note
// [Weights on the host] in schedule/weights.h) under --weights host, or under auto where no
// plan fits even with the optimizer state there: it frees 10 B a parameter of the device in
// bf16 (the fp32 weights, their working copy, the fp32 gradient) but copies every layer's
// weights in for each forward and backward that runs it, which only buys memory. It runs on
// layouts without tensor parallelism and with no ZeRO-1 (the host's master is whole on
// each rank; under --zero auto it is turned off there), and without MSP.
// Takes the layouts; gives those that can keep their weights on the host, so placed.
std::vector<plan::Plan> weights_on_host(const PlanRequest& req, const std::vector<plan::Plan>& layouts) {
  std::vector<plan::Plan> out;
  for (plan::Plan p : layouts) {
    if (p.par.tp > 1 || (req.zero && *req.zero != ZeroStage::None)) continue;
    p.par.zero = ZeroStage::None;
    p.place.optimizer_state = Tier::Host;
    p.place.weights = Tier::Host;
    out.push_back(std::move(p));
  }
  return out;
}

// Note [ZeRO in the search]: ZeRO-2 and 3 (Notes [ZeRO-2] and [ZeRO-3] in
// schedule/weights.h) shard a layer group's gradients, and its weights, as ZeRO-1 shards the
// AdamW state. Under --zero auto the search lays out ZeRO-1 (where a group has two or more
// ranks) and searches it first; then the same layouts under ZeRO-2, and under ZeRO-3, with
// the same placements, pruned by the plans found (a candidate whose bound is slower than
// the best that fits is not simulated); and where nothing fits with the optimizer state on
// the device, all three again with it on the host. ZeRO-2 costs no time (its
// reduce-scatters are ZeRO-1's) and saves where a layer's gradient is not alive: before its
// first backward, and in the layer-major backward after its last. ZeRO-3 saves the weights
// too, but all-gathers every layer ahead of each F and B that runs it, priced on the
// network lane: it wins where what it frees buys a faster placement (fewer tensors
// recomputed, less offloaded, fewer subsequences): gpt-7b at 32K on four one-GPU nodes, dp
// 4, 2422.8 tokens/GPU/s against ZeRO-1's 2349.3. Of two plans as fast the one sharding
// less is chosen (rank_pass). Layouts with tensor parallelism, or one rank a group, run
// neither (ParallelDims::zero_sharding_refused, which train's refusals name too), and none
// weighs MSP (msp_possible). --zero 2 or 3 searches the layouts that run it alone.
// Takes layouts; gives those that run `zero`, so sharded.
std::vector<plan::Plan> zero_sharded(const std::vector<plan::Plan>& layouts, ZeroStage zero) {
  std::vector<plan::Plan> out;
  for (plan::Plan p : layouts) {
    if (p.par.zero_sharding_refused() || p.place.weights_host()) continue;
    p.par.zero = zero;
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace sppo::sim::solver
