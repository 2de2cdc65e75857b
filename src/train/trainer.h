// `sppo train` and `sppo grads`.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "comm/comm.h"
#include "train/options.h"

namespace sppo {

// Trains for o.steps steps (resuming from o.resume_dir when given), printing a progress
// line, writing metrics, checkpoints and a trace as asked. Returns the process exit status.
int run_train(const TrainOptions& o);
// Note [Continuing a trained model] (train/options.h): with --init, the fine-tuning values of
// the settings not given on the command line (`given`: whether --lr, --warmup and
// --weight-decay were), and where each value came from.
void apply_finetune_defaults(TrainOptions& o, bool lr_given, bool warmup_given, bool weight_decay_given);

// The options that change a run's numbers, as command-line flags and canonical values
// ({"--seq-len": "65536", "--recompute": false, ...}). A checkpoint records them, and
// `train --resume DIR` restores every one not given again and refuses one given with
// another value. The model is recorded as its preset and every size.
nlohmann::json numeric_options(const TrainOptions& o);

// Names the first option of `given` (numeric_options of the command line) whose value
// differs from `recorded` (a checkpoint's), or returns "" when they agree.
std::string first_difference(const nlohmann::json& given, const nlohmann::json& recorded);

// One forward/backward, exported to `out_dir` (config.json, tokens.u32,
// weights.safetensors, grads.safetensors, result.json). Weights come from `init_from`
// (a checkpoint directory) when given, else from the seed.
int run_grads(const StepOptions& o, const std::string& out_dir, const std::string& weights_from);

// Shared by the commands that run steps (train, grads, eval).
// Threads per rank: as asked, else the cores shared by the ranks on this machine.
void apply_threads(int threads, const comm::Comm& world);
void write_json_file(const std::string& path, const nlohmann::json& j);
// A directory the run writes: a checkpoint (replaced atomically) or an export; throws naming
// `option` when it cannot be written.
void check_output_dir(const std::string& path, const char* option, bool checkpoint);

}  // namespace sppo
