// Baseline systems priced on the same cost model and profiles as SPPO, so the planner's
// comparisons are side by side (issue 4). See Note [Baseline models] and Note [Baseline
// memory] in baselines.cpp.
#pragma once

#include "planner/plan.h"
#include "sim/explain.h"
#include "sim/simulator.h"

namespace sppo::sim {

struct PlanRequest;
struct PlanOutcome;

// Best layout of p.system ("megatron" or "deepspeed") that fits, or why none does.
PlanOutcome solve_baseline(const PlanRequest& req);
// Step time, bubbles and peak memory of a baseline plan's layout.
SimResult simulate_baseline(const plan::Plan& p, const HardwareProfile& hw, const SimOptions& options = {});
// Its device and host memory term by term at its peak.
MemoryExplain explain_baseline(const plan::Plan& p, const HardwareProfile& hw);

}  // namespace sppo::sim
