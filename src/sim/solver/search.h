// solve_sppo's search (sim/solver.cpp), in passes, one file apiece in this folder. A
// SearchContext holds what the request fixes, a SearchState what the searches learn and keep
// from one to the next. The passes, in the order a plan goes through them:
//  1. layouts (layouts.cpp, layout_pass): every (tp, ulysses, cp, dp, pp) and the N of each the search
//     considers;
//  2. placements (placements.cpp, placement_pass): each layout under each placement of its
//     tensors (K/V, recompute set, MLP tiles) and MSP setting, a candidate apiece;
//  3. bounds (bounds.cpp, bound_pass): each candidate's memory, host and throughput bounds,
//     which rule candidates out and set the order the next pass tries them in;
//  4. alpha (alpha.cpp, alpha_pass): the candidates the bounds leave, simulated for their best
//     alpha (offload ratios, solve_alpha.cpp) under the budget, pruned as faster plans are
//     found;
//  5. ranking (ranking.cpp, rank_pass): the fastest that fit, MSP weighed for the best few,
//     and the notes that explain the plan (or why nothing fits).
// Passes 2 to 4 run once a search (search() in sim/solver.cpp), and solve_sppo runs up to four
// searches: the first placement, the wider ones, and both again with the optimizer state on
// the host.
//
// This header is the solver's own: the types the passes hand each other, and the helpers
// more than one of them uses (search.cpp). A helper of one pass stays in that pass's file.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "sim/solver.h"

namespace sppo::sim::solver {

using sched::MemoryRules;
using sched::Schedule;

// The search's reach (solve_sppo): subsequences per sequence, and the longest subsequence
// share per device it starts from (it also tries 8K, 4K and 2K).
constexpr i64 kMaxPlanSubseqs = 4096;
constexpr i64 kMaxTokensPerSubseq = 16384;
// The most members of a ring the search lays out (train --cp takes 1 to 8).
constexpr int kMaxRing = 8;

// The profile `hw_in` on nodes of `gpus_per_node` devices.
HardwareProfile plan_hardware(const HardwareProfile& hw_in, int gpus_per_node);

std::string bytes_text(i64 b);
std::string seconds_text(double s);  // "%.4g s"

struct Candidate {
  plan::Plan plan;
  AlphaResult alpha;
};

// Evaluates one (tp, cp, pp, dp, N, msp) layout: the best alpha under the budget
// (solve_alpha's no_use_s: stop early when it cannot be faster than that).
Candidate evaluate(const PlanRequest& req, plan::Plan p, const CostModel& cost, i64 budget, double no_use_s = 0);

// Fills in p->predicted: the plan simulated whole on `hw`.
void predict(plan::Plan* p, const HardwareProfile& hw);

// plan --system megatron (megatron.cpp, Note [Megatron-LM as a schedule]) and --system
// deepspeed (deepspeed.cpp, Note [DeepSpeed-Ulysses as a schedule]): the fastest of the
// system's layouts that fits, as a plan `train --plan` runs, or why none does; and what a
// full recomputation recomputes on layout `par` (every group but the attention's under a
// ring or Ulysses, and the head's).
PlanOutcome solve_megatron(const PlanRequest& req);
PlanOutcome solve_deepspeed(const PlanRequest& req);
SavedSet megatron_recompute(const ParallelDims& par);

// What the baselines' searches share: a plan of the request's job with the system's name,
// the budget and the kernels' scratch; each layout predicted whole (predict), the fastest
// that fits kept and the closest miss named; and the closed form's figures for the same job
// (Note [Baseline models] in sim/baselines.cpp) as a note.
// A plan of the request's model, length and machine under `budget` and `prec`, with no
// layout or placement yet: what the search's layouts and the baselines' start from.
plan::Plan unplanned(const PlanRequest& req, i64 budget, ActPrecision prec);

class BaselinePick {
 public:
  explicit BaselinePick(const PlanRequest& req);
  plan::Plan start() const;  // a plan with no layout yet
  void consider(plan::Plan p);
  // The fastest plan with `how` as its note (and the closed form's), or the error naming the
  // closest miss (`none`: why there was no layout at all).
  PlanOutcome outcome(const std::string& how, const std::string& none) const;

