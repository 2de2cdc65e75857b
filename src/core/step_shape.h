// The shape of one training step (docs/design.md 7): its parallelism, its pipeline's layer
// split and its placements, with what the memory rules need of the backend (precision,
// kernel scratch) and of the data (packed documents, labels). What `train` resolves its
// options to, what a plan records (plan::Plan::shape), and what sched::build_step turns,
// with the subsequences' lengths and offload fractions, into the schedule that the runtime
// and the simulator both execute.
#pragma once

#include <vector>

#include "core/layout.h"
#include "core/parallel.h"
#include "core/placement.h"

namespace sppo {

struct StepShape {
  ParallelDims par;
  std::vector<int> stage_layers;  // layers per pipeline stage; empty: as even as possible
  Placements place;
  ActPrecision precision = ActPrecision::F32;  // of the activations (bf16 on GPUs)
  KernelScratch block_scratch, head_scratch;   // what the runtime's kernels take (MemoryRules)
  bool packed = false;                         // Schedule::packed
  bool labeled = false;                        // Schedule::labeled
  // An evaluation (`sppo eval`): the step's schedule is forward-only (Schedule::forward_only)
  // and the runtime holds the weights alone, no gradients or optimizer state.
  bool forward_only = false;
};

}  // namespace sppo
