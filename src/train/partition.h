// The CLI's --partition and --offload choices for one process, resolved through the
// planner (partitions) and the simulator (adaptive alpha, the budget check).
#pragma once

#include <string>
#include <vector>

#include "core/config.h"
#include "planner/profile.h"
#include "sim/solver.h"

namespace sppo {

// The CPU attention kernel works in tiles of 128 keys and 256 queries: subsequence
// boundaries on multiples of 128 waste no partial tiles.
inline constexpr i64 kTileTokens = 128;

struct SubseqChoice {
  std::vector<i64> lengths;        // l_i
  std::vector<double> alpha;       // alpha_i, last 0
  i64 predicted_peak_bytes = 0;    // simulated with the runtime's memory rules
  double predicted_step_s = 0;     // simulated on the profile
  double predicted_exposed_copy_s = 0;
  std::string alpha_rule;          // how alpha was chosen
};

// --partition length|flops|adaptive, --offload none|full|paper|adaptive|<ratio>, for N
// subsequences of S tokens under `budget` bytes per rank (0: none) on profile `hw`, in a
// step of `shape` (one process, or a pipeline of stages and replicas).
// `adaptive` partition: whichever of length and flops the simulator predicts faster (with
// its best alpha). `adaptive` offload: the solver's alpha (sim/solver.h Note [Alpha under a
// budget]): nothing when everything fits, else the least that fits, hidden behind compute
// where possible. `paper`: the paper's rule (sim/solver.h paper_alpha), whatever the
// budget. A budget that cannot hold the choice throws sppo::Error naming the bytes
// needed and, with `hint`, the smallest N and offload that would fit, or that nothing
// does (a search over N: a caller that drops the error asks for none).
SubseqChoice choose_subseqs(const std::string& partition, const std::string& offload,
                            const ModelConfig& c, i64 S, int N, i64 budget,
                            const plan::HardwareProfile& hw, const StepShape& shape = {}, bool hint = true);

}  // namespace sppo