 private:
  const PlanRequest& req_;
  HardwareProfile hw_;
  i64 budget_ = 0;
  plan::Plan best_;
  double best_tput_ = 0, closest_ = 0;  // closest_: the least need over limit of a miss
  std::string closest_text_;
};

// Note [MSP in the search]: MSP's split tasks run over every idle stage group (reach 0, the
// paper's) in a plan that keeps K/V on the device and recomputes nothing more, so every plan
// that fitted before is the same plan. A plan placed to save memory (K/V on the host, tensors
// recomputed, MLP tiles) splits over its own and the nearest idle group only (reach 2, Note
// [MSP reach] in schedule/msp.h): over every group, helpers borrow most stages' weights (at
// gpt-13b 512K on 128 A100s, 70 of a 96 GiB peak in 32 stages, and no fit), and searching
// those layouts took 70 s for gpt-65b at 640K. On a ring (cp > 1) MSP runs at reach 2 (over
// every group: 134 s for gpt-13b at 512K, and no fit), and so it does past
// kMspEveryGroupStages stages, where a split task has up to pp pieces, each helper
// borrowing a stage's weights (gpt-65b at 384K, tp 2 pp 64 N 96 over every group: 17 GB of
// memory and 83 s to simulate its alpha = 0, a step of 261 s; at reach 2, 0.04 s for a step
// of 84 s). --msp on searches it (with the placements that save memory, where a plan fits
// without them, on pipelines of at most kMspWiderTasks tasks a replica). --msp auto weighs
// MSP for ring-less layouts only, since on a ring it won none of the README's plans and
// doubled the time of the longest searches (gpt-7b 8M on 128 H200s: 8.0 s against 3.8):
// it simulates each such layout with MSP as well where the first placement is searched and
// the pipeline has at most kAutoMspTasks tasks a replica (pp x N; with every one, gpt-7b 4M
// on 32 A100s took 55 s against 0.6 s, and MSP gains least where N is large), and weighs
// MSP again for its cp 1 finalists. So gpt-13b at 512K on 128 A100s found tp 8 pp 4 dp 4
// with MSP (198.0 tokens/GPU/s), which without MSP (87.02 s a step) the search prunes,
// until the profiles that compute in bf16 left MSP off (Note [MSP in bf16] in
// sim/solver.cpp): it runs on profiles whose activations are fp32, such as a CPU's.
constexpr int kAutoMspTasks = 256;
constexpr const char* kMspOffNote = "MSP off (--msp off)";
constexpr int kMspEveryGroupStages = 16;
constexpr int kMspWiderTasks = 512;
int msp_search_reach(const plan::Plan& p);
// Layout p with MSP as the search runs it, at its reach.
plan::Plan with_msp(plan::Plan p);
// Whether the runtime can run layout p with MSP.
bool msp_possible(const plan::Plan& p);

// How a layer runs on each piece busiest_piece_s weighs (its arguments after `layout`).
struct PieceOptions {
  int tp = 1;
  int ulysses = 1;
  KvPlace kv = KvPlace::Device;
  bool last = false;
};
// Forward (backward) seconds of one layer on the busiest piece of a subsequence [o, o+l)
// split over `cp` ring ranks laid out by `layout`, each piece's layer split over `run.tp`
// tensor-parallel ranks (CostModel::forward_s: compute over tp, ten collectives), or over
// `run.ulysses` Ulysses ranks (the busiest member's rows of all but the attention, its heads
// of the attention: Note [Ulysses, priced] in planner/cost.cpp; the all-to-alls not
// counted, as a bound may leave out). With the
// K/V streamed (run.kv Host or Recompute), what the attention does not hide of the earlier
// rows' chunks (CostModel::layer_stream_s; `run.last`: the sequence's last subsequence,
// whose backward finds no sums on the host).
double busiest_piece_s(const CostModel& cost, i64 o, i64 l, int cp, RingLayout layout, const PieceOptions& run = {});

// What the request fixes for every pass.
struct SearchContext {
  explicit SearchContext(const PlanRequest& r)
      : req(r),
        c(r.model),
        hw(plan_hardware(r.hw, r.gpus_per_node)),
        prec(precision_of(hw)),
        rules(memory_rules(c, prec)),
        cost(hw, c, prec),
        budget(r.budget > 0 ? r.budget : hw.usable_memory()),
        S(r.seq_len),
        G(r.gpus),
        gpn(r.gpus_per_node),
        host_allowed(r.place.optimizer_state != Tier::Device),
        kv_pt(skeletal_bytes_per_token(c, prec)),
        acc_pt(2 * i64(c.kv_width()) * rules.accum_bytes),
        saved_table(block_saved_specs(c, 1, prec)),
        host_limit(hw.host_memory) {}
  SearchContext(const SearchContext&) = delete;
  SearchContext& operator=(const SearchContext&) = delete;

