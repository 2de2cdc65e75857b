#include "schedule/msp.h"

#include <algorithm>

#include "core/check.h"

namespace sppo::sched {

MspPhases msp_phases(int pp, int n, int stage, int reach) {
  SPPO_CHECK(pp >= 1 && n >= pp, "schedule")
      << "MSP needs at least as many subsequences as stages (N = " << n << ", P = " << pp << ")";
  SPPO_CHECK(stage >= 0 && stage < pp, "schedule") << "stage " << stage << " outside [0, " << pp << ")";
  SPPO_CHECK(reach == 0 || reach >= 2, "schedule") << "MSP reach " << reach << ": use 0 (every idle group) or 2 or more";
  const int wide = reach == 0 ? pp : reach;
  MspPhases m;
  for (int k = 0; k <= pp - 2 - stage; ++k) m.left.push_back(k);
  for (int k = pp - 1 - stage; k <= n - 1 - stage; ++k) m.steady.push_back(k);
  for (int k = n - stage; k <= n - 1; ++k) m.right.push_back(k);
  if (!m.left.empty())
    for (int g = stage; g < std::min(pp, stage + wide); ++g) m.left_gpus.push_back(g);
  if (!m.right.empty())
    for (int g = std::max(0, stage - wide + 1); g <= stage; ++g) m.right_gpus.push_back(g);
  return m;
}

std::vector<int> msp_groups(int pp, int n, int stage, int k, int reach) {
  const MspPhases m = msp_phases(pp, n, stage, reach);
  SPPO_CHECK(k >= 0 && k < n, "schedule") << "subsequence " << k << " outside [0, " << n << ")";
  if (reach == 0) {
    for (int x : m.left)
      if (x == k) return m.left_gpus;
    for (int x : m.right)
      if (x == k) return m.right_gpus;
    return {stage};
  }
  std::vector<int> g;
  for (int j = std::max(0, stage - reach + 1); j < std::min(pp, stage + reach); ++j)
    if (j == stage || (j > stage && k <= j - stage - 1) || (j < stage && k >= n - (stage - j))) g.push_back(j);
  return g;
}

}  // namespace sppo::sched
