// Model configuration and presets. Pure data: the planner, the simulator and the runtime
// all read it, so it lives in core and includes nothing of kernels or backends.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/dims.h"

namespace sppo {

// Limits ModelConfig::validate() enforces: far beyond any real model, they keep parameter
// counts and byte counts inside 64 bits.
inline constexpr int kMaxHidden = 1 << 20;
inline constexpr int kMaxLayers = 1 << 16;
inline constexpr int kMaxFfnMult = 64;
inline constexpr double kMaxParams = 1e15;

struct ModelConfig {
  int vocab = 0;              // V
  int hidden = 0;             // H
  int layers = 0;             // L
  int heads = 0;              // Z
  int ffn_mult = 4;           // F = ffn_mult * H
  float rope_theta = 10000.0f;
  float ln_eps = 1e-5f;
  bool causal = true;         // false: bidirectional attention (every query sees every key)

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

// The `sppo grads` config.json fields: vocab, hidden, layers, heads, ffn_mult, rope_theta, ln_eps,
// and "attention": "bidirectional" for a bidirectional model (absent: causal).
nlohmann::json to_json(const ModelConfig& c);
ModelConfig model_config_from_json(const nlohmann::json& j);

// Parses "65536", "64K", "1M", "1.5K" (K = 1024, M = 1048576, G = 2^30; the result must be
// whole), and for bytes "512MiB", "2GiB", "1.5GB" (B, KiB/KB, MiB/MB, GiB/GB, TiB/TB;
// KB = 1000 B; fractions of a byte are dropped). Arithmetic is exact and checked: a value
// above the limit below is refused as too large, naming the limit. `what` names the option
// in errors.
i64 parse_count(const std::string& text, const char* what);
i64 parse_bytes(const std::string& text, const char* what);

// Largest count parse_count accepts: 2^40 (1024G). Sizes derived from a count (S * H * 8
// bytes, S * Z * 4, ...) stay far inside 64 bits.
inline constexpr i64 kMaxCount = i64{1} << 40;
// Largest size parse_bytes accepts: 2^60 bytes (1048576 TiB); sums of a few such sizes
// still fit 64 bits.
inline constexpr i64 kMaxBytes = i64{1} << 60;
std::string format_bytes(double bytes);  // "1.50 GiB"

}  // namespace sppo
