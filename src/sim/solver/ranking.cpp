// Pass 5 of the search (search.h): ranking. Takes what the searches found (the SearchState:
// every candidate that fitted, with its alpha, or the closest miss); gives the outcome: the
// fastest plan, simulated whole (every replica, where the searches simulated one), with MSP
// weighed once more for the best few (choose_msp) and the notes that say why it places what
// it does, or the error that says why nothing fits and what came closest. The searches rank
// candidates by their own simulations; the plan returned is judged as it will run.
#include <algorithm>
#include <cstdio>

#include "planner/partition.h"
#include "sim/solver/search.h"

namespace sppo::sim::solver {

using plan::divisors;

namespace {

// Takes the context and the searches' state; gives why no plan came out, where none did.
std::optional<std::string> no_plan_error(const SearchContext& ctx, const SearchState& st) {
  const i64 S = ctx.S;
  const int G = ctx.G;
  if (st.layouts_tried == 0) {
    // Every layout needs more subsequences than the search allows (or has subsequences
    // shorter than its sequence-parallel degree): say which lengths it covers.
    i64 longest = 0;
    for (int n : divisors(std::min(G, ctx.gpn)))
      if (G % n == 0) longest = std::max(longest, (kMaxPlanSubseqs + 1) * kMaxTokensPerSubseq * n - 1);
    return "no layout of " + std::to_string(G) + " devices was tried for " + std::to_string(S) +
           " tokens: the planner cuts a sequence into at most " + std::to_string(kMaxPlanSubseqs) +
           " subsequences of about " + std::to_string(kMaxTokensPerSubseq) +
           " tokens per device at the longest, so the longest sequence it plans on " + std::to_string(G) +
           " devices is " + std::to_string(longest) + " tokens; use a shorter --seq-len or more --gpus";
  }
  if (st.fits.empty())
    return "no layout of " + std::to_string(G) + " devices fits " + std::to_string(S) + " tokens in " +
           format_bytes(double(ctx.budget)) + " per device; the closest" +
           (st.closest_place.empty() ? "" : ", with " + st.closest_place) + ": " + st.closest_reason;
  return std::nullopt;
}

// The notes that explain the best plan: how its layout runs, and why it places what it
// does where that is not K/V on the device with nothing more recomputed (`first_best`:
// tokens/GPU/s of the best plan of the first placement, 0 where none fits; `kept_best`, of
// the best keeping every input; `less_sharded`, of the best under a lower ZeRO stage).
void explain_best(const SearchContext& ctx, plan::Plan& best, double first_best, double kept_best,
                  double less_sharded) {
  const PlanRequest& req = ctx.req;
  if (best.par.stage_ranks() > ctx.gpn)
    best.notes.push_back("the ring spans nodes: each group of " + std::to_string(best.par.ulysses) +
                         " Ulysses ranks inside a node, the ring's " + std::to_string(best.par.cp) +
                         " members across them (USP)");
  else if (best.par.stage_ranks() * best.par.pp > ctx.gpn)
    best.notes.push_back("pipeline stages span nodes (tp, ulysses and cp stay inside a node)");
  if (best.par.ulysses > 1) {
    const ModelConfig& c = best.model;
    const int U = best.par.ulysses, m = TpShard{0, U}.kv_replicas(c);
    best.notes.push_back(
        "ulysses " + std::to_string(U) + ": each of " + std::to_string(U) +
        " devices holds its rows of every layer but the attention, where all-to-alls give it every row of " +
        (m > 1 ? "a share of one key/value head's queries (each of the " + std::to_string(c.kv_head_count()) +
                     " key/value heads whole on " + std::to_string(m) + " devices: its K/V cache and dK/dV " +
                     std::to_string(m) + " times an even split's, its dK, dV summed over them)"
               : "its heads (its K/V cache 1/" + std::to_string(U) + " of one device's)") +
        "; four all-to-alls a layer, no prefix moving (train --ulysses " + std::to_string(U) + ")");
  }
  if (best.par.tp > 1)
    best.notes.push_back("tp " + std::to_string(best.par.tp) +
                         ": tensor parallel with sequence-parallel regions over " + std::to_string(best.par.tp) +
                         " devices (train --tp): weights, K/V cache and activations divided among them");
  std::string why_wider = "no plan with K/V on the device and no more recomputed fits";
  if (first_best > 0) {
    char buf[160];
    std::snprintf(buf, sizeof buf,
                  "faster than the best plan with K/V on the device and no more recomputed, %.1f tokens/GPU/s",
                  first_best);
    why_wider = buf;
  }
  if (!best.place.kv_layers(KvPlace::Host).empty())
    best.notes.push_back(std::string("K/V and their dK/dV sums on the host, every layer (") +
                         (req.place.kv == KvPlace::Host ? "--kv-cache host" : why_wider) +
                         "): later subsequences stream them back through a window of " +
                         std::to_string(best.kv_window_tokens()) + " tokens a layer (train --kv-cache host)");
  if (!best.place.kv_layers(KvPlace::Recompute).empty())
    best.notes.push_back(std::string("K/V recomputed from each layer's input, every layer, their dK/dV sums on the "
                                     "host (") +
                         (req.place.kv == KvPlace::Recompute ? "--kv-cache recompute" : why_wider) +
                         "): later subsequences stream the inputs of earlier ones through a window of " +
                         std::to_string(best.kv_window_tokens()) + " tokens a layer (train --kv-cache recompute)");
  if (best.place.mlp_tile_rows > 0)
    best.notes.push_back("the MLP runs in tiles of " + std::to_string(best.place.mlp_tile_rows) + " rows (" +
                         why_wider + "; train --mlp-tile-rows " + std::to_string(best.place.mlp_tile_rows) + ")");
  if (best.place.recompute != req.recompute_least())
    best.notes.push_back("backward recomputes " + recompute_tensors_text(best.place.recompute) + " (" + why_wider +
                         "; train --recompute-tensors " + recompute_tensors_text(best.place.recompute) + ")");
  if (best.place.layer_major())
    best.notes.push_back(std::string("the backward runs a layer at a time, one layer's dK/dV sums alive (") +
                         (req.place.backward == BackwardOrder::Layer ? "--backward-order layer" : why_wider) +
                         "; train --backward-order layer)");
  if (best.place.any_input_rebuilt()) {
    std::string layers;
    for (int l : best.place.rebuilt_layers()) layers += (layers.empty() ? "" : ",") + std::to_string(l);
    char kept[120];
    std::snprintf(kept, sizeof kept, "faster than the best plan keeping every input, %.1f tokens/GPU/s", kept_best);
    const std::string why = req.place.rebuild.kind == RebuildRequest::Kind::Odd ? "--rebuild-inputs odd"
                            : kept_best > 0             ? kept
                                                        : "no plan keeping every input fits";
    best.notes.push_back("the inputs of layers " + layers + " rebuilt: their forward drops them, and each of their "
                         "backward's ops runs the layer below's forward again to make them (" + why +
                         "; a layer's forward more per rebuilt layer; train --rebuild-inputs " + layers + ")");
  }
  if (best.par.zero == ZeroStage::OptimizerState)
    best.notes.push_back("ZeRO-1: AdamW state sharded over the " + std::to_string(best.par.zero_shards()) +
                         " ranks of each stage's gradient all-reduce");
  if (shards_gradients(best.par.zero)) {  // Note [ZeRO in the search]
    const bool three = shards_weights(best.par.zero);
    char faster[120];
    std::snprintf(faster, sizeof faster, "faster than the best plan sharding less, %.1f tokens/GPU/s", less_sharded);
    best.notes.push_back(std::string(three ? "ZeRO-3: AdamW state, gradients and weights" : "ZeRO-2: AdamW state and gradients") +
                         " sharded over the " + std::to_string(best.par.zero_shards()) +
                         " ranks of each stage's gradient reduce-scatter (" +
                         (req.zero           ? "--zero " + std::to_string(stage_number(best.par.zero))
                          : less_sharded > 0 ? std::string(faster)
                                             : std::string("no plan sharding less fits")) +
                         (three ? "; every layer's weights all-gathered a layer ahead of each forward and backward "
                                  "that runs it, priced on the network" : "") +
                         "; train --zero " + std::to_string(stage_number(best.par.zero)) + ")");
  }
  if (best.place.optimizer_host())
    best.notes.push_back(std::string("optimizer state on the host (") +
                         (req.place.optimizer_state == Tier::Host ? "--optimizer-state host"
                                                        : "no plan with it on the device fits") +
                         "): fp32 master weights, AdamW m, v and a gradient copy, 16 B a parameter of each rank's "
                         "shard; each step the gradients go down, the host's processor updates them, the weights "
                         "come back up (" + seconds_text(best.predicted.host_update_s) +
                         " a step, priced in the step time; train --optimizer-state host)");
  if (best.place.weights_host())
    best.notes.push_back(std::string("the layers' weights and gradients on the host (") +
                         (req.place.weights == Tier::Host ? "--weights host" : "no plan with them on the device fits") +
                         "): each layer's fp32 weights come to the device a layer ahead of the forward or backward "
                         "that runs it (its bf16 working copy converted there) and go after; its gradient goes to "
                         "the host after its last backward; the device keeps the embedding, final norm and head "
                         "(train --weights host)");
}

}  // namespace

// The ranking pass. Takes the searches' state (its fits, which it sorts) and `first_best`
// (as explain_best takes it); gives the outcome: the fastest plan, predicted as a whole,
// with its notes, or why nothing fits.
PlanOutcome rank_pass(const SearchContext& ctx, SearchState& st, double first_best) {
  const PlanRequest& req = ctx.req;
  PlanOutcome out;
  if (std::optional<std::string> error = no_plan_error(ctx, st)) {
    out.error = *error;
    return out;
  }
  std::vector<Candidate>& fits = st.fits;
  // Of two as fast, the one that shards less (Note [ZeRO in the search]: ZeRO-2's step is
  // ZeRO-1's wherever it fits both).
  std::sort(fits.begin(), fits.end(), [&](const Candidate& a, const Candidate& b) {
    const double ta = ctx.tput(a.plan, a.alpha.step_time_s), tb = ctx.tput(b.plan, b.alpha.step_time_s);
    return ta != tb ? ta > tb : a.plan.par.zero < b.plan.par.zero;
  });
  // MSP when it pays: each of the best few pipelined layouts is simulated with and without
  // it as a whole plan; the faster that fits stays, and says both figures.
  std::vector<plan::Plan> finalists;
  const size_t top = std::min<size_t>(fits.size(), req.msp == kAuto ? 3 : 1);
  for (size_t k = 0; k < top; ++k) {
    plan::Plan p = fits[k].plan;
    // --msp auto weighs MSP for its cp 1 finalists only (Note [MSP in the search]).
    if (req.msp != false && msp_possible(p) && (req.msp == true || p.par.cp == 1)) {
      finalists.push_back(choose_msp(req, p).chosen);
    } else {
      predict(&p, ctx.hw);
      if (req.msp == false) p.notes.push_back(kMspOffNote);
      finalists.push_back(p);
    }
  }
  plan::Plan best = *std::max_element(finalists.begin(), finalists.end(), [](const plan::Plan& a, const plan::Plan& b) {
    return a.predicted.tokens_per_gpu_per_s < b.predicted.tokens_per_gpu_per_s;
  });
  // The best plan keeping every layer's input, where one fitted (its tokens/GPU/s as searched).
  double kept_best = 0;
  for (const Candidate& f : fits)
    if (!f.plan.place.any_input_rebuilt()) kept_best = std::max(kept_best, ctx.tput(f.plan, f.alpha.step_time_s));
  double less_sharded = 0;
  for (const Candidate& f : fits)
    if (f.plan.par.zero < best.par.zero)
      less_sharded = std::max(less_sharded, ctx.tput(f.plan, f.alpha.step_time_s));
  explain_best(ctx, best, first_best, kept_best, less_sharded);
  out.ok = true;
  out.plan = best;
  return out;
}

}  // namespace sppo::sim::solver
