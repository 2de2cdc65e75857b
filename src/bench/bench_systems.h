// `sppo bench systems`: the SPPO paper's comparison on CPU ranks. Four ranks with one thread
// each stand in for four GPUs of one node, one device budget a rank; on a model, that
// budget and a search cap small enough to finish here, each system's plan:
//  - sppo: the planner's (`sppo plan`);
//  - megatron: Megatron-LM's layout as a schedule (`plan --system megatron`, Note
//    [Megatron-LM as a schedule] in sim/solver/megatron.cpp);
//  - deepspeed: DeepSpeed-Ulysses with ZeRO-3 and FPDT as a schedule (`plan --system
//    deepspeed`, Note [DeepSpeed-Ulysses as a schedule] in sim/solver/deepspeed.cpp).
// For each, the longest sequence the planner fits under the budget (in steps of 1024 tokens
// up to the cap; one at the cap is reported as such), and at the longest length all three
// fit (at most the measure cap) the step time measured on the ranks (median of --reps after
// a warm-up, each rank's peak device memory beside the plan's) and simulated on a profile the
// ranks measure at the start, all at once, as they compute.
// Started without a launcher, it starts itself under `mpirun -np 4`.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "comm/comm.h"
#include "core/dims.h"

namespace sppo {

inline constexpr int kBenchSystemsRanks = 4;

struct BenchSystemsOptions {
  std::string model = "medium";
  i64 budget = i64(128) << 20;       // device bytes a rank
  i64 cap = i64(64) << 10;           // the longest length searched
  i64 measure_cap = i64(16) << 10;   // the longest common length run
  int reps = 2;                      // timed steps a system (median), after one warm-up
  std::string hardware;              // profile to plan and simulate with ("" = measured now)
};

// Every rank calls it; the result is meaningful on rank 0. JSON: {"common_seq_len",
// "systems": {"sppo"|"megatron"|"deepspeed": {"max_seq_len", "max_at_cap",
// "measured_step_s" (null where nothing is run: no common length), "simulated_step_s",
// "layout", ...}}, ...}.
nlohmann::json bench_systems(const BenchSystemsOptions& o, comm::Comm& world);
void print_bench_systems(const nlohmann::json& j);
// A picture of the three: the longest sequence of each, and at the common length the step
// measured and simulated.
std::string svg_bench_systems(const nlohmann::json& j);

}  // namespace sppo
