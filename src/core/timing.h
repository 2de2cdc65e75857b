// The measuring helpers the machine profile and the benchmarks share.
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace sppo {

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The upper median of v (its middle value, or the larger of the two); 0 for none.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

}  // namespace sppo
