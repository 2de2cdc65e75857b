#include "io/hf.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/bf16.h"
#include "core/check.h"
#include "core/json_fields.h"
#include "core/layout.h"
#include "io/fileutil.h"
#include "io/safetensors.h"

namespace sppo::io {

namespace fs = std::filesystem;

namespace {

constexpr const char* kComponent = "hf";
constexpr const char* kArchitectures[] = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                          "Qwen3ForCausalLM"};

nlohmann::json read_json(const std::string& path) {
  try {
    return nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    SPPO_CHECK(false, kComponent) << path << " is not JSON: " << e.what();
  }
  return {};
}

float f16_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float f;
  if (exp == 0) {
    f = std::ldexp(float(man), -24);  // subnormal (or zero)
  } else if (exp == 31) {
    f = man ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    f = std::ldexp(float(man | 0x400), int(exp) - 25);
  }
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits |= sign;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One sppo parameter as HF tensors: each source fills `rows` rows of it, in order.
struct Source {
  std::string name;
  i64 rows = 0;
};
struct Mapping {
  std::string sppo;
  std::vector<i64> shape;
  std::vector<Source> sources;
};

std::vector<Mapping> mappings(const ModelConfig& c) {
  const i64 H = c.hidden, KV = c.kv_width(), F = c.ffn(), QW = c.q_width(), A = c.head_size();
  std::vector<Mapping> out;
  for (const TensorSpec& t : parameter_specs(c)) {
    const std::string& n = t.name;
    Mapping m{n, t.shape, {}};
    if (n == "embed.weight") m.sources = {{"model.embed_tokens.weight", t.shape[0]}};
    else if (n == "ln_f.weight") m.sources = {{"model.norm.weight", H}};
    else if (n == "lm_head.weight") m.sources = {{"lm_head.weight", t.shape[0]}};
    else {
      const std::size_t dot = n.find('.', 7);
      const std::string l = "model.layers." + n.substr(7, dot - 7) + ".", what = n.substr(dot + 1);
      if (what == "ln1.weight") m.sources = {{l + "input_layernorm.weight", H}};
      else if (what == "ln2.weight") m.sources = {{l + "post_attention_layernorm.weight", H}};
      else if (what == "attn.qkv.weight" || what == "attn.qkv.bias") {
        const std::string kind = what == "attn.qkv.weight" ? "weight" : "bias";
        m.sources = {{l + "self_attn.q_proj." + kind, QW}, {l + "self_attn.k_proj." + kind, KV},
                     {l + "self_attn.v_proj." + kind, KV}};
      } else if (what == "attn.q_norm.weight") m.sources = {{l + "self_attn.q_norm.weight", A}};
      else if (what == "attn.k_norm.weight") m.sources = {{l + "self_attn.k_norm.weight", A}};
      else if (what == "attn.out.weight") m.sources = {{l + "self_attn.o_proj.weight", H}};
      else if (what == "mlp.fc.weight") m.sources = {{l + "mlp.gate_proj.weight", F}, {l + "mlp.up_proj.weight", F}};
      else if (what == "mlp.proj.weight") m.sources = {{l + "mlp.down_proj.weight", H}};
      else SPPO_ASSERT_MSG(false, "no Hugging Face name for " << n);
    }
    out.push_back(std::move(m));
  }
  return out;
}

// The HF shape of source k of m: its rows of the sppo tensor's (a bias is 1-D).
std::vector<i64> source_shape(const Mapping& m, const Source& s) {
  if (m.shape.size() == 1) return {s.rows};
  return {s.rows, m.shape[1]};
}

}  // namespace

bool is_hf_dir(const std::string& path) {
  std::error_code ec;
  const fs::path config = fs::path(path) / "config.json";
  if (!fs::is_regular_file(config, ec)) return false;
  try {
    const nlohmann::json j = nlohmann::json::parse(read_file(config.string()));
    return j.is_object() && j.contains("architectures");
  } catch (const std::exception&) {
    return false;
  }
}

