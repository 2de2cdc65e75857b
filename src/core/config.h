// Model configuration and presets. Pure data: the planner, the simulator and the runtime
// all read it, so it lives in core and includes nothing of kernels or backends.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/dims.h"

namespace sppo {

struct ModelConfig {
  int vocab = 0;              // V
  int hidden = 0;             // H
  int layers = 0;             // L
  int heads = 0;              // Z
  int ffn_mult = 4;           // F = ffn_mult * H
  float rope_theta = 10000.0f;
  float ln_eps = 1e-5f;

  int head_size() const { return hidden / heads; }  // A
  int ffn() const { return ffn_mult * hidden; }     // F
  i64 num_params() const;
  // Throws sppo::Error naming the option and what would work.
  void validate() const;
};

// Names of the built-in presets, in the order `--help` lists them.
std::vector<std::string> preset_names();
// Throws sppo::Error listing the presets when the name is unknown.
ModelConfig preset(const std::string& name);

// The `sppo grads` config.json fields: vocab, hidden, layers, heads, ffn_mult, rope_theta, ln_eps.
nlohmann::json to_json(const ModelConfig& c);
ModelConfig model_config_from_json(const nlohmann::json& j);

// Parses "65536", "64K", "1M" (K = 1024, M = 1048576), and for bytes "512MiB", "2GiB",
// "1.5GB" (B, KiB/KB, MiB/MB, GiB/GB; KB = 1000 B). `what` names the option in errors.
i64 parse_count(const std::string& text, const char* what);
i64 parse_bytes(const std::string& text, const char* what);
std::string format_bytes(double bytes);  // "1.50 GiB"

}  // namespace sppo
