// Pass 2 of the search (search.h): placements. Takes the layouts of pass 1 and the
// placements one search tries; gives its candidates: each layout under each placement of
// its tensors it can run (where its K/V live, what its backward recomputes, MLP tiles, the
// backward's order, rebuilt inputs), with MSP or without, that no earlier search tried.
// Alpha aside, these are every choice a plan makes, and each candidate carries the keys
// (its variant, group, level and FloorKey) by which the later passes prune it against
// the others. Also the placements a request allows (placement_sets), grouped by the search
// that tries them (Note [Placing every tensor]).
#include <algorithm>

#include "core/check.h"
#include "sim/solver/search.h"

namespace sppo::sim::solver {

// Note [Rebuilt inputs in the search]: rebuilding every other layer's input (Note [Rebuilt
// layer inputs] in schedule/builders.cpp) frees H e bytes a token of each rebuilt layer
// (less the K/V it keeps where the others recompute theirs) for a layer's forward more in
// its backward: it buys memory, and with memory fewer, longer subsequences (each
// subsequence's backward recomputes or streams the K/V of every earlier one, so near the
// limit a plan keeping every input runs hundreds of short ones and is several times
// slower). So it is searched last: where the plans found already run the layer-major order
// (which only memory makes the planner choose), against them, over the layouts searched
// last; and where nothing fits keeping every input, over each tier of layouts the
// searches before it tried (the state on the device, then on the host, then the layers'
// weights there too). In the layer-major order, with every placement whose K/V are on the
// device or recomputed, on layouts without TP, rings or MSP (Ulysses' groups rebuild theirs). A stage rebuilds its second,
// fourth, ... layers (those at odd offsets from its first), each from the one below it.

// Note [Placing every tensor]: besides alpha, a plan places the K/V of its layers (kept
// on the device, on the host, or recomputed from the layer input) and the rest of each
// layer's saved tensors (kept or offloaded, or recomputed: one of recompute_levels(),
// which add groups in order of their seconds per byte saved). One placement serves every
// layer. The search runs twice: first with the K/V on the device and nothing recomputed
// beyond --recompute-tensors, then over every other placement --kv-cache and
// --recompute-tensors allow, each (layout, placement) a candidate with its own bounds,
// and the fastest that fits of both wins. The first search's best prunes most of the
// second (Note [Pruning the search]). A placement that saves memory can be faster where
// it lets a faster layout fit: gpt-65b at 640K on 128 A100s, tp 4 cp 2 pp 8 dp 2 with the
// K/V on the host and ln1, ln2 and fc_pre recomputed, 42.6 tokens/GPU/s, against 37.7 for
// the best plan that keeps the K/V on the device (tp 2 cp 4 pp 16), which was the plan
// while the second search ran only where the first found nothing. The wider search also
// runs each of those placements with the MLP in tiles of kPlanMlpTileRows rows (Note [MLP
// tiles] in core/layout.h) on layouts without tensor parallelism whose subsequences are longer:
// the workspace's [T, F] MLP activation, and a recomputed fc_pre, become [R, F]. The
// same FLOPs in GEMMs of R rows, which run at the rate of whole ones; the cost model
// prices the tiles' kernel launches (CostModel::mlp_tiles_s).
// Note [Layer-major backward in the search]: each placement runs in the paper's backward
// order and, under --backward-order auto or layer, in the layer-major order too (Note [Layer-major backward] in
// schedule/builders.cpp): the same ops in another order, so it costs the prefetches'
// smaller overlap, the residual gradients' rows and, between pipeline stages, the
// backwards' overlap (a stage sends its first gradient in its last pass), and holds one
// layer's dK/dV sums (on the device, or the host's for streamed K/V) where the paper's
// order holds every layer's. It only saves memory, so under auto a third search runs the
// layer-major twins of the candidates the first two could not fit (SearchState::settled),
// on layouts of one stage; its schedules have a B op for every (layer, subsequence), and
// searching every twin took llama-3-8b at 3584K on 8 H100s from 1.2 to 23 s of CPU.

// The placements the request allows, each search's (PlacementSets).
PlacementSets placement_sets(const PlanRequest& req) {
  PlacementSets out;
  const auto order = req.place.backward == BackwardOrder::Layer ? BackwardOrder::Layer : BackwardOrder::Subseq;
  out.first = {req.place.kv.value_or(KvPlace::Device), req.recompute_least(), 0, order};
  const Placement& first = out.first;
  std::vector<Placement>& wider = out.wider;
  std::vector<KvPlace> kvs = {first.kv};
  if (req.place.kv == kAuto) kvs = {KvPlace::Device, KvPlace::Host, KvPlace::Recompute};
  std::vector<SavedSet> sets = {req.recompute_least()};
  if (req.recompute_auto())
    for (SavedSet level : recompute_levels())
      if (std::find(sets.begin(), sets.end(), level | req.recompute_least()) == sets.end())
        sets.push_back(level | req.recompute_least());
  for (KvPlace kv : kvs)
    for (SavedSet set : sets) {
      const Placement pl{kv, set, 0, order};
      if (!(pl == first)) wider.push_back(pl);
    }
  const std::size_t untiled = wider.size();
  wider.push_back({first.kv, first.recompute, kPlanMlpTileRows, order});
  for (std::size_t k = 0; k < untiled; ++k)
    wider.push_back({wider[k].kv, wider[k].recompute, kPlanMlpTileRows, order});
  // --backward-order auto: every placement in the layer-major order too.
  if (req.place.backward == kAuto) {
    out.layered.push_back({first.kv, first.recompute, 0, BackwardOrder::Layer});
    for (Placement pl : wider) {
      pl.backward = BackwardOrder::Layer;
      out.layered.push_back(pl);
    }
  }
  // Note [Rebuilt inputs in the search]: in the layer-major order, every placement whose
  // K/V are not on the host (the layer below a rebuilt one cannot stream them) again with
  // every other layer's input rebuilt; the rebuilt layers keep the K/V that the others
  // recompute on the host.
  if (req.place.rebuild.kind == RebuildRequest::Kind::Auto)
    for (const std::vector<Placement>* from : {&out.layered, &out.wider})
      for (Placement pl : *from)
        if (pl.backward == BackwardOrder::Layer && pl.kv != KvPlace::Host) {
          pl.rebuilt = true;
          if (std::find(out.rebuilt.begin(), out.rebuilt.end(), pl) == out.rebuilt.end()) out.rebuilt.push_back(pl);
        }
  if (req.place.rebuild.kind == RebuildRequest::Kind::Auto && out.first.backward == BackwardOrder::Layer &&
      out.first.kv != KvPlace::Host) {
    Placement pl = out.first;
    pl.rebuilt = true;
    out.rebuilt.insert(out.rebuilt.begin(), pl);
  }
  // --rebuild-inputs odd (with --backward-order layer, and K/V not on the host): every
  // placement rebuilds them.
  if (req.place.rebuild.kind == RebuildRequest::Kind::Odd) {
    SPPO_ASSERT(out.first.backward == BackwardOrder::Layer && out.first.kv != KvPlace::Host);
    out.first.rebuilt = true;
    std::erase_if(out.wider, [](const Placement& pl) { return pl.kv == KvPlace::Host; });
    for (Placement& pl : out.wider) pl.rebuilt = true;
    out.layered.clear();
  }
  return out;
}

namespace {

// The layers a stage [b, e) rebuilds the inputs of: every other one from its second.
bool rebuilt_in_stage(int l, int b) { return l > b && (l - b) % 2 == 1; }

// What a layout can recompute: the attention needs a rank's whole rows (no ring, no MSP),
// head_grad a stage's own head (no MSP: Note [The loss in backward] in core/layout.h). A
// placement recomputes the rest of its set there.
SavedSet runnable(const PlanRequest& req, const plan::Plan& p) {
  SavedSet out = ~SavedSet(0);
  // (Ulysses runs the attention once a layer between its all-to-alls.)
  if (p.par.cp > 1 || p.par.ulysses > 1 || req.msp == true) out &= ~kAttentionGroup;
  if (req.msp == true) out &= ~kHeadGradGroup;
  return out;
}

// Layout p under placement pl: the set it recomputes cut to what it can, its K/V placed
// on every layer.
plan::Plan placed(const PlanRequest& req, plan::Plan p, const Placement& pl) {
  p.place.recompute = pl.recompute & runnable(req, p);
  p.place.mlp_tile_rows = pl.mlp_tile_rows;
  p.place.backward = pl.backward;
  const int L = req.model.layers;
  if (pl.rebuilt) {
    p.place.inputs_rebuilt.assign(std::size_t(L), false);
    int b = 0;
    for (int n : p.stage_layers) {
      for (int l = b; l < b + n; ++l)
        if (rebuilt_in_stage(l, b)) p.place.inputs_rebuilt[std::size_t(l)] = true;
      b += n;
    }
  }
  if (pl.kv != KvPlace::Device) {
    // A rebuilt layer keeps the K/V the others recompute, on the host.
    p.place.kv.assign(std::size_t(L), pl.kv);
    for (int l = 0; l < L; ++l)
      if (pl.kv == KvPlace::Recompute && p.place.input_rebuilt(l)) p.place.kv[std::size_t(l)] = KvPlace::Host;
  }
  return p;
}

// Whether a layout can run a placement: streamed K/V are a rank's own blocks (its ring
// pieces, or an MSP owner's with its helpers'); recomputed K/V need a rank's whole rows of
// x of every earlier position (no tensor parallelism, no ring, no Ulysses, no MSP).
bool runs(const PlanRequest& req, const plan::Plan& p, const Placement& pl) {
  // The layer-major order: not MSP's pieces; under auto, on layouts of one stage only. A
  // pipeline loses its backwards' overlap in it, and its schedules have a B op for every
  // (layer, subsequence): searching them too took llama-3-8b at 3584K on 8 H100s from 1.3
  // to 23 s of the planner's time, for no plan that won.
  if (pl.backward == BackwardOrder::Layer && (req.msp == true || (p.par.pp > 1 && req.place.backward == kAuto)))
    return false;
  if (pl.mlp_tile_rows > 0 &&
      (p.par.tp > 1 ||
       *std::max_element(p.lengths.begin(), p.lengths.end()) <= pl.mlp_tile_rows * p.par.cp * p.par.ulysses))
    return false;
  // Rebuilt inputs (Note [Rebuilt layer inputs]): without TP, rings and MSP.
  if (pl.rebuilt && (p.par.tp > 1 || p.par.cp > 1 || req.msp == true)) return false;
  if (pl.kv != KvPlace::Recompute) return true;
  return req.msp != true && p.par.tp == 1 && p.par.cp == 1 && p.par.ulysses == 1;
}

}  // namespace

// The placements pass. Takes the layouts and the placements `pls` of one search, and the
// candidates earlier searches tried (`tried`, which it adds to); gives a candidate for
// every (layout, placement, MSP setting) a layout runs and no search has tried yet, in
// that order, MSP weighed as `options` say (SearchOptions: weigh_msp, msp_tasks).
// Every choice a candidate makes is enumerated here; a new one (a field of Placement, or a
// loop beside MSP's) enters the candidate's keys too (the variant, FloorKey, group,
// LeastStep), since the alpha pass prunes a candidate only by others that share them.
std::vector<SearchCandidate> placement_pass(const SearchContext& ctx, const std::vector<plan::Plan>& layouts,
                                            const std::vector<Placement>& pls, const SearchOptions& options,
                                            StateTier state, PlacementsTried& tried,
                                            const std::set<FloorKey>& settled) {
  const PlanRequest& req = ctx.req;
  std::vector<SearchCandidate> cands;
  // --msp on runs every layout with MSP; --msp auto, with its first placement, each
  // ring-less one both ways too (Note [MSP in the search]).
  for (std::size_t base = 0; base < layouts.size(); ++base)
    for (std::size_t q = 0; q < pls.size(); ++q) {
      const Placement& pl = pls[q];
      if (!runs(req, layouts[base], pl)) continue;
      const plan::Plan without = placed(req, layouts[base], pl);
      const bool weighed = options.weigh_msp && req.msp == kAuto && without.par.cp == 1 &&
                           without.par.pp * without.subseqs <= kAutoMspTasks;
      for (const bool msp : {false, true}) {
        if (!(msp ? req.msp == true || weighed : req.msp != true)) continue;
        if (msp && (!msp_possible(without) ||
                    (options.msp_tasks > 0 && without.par.pp * without.subseqs > options.msp_tasks)))
          continue;
        if (msp && pl.backward == BackwardOrder::Layer) continue;
        SearchCandidate cand;
        cand.plan = msp ? with_msp(without) : without;
        cand.pl = pl;
        const plan::Plan& p = cand.plan;
        // A set the layout cannot recompute whole may equal one already tried there.
        const bool layer = pl.backward == BackwardOrder::Layer;
        const Variant variant{.layout = layout_key(layouts[base]), .msp = msp, .rebuilt = pl.rebuilt, .layer_major = layer};
        // Its twin in the paper's order, settled: no faster in this one.
        const FloorKey twin{.variant = {.layout = variant.layout, .msp = msp, .rebuilt = pl.rebuilt, .layer_major = false},
                            .kv = pl.kv,
                            .recompute = p.place.recompute,
                            .mlp_tile_rows = pl.mlp_tile_rows};
        if (layer && settled.count(twin)) continue;
        if (msp && p.place.weights_host()) continue;  // a helper borrows a stage's weights whole
        cand.key = {variant, pl.kv, p.place.recompute, pl.mlp_tile_rows};
        if (!tried.insert({cand.key, state}).second) continue;
        cand.group = {.variant = variant, .kv = pl.kv, .tiled = pl.mlp_tile_rows > 0};
        cand.level = std::size_t(std::count_if(pls.begin(), pls.end(), [&](const Placement& o) {
          return o.kv == pl.kv && o.mlp_tile_rows == pl.mlp_tile_rows && o.backward == pl.backward &&
                 (o.recompute & pl.recompute) == o.recompute && o.recompute != pl.recompute;
        }));
        cands.push_back(std::move(cand));
      }
    }
  return cands;
}

}  // namespace sppo::sim::solver
