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
//
// Note [MSP reach]: a helper computes on a copy of the stage's weights and keeps the fp32
// gradients of each stage it helps until its last piece there, so a split over every idle
// group (reach 0, the paper's) makes the last stage hold most of the model's weights at the
// end of the step: gpt-13b at 512K on 128 A100s in 32 stages, 70 of a 96 GiB peak. With
// reach k >= 2 a split task runs on the stage's own group and the k - 1 nearest idle ones
// only ({i .. i+k-1} and {i-k+1 .. i}), so a helper borrows at most k - 1 stages' weights.
#pragma once

#include <vector>

namespace sppo::sched {

struct MspPhases {
  std::vector<int> left, steady, right;   // subsequences of the stage, by phase
  std::vector<int> left_gpus, right_gpus; // stage groups that run the split pieces
};

// Requires 1 <= pp <= n, 0 <= stage < pp and reach 0 (every idle group) or >= 2.
MspPhases msp_phases(int pp, int n, int stage, int reach = 0);

}  // namespace sppo::sched