  const PlanRequest& req;
  const ModelConfig& c;
  const HardwareProfile hw;
  const ActPrecision prec;
  const MemoryRules rules;
  const CostModel cost;
  const i64 budget;
  const i64 S;
  const int G, gpn;
  // Note [Optimizer state under a budget]: the fp32 master weights and AdamW m, v stay
  // on the device unless --optimizer-state says host, or, under auto, no plan fits with
  // them there (every layout, K/V placement and recompute level tried): moving them costs
  // each step its gradients' and weights' copies and the host's update (CostModel::
  // host_update_s), which only buys memory. Then the whole search runs again with the
  // state on the host, where the device keeps the weights and gradients alone.
  const bool host_allowed;
  // Bytes a token of the K/V and of their dK/dV accumulators, and a layer's saved tensors
  // (the bounds' per-token rates).
  const i64 kv_pt, acc_pt;
  const std::vector<TensorSpec> saved_table;
  const i64 host_limit;

  // Device bytes of the weights, gradients and (with `state` on the device) AdamW state of
  // `params` parameters, the state sharded `shards` ways; and the host's, with the state there.
  i64 device_fixed(i64 params, int shards, Tier state) const {
    return params * (rules.param_state_bytes - rules.optimizer_bytes) +
           (state == Tier::Host ? 0 : params * rules.optimizer_bytes / shards);
  }
  i64 host_fixed(i64 params, int shards, Tier state) const {
    return state == Tier::Host ? params / shards * rules.param_state_bytes : i64(0);
  }
  i64 unit_pt(SavedSet recompute) const {  // offloadable bytes a token, less the recomputed
    i64 b = 0;
    for (std::size_t k = 0; k < saved_table.size(); ++k)
      if (saved_table[k].role == Role::Offloadable && !in_set(recompute, int(k))) b += saved_table[k].bytes();
    return b;
  }
  // Tokens/GPU/s of layout p at a step of `step_s` seconds.
  double tput(const plan::Plan& p, double step_s) const { return double(S) * p.par.dp / (G * step_s); }
};

// One placement of a layout's tensors (Note [Placing every tensor] in placements.cpp).
struct Placement {
  KvPlace kv = KvPlace::Device;
  SavedSet recompute = 0;
  i64 mlp_tile_rows = 0;
  BackwardOrder backward = BackwardOrder::Subseq;
  bool rebuilt = false;  // every other layer of a stage rebuilds its input (Plan::rebuilt_inputs)
  bool operator==(const Placement&) const = default;
};

// The placements the request allows: the first search's, and the wider search's (every
// other one, then the first and those others with the MLP in tiles).
struct PlacementSets {
  Placement first;
  std::vector<Placement> wider;
  std::vector<Placement> layered;  // --backward-order auto: the first and wider in the layer-major order
  std::vector<Placement> rebuilt;  // the layer-major ones that can rebuild inputs, rebuilding them
};

// A layout's identity across the searches of one request, which search copies of the
// layouts (a tier's, some left out): its dimensions and N, and its ZeRO stage where that
// shards more than the AdamW state (stages 0 and 1 differ by the state alone, which a floor
// carried between tiers subtracts: state_bound in alpha.cpp).
struct LayoutKey {
  int tp = 1, ulysses = 1, cp = 1, pp = 1, dp = 1, subseqs = 1;
  ZeroStage zero = ZeroStage::None;
  auto operator<=>(const LayoutKey&) const = default;
};
LayoutKey layout_key(const plan::Plan& p);
// A layout as a search varies it: the layout, with MSP or not, rebuilding inputs or not, in
// the layer-major backward order or not.
struct Variant {
  LayoutKey layout;
  bool msp = false, rebuilt = false, layer_major = false;
  auto operator<=>(const Variant&) const = default;
};
// A candidate's (layout variant, K/V placement, recomputed set, MLP tile rows): what the
// pruning of the alpha pass tells candidates apart by.
struct FloorKey {
  Variant variant;
  KvPlace kv = KvPlace::Device;
  SavedSet recompute = 0;
  i64 mlp_tile_rows = 0;
  auto operator<=>(const FloorKey&) const = default;
};
// Where a search keeps the optimizer state and the layers' weights: both on the device; the
// state on the host; the weights there too.
enum class StateTier : char { Device, OptimizerHost, WeightsHost };
inline StateTier state_tier(const plan::Plan& p) {
  return !p.place.optimizer_host() ? StateTier::Device
         : p.place.weights_host()  ? StateTier::WeightsHost
                                   : StateTier::OptimizerHost;
}
// The candidates searched so far, with where their search kept the state.
struct Tried {
  FloorKey key;
  StateTier state = StateTier::Device;
  auto operator<=>(const Tried&) const = default;
};
using PlacementsTried = std::set<Tried>;
// Candidates of one layout variant and K/V placement, tiled or not, whose recompute sets
// nest (Note [Pruning the search], continued, below).
struct GroupKey {
  Variant variant;
  KvPlace kv = KvPlace::Device;
  bool tiled = false;
  auto operator<=>(const GroupKey&) const = default;
};

// One candidate of a search: a layout placed, with MSP or without.
// Note [Pruning the search], continued: the recompute sets are nested (each level holds
// the one before), so within one layout and K/V placement a level that does not fit
// means no lower one does. `group` names that (layout variant, K/V placement, tiled or
// not), `level` the rank of the candidate's set in it.
struct SearchCandidate {
  plan::Plan plan;
  Placement pl;
  GroupKey group;
  std::size_t level = 0;
  FloorKey key;
};

// A candidate's bounds (Note [Pruning the search] in bounds.cpp).
struct Bounds {
  i64 mem = 0;      // device bytes, at least
  double tput = 0;  // tokens/GPU/s, at most
  i64 host = 0;     // host bytes, at least
};
// A search's candidates' bounds (by index) and the order the alpha pass tries them in.
struct BoundedCandidates {
  std::vector<Bounds> bound;
  std::vector<std::size_t> order;
};

// Note [Pruning the search], continued: a placement's alpha = 0 step bounds from below
// every placement of the same layout that adds to it: K/V streamed from the host or
// recomputed rather than kept, more tensors recomputed, the MLP in tiles (each only adds
// copies or compute to the same schedule). So once such a step is no faster than the best
// plan found, the placements that add to it are not simulated. (MSP's reach changes with
// the placement, and with it the schedule: only placements at one reach compare.)
struct LeastStep {
  KvPlace kv;
  SavedSet recompute;
  i64 tiles;
  int reach;
  double step_s;
};

// What the searches learn, kept from one to the next.
struct SearchState {
  std::vector<Candidate> fits;  // every candidate that fitted, with its alpha
  // The closest miss over every placement searched, for the error when nothing fits: the
  // least need over its limit (a device peak, or a bound on it, over the budget; host bytes
  // over the host's), why, and under which placement of the state (`state_place`,
  // another_placement) it came. A ratio, so that a host miss of one tier and a device miss
  // of another compare.
  double closest = 0;  // 0: none yet
  std::string closest_reason, closest_place;
  std::string state_place;
  template <typename Why>
  void miss(double need, double limit, Why why) {
    const double over = need / limit;
    if (closest > 0 && over >= closest) return;
    closest = over;
    closest_reason = why();
    closest_place = state_place;
  }

