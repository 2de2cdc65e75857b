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

ModelConfig gpt(int vocab, int hidden, int layers, int heads) {
  ModelConfig c;
  c.vocab = vocab;
  c.hidden = hidden;
  c.layers = layers;
  c.heads = heads;
  return c;
}

ModelConfig llama(int vocab, int hidden, int layers, int heads, int kv_heads, int ffn_size, float theta, float eps,
                  i64 max_positions, bool qkv_bias, bool tied = false) {
  ModelConfig c = gpt(vocab, hidden, layers, heads);
  c.rope_theta = theta;
  c.ln_eps = eps;
  c.family = Family::Llama;
  c.kv_heads = kv_heads;
  c.ffn_size = ffn_size;
  c.qkv_bias = qkv_bias;
  c.max_positions = max_positions;
  c.tie_embeddings = tied;
  return c;
}

// Llama 3.2's RoPE: llama3 scaling by 32 from the 8192 positions Llama 3 was trained at.
ModelConfig llama32(int hidden, int layers, int heads, int ffn_size) {
  ModelConfig c = llama(128256, hidden, layers, heads, 8, ffn_size, 500000.0f, 1e-5f, 131072, false, true);
  c.rope_scaling.type = RopeScaling::Type::Llama3;
  c.rope_scaling.factor = 32.0;
  c.rope_scaling.original_max_positions = 8192;
  c.rope_scaling.low_freq_factor = 1.0;
  c.rope_scaling.high_freq_factor = 4.0;
  return c;
}

// Qwen3: 128-wide heads over any hidden size (Note [Head size]), their queries and keys
// normed (Note [Query/key norms]), 8 key/value heads, RoPE theta 1e6 over 40960 positions.
ModelConfig qwen3(int hidden, int layers, int heads, int ffn_size, bool tied) {
  ModelConfig c = llama(151936, hidden, layers, heads, 8, ffn_size, 1000000.0f, 1e-6f, 40960, false, tied);
  c.head_dim = 128;
  c.qk_norm = true;
  return c;
}

// Qwen3's block in small: 4 heads of 24 on H 64 (A not H / Z), 2 key/value heads, tied.
ModelConfig qwen3_tiny() {
  ModelConfig c = llama(64, 64, 2, 4, 2, 192, 1000000.0f, 1e-6f, 256, false, true);
  c.head_dim = 24;
  c.qk_norm = true;
  return c;
}

struct ScalingName {
  RopeScaling::Type type;
  const char* name;
};
const ScalingName kScalings[] = {{RopeScaling::Type::None, "none"},
                                 {RopeScaling::Type::Linear, "linear"},
                                 {RopeScaling::Type::Dynamic, "dynamic"},
                                 {RopeScaling::Type::Yarn, "yarn"},
                                 {RopeScaling::Type::Llama3, "llama3"}};

// Small presets train here in seconds; the gpt-* shapes are the paper's Table 2; the
// Llama-family ones those of the released models (config.json).
const Preset kPresets[] = {
    {"tiny", gpt(64, 64, 2, 4)},
    {"small", gpt(64, 128, 2, 4)},
    {"medium", gpt(256, 256, 4, 4)},
    {"bench", gpt(256, 1024, 4, 16)},
    {"bench-memory", gpt(64, 128, 4, 2)},
    {"gpt-7b", gpt(50304, 4096, 32, 32)},
    {"gpt-13b", gpt(50304, 5120, 40, 40)},
    {"gpt-65b", gpt(50304, 8192, 80, 64)},
    {"llama-tiny", llama(64, 64, 2, 4, 2, 256, 10000.0f, 1e-5f, 256, false)},
    {"llama-tiny-tied", llama(64, 64, 2, 4, 2, 256, 10000.0f, 1e-5f, 256, true, true)},  // Qwen2.5's small shape
    {"qwen3-tiny", qwen3_tiny()},
    {"llama-3-8b", llama(128256, 4096, 32, 32, 8, 14336, 500000.0f, 1e-5f, 8192, false)},
    {"llama-3-70b", llama(128256, 8192, 80, 64, 8, 28672, 500000.0f, 1e-5f, 8192, false)},
    {"qwen2.5-7b", llama(152064, 3584, 28, 28, 4, 18944, 1000000.0f, 1e-6f, 32768, true)},
    // The small ones people start from on modest hardware: their LM head is their embedding.
    {"llama-3.2-1b", llama32(2048, 16, 32, 8192)},
    {"llama-3.2-3b", llama32(3072, 28, 24, 8192)},
    {"qwen2.5-0.5b", llama(151936, 896, 24, 14, 2, 4864, 1000000.0f, 1e-6f, 32768, true, true)},
    {"qwen2.5-1.5b", llama(151936, 1536, 28, 12, 2, 8960, 1000000.0f, 1e-6f, 32768, true, true)},
    {"qwen3-0.6b", qwen3(1024, 28, 16, 3072, true)},
    {"qwen3-1.7b", qwen3(2048, 28, 16, 6144, true)},
    {"qwen3-4b", qwen3(2560, 36, 32, 9728, true)},
    {"qwen3-8b", qwen3(4096, 36, 32, 12288, false)},
    {"qwen3-32b", qwen3(5120, 64, 64, 25600, false)},
};

}  // namespace

