#include "schedule/msp.h"

#include "core/check.h"

namespace sppo::sched {

MspPhases msp_phases(int pp, int n, int stage) {
  SPPO_CHECK(pp >= 1 && n >= pp, "schedule")
      << "MSP needs at least as many subsequences as stages (N = " << n << ", P = " << pp << ")";
  SPPO_CHECK(stage >= 0 && stage < pp, "schedule") << "stage " << stage << " outside [0, " << pp << ")";
  MspPhases m;
  for (int k = 0; k <= pp - 2 - stage; ++k) m.left.push_back(k);
  for (int k = pp - 1 - stage; k <= n - 1 - stage; ++k) m.steady.push_back(k);
  for (int k = n - stage; k <= n - 1; ++k) m.right.push_back(k);
  if (!m.left.empty())
    for (int g = stage; g < pp; ++g) m.left_gpus.push_back(g);
  if (!m.right.empty())
    for (int g = 0; g <= stage; ++g) m.right_gpus.push_back(g);
  return m;
}

}  // namespace sppo::sched
