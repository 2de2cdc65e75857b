#include "core/config.h"

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/check.h"

namespace sppo {

namespace {

struct Preset {
  const char* name;
  ModelConfig config;
};

// Small presets train here in seconds; the gpt-* shapes are the paper's Table 2.
const Preset kPresets[] = {
    {"tiny", {64, 64, 2, 4, 4, 10000.0f, 1e-5f}},
    {"small", {64, 128, 2, 4, 4, 10000.0f, 1e-5f}},
    {"medium", {256, 256, 4, 4, 4, 10000.0f, 1e-5f}},
    {"bench", {256, 1024, 4, 16, 4, 10000.0f, 1e-5f}},
    {"bench-memory", {64, 128, 4, 2, 4, 10000.0f, 1e-5f}},
    {"gpt-7b", {50304, 4096, 32, 32, 4, 10000.0f, 1e-5f}},
    {"gpt-13b", {50304, 5120, 40, 40, 4, 10000.0f, 1e-5f}},
    {"gpt-65b", {50304, 8192, 80, 64, 4, 10000.0f, 1e-5f}},
};

}  // namespace

i64 ModelConfig::num_params() const {
  const i64 H = hidden, F = ffn();
  const i64 per_layer = 2 * H + (3 * H * H + 3 * H) + (H * H + H) + 2 * H + (F * H + F) + (H * F + H);
  return i64(vocab) * H + i64(layers) * per_layer + 2 * H;
}

void ModelConfig::validate() const {
  SPPO_CHECK(vocab >= 2, "config") << "--vocab must be at least 2 (got " << vocab << ")";
  SPPO_CHECK(hidden >= 2, "config") << "--hidden must be positive and at least 2 (got " << hidden << ")";
  SPPO_CHECK(layers >= 1, "config") << "--layers must be at least 1 (got " << layers << ")";
  SPPO_CHECK(heads >= 1, "config") << "--heads must be at least 1 (got " << heads << ")";
  if (hidden % heads != 0 || (hidden / heads) % 2 != 0) {
    std::string ok;  // head counts that work: divide H with an even head size
    for (int z = 1, shown = 0; z <= hidden && shown < 4; ++z)
      if (hidden % z == 0 && (hidden / z) % 2 == 0 && hidden / z <= 256) {
        ok += (shown++ ? ", " : "") + std::to_string(z);
      }
    SPPO_CHECK(hidden % heads == 0, "config")
        << "--hidden " << hidden << " is not divisible by --heads " << heads
        << "; heads must divide the hidden size with an even head size (e.g. --heads " << ok << ")";
    SPPO_CHECK(false, "config") << "head size hidden/heads = " << head_size()
                                << " is odd; RoPE rotates pairs of dims, so it must be even (e.g. --heads "
                                << ok << ")";
  }
  SPPO_CHECK(ffn_mult >= 1, "config") << "ffn_mult must be at least 1 (got " << ffn_mult << ")";
  SPPO_CHECK(rope_theta > 0, "config") << "rope_theta must be positive (got " << rope_theta << ")";
  SPPO_CHECK(ln_eps > 0, "config") << "ln_eps must be positive (got " << ln_eps << ")";
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& p : kPresets) names.push_back(p.name);
  return names;
}

ModelConfig preset(const std::string& name) {
  for (const auto& p : kPresets)
    if (name == p.name) return p.config;
  std::string list;
  for (const auto& p : kPresets) list += std::string(list.empty() ? "" : ", ") + p.name;
  SPPO_CHECK(false, "config") << "unknown --model preset '" << name << "'; presets are: " << list;
  return {};
}

nlohmann::json to_json(const ModelConfig& c) {
  return {{"vocab", c.vocab},          {"hidden", c.hidden},         {"layers", c.layers},
          {"heads", c.heads},          {"ffn_mult", c.ffn_mult},     {"rope_theta", c.rope_theta},
          {"ln_eps", c.ln_eps}};
}

ModelConfig model_config_from_json(const nlohmann::json& j) {
  SPPO_CHECK(j.is_object(), "config") << "model config must be a JSON object";
  ModelConfig c;
  try {
    c.vocab = j.at("vocab").get<int>();
    c.hidden = j.at("hidden").get<int>();
    c.layers = j.at("layers").get<int>();
    c.heads = j.at("heads").get<int>();
    c.ffn_mult = j.value("ffn_mult", 4);
    c.rope_theta = j.value("rope_theta", 10000.0f);
    c.ln_eps = j.value("ln_eps", 1e-5f);
  } catch (const nlohmann::json::exception& e) {
    SPPO_CHECK(false, "config") << "model config: " << e.what()
                                << "; expected integer fields vocab, hidden, layers, heads";
  }
  c.validate();
  return c;
}

namespace {

// Splits "1.5GiB" into 1.5 and "GiB".
bool split_number(const std::string& text, double* value, std::string* suffix) {
  size_t pos = 0;
  try {
    *value = std::stod(text, &pos);
  } catch (...) {
    return false;
  }
  *suffix = text.substr(pos);
  return std::isfinite(*value);
}

}  // namespace

i64 parse_count(const std::string& text, const char* what) {
  double v = 0;
  std::string suf;
  bool ok = split_number(text, &v, &suf);
  double mult = 1;
  if (suf == "K" || suf == "k") mult = 1024;
  else if (suf == "M" || suf == "m") mult = 1048576;
  else if (suf == "G" || suf == "g") mult = 1073741824.0;
  else if (!suf.empty()) ok = false;
  const double r = v * mult;
  SPPO_CHECK(ok && r == std::floor(r) && r >= 0 && r < 9e18, "options")
      << what << " '" << text << "' is not a whole number; write e.g. 65536, 64K or 1M";
  return i64(r);
}

i64 parse_bytes(const std::string& text, const char* what) {
  double v = 0;
  std::string suf;
  bool ok = split_number(text, &v, &suf);
  double mult = 1;
  if (suf.empty() || suf == "B") mult = 1;
  else if (suf == "KiB" || suf == "K") mult = 1024.0;
  else if (suf == "MiB" || suf == "M") mult = 1048576.0;
  else if (suf == "GiB" || suf == "G") mult = 1073741824.0;
  else if (suf == "TiB" || suf == "T") mult = 1099511627776.0;
  else if (suf == "KB") mult = 1e3;
  else if (suf == "MB") mult = 1e6;
  else if (suf == "GB") mult = 1e9;
  else if (suf == "TB") mult = 1e12;
  else ok = false;
  const double r = std::floor(v * mult);
  SPPO_CHECK(ok && r > 0 && r < 9e18, "options")
      << what << " '" << text << "' is not a positive size; write e.g. 512MiB, 2GiB or 1.5GB";
  return i64(r);
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (std::fabs(bytes) >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
  return buf;
}

}  // namespace sppo
