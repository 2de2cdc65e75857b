// Multiplexed sequence partitioning (docs/design.md 6, the paper's 6.2 and Table 3).
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
// only, so a helper borrows at most k - 1 stages' weights.
//
// Note [MSP idle groups]: Table 3's sets count a group as free while it runs its own split
// Left or Right tasks, so a split task can wait on a helper busy with its own work. At reach
// k >= 2 a task is split only over groups that idle in its slot of the pipeline without MSP
// (a forward one unit, a backward two): a later group j > i has not started its forwards
// in stage i's forward of subsequence s, and has finished its backwards in i's backward of
// s, when s <= j - i - 1; an earlier group j < i has finished its forwards and not started
// its backwards, in both of i's slots of s, when s >= N - (i - j). So stage i's subsequence
// 0 goes to the k - 1 later groups, its last to the k - 1 earlier ones, and fewer the
// further from either end. At gpt-13b 512K on 128 A100s (sp 8, pp 8, N 32, reach 2) the
// step took 55.2 s with Table 3's sets at that reach, 48.9 s with the idle ones (47.8 s
// without MSP): at that length a late subsequence's attention to every earlier position
// is most of its work, and it stays with the stage's owner, where the keys are.
#pragma once

#include <vector>

namespace sppo::sched {

struct MspPhases {
  std::vector<int> left, steady, right;   // subsequences of the stage, by phase
  std::vector<int> left_gpus, right_gpus; // stage groups that run the split pieces
};

// Requires 1 <= pp <= n, 0 <= stage < pp and reach 0 (every idle group) or >= 2.
MspPhases msp_phases(int pp, int n, int stage, int reach = 0);

// The stage groups that run stage `stage`'s task on subsequence `k` under MSP, ascending:
// at reach 0 Table 3's (msp_phases), at reach >= 2 the stage's own and the idle ones within
// reach (Note [MSP idle groups]).
std::vector<int> msp_groups(int pp, int n, int stage, int k, int reach);

}  // namespace sppo::sched
