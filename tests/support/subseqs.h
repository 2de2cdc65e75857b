// Test helper: the subsequence lengths and offload fractions the one-process mode tests
// run (what --subseqs N --partition length and --offload a give).
#pragma once

#include <cstddef>
#include <vector>

#include "core/config.h"

namespace sppo::testing {

// S tokens in N subsequences of equal length, the first S % N one longer.
inline std::vector<i64> equal_lengths(i64 S, int N) {
  std::vector<i64> l(std::size_t(N), S / N);
  for (i64 k = 0; k < S % N; ++k) ++l[std::size_t(k)];
  return l;
}

// alpha = a for every subsequence but the last, whose backward comes first: never offloaded.
inline std::vector<double> alphas(int N, double a) {
  std::vector<double> v(std::size_t(N), a);
  if (!v.empty()) v.back() = 0;
  return v;
}

}  // namespace sppo::testing
