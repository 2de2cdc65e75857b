// `sppo train` and `sppo grads`.
#pragma once

#include <string>

#include "train/options.h"

namespace sppo {

// Trains for o.steps steps (resuming from o.resume_dir when given), printing a progress
// line, writing metrics, checkpoints and a trace as asked. Returns the process exit status.
int run_train(const TrainOptions& o);

// One forward/backward, exported to `out_dir` (config.json, tokens.u32,
// weights.safetensors, grads.safetensors, result.json). Weights come from `init_from`
// (a checkpoint directory) when given, else from the seed.
int run_grads(const StepOptions& o, const std::string& out_dir, const std::string& init_from);

}  // namespace sppo
