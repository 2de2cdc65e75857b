// The benchmarks' search for the longest sequence a configuration fits (bench eval, bench
// systems): the lengths are multiples of a step, fitting is taken to be monotone in the
// length (what fits at S fits below it), and each probe is a planner's or a setup's check.
#pragma once

#include <algorithm>
#include <functional>

#include "core/dims.h"

namespace sppo {

// The step the benchmarks search lengths in.
inline constexpr i64 kLengthStep = 1024;

// The longest multiple of `step` up to `cap` (rounded down to one) at which fits(S) holds;
// 0 where not even `step` fits. Doubling from `step`, then halving the interval.
inline i64 longest_fitting(i64 step, i64 cap, const std::function<bool(i64)>& fits) {
  cap = cap / step * step;
  i64 good = 0, bad = 0, S = step;
  while (true) {
    if (!fits(S)) {
      bad = S;
      break;
    }
    good = S;
    if (S == cap) return cap;
    S = std::min(cap, 2 * S);
  }
  while (bad - good > step) {
    const i64 mid = (good + bad) / 2 / step * step;
    (fits(mid) ? good : bad) = mid;
  }
  return good;
}

}  // namespace sppo