ModelConfig hf_model_config(const nlohmann::json& j, const std::string& file) {
  SPPO_CHECK(j.is_object(), kComponent) << file << " must hold a JSON object";
  const std::string where = file + ": ";
  const auto arch = j.find("architectures");
  SPPO_CHECK(arch != j.end() && arch->is_array() && arch->size() == 1 && (*arch)[0].is_string(), kComponent)
      << where << "\"architectures\" must name one model class (e.g. [\"LlamaForCausalLM\"])";
  const std::string a = (*arch)[0].get<std::string>();
  bool known = false;
  for (const char* k : kArchitectures) known = known || a == k;
  SPPO_CHECK(known, kComponent) << where << "architecture " << a
                                << " is not supported; sppo imports LlamaForCausalLM, MistralForCausalLM, "
                                   "Qwen2ForCausalLM and Qwen3ForCausalLM";
  const bool qwen2 = a == "Qwen2ForCausalLM", qwen3 = a == "Qwen3ForCausalLM";
  constexpr i64 kIntMax = std::numeric_limits<int>::max();
  auto integer = [&](const char* key, i64 fallback) {
    SPPO_CHECK(fallback >= 0 || j.contains(key), kComponent) << where << "lacks \"" << key << "\"";
    return json_integer_field(j, key, fallback, 1, kIntMax, kComponent, where);
  };
  auto real = [&](const char* key, double fallback) {
    const auto it = j.find(key);
    if (it == j.end() || it->is_null()) return fallback;
    SPPO_CHECK(it->is_number(), kComponent) << where << "\"" << key << "\" must be a number (got " << it->dump() << ")";
    return it->get<double>();
  };
  auto flag = [&](const char* key, bool fallback) {
    const auto it = j.find(key);
    if (it == j.end() || it->is_null()) return fallback;
    SPPO_CHECK(it->is_boolean(), kComponent) << where << "\"" << key << "\" must be true or false";
    return it->get<bool>();
  };
  const std::string act = json_string_field(j, "hidden_act", "silu", kComponent, where);
  SPPO_CHECK(act == "silu", kComponent) << where << "\"hidden_act\": \"" << act
                                        << "\" is not supported; Llama-family MLPs use silu (SwiGLU)";
  SPPO_CHECK(!flag("attention_bias", false), kComponent)
      << where << "\"attention_bias\": true (biases on q, k, v and o) is not supported; only Qwen2's q/k/v biases are";
  SPPO_CHECK(!flag("mlp_bias", false), kComponent) << where << "\"mlp_bias\": true is not supported";
  SPPO_CHECK(real("partial_rotary_factor", 1.0) == 1.0, kComponent)
      << where << "\"partial_rotary_factor\" other than 1 is not supported (RoPE rotates every head dim)";
  // Qwen2 and Qwen3 name a window they may not use (use_sliding_window false); Llama and
  // Mistral have one where they name it.
  const bool qwen = qwen2 || qwen3;
  const bool window = qwen ? flag("use_sliding_window", false) : j.contains("sliding_window") && !j["sliding_window"].is_null();
  SPPO_CHECK(!window, kComponent) << where << (qwen ? "\"use_sliding_window\": true" : "\"sliding_window\"")
                                  << ": sliding-window attention is not supported; sppo attends to every earlier "
                                     "position";
  // Newer configs also list each layer's kind (transformers 4.53 on): all must be full.
  if (const auto kinds = j.find("layer_types"); kinds != j.end() && !kinds->is_null()) {
    SPPO_CHECK(kinds->is_array(), kComponent) << where << "\"layer_types\" must be a list of layer kinds";
    for (const auto& k : *kinds)
      SPPO_CHECK(k == "full_attention", kComponent)
          << where << "\"layer_types\" names " << k.dump()
          << ": only full attention is supported (sppo attends to every earlier position)";
  }
  ModelConfig c = preset("llama-tiny");
  c.vocab = int(integer("vocab_size", -1));
  c.hidden = int(integer("hidden_size", -1));
  c.layers = int(integer("num_hidden_layers", -1));
  c.heads = int(integer("num_attention_heads", -1));
  c.kv_heads = int(integer("num_key_value_heads", c.heads));
  c.ffn_size = int(integer("intermediate_size", -1));
  c.ln_eps = float(real("rms_norm_eps", 1e-6));
  c.rope_theta = float(real("rope_theta", 10000.0));
  c.max_positions = json_integer_field(j, "max_position_embeddings", 2048, 1, i64{1} << 40, kComponent, where);
  c.qkv_bias = qwen2;
  c.qk_norm = qwen3;  // Note [Query/key norms]: q_norm and k_norm of each layer
  // Absent, false: transformers' LlamaConfig, Qwen2Config and Qwen3Config default to a
  // head of its own.
  c.tie_embeddings = flag("tie_word_embeddings", false);
  // Note [Head size]: A as given, where it is not hidden / heads. Absent: Qwen3Config's
  // default, 128; the others' hidden / heads.
  const bool has_head_dim = j.contains("head_dim") && !j["head_dim"].is_null();
  if (has_head_dim || qwen3) {
    const i64 head_dim = has_head_dim ? json_integer_field(j, "head_dim", 0, 1, kMaxHeadDim, kComponent, where) : 128;
    if (c.heads <= 0 || head_dim * c.heads != c.hidden) c.head_dim = int(head_dim);
  }
  if (const auto rs = j.find("rope_scaling"); rs != j.end() && !rs->is_null()) {
    try {
      c.rope_scaling = rope_scaling_from_json(*rs);
    } catch (const Error& e) {
      SPPO_CHECK(false, kComponent) << where << "\"rope_scaling\": " << e.what();
    }
  }
  try {
    c.validate();
  } catch (const Error& e) {
    SPPO_CHECK(false, kComponent) << where << e.what();
  }
  return c;
}

