// `sppo bench eval`: how much longer SPPO's forward alone (sppo eval, Note [Forward-only
// steps] in schedule/builders.cpp) reaches than training under the same device budget.
//
// For the model and budgets given (device and host), and each K/V placement (device, host), the longest
// sequence `train --subseqs auto --offload adaptive` fits and the longest `sppo eval
// --subseqs auto` fits, both from the setup's own predictions (the checks a run makes before
// its first step), searched in multiples of 1024 tokens up to a cap (a length at the cap is
// reported as such); then one evaluation at its longest, or at a shorter cap on what is
// measured here, its measured device and host peaks beside the predicted ones.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "core/dims.h"

namespace sppo {

struct BenchEvalOptions {
  std::string model = "small";
  i64 budget = i64{96} << 20;      // the demo's device budget
  i64 host_budget = i64{4} << 30;  // the host's, which holds what both move off the device
  i64 cap = i64{4} << 20;          // the longest length searched
  // The longest evaluation run to measure its peaks (eval's longest where that is shorter).
  i64 measure_cap = i64{64} << 10;
};

nlohmann::json bench_eval(const BenchEvalOptions& o);
void print_bench_eval(const nlohmann::json& j);

}  // namespace sppo
