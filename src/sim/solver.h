// The solver: the planner's search (DESIGN.md 5) with the simulator as its judge. It lives
// beside the simulator because every candidate is priced by simulating its schedule.
//
// Note [Alpha under a budget]: offloading never makes a step faster; it only buys memory.
// So the solver first simulates alpha = 0, and keeps it when it fits. Otherwise it scales
// the paper's rule (alpha_i A_i = BW_d2h * T_comp(i+1): the most that hides behind the
// next subsequence's forward), alpha = lambda * paper, lambda in (0, 1], choosing the least
// lambda that fits (bisection on the simulated peak); if even the paper's rule does not
// fit, it raises every alpha_i towards 1, alpha = paper + mu (1 - paper), with the least mu
// that fits, paying exposed copy time. alpha_{N-1} is always 0. The result is compared
// with the paper's rule itself and the faster of the two that fit is returned.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "planner/plan.h"
#include "planner/profile.h"
#include "schedule/builders.h"
#include "sim/simulator.h"

namespace sppo::sim {

enum class OffloadMode { None, Full, Adaptive };
OffloadMode parse_offload(const std::string& text);  // none | full | adaptive

struct AlphaResult {
  std::vector<double> alpha;      // per subsequence, alpha.back() == 0
  i64 peak_device_bytes = 0;      // simulated peak (max over ranks)
  double step_time_s = 0;         // simulated step time
  double exposed_copy_s = 0;
  bool fits = false;
  std::string reason;             // why not, when !fits
  std::string rule;               // "none", "paper", "scaled paper", "beyond paper", "full"
};

// The layout a runtime step runs its subsequences in: one process, or a sequence pipeline
// of pp stages times dp replicas (no sequence parallelism).
struct StepShape {
  int pp = 1, dp = 1;
  bool zero = false;               // ZeRO-1 over the replicas
  std::vector<int> stage_layers;   // layers per stage; empty: as even as possible
  KernelScratch block_scratch, head_scratch;  // what the runtime's kernels take (MemoryRules)
  ActPrecision precision = ActPrecision::F32;  // of the activations (bf16 on GPUs)
};
// The schedule of one step of that shape (build_single for one process).
sched::Schedule build_step(const ModelConfig& c, const std::vector<i64>& lengths, const std::vector<double>& alpha,
                           const StepShape& shape);

// The runtime's `--offload adaptive`: alpha for `lengths` in a step of `shape` on devices
// of profile `hw` (its GEMM and copy rates), activations in `precision`, every rank's peak
// <= budget. The paper's rule is sized for the first stage (it holds the most layers).
AlphaResult solve_alpha_single(const ModelConfig& c, const std::vector<i64>& lengths, const HardwareProfile& hw,
                               ActPrecision precision, i64 budget, OffloadMode mode = OffloadMode::Adaptive,
                               const StepShape& shape = {});

// The same search for any schedule family: `build(alpha)` makes the schedule.
AlphaResult solve_alpha(const std::function<sched::Schedule(const std::vector<double>&)>& build,
                        const std::vector<double>& paper, const CostModel& cost,
                        const sched::MemoryRules& rules, i64 budget, OffloadMode mode);

// The paper's rule for ranks holding `layers` layers (and the head when `head`) with `sp`
// ranks sharing each subsequence: alpha_i = min(1, BW_d2h * T_fwd(i+1) / A_i), last 0.
std::vector<double> paper_alpha(const std::vector<i64>& lengths, int layers, bool head, int sp,
                                const CostModel& cost, const sched::MemoryRules& rules);

// Smallest N (from `min_n` up to `max_n`) whose best alpha fits `budget` on one device
// (Note [Searching N]: assumes fitting is monotone in N, as the peak falls with N).
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
                             i64 budget, bool flops_balanced, int min_n, int max_n, const StepShape& shape = {});

// Memory rules of a GPU plan or of this CPU.
sched::MemoryRules memory_rules(const ModelConfig& c, ActPrecision precision, bool zero = false);
// The memory rules of a runtime step of `shape`.
sched::MemoryRules memory_rules(const ModelConfig& c, ActPrecision precision, const StepShape& shape);

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
  i64 budget = 0;             // 0: the profile's usable device memory
};

struct PlanOutcome {
  bool ok = false;
  plan::Plan plan;
  std::string error;          // why nothing fits, when !ok
};

// The heuristic solver of DESIGN.md 5 for system "sppo"; the baselines for "megatron"
// and "deepspeed" (sim/baselines.h).
PlanOutcome solve_plan(const PlanRequest& req);

// The schedule of an SPPO plan, and its simulation on `hw`.
sched::Schedule plan_schedule(const plan::Plan& p);
SimResult simulate_plan(const plan::Plan& p, const HardwareProfile& hw, const SimOptions& options = {});

}  // namespace sppo::sim