ModelConfig hf_read_config(const std::string& dir) {
  const std::string file = (fs::path(dir) / "config.json").string();
  return hf_model_config(read_json(file), file);
}

void hf_read_weights(const std::string& dir, const ModelConfig& c, float* params) {
  const fs::path d(dir);
  // Which file holds each tensor.
  std::map<std::string, std::string> where;
  const fs::path index = d / "model.safetensors.index.json";
  std::vector<std::string> files;
  if (fs::exists(index)) {
    const nlohmann::json j = read_json(index.string());
    const auto map = j.find("weight_map");
    SPPO_CHECK(map != j.end() && map->is_object(), kComponent)
        << index.string() << " lacks \"weight_map\" (tensor name -> shard file)";
    for (auto it = map->begin(); it != map->end(); ++it) {
      SPPO_CHECK(it.value().is_string(), kComponent) << index.string() << ": the shard of " << it.key() << " is not a file name";
      const std::string f = it.value().get<std::string>();
      SPPO_CHECK(f.find('/') == std::string::npos, kComponent)
          << index.string() << ": shard '" << f << "' must be a file name in " << dir;
      SPPO_CHECK(fs::exists(d / f), kComponent)
          << index.string() << " lists shard " << f << " (holding " << it.key() << "), which is missing from " << dir;
      where[it.key()] = f;
      if (std::find(files.begin(), files.end(), f) == files.end()) files.push_back(f);
    }
  } else {
    SPPO_CHECK(fs::exists(d / "model.safetensors"), kComponent)
        << dir << " has neither model.safetensors nor model.safetensors.index.json";
    files = {"model.safetensors"};
  }
  std::map<std::string, std::unique_ptr<SafetensorsReader>> readers;
  std::map<std::string, const SafetensorsReader*> holder;  // tensor -> its file's reader
  for (const std::string& f : files) {
    auto r = std::make_unique<SafetensorsReader>((d / f).string());
    for (const TensorInfo& t : r->tensors()) {
      SPPO_CHECK(where.empty() || where.count(t.name) == 0 || where[t.name] == f, kComponent)
          << (d / f).string() << " holds " << t.name << ", which the index places in " << where[t.name];
      holder[t.name] = r.get();
    }
    readers[f] = std::move(r);
  }
  // Check everything before a byte lands in params: names, shapes and dtypes.
  const std::vector<Mapping> maps = mappings(c);
  std::map<std::string, bool> used;
  for (const Mapping& m : maps)
    for (const Source& s : m.sources) {
      const auto it = holder.find(s.name);
      SPPO_CHECK(it != holder.end(), kComponent) << dir << " lacks tensor " << s.name << " (sppo's " << m.sppo << ")";
      const TensorInfo& t = it->second->at(s.name);
      const std::vector<i64> shape = source_shape(m, s);
      SPPO_CHECK(t.shape == shape, kComponent) << it->second->path() << ": " << s.name << " has shape "
                                               << shape_str(t.shape) << ", but config.json makes it " << shape_str(shape);
      SPPO_CHECK(t.dtype == DType::F32 || t.dtype == DType::BF16 || t.dtype == DType::F16, kComponent)
          << it->second->path() << ": " << s.name << " is " << dtype_name(t.dtype) << "; F32, BF16 and F16 are read";
      used[s.name] = true;
    }
  for (const auto& [name, reader] : holder) {
    if (used.count(name)) continue;
    const bool rotary_buffer = name.size() > 20 && name.compare(name.size() - 20, 20, "rotary_emb.inv_freq") == 0;
    // A tied model's checkpoint may hold its head as well: the embedding's copy.
    const bool tied_head = name == "lm_head.weight" && c.tied_embeddings();
    SPPO_CHECK(rotary_buffer || tied_head, kComponent) << reader->path() << " holds " << name
                                                       << ", which this model (config.json) has no place for";
  }
  float* out = params;
  std::vector<std::uint16_t> half;
  for (const Mapping& m : maps)
    for (const Source& s : m.sources) {
      const SafetensorsReader& r = *holder.at(s.name);
      const TensorInfo& t = r.at(s.name);
      const i64 n = t.numel();
      if (t.dtype == DType::F32) {
        r.read(s.name, DType::F32, t.shape, out);
      } else {
        half.resize(std::size_t(n));
        r.read(s.name, t.dtype, t.shape, half.data());
        for (i64 k = 0; k < n; ++k) out[k] = t.dtype == DType::BF16 ? bf16_to_float(half[k]) : f16_to_float(half[k]);
      }
      out += n;
    }
  SPPO_ASSERT(out - params == c.num_params());
}

