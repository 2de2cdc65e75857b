// The options `train` and `grads` share: the model, the data, the modes and the layout of
// ranks. add_step_options registers them; resolve_step_options turns what was given into a
// StepOptions (presets, --init's and a --plan's model, checks).
#pragma once

#include <string>

#include "train/options.h"

namespace CLI {
class App;
class Option;
}  // namespace CLI

namespace sppo::cli {

// Model, data and layout options shared by `train` and `grads`.
struct StepFlags {
  std::string model = "small";
  std::string attention = "causal";
  int vocab = 0, hidden = 0, layers = 0, heads = 0;
  double rope_theta = 0;     // 0: the model's
  std::string rope_scaling;  // "": the model's
  std::string seq_len = "1024";
  std::string device_memory;
  std::string host_memory;
  i64 mlp_tile_rows = 0;
  // The placement and layout options as given, parsed into StepOptions::place and ::par by
  // resolve_step_options.
  std::string kv_cache = "auto";
  std::string backward_order = "auto";
  std::string weights = "auto";
  std::string optimizer_state = "auto";
  std::string residual_grads = "device";
  std::string rebuild_inputs = "auto";
  std::string recompute_tensors = "auto";
  std::string ring = "flash,zigzag";
  std::string msp = "off";
  int zero = 0;
  CLI::Option* model_option = nullptr;
  CLI::Option* zero_option = nullptr;
  CLI::Option* seq_len_option = nullptr;
  CLI::Option* mlp_tile_rows_option = nullptr;
};

inline constexpr const char* kAttentionKernelsHelp =
    "Attention kernels: auto (cuDNN's fused attention on CUDA where it takes the shapes, else the backend's own), "
    "own, or cudnn";

void add_step_options(CLI::App* cmd, StepFlags& f, StepOptions& o);

// After parsing: presets, --init's or the plan's model, the sizes given, the sequence length
// and budgets; throws sppo::Error naming an option that cannot be.
void resolve_step_options(const StepFlags& f, StepOptions& o);

}  // namespace sppo::cli
