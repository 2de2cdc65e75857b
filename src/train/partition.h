// The CLI's --partition and --offload choices, resolved through the planner.
#pragma once

#include <string>
#include <vector>

#include "core/config.h"

namespace sppo {

// --partition length|flops|adaptive into N lengths summing to S.
std::vector<i64> choose_partition(const std::string& mode, const ModelConfig& c, i64 S, int N);

// --offload none|full|adaptive|<ratio>: alpha per subsequence; the last is always 0.
std::vector<double> choose_alpha(const std::string& mode, const ModelConfig& c,
                                 const std::vector<i64>& lengths, i64 device_budget);

}  // namespace sppo
