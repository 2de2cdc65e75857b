// The solver: the planner's search (docs/design.md 5) with the simulator as its judge. It lives
// beside the simulator because every candidate is priced by simulating its schedule.
//
// Note [Alpha under a budget]: offloading never makes a step faster; it only buys memory.
// So the solver first simulates alpha = 0 and keeps it when it fits. Otherwise it fills
// offload bytes in the order of their cost in step time (Note [Filling alpha] in
// solver/solve_alpha.cpp): first the bytes whose copies hide behind compute (the offload of
// i behind F(i+1), its prefetch behind B(i+1)), then the bytes whose copy is exposed in one
// direction, then in both; within a level, earlier subsequences first, since a byte of an
// earlier unit is off the device at every point where a later one is. The least fill that
// fits is found by bisection on the simulated peak. The paper's rule and full offload are
// simulated too, and the fastest of the three that fits is returned.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "planner/plan.h"
#include "planner/profile.h"
#include "schedule/builders.h"
#include "sim/simulator.h"

namespace sppo::sim {

// The activations' precision a hardware profile names ("f32" or "bf16").
ActPrecision precision_of(const plan::HardwareProfile& hw);

using plan::OffloadMode;
using plan::parse_offload;

struct AlphaResult {
  std::vector<double> alpha;      // per subsequence, alpha.back() == 0
  i64 peak_device_bytes = 0;      // simulated peak (max over ranks)
  double step_time_s = 0;         // simulated step time
  double exposed_copy_s = 0;
  i64 host_bytes = 0;             // simulated peak of offloaded bytes on the host
  bool fits = false;
  std::string reason;             // why not, when !fits
  std::string rule;               // "none", "paper", "hidden", "exposed", "directed", "full"
  bool slow = false;              // stopped at alpha = 0: no faster than solve_alpha's no_use_s
  // The step at alpha = 0, where solve_alpha simulated it (0 where not): no alpha is faster
  // (copies only add).
  double least_step_s = 0;
  // The least peak any alpha can reach (Note [A floor under the peak] in simulator.cpp),
  // where solve_alpha worked it out; 0 where it did not. A layout's floor falls with N as
  // its simulated peaks do, and is one measure for every N whatever the search did.
  i64 floor_bytes = 0;
};

// The runtime's `--offload adaptive`: alpha for `lengths` in a step of `shape` on devices
// of profile `hw` (its GEMM and copy rates), activations in `precision`, every rank's peak
// <= budget. The paper's rule is sized for the first stage (it holds the most layers).
AlphaResult solve_alpha_single(const ModelConfig& c, const std::vector<i64>& lengths, const HardwareProfile& hw,
                               ActPrecision precision, i64 budget, OffloadMode mode = OffloadMode::Adaptive,
                               const StepShape& shape = {});

// The same search for any schedule family of N subsequences: `build(alpha)` makes the
// schedule. `no_use_s` > 0: a step of at least that many seconds is of no use to the
// caller, so when alpha = 0 is already that slow the search stops there (copies only add,
// so no alpha is faster) and returns alpha = 0 with fits false and `slow` set.
AlphaResult solve_alpha(const std::function<sched::Schedule(const std::vector<double>&)>& build, int subseqs,
                        const CostModel& cost, const sched::MemoryRules& rules, i64 budget, OffloadMode mode,
                        double no_use_s = 0);

// What offloading subsequence i means on one rank of a schedule: the bytes of its unit
// (A_i: every offloadable tensor of its owned layers, head_grad included) and the seconds
// of its forward and backward ops there.
struct UnitProfile {
  int rank = 0;
  std::vector<i64> unit_bytes;
  std::vector<std::vector<i64>> tensors;  // per subsequence, its tensors in offload order
  std::vector<double> fwd_s, bwd_s;
};
// Every rank's; `s` built with alpha = 0.
std::vector<UnitProfile> unit_profiles(const sched::Schedule& s, const CostModel& cost,
                                       const sched::MemoryRules& rules);

// The paper's rule (Note [The paper's alpha] in solver/solve_alpha.cpp) on the rank that
// offloads the most bytes: alpha_i A_i = BW_d2h * T_bal, where T_bal is that rank's forward
// seconds per subsequence of a balanced partition (its total forward time over N), clipped
// to [0, 1], non-increasing in i, alpha_{N-1} = 0.
std::vector<double> paper_alpha(const std::vector<UnitProfile>& units, const CostModel& cost);

// Smallest N (from `min_n` up to `max_n`) whose best alpha fits `budget` on one device
// (Note [Searching N]: assumes fitting is monotone in N, as the peak falls with N).
// Balanced lengths are cut on multiples of `quantum` tokens, as the run that follows cuts
// them (train/partition.h kTileTokens), so that the N found is the N that runs.
struct FitSearch {
  bool found = false;
  int subseqs = 0;
  std::vector<i64> lengths;
  AlphaResult alpha;
  i64 least_peak_bytes = 0;  // the least simulated peak seen (what a budget must be at least)
  int least_peak_subseqs = 0;
  std::string reason;
};
FitSearch smallest_fitting_n(const ModelConfig& c, i64 S, const HardwareProfile& hw, ActPrecision precision,
                             i64 budget, bool flops_balanced, int min_n, int max_n, const StepShape& shape = {},
                             i64 quantum = 1);

// Memory rules of a GPU plan or of this CPU, with no ZeRO, the optimizer state on the device
// and no kernel scratch.
sched::MemoryRules memory_rules(const ModelConfig& c, ActPrecision precision);
// The memory rules of a step of `shape` (its ZeRO stage, optimizer state and kernels'
// scratch; an evaluation's, the weights alone), activations in `precision`. Replicas::One: the schedule is one replica of
// shape.par.dp (sched::build_step), and ZeRO's shards are counted over the whole layer
// group, which that schedule's all-reduces do not show.
sched::MemoryRules memory_rules(const ModelConfig& c, ActPrecision precision, const StepShape& shape,
                                sched::Replicas replicas = sched::Replicas::All);

// Rows of the MLP tiles the planner's wider search tries (Note [Placing every tensor] in
// solver/placements.cpp): GEMMs of 4096 rows run at the rate of whole ones.
inline constexpr i64 kPlanMlpTileRows = 4096;

struct PlanRequest {
  std::string model_name;
  ModelConfig model;
  i64 seq_len = 0;
  int gpus = 1;
  int gpus_per_node = 8;
  std::string hardware;       // profile name or path (recorded in the plan)
  HardwareProfile hw;
  plan::System system = plan::System::Sppo;
  OffloadMode offload = OffloadMode::Adaptive;
  Auto<bool> msp;             // auto: where it pays (Note [MSP in the search])
  // auto: ZeRO-1 wherever the all-reduce group has 2+ ranks, weighed against ZeRO-2 and
  // ZeRO-3 where they run (Note [ZeRO in the search] in solver/layouts.cpp); 2 or 3: the
  // layouts that can run it alone.
  Auto<ZeroStage> zero;
  RingLayout ring_layout = RingLayout::Zigzag;
  // The placements asked for (core/placement.h; --kv-cache, --recompute-tensors,
  // --backward-order, --optimizer-state, --weights, --rebuild-inputs). Under auto:
  //  - kv: the device, and where no plan with it fits, whichever of the three is fastest
  //    (host or recompute on every layer; recompute without ring, MSP or TP);
  //  - recompute: the planner chooses (Note [Placing every tensor] in
  //    solver/placements.cpp), from none; a set given is recomputed at least, the planner
  //    adding none;
  //  - backward: the paper's order, and the layers' on one stage where nothing else fits;
  //  - optimizer_state: the device, and the host where no plan with it fits;
  //  - weights: the device, and the host where no plan fits with the optimizer state alone
  //    there (Host needs the optimizer state on the host too);
  //  - rebuild: none, odd (every other layer of each stage, in every plan: with the
  //    layer-major order, K/V not on the host), or auto: those, where the plans that keep
  //    them do not fit or need the layer-major order (Note [Rebuilt inputs in the search]).
  PlacementRequest place;
  i64 budget = 0;             // 0: the profile's usable device memory
  // The kernels' scratch on the profile's backend (plan::Plan::block_scratch, head_scratch).
  KernelScratch block_scratch, head_scratch;

