// The solver: the planner's search (docs/design.md 5) with the simulator as its judge. It lives
// beside the simulator because every candidate is priced by simulating its schedule.
//
// Note [Alpha under a budget]: offloading never makes a step faster; it only buys memory.
// So the solver first simulates alpha = 0 and keeps it when it fits. Otherwise it fills
// offload bytes in the order of their cost in step time (Note [Filling alpha] in
// solver.cpp): first the bytes whose copies hide behind compute (the offload of i behind
// F(i+1), its prefetch behind B(i+1)), then the bytes whose copy is exposed in one
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

enum class OffloadMode { None, Full, Paper, Adaptive };
OffloadMode parse_offload(const std::string& text);  // none | full | paper | adaptive
const char* to_string(OffloadMode m);

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

// The layout a runtime step runs its subsequences in: one process, or a sequence pipeline
// of pp stages times dp replicas (no sequence parallelism).
struct StepShape {
  int pp = 1, dp = 1;
  int sp = 1;                      // ring attention (context parallel) ranks a stage
  int tp = 1;                      // tensor parallel (sequence-parallel regions) ranks a stage
  sched::RingLayout ring_layout = sched::RingLayout::Zigzag;
  bool ring_rsa = false;           // Schedule::ring_rsa (--ring rsa)
  bool zero = false;               // ZeRO-1 over the replicas
  bool optimizer_host = false;     // fp32 master and AdamW state on the host (--optimizer-state host)
  bool weights_host = false;       // the layers' weights and gradients on the host (Schedule::weights_host)
  bool residual_host = false;      // a layer-major backward's residual gradients on the host (Schedule::residual_host)
  bool msp = false;                // multiplexed sequence partitioning (pp > 1)
  int msp_reach = 0;               // its split tasks' groups (Note [MSP reach]; 0: every idle one)
  std::vector<int> stage_layers;   // layers per stage; empty: as even as possible
  KernelScratch block_scratch, head_scratch;  // what the runtime's kernels take (MemoryRules)
  ActPrecision precision = ActPrecision::F32;  // of the activations (bf16 on GPUs)
  std::vector<sched::KvPlace> kv_place;  // where each layer keeps its K/V (Schedule::kv_place)
  SavedSet recompute = 0;          // saved tensors backward recomputes (Schedule::recompute)
  i64 mlp_tile_rows = 0;           // Schedule::mlp_tile_rows
  bool packed = false;             // Schedule::packed
  bool labeled = false;            // Schedule::labeled
  sched::BackwardOrder backward = sched::BackwardOrder::Subseq;  // Schedule::backward (one stage)
  std::vector<bool> inputs_rebuilt;  // Schedule::inputs_rebuilt
};
// The schedule of one step of that shape (build_single for one process), expanded for
// tensor parallelism (sched::expand_tensor_parallel) when tp > 1.
sched::Schedule build_step(const ModelConfig& c, const std::vector<i64>& lengths, const std::vector<double>& alpha,
                           const StepShape& shape);

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

// The paper's rule (Note [The paper's alpha] in solver.cpp) on the rank that offloads the
// most bytes: alpha_i A_i = BW_d2h * T_bal, where T_bal is that rank's forward seconds per
// subsequence of a balanced partition (its total forward time over N), clipped to [0, 1],
// non-increasing in i, alpha_{N-1} = 0.
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

// Memory rules of a GPU plan or of this CPU. `zero_shards` > 0: the ZeRO-1 shard count to
// count (MemoryRules::zero_shards).
sched::MemoryRules memory_rules(const ModelConfig& c, ActPrecision precision, bool zero = false, int zero_shards = 0);
// The memory rules of a runtime step of `shape`.
sched::MemoryRules memory_rules(const ModelConfig& c, ActPrecision precision, const StepShape& shape);

// Rows of the MLP tiles the planner's wider search tries (Note [Placing every tensor] in
// solver.cpp): GEMMs of 4096 rows run at the rate of whole ones.
inline constexpr i64 kPlanMlpTileRows = 4096;

struct PlanRequest {
  std::string model_name;
  ModelConfig model;
  i64 seq_len = 0;
  int gpus = 1;
  int gpus_per_node = 8;
  std::string hardware;       // profile name or path (recorded in the plan)
  HardwareProfile hw;
  std::string system = "sppo";
  OffloadMode offload = OffloadMode::Adaptive;
  int msp = -1;               // -1 auto (when it pays), 0 off, 1 on
  int zero = -1;              // ZeRO-1: -1 auto (wherever the all-reduce group has 2+ ranks), 0 off, 1 on
  // Where the fp32 master weights and AdamW state live (--optimizer-state): "device",
  // "host", or "auto" (the device, and the host where no plan with it fits).
  std::string optimizer_state = "auto";
  // Where the layers' weights and gradients live (--weights): "device", "host" (with the
  // optimizer state there), or "auto" (the device, and the host where no plan fits with
  // the optimizer state alone there).
  std::string weights = "auto";
  sched::RingLayout ring_layout = sched::RingLayout::Zigzag;
  i64 budget = 0;             // 0: the profile's usable device memory
  // Where layers keep the K/V cache (--kv-cache): "device"; "host" or "recompute" (every
  // layer; recompute without ring, MSP or tensor parallelism); "auto": the device, and
  // where no plan with it fits, whichever of the three is fastest.
  std::string kv_cache = "auto";
  // Saved tensors to recompute (--recompute-tensors, a closed set); `recompute_auto`: the
  // planner chooses (Note [Placing every tensor] in solver.cpp), from these at least.
  SavedSet recompute = 0;
  bool recompute_auto = true;
  // The backward's order (--backward-order): "subseq", "layer" (one pipeline stage), or
  // "auto": the paper's order, and the layers' on one stage where nothing else fits.
  std::string backward_order = "auto";
  // Layers whose inputs are rebuilt (--rebuild-inputs, Note [Rebuilt layer inputs] in
  // schedule/builders.cpp): "none"; "odd": every other layer of each stage, in every plan
  // (with backward_order "layer", K/V not on the host); or "auto": those, where the plans
  // that keep them do not fit or need the layer-major order (Note [Rebuilt inputs in the
  // search] in solver.cpp).
  std::string rebuild_inputs = "auto";
  // The kernels' scratch on the profile's backend (plan::Plan::block_scratch, head_scratch).
  KernelScratch block_scratch, head_scratch;
};

struct PlanOutcome {
  bool ok = false;
  plan::Plan plan;
  std::string error;          // why nothing fits, when !ok
};

// The heuristic solver of docs/design.md 5 for system "sppo"; the baselines for "megatron"
// and "deepspeed" (sim/baselines.h).
PlanOutcome solve_plan(const PlanRequest& req);

// The memory rules an SPPO plan runs under; `search`: one replica simulated for a layout
// of p.dp, so ZeRO-1 shards are counted for the whole all-reduce group (sp x dp).
sched::MemoryRules plan_rules(const plan::Plan& p, ActPrecision prec, bool search = false);
// The schedule of an SPPO plan, and its simulation on `hw`.
sched::Schedule plan_schedule(const plan::Plan& p);
SimResult simulate_plan(const plan::Plan& p, const HardwareProfile& hw, const SimOptions& options = {});

// MSP on and off for one SPPO layout (its sp, pp, dp, N, lengths and stage split), each
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
