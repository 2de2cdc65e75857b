// Multiplexed sequence partitioning (DESIGN.md 6, the paper's 6.2 and Table 3).
//
// Note [MSP phases]: in the forward flow stage i runs subsequence k in time slot i + k.
// Its Left subsequences {0 .. P-2-i} run while the later stages {i+1 .. P-1} still idle,
// so they are split over the stage groups {i .. P-1}; its Right subsequences
// {N-i .. N-1} run after stage 0 has finished its forwards, so they are split over
// {0 .. i}. The backward flow mirrors this: Left subsequences are the last backwards of
// stage i (stages after it have finished) and Right ones its first (stages before it have
// not started), so the same groups are idle then too and a split subsequence runs its
// forward and its backward on the same devices. Sets are empty where the phase is.
#pragma once

#include <vector>

namespace sppo::sched {

struct MspPhases {
  std::vector<int> left, steady, right;   // subsequences of the stage, by phase
  std::vector<int> left_gpus, right_gpus; // stage groups that run the split pieces
};

// Requires 1 <= pp <= n and 0 <= stage < pp.
MspPhases msp_phases(int pp, int n, int stage);

}  // namespace sppo::sched