  SavedSet recompute_least() const { return place.recompute.value_or(0); }
  bool recompute_auto() const { return !place.recompute.has_value(); }
};

struct PlanOutcome {
  bool ok = false;
  plan::Plan plan;
  std::string error;          // why nothing fits, when !ok
};

// The heuristic solver of docs/design.md 5 for system "sppo"; the baselines for "megatron"
// and "deepspeed" (sim/baselines.h).
PlanOutcome solve_plan(const PlanRequest& req);

// The memory rules an SPPO plan runs under (memory_rules of its shape; Replicas::One: one
// replica simulated for a layout of p.par.dp, as the search does).
sched::MemoryRules plan_rules(const plan::Plan& p, ActPrecision prec, sched::Replicas replicas = sched::Replicas::All);
// The schedule of an SPPO plan, and its simulation on `hw`.
sched::Schedule plan_schedule(const plan::Plan& p);
SimResult simulate_plan(const plan::Plan& p, const HardwareProfile& hw, const SimOptions& options = {});

// MSP on and off for one SPPO layout (its tp, cp, pp, dp, N, lengths and stage split), each
// with its best alpha under the request's budget and offload mode, simulated as whole
// plans. `chosen` is the faster that fits (the layout's own setting when neither does),
// with a note that states both figures.
struct MspChoice {
  bool off_fits = false, on_fits = false;
  plan::Plan off, on;              // predicted filled in for both
  plan::Plan chosen;
  std::string note;
};
MspChoice choose_msp(const PlanRequest& req, const plan::Plan& layout);

}  // namespace sppo::sim