  // A search of the state placed as `place` says (e.g. "the optimizer state on the host")
  // begins.
  void another_placement(std::string place) { state_place = std::move(place); }
  int layouts_tried = 0;
  PlacementsTried placements_tried;
  // Note [Optimizer state under a budget], continued: when nothing fits, every layout the
  // device-state search simulated was ruled out by its floor (Note [A floor under the peak]),
  // and the host-state search would rebuild the same schedules: moving the state changes a
  // rank's fixed bytes by its AdamW m and v alone, so a rank's floor drops by exactly that,
  // and a layout's by at most its largest stage's. The floors are kept by (layout,
  // placement), and a layout whose kept floor less that still exceeds the budget is dropped
  // as a simulation would drop it.
  std::map<FloorKey, i64> device_floors;
  std::map<Variant, std::vector<LeastStep>> least_steps;  // by layout variant
  // Candidates that fitted, or whose step was of no use (slower than a plan found): their
  // twins in the layer-major order, the same ops in another order, are no faster, so only
  // the twins of candidates that did not fit are searched (Note [Layer-major backward in
  // the search]).
  std::set<FloorKey> settled;
};

// How one search (search() in sim/solver.cpp) treats MSP and the plans found before it.
struct SearchOptions {
  // Under --msp auto, ring-less layouts are simulated with MSP too.
  bool weigh_msp = false;
  // Under --msp on, MSP layouts of at most that many tasks a replica (0: all).
  int msp_tasks = 0;
  // Candidates no faster than the best plan earlier searches found are of no use (the
  // layer-major twins' search); else only this search's own plans prune.
  bool prune_by_fits = false;
};

// ---- The passes, each in its file.

// 1. Layouts (layouts.cpp).
std::optional<std::string> weights_alone_error(const SearchContext& ctx);
std::vector<plan::Plan> layout_pass(const SearchContext& ctx);
std::vector<plan::Plan> weights_on_host(const PlanRequest& req, const std::vector<plan::Plan>& layouts);
std::vector<plan::Plan> zero_sharded(const std::vector<plan::Plan>& layouts, ZeroStage zero);

// 2. Placements (placements.cpp).
PlacementSets placement_sets(const PlanRequest& req);
std::vector<SearchCandidate> placement_pass(const SearchContext& ctx, const std::vector<plan::Plan>& layouts,
                                            const std::vector<Placement>& pls, const SearchOptions& options,
                                            StateTier state, PlacementsTried& tried,
                                            const std::set<FloorKey>& settled);

// 3. Bounds (bounds.cpp).
BoundedCandidates bound_pass(const SearchContext& ctx, const std::vector<SearchCandidate>& cands);

// 4. Alpha (alpha.cpp).
void alpha_pass(const SearchContext& ctx, const std::vector<SearchCandidate>& cands, const BoundedCandidates& b,
                StateTier state, SearchState& st, double best_tput);

// 5. Ranking (ranking.cpp).
PlanOutcome rank_pass(const SearchContext& ctx, SearchState& st, double first_best);

}  // namespace sppo::sim::solver
