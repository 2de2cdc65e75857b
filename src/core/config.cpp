#include "core/config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/json_fields.h"

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
  SPPO_CHECK(ffn_mult >= 1, "config") << "ffn_mult must be at least 1 (got " << ffn_mult << ")";
  // Sizes far beyond any model, so that parameter counts and per-token byte counts stay
  // inside 64 bits wherever they are computed (and the search for head counts below is short).
  SPPO_CHECK(hidden <= kMaxHidden && ffn_mult <= kMaxFfnMult && layers <= kMaxLayers, "config")
      << "--hidden " << hidden << ", --layers " << layers << ", ffn_mult " << ffn_mult
      << ": at most " << kMaxHidden << ", " << kMaxLayers << " and " << kMaxFfnMult << " are accepted";
  if (hidden % heads != 0 || (hidden / heads) % 2 != 0) {
    std::string ok;  // head counts that work: divide H with an even head size of at most 256
    for (int z = std::max(1, hidden / 256), shown = 0; z <= hidden && shown < 4; ++z)
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
  SPPO_CHECK(std::isfinite(rope_theta) && rope_theta > 0, "config") << "rope_theta must be positive (got " << rope_theta << ")";
  SPPO_CHECK(std::isfinite(ln_eps) && ln_eps > 0, "config") << "ln_eps must be positive (got " << ln_eps << ")";
  const double params = double(vocab) * hidden + double(layers) * (4.0 + 2.0 * ffn_mult) * double(hidden) * hidden;
  SPPO_CHECK(params <= kMaxParams, "config")
      << "the model would have about " << params << " parameters; at most " << kMaxParams << " are accepted";
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
  nlohmann::json j = {{"vocab", c.vocab},          {"hidden", c.hidden},         {"layers", c.layers},
                      {"heads", c.heads},          {"ffn_mult", c.ffn_mult},     {"rope_theta", c.rope_theta},
                      {"ln_eps", c.ln_eps}};
  if (!c.causal) j["attention"] = "bidirectional";
  return j;
}

ModelConfig model_config_from_json(const nlohmann::json& j) {
  SPPO_CHECK(j.is_object(), "config") << "model config must be a JSON object";
  for (const char* key : {"vocab", "hidden", "layers", "heads"})
    SPPO_CHECK(j.contains(key), "config")
        << "model config lacks \"" << key << "\"; expected integer fields vocab, hidden, layers, heads";
  constexpr i64 kIntMax = std::numeric_limits<int>::max();
  auto integer = [&](const char* key, int fallback) {
    return int(json_integer_field(j, key, fallback, std::numeric_limits<int>::min(), kIntMax, "config",
                                  "model config: "));
  };
  auto real = [&](const char* key, float fallback) {
    const auto it = j.find(key);
    if (it == j.end()) return fallback;
    SPPO_CHECK(it->is_number(), "config") << "model config: \"" << key << "\" must be a number (got " << it->dump() << ")";
    return float(it->get<double>());
  };
  ModelConfig c;
  c.vocab = integer("vocab", 0);
  c.hidden = integer("hidden", 0);
  c.layers = integer("layers", 0);
  c.heads = integer("heads", 0);
  c.ffn_mult = integer("ffn_mult", 4);
  c.rope_theta = real("rope_theta", 10000.0f);
  c.ln_eps = real("ln_eps", 1e-5f);
  const std::string attention = json_string_field(j, "attention", "causal", "config", "model config: ");
  SPPO_CHECK(attention == "causal" || attention == "bidirectional", "config")
      << "model config: \"attention\" must be causal or bidirectional (got '" << attention << "')";
  c.causal = attention == "causal";
  c.validate();
  return c;
}