nlohmann::json hf_config_json(const ModelConfig& c, const std::string& torch_dtype, i64 max_positions) {
  SPPO_CHECK(c.llama(), kComponent) << "only Llama-family models export to Hugging Face's format (the model is GPT)";
  SPPO_CHECK(!(c.qkv_bias && c.qk_norm), kComponent)
      << "a model with both q/k/v biases and query/key norms has no Hugging Face class (Qwen2ForCausalLM has the "
         "biases, Qwen3ForCausalLM the norms)";
  const bool qwen2 = c.qkv_bias, qwen3 = c.qk_norm;
  using Type = RopeScaling::Type;
  const Type t = c.rope_scaling.type;
  // dynamic and yarn scale from max_position_embeddings: it stays, so the frequencies do.
  const bool keeps_reference = t == Type::Dynamic || t == Type::Yarn;
  const i64 positions = keeps_reference || max_positions <= 0 ? c.max_positions : std::max(max_positions, c.max_positions);
  nlohmann::json j = {
      {"architectures", {qwen3 ? "Qwen3ForCausalLM" : qwen2 ? "Qwen2ForCausalLM" : "LlamaForCausalLM"}},
      {"model_type", qwen3 ? "qwen3" : qwen2 ? "qwen2" : "llama"},
      {"vocab_size", c.vocab},
      {"hidden_size", c.hidden},
      {"intermediate_size", c.ffn()},
      {"num_hidden_layers", c.layers},
      {"num_attention_heads", c.heads},
      {"num_key_value_heads", c.kv_head_count()},
      {"hidden_act", "silu"},
      {"max_position_embeddings", positions},
      {"rms_norm_eps", c.ln_eps},
      {"rope_theta", c.rope_theta},
      {"tie_word_embeddings", c.tied_embeddings()},
      {"torch_dtype", torch_dtype},
      {"initializer_range", 0.02},
      {"use_cache", true},
  };
  // Qwen3Config's head_dim defaults to 128 whatever the shape: it is always written.
  if (qwen3 || c.head_dim != 0) j["head_dim"] = c.head_size();
  if (qwen2 || qwen3) {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = c.layers;
    j["attention_dropout"] = 0.0;
    if (qwen3) j["attention_bias"] = false;
  } else {
    j["attention_bias"] = false;
    j["mlp_bias"] = false;
    j["attention_dropout"] = 0.0;
    j["pretraining_tp"] = 1;
  }
  j["rope_scaling"] = nullptr;
  if (t != Type::None) {
    nlohmann::json s = to_json(c)["rope_scaling"];
    s["rope_type"] = s["type"];
    s.erase("type");
    j["rope_scaling"] = s;
  }
  return j;
}