const char* rope_scaling_name(RopeScaling::Type t) {
  for (const auto& s : kScalings)
    if (s.type == t) return s.name;
  return "?";
}

i64 ModelConfig::num_params() const {
  const i64 H = hidden, F = ffn(), Q = qkv_width(), W = fc_width(), QW = q_width();
  const i64 norms = llama() ? 1 : 2;  // LayerNorm's weight and bias, RMSNorm's weight
  const i64 b = biases() ? 1 : 0;
  const i64 qk_norms = qk_norm ? 2 * i64(head_size()) : 0;  // q_norm and k_norm [A]
  const i64 per_layer = 2 * norms * H + (Q * H + (qkv_bias ? Q : 0)) + qk_norms + (H * QW + b * H) + (W * H + b * W) +
                        (H * F + b * H);
  return i64(vocab) * H * (tied_embeddings() ? 1 : 2) + i64(layers) * per_layer + norms * H;
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
  if (head_dim != 0) {
    // Note [Head size]: a Llama-family model's heads need not split H.
    SPPO_CHECK(llama(), "config") << "head_dim " << head_dim
                                  << " belongs to Llama-family models (\"family\": \"llama\"); a GPT block's "
                                     "heads split the hidden size (head size hidden / heads)";
    SPPO_CHECK(head_dim >= 2 && head_dim <= kMaxHeadDim && head_dim % 2 == 0, "config")
        << "head_dim " << head_dim << " must be even and between 2 and " << kMaxHeadDim
        << " (RoPE rotates pairs of dims; e.g. head_dim 64 or 128)";
    SPPO_CHECK(heads <= kMaxHidden && i64(heads) * head_dim <= kMaxHidden, "config")
        << "--heads " << heads << " of head_dim " << head_dim << " make queries " << i64(heads) * head_dim
        << " wide; at most " << kMaxHidden << " are accepted";
  } else if (hidden % heads != 0 || (hidden / heads) % 2 != 0) {
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
  if (llama()) {
    const int G = kv_head_count();
    SPPO_CHECK(G >= 1 && G <= heads && heads % G == 0, "config")
        << "kv_heads " << kv_heads << " must divide heads " << heads
        << " (grouped-query attention shares each key/value head among heads / kv_heads query heads)";
    SPPO_CHECK(ffn_size >= 1 && ffn_size <= i64(kMaxFfnMult) * hidden, "config")
        << "ffn_size (intermediate_size) must be between 1 and " << kMaxFfnMult << " x hidden (got " << ffn_size
        << ")";
    SPPO_CHECK(causal, "config") << "a Llama-family model is causal";
  } else {
    SPPO_CHECK(kv_heads == 0 || kv_heads == heads, "config")
        << "kv_heads " << kv_heads << ": grouped-query attention needs a Llama-family model (\"family\": \"llama\")";
    SPPO_CHECK(ffn_size == 0 && qkv_bias && rope_scaling.type == RopeScaling::Type::None && !qk_norm, "config")
        << "ffn_size, qkv_bias, qk_norm and rope_scaling belong to Llama-family models (\"family\": \"llama\")";
  }
  SPPO_CHECK(max_positions >= 0 && max_positions <= (i64{1} << 40), "config")
      << "max_positions must be between 0 and 2^40 (got " << max_positions << ")";
  {
    const RopeScaling& r = rope_scaling;
    const bool none = r.type == RopeScaling::Type::None;
    SPPO_CHECK(none || (std::isfinite(r.factor) && r.factor >= 1.0), "config")
        << "rope_scaling factor must be at least 1 (got " << r.factor << ")";
    SPPO_CHECK(!(r.type == RopeScaling::Type::Llama3) ||
                   (r.original_max_positions > 0 && r.low_freq_factor > 0 && r.high_freq_factor > r.low_freq_factor),
               "config")
        << "llama3 rope_scaling needs original_max_position_embeddings > 0 and high_freq_factor > low_freq_factor > 0";
    SPPO_CHECK(!(r.type == RopeScaling::Type::Dynamic || r.type == RopeScaling::Type::Yarn) || max_positions > 0,
               "config")
        << rope_scaling_name(r.type) << " rope_scaling needs max_position_embeddings (max_positions), the length it "
        << "scales from";
    SPPO_CHECK(r.type != RopeScaling::Type::Yarn ||
                   (std::isfinite(r.beta_fast) && std::isfinite(r.beta_slow) && r.beta_fast > 0 && r.beta_slow > 0 &&
                    std::isfinite(r.attention_factor) && r.attention_factor >= 0),
               "config")
        << "yarn rope_scaling needs positive beta_fast and beta_slow and a non-negative attention_factor";
  }
  SPPO_CHECK(std::isfinite(rope_theta) && rope_theta > 0, "config") << "rope_theta must be positive (got " << rope_theta << ")";
  SPPO_CHECK(std::isfinite(ln_eps) && ln_eps > 0, "config") << "ln_eps must be positive (got " << ln_eps << ")";
  const double params =
      double(vocab) * hidden * 2 + double(layers) * (double(qkv_width()) + q_width() + 3.0 * ffn()) * double(hidden);
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
  if (c.llama()) {
    j["family"] = "llama";
    j.erase("ffn_mult");
    j["kv_heads"] = c.kv_head_count();
    j["ffn_size"] = c.ffn_size;
    j["qkv_bias"] = c.qkv_bias;
    j["max_positions"] = c.max_positions;
    if (c.tie_embeddings) j["tie_embeddings"] = true;
    if (c.head_dim != 0) j["head_dim"] = c.head_dim;
    if (c.qk_norm) j["qk_norm"] = true;
    const RopeScaling& r = c.rope_scaling;
    if (r.type != RopeScaling::Type::None) {
      nlohmann::json s = {{"type", rope_scaling_name(r.type)}, {"factor", r.factor}};
      if (r.type == RopeScaling::Type::Llama3) {
        s["original_max_position_embeddings"] = r.original_max_positions;
        s["low_freq_factor"] = r.low_freq_factor;
        s["high_freq_factor"] = r.high_freq_factor;
      }
      if (r.type == RopeScaling::Type::Yarn) {
        s["beta_fast"] = r.beta_fast;
        s["beta_slow"] = r.beta_slow;
        if (r.attention_factor > 0) s["attention_factor"] = r.attention_factor;
      }
      j["rope_scaling"] = s;
    }
  }
  return j;
}

RopeScaling rope_scaling_from_json(const nlohmann::json& j) {
  SPPO_CHECK(j.is_object(), "config") << "rope_scaling must be a JSON object (got " << j.dump() << ")";
  std::string type = json_string_field(j, "rope_type", "", "config", "rope_scaling: ");
  if (type.empty()) type = json_string_field(j, "type", "", "config", "rope_scaling: ");
  RopeScaling r;
  bool known = false;
  for (const auto& s : kScalings)
    if (type == s.name || (type == "default" && s.type == RopeScaling::Type::None)) r.type = s.type, known = true;
  SPPO_CHECK(known, "config") << "rope_scaling type '" << type
                              << "' is not supported; supported: none, linear, dynamic, yarn, llama3";
  auto real = [&](const char* key, double fallback) {
    const auto it = j.find(key);
    if (it == j.end() || it->is_null()) return fallback;
    SPPO_CHECK(it->is_number(), "config") << "rope_scaling: \"" << key << "\" must be a number (got " << it->dump() << ")";
    return it->get<double>();
  };
  r.factor = real("factor", 1.0);
  const double original = real("original_max_position_embeddings", 0.0);
  SPPO_CHECK(std::isfinite(original) && original >= 0 && original <= double(i64{1} << 40) &&
                 original == std::floor(original),
             "config")
      << "rope_scaling: \"original_max_position_embeddings\" must be a whole number of positions up to 2^40 (got "
      << original << ")";
  r.original_max_positions = i64(original);
  r.low_freq_factor = real("low_freq_factor", 1.0);
  r.high_freq_factor = real("high_freq_factor", 4.0);
  r.beta_fast = real("beta_fast", 32.0);
  r.beta_slow = real("beta_slow", 1.0);
  r.attention_factor = real("attention_factor", 0.0);
  return r;
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
  const std::string family = json_string_field(j, "family", "gpt", "config", "model config: ");
  SPPO_CHECK(family == "gpt" || family == "llama", "config")
      << "model config: \"family\" must be gpt or llama (got '" << family << "')";
  if (family == "llama") {
    c.family = Family::Llama;
    c.kv_heads = integer("kv_heads", c.heads);
    c.ffn_size = integer("ffn_size", 0);
    const auto bias = j.find("qkv_bias");
    c.qkv_bias = false;
    if (bias != j.end()) {
      SPPO_CHECK(bias->is_boolean(), "config") << "model config: \"qkv_bias\" must be true or false";
      c.qkv_bias = bias->get<bool>();
    }
    c.max_positions = json_integer_field(j, "max_positions", 0, 0, i64{1} << 40, "config", "model config: ");
    if (const auto tie = j.find("tie_embeddings"); tie != j.end()) {
      SPPO_CHECK(tie->is_boolean(), "config") << "model config: \"tie_embeddings\" must be true or false";
      c.tie_embeddings = tie->get<bool>();
    }
    c.head_dim = int(json_integer_field(j, "head_dim", 0, 0, kMaxHeadDim, "config", "model config: "));
    if (const auto norms = j.find("qk_norm"); norms != j.end()) {
      SPPO_CHECK(norms->is_boolean(), "config") << "model config: \"qk_norm\" must be true or false";
      c.qk_norm = norms->get<bool>();
    }
    const auto rs = j.find("rope_scaling");
    if (rs != j.end() && !rs->is_null()) c.rope_scaling = rope_scaling_from_json(*rs);
  }
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