namespace {

// "1.5GiB" as exact parts: integer digits, fraction digits and the suffix after them.
struct Number {
  std::string whole, fraction, suffix;
  bool negative = false;
};

bool is_digit(char c) { return c >= '0' && c <= '9'; }

// Digits, optionally "." and more digits, then any suffix. False when no digit leads.
bool split_number(const std::string& text, Number* n) {
  std::size_t i = 0;
  if (i < text.size() && (text[i] == '-' || text[i] == '+')) n->negative = text[i++] == '-';
  while (i < text.size() && is_digit(text[i])) n->whole += text[i++];
  if (i < text.size() && text[i] == '.') {
    ++i;
    while (i < text.size() && is_digit(text[i])) n->fraction += text[i++];
  }
  n->suffix = text.substr(i);
  while (!n->fraction.empty() && n->fraction.back() == '0') n->fraction.pop_back();
  return !n->whole.empty() || !n->fraction.empty();
}

// Fraction digits beyond this are refused rather than rounded: the exact value times a
// multiplier of at most 2^40 then still fits 128 bits.
constexpr std::size_t kMaxFractionDigits = 18;

enum class Scaled { Ok, NotWhole, TooLarge };

// value = number * mult, exactly; `limit` bounds the result. With `floor`, a fractional
// result is rounded down, else it is NotWhole.
Scaled scale(const Number& n, std::uint64_t mult, i64 limit, bool floor, i64* value) {
  using u128 = unsigned __int128;
  u128 whole = 0;
  for (char c : n.whole) {
    whole = whole * 10 + u128(c - '0');
    if (whole > u128(limit)) return Scaled::TooLarge;  // mult >= 1, so already too large
  }
  whole *= mult;  // <= 2^60 * 2^40 after the loop's bound
  u128 frac = 0, denom = 1;
  for (char c : n.fraction) frac = frac * 10 + u128(c - '0'), denom *= 10;
  frac *= mult;
  if (!floor && frac % denom != 0) return Scaled::NotWhole;
  const u128 total = whole + frac / denom;
  if (total > u128(limit)) return Scaled::TooLarge;
  *value = i64(total);
  return Scaled::Ok;
}

std::uint64_t count_multiplier(const std::string& suffix) {
  if (suffix.empty()) return 1;
  if (suffix == "K" || suffix == "k") return std::uint64_t{1} << 10;
  if (suffix == "M" || suffix == "m") return std::uint64_t{1} << 20;
  if (suffix == "G" || suffix == "g") return std::uint64_t{1} << 30;
  return 0;
}

std::uint64_t byte_multiplier(const std::string& suffix) {
  if (suffix.empty() || suffix == "B") return 1;
  if (suffix == "KiB" || suffix == "K") return std::uint64_t{1} << 10;
  if (suffix == "MiB" || suffix == "M") return std::uint64_t{1} << 20;
  if (suffix == "GiB" || suffix == "G") return std::uint64_t{1} << 30;
  if (suffix == "TiB" || suffix == "T") return std::uint64_t{1} << 40;
  if (suffix == "KB") return 1000;
  if (suffix == "MB") return 1000000;
  if (suffix == "GB") return 1000000000;
  if (suffix == "TB") return 1000000000000;
  return 0;
}

}  // namespace

i64 parse_count(const std::string& text, const char* what) {
  constexpr const char* kExamples = "; write e.g. 65536, 64K or 1M";
  Number n;
  const bool number = split_number(text, &n);
  const std::uint64_t mult = count_multiplier(n.suffix);
  SPPO_CHECK(number && mult != 0 && n.fraction.size() <= kMaxFractionDigits, "options")
      << what << " '" << text << "' is not a whole number" << kExamples;
  i64 v = 0;
  const Scaled r = scale(n, mult, kMaxCount, false, &v);
  SPPO_CHECK(!n.negative || (r == Scaled::Ok && v == 0), "options") << what << " '" << text << "' is negative" << kExamples;
  SPPO_CHECK(r != Scaled::TooLarge, "options")
      << what << " '" << text << "' is too large; the largest accepted is " << kMaxCount << " (1024G)";
  SPPO_CHECK(r == Scaled::Ok, "options") << what << " '" << text << "' is not a whole number" << kExamples;
  return v;
}

i64 parse_bytes(const std::string& text, const char* what) {
  constexpr const char* kExamples = "; write e.g. 512MiB, 2GiB or 1.5GB";
  Number n;
  const bool number = split_number(text, &n);
  const std::uint64_t mult = byte_multiplier(n.suffix);
  SPPO_CHECK(number && mult != 0 && n.fraction.size() <= kMaxFractionDigits, "options")
      << what << " '" << text << "' is not a positive size" << kExamples;
  SPPO_CHECK(!n.negative, "options") << what << " '" << text << "' is not a positive size" << kExamples;
  i64 v = 0;
  const Scaled r = scale(n, mult, kMaxBytes, true, &v);
  SPPO_CHECK(r != Scaled::TooLarge, "options")
      << what << " '" << text << "' is too large; the largest accepted is " << kMaxBytes
      << " bytes (1048576TiB)";
  SPPO_CHECK(v > 0, "options") << what << " '" << text << "' is not a positive size" << kExamples;
  return v;
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