void hf_write(const std::string& dir, const ModelConfig& c, const float* params, const std::string& dtype,
              i64 max_positions, i64 shard_bytes) {
  SPPO_CHECK(dtype == "float32" || dtype == "bfloat16", kComponent)
      << "--dtype '" << dtype << "': use float32 (f32) or bfloat16 (bf16)";
  const nlohmann::json config = hf_config_json(c, dtype, max_positions);
  std::error_code ec;
  fs::create_directories(dir, ec);
  SPPO_CHECK(!ec, kComponent) << "cannot create " << dir << ": " << ec.message();
  const bool bf16 = dtype == "bfloat16";
  const std::size_t elem = bf16 ? 2 : 4;
  // HF tensors in HF's order, each a view of params (converted to bf16 when asked).
  struct Out {
    std::string name;
    std::vector<i64> shape;
    const float* data;
    i64 numel;
  };
  std::vector<Out> outs;
  const float* at = params;
  for (const Mapping& m : mappings(c))
    for (const Source& s : m.sources) {
      const std::vector<i64> shape = source_shape(m, s);
      const i64 n = shape.size() == 1 ? shape[0] : shape[0] * shape[1];
      outs.push_back({s.name, shape, at, n});
      at += n;
    }
  // Shards of at most shard_bytes (a tensor larger than that alone in its shard).
  std::vector<std::vector<std::size_t>> shards(1);
  i64 filled = 0;
  for (std::size_t k = 0; k < outs.size(); ++k) {
    const i64 bytes = outs[k].numel * i64(elem);
    if (!shards.back().empty() && filled + bytes > shard_bytes) shards.emplace_back(), filled = 0;
    shards.back().push_back(k);
    filled += bytes;
  }
  const std::size_t n = shards.size();
  auto shard_name = [&](std::size_t k) {
    if (n == 1) return std::string("model.safetensors");
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k + 1, n);
    return std::string(name);
  };
  nlohmann::json weight_map = nlohmann::json::object();
  i64 total = 0;
  std::vector<std::uint16_t> converted;
  for (std::size_t k = 0; k < n; ++k) {
    std::vector<TensorView> views;
    converted.clear();
    if (bf16) {
      i64 count = 0;
      for (std::size_t i : shards[k]) count += outs[i].numel;
      converted.resize(std::size_t(count));
    }
    i64 off = 0;
    for (std::size_t i : shards[k]) {
      const Out& o = outs[i];
      const void* data = o.data;
      if (bf16) {
        for (i64 e = 0; e < o.numel; ++e) converted[std::size_t(off + e)] = float_to_bf16(o.data[e]);
        data = converted.data() + off;
      }
      views.push_back({o.name, bf16 ? DType::BF16 : DType::F32, o.shape, data});
      off += o.numel;
      weight_map[o.name] = shard_name(k);
      total += o.numel * i64(elem);
    }
    write_safetensors((fs::path(dir) / shard_name(k)).string(), views, {{"format", "pt"}});
  }
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (n > 1) {
    const nlohmann::json j = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_file_atomic(index.string(), j.dump(2) + "\n");
  } else {
    fs::remove(index, ec);  // a stale index would point transformers at shards that are gone
  }
  write_file_atomic((fs::path(dir) / "config.json").string(), config.dump(2) + "\n");
}

}  // namespace sppo::io
