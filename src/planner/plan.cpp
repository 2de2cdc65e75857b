#include "planner/plan.h"

#include <nlohmann/json.hpp>
#include <algorithm>
#include <limits>
#include <sstream>
#include <string>

#include "core/check.h"
#include "core/json_fields.h"
#include "core/layout.h"

namespace sppo::plan {

const char* to_string(System s) {
  switch (s) {
    case System::Sppo: return "sppo";
    case System::Megatron: return "megatron";
    case System::Deepspeed: return "deepspeed";
  }
  return "";
}

System parse_system(const std::string& text) {
  if (text == "sppo") return System::Sppo;
  if (text == "megatron") return System::Megatron;
  if (text == "deepspeed") return System::Deepspeed;
  SPPO_CHECK(false, "planner") << "system must be sppo, megatron or deepspeed (got '" << text << "')";
  return System::Sppo;
}

OffloadMode parse_offload(const std::string& text) {
  if (text == "none") return OffloadMode::None;
  if (text == "full") return OffloadMode::Full;
  if (text == "paper") return OffloadMode::Paper;
  if (text == "adaptive") return OffloadMode::Adaptive;
  SPPO_CHECK(false, "planner") << "--offload must be none, full, paper or adaptive (got '" << text << "')";
  return OffloadMode::Adaptive;
}

const char* to_string(OffloadMode m) {
  switch (m) {
    case OffloadMode::None: return "none";
    case OffloadMode::Full: return "full";
    case OffloadMode::Paper: return "paper";
    case OffloadMode::Adaptive: return "adaptive";
  }
  return "";
}

nlohmann::json to_json(const Plan& p) {
  const ParallelDims& d = p.par;
  const Placements& pl = p.place;
  nlohmann::json j = {
      {"system", to_string(p.system)},
      {"model", p.model_name},
      {"model_config", sppo::to_json(p.model)},
      {"hardware", p.hardware},
      {"seq_len", p.seq_len},
      {"gpus", p.gpus},
      {"gpus_per_node", p.gpus_per_node},
      {"tp", d.tp},
      {"ulysses", d.ulysses},
      {"cp", d.cp},
      {"pp", d.pp},
      {"dp", d.dp},
      {"zero", stage_number(d.zero)},
      {"msp", d.msp.on},
      {"msp_reach", d.msp.reach},
      {"ring_layout", to_string(d.ring_layout)},
      {"precision", p.precision == ActPrecision::BF16 ? "bf16" : "fp32"},
      {"subseqs", p.subseqs},
      {"lengths", p.lengths},
      {"alpha", p.alpha},
      {"optimizer_state", to_string(pl.optimizer_state)},
      {"weights", to_string(pl.weights)},
      {"stage_layers", p.stage_layers},
      {"offload", to_string(p.offload)},
      {"alpha_rule", p.alpha_rule},
      {"budget_bytes", p.budget},
      {"kv_host_layers", pl.kv_layers(KvPlace::Host)},
      {"kv_recompute_layers", pl.kv_layers(KvPlace::Recompute)},
      {"kv_window_tokens", p.kv_window_tokens()},
      {"recompute_tensors", recompute_tensors_text(pl.recompute)},
      {"backward_order", to_string(pl.backward)},
      {"residual_grads", to_string(pl.residual_grads)},
      {"rebuilt_inputs", pl.rebuilt_layers()},
      {"mlp_tile_rows", pl.mlp_tile_rows},
      {"kernel_scratch",
       {{"block", {p.block_scratch.fixed_bytes, p.block_scratch.bytes_per_token}},
        {"head", {p.head_scratch.fixed_bytes, p.head_scratch.bytes_per_token}}}},
      {"predicted",
       {{"step_time_s", p.predicted.step_time_s},
        {"tokens_per_gpu_per_s", p.predicted.tokens_per_gpu_per_s},
        {"bubble_ratio", p.predicted.bubble_ratio},
        {"peak_device_bytes", p.predicted.peak_device_bytes},
        {"exposed_copy_s", p.predicted.exposed_copy_s},
        {"peak_host_bytes", p.predicted.peak_host_bytes},
        {"host_update_s", p.predicted.host_update_s}}},
  };
  if (!p.notes.empty()) j["notes"] = p.notes;
  return j;
}

std::string layout_text(const Plan& p) {
  const ParallelDims& d = p.par;
  const Placements& pl = p.place;
  std::ostringstream os;
  os << sppo::layout_text(d);
  if (p.system != System::Megatron) os << " N " << p.subseqs;
  if (d.msp.on) os << " msp" << (d.msp.reach > 0 ? " reach " + std::to_string(d.msp.reach) : std::string());
  if (!pl.kv_layers(KvPlace::Host).empty()) os << " kv-host";
  if (!pl.kv_layers(KvPlace::Recompute).empty()) os << " kv-recompute";
  if (pl.recompute) os << " recompute " << recompute_tensors_text(pl.recompute);
  if (pl.mlp_tile_rows) os << " mlp-tiles " << pl.mlp_tile_rows;
  {
    if (pl.layer_major()) os << " layer-major";
    if (pl.residual_host()) os << " residual-host";
    if (pl.any_input_rebuilt()) os << " rebuilt-inputs " << pl.rebuilt_layers().size();
    if (d.zero != ZeroStage::None) os << " zero-" << stage_number(d.zero);
    if (pl.optimizer_host()) os << " optimizer-host";
    if (pl.weights_host()) os << " weights-host";
    if (d.cp > 1 && d.ring_layout != RingLayout::Zigzag) os << " " << to_string(d.ring_layout);
  }
  return os.str();
}

i64 Plan::kv_window_tokens() const {
  if (!place.any_kv_streamed()) return 0;
  // Subsequence i streams the earlier positions in chunks of kv_chunk_rows(l_i) through
  // two slots (one when a single chunk holds them all; runtime/kv_stream.h).
  i64 most = 0, before = 0;
  for (const i64 l : lengths) {
    const i64 C = kv_chunk_rows(l);
    most = std::max(most, before > C ? 2 * C : before);
    before += l;
  }
  return most;
}

Plan plan_from_json(const nlohmann::json& j) {
  SPPO_CHECK(j.is_object(), "planner") << "a plan is a JSON object, not " << j.type_name();
  std::string missing;
  for (const char* field : {"hardware", "seq_len", "pp", "lengths"})
    if (!j.contains(field)) missing += std::string(missing.empty() ? "" : ", ") + "\"" + field + "\"";
  if (!j.contains("model_config") && !j.contains("model"))
    missing += std::string(missing.empty() ? "" : ", ") + "\"model_config\" (or \"model\" naming a preset)";
  SPPO_CHECK(missing.empty(), "planner")
      << "plan: missing field(s) " << missing << "; `sppo plan --json` writes a complete plan";
  Plan p;
  ParallelDims& d = p.par;
  Placements& pl = p.place;
  // Integers are read with their ranges checked (core/json_fields.h): nlohmann's get<int>()
  // of 1e300 is undefined behaviour.
  constexpr const char* kWhere = "plan: ";
  constexpr i64 kIntMax = std::numeric_limits<int>::max();
  auto integer = [&](const nlohmann::json& obj, const char* key, i64 fallback, i64 lo, i64 hi) {
    return json_integer_field(obj, key, fallback, lo, hi, "planner", kWhere);
  };
  auto integers = [&](const char* key, i64 lo, i64 hi) {
    std::vector<i64> out;
    const auto it = j.find(key);
    if (it == j.end()) return out;
    SPPO_CHECK(it->is_array(), "planner") << kWhere << "\"" << key << "\" must be a list of integers";
    for (std::size_t k = 0; k < it->size(); ++k)
      out.push_back(json_integer((*it)[k], lo, hi, "planner",
                                 std::string(kWhere) + "\"" + key + "\"[" + std::to_string(k) + "]"));
    return out;
  };
  auto text = [&](const char* key, const char* fallback) {
    return json_string_field(j, key, fallback, "planner", kWhere);
  };
  // A field's text as its type, or an error naming the field.
  auto typed = [&](const char* key, const char* fallback, auto parse) {
    const std::string value = text(key, fallback);
    try {
      return parse(value);
    } catch (const Error& e) {
      // The parser's message, without the component it names: the plan's is the planner.
      std::string why = e.what();
      if (why.rfind('[', 0) == 0 && why.find("] ") != std::string::npos) why = why.substr(why.find("] ") + 2);
      SPPO_CHECK(false, "planner") << kWhere << "\"" << key << "\": " << why;
      throw;
    }
  };
  p.system = typed("system", "sppo", parse_system);
  p.model_name = text("model", "custom");
  if (j.contains("model_config")) p.model = model_config_from_json(j.at("model_config"));
  else p.model = preset(p.model_name);
  p.hardware = text("hardware", "");
  p.seq_len = integer(j, "seq_len", 0, std::numeric_limits<i64>::min(), std::numeric_limits<i64>::max());
  p.gpus = int(integer(j, "gpus", 1, -kIntMax, kIntMax));
  p.gpus_per_node = int(integer(j, "gpus_per_node", 8, -kIntMax, kIntMax));
  d.tp = int(integer(j, "tp", 1, -kIntMax, kIntMax));
  d.ulysses = int(integer(j, "ulysses", 1, -kIntMax, kIntMax));
  d.cp = int(integer(j, "cp", 1, -kIntMax, kIntMax));
  // Plans written before each kind of sequence parallelism had its own name: "sp", of the
  // kind "sp_kind" names ("ring" for SPPO and Megatron-LM, "ulysses" for DeepSpeed).
  if (j.contains("sp") && !j.contains("cp") && !j.contains("ulysses")) {
    const int sp = int(integer(j, "sp", 1, -kIntMax, kIntMax));
    const std::string kind = text("sp_kind", p.system == System::Deepspeed ? "ulysses" : "ring");
    SPPO_CHECK(kind == "ring" || kind == "ulysses", "planner")
        << kWhere << "\"sp_kind\" must be ring or ulysses (got '" << kind << "')";
    (kind == "ulysses" ? d.ulysses : d.cp) = sp;
  }
  d.pp = int(integer(j, "pp", 1, -kIntMax, kIntMax));
  d.dp = int(integer(j, "dp", 1, -kIntMax, kIntMax));
  p.lengths = integers("lengths", std::numeric_limits<i64>::min(), std::numeric_limits<i64>::max());
  p.subseqs = int(integer(j, "subseqs", i64(p.lengths.size()), -kIntMax, kIntMax));
  for (const i64 n : integers("stage_layers", -kIntMax, kIntMax)) p.stage_layers.push_back(int(n));
  p.offload = typed("offload", "adaptive", parse_offload);
  p.alpha_rule = text("alpha_rule", "");
  // Plans written before these fields: no ZeRO; the cost model then priced zigzag rings;
  // the optimizer state on the device; fp32 activations.
  d.zero = parse_zero_stage(integer(j, "zero", 0, -kIntMax, kIntMax), 3, "planner", "plan: \"zero\"");
  p.precision = typed("precision", "fp32", [](const std::string& v) {
    SPPO_CHECK(v == "fp32" || v == "bf16", "planner") << "must be fp32 or bf16 (got '" << v << "')";
    return v == "bf16" ? ActPrecision::BF16 : ActPrecision::F32;
  });
  pl.mlp_tile_rows = integer(j, "mlp_tile_rows", 0, 0, kIntMax);
  if (j.contains("kernel_scratch")) {  // plans written before it: none
    const nlohmann::json& k = j["kernel_scratch"];
    auto scratch = [&](const char* name) {
      constexpr i64 kMost = i64(1) << 50;
      auto in_range = [&](const nlohmann::json& v) {
        return v.is_number_integer() && v.get<i64>() >= 0 && v.get<i64>() <= kMost;
      };
      const bool ok = k.is_object() && k.contains(name) && k[name].is_array() && k[name].size() == 2 &&
                      in_range(k[name][0]) && in_range(k[name][1]);
      SPPO_CHECK(ok, "planner") << kWhere << "\"kernel_scratch\" needs \"" << name
                                << "\": [fixed bytes, bytes a token], two integers from 0 to 2^50";
      return KernelScratch{k[name][0].get<i64>(), k[name][1].get<i64>()};
    };
    p.block_scratch = scratch("block");
    p.head_scratch = scratch("head");
  }
  d.msp.reach = int(integer(j, "msp_reach", 0, 0, kIntMax));
  SPPO_CHECK(d.msp.reach != 1, "planner")
      << kWhere << "\"msp_reach\" 1: a split task runs on its own stage and at least one other; use 0 (every "
      << "idle group) or 2 or more";
  SPPO_CHECK(pl.mlp_tile_rows == 0 || d.tp == 1, "planner")
      << kWhere << "\"mlp_tile_rows\" " << pl.mlp_tile_rows << " with \"tp\" " << d.tp
      << ": MLP tiles run without tensor parallelism; set one of them to its default";
  d.ring_layout = typed("ring_layout", "zigzag", parse_ring_layout);
  pl.optimizer_state = typed("optimizer_state", "device", [](const std::string& v) { return parse_tier(v, "optimizer_state"); });
  pl.weights = typed("weights", "device", [](const std::string& v) { return parse_tier(v, "weights"); });
  pl.residual_grads = typed("residual_grads", "device", [](const std::string& v) { return parse_tier(v, "residual_grads"); });
  pl.backward = typed("backward_order", "subseq", parse_backward_order);
  p.budget = integer(j, "budget_bytes", 0, std::numeric_limits<i64>::min(), std::numeric_limits<i64>::max());
  const auto host_layers = integers("kv_host_layers", 0, kIntMax);
  const auto recompute_layers = integers("kv_recompute_layers", 0, kIntMax);
  if (!host_layers.empty() || !recompute_layers.empty()) pl.kv.assign(std::size_t(p.model.layers), KvPlace::Device);
  for (const i64 l : host_layers) {
    SPPO_CHECK(l < p.model.layers, "planner")
        << kWhere << "\"kv_host_layers\" names layer " << l << " of a model of " << p.model.layers << " layers";
    pl.kv[std::size_t(l)] = KvPlace::Host;
  }
  for (const i64 l : recompute_layers) {
    SPPO_CHECK(l < p.model.layers, "planner")
        << kWhere << "\"kv_recompute_layers\" names layer " << l << " of a model of " << p.model.layers << " layers";
    SPPO_CHECK(pl.kv[std::size_t(l)] != KvPlace::Host, "planner")
        << kWhere << "layer " << l << " is in both \"kv_host_layers\" and \"kv_recompute_layers\"; a layer keeps "
        << "its K/V on the host or recomputes them, not both";
    pl.kv[std::size_t(l)] = KvPlace::Recompute;
  }
  for (const i64 l : integers("rebuilt_inputs", 1, kIntMax)) {
    SPPO_CHECK(l < p.model.layers, "planner")
        << kWhere << "\"rebuilt_inputs\" names layer " << l << " of a model of " << p.model.layers << " layers";
    pl.inputs_rebuilt.resize(std::size_t(p.model.layers), false);
    pl.inputs_rebuilt[std::size_t(l)] = true;
  }
  try {
    pl.recompute = parse_recompute_tensors(text("recompute_tensors", "none"));
  } catch (const Error& e) {
    SPPO_CHECK(false, "planner") << kWhere << "\"recompute_tensors\": " << e.what();
  }
  try {
    p.alpha = j.value("alpha", std::vector<double>(p.lengths.size(), 0.0));
    d.msp.on = j.value("msp", false);
    if (j.contains("predicted")) {
      const auto& q = j.at("predicted");
      SPPO_CHECK(q.is_object(), "planner") << kWhere << "\"predicted\" must be an object";
      p.predicted.step_time_s = q.value("step_time_s", 0.0);
      p.predicted.tokens_per_gpu_per_s = q.value("tokens_per_gpu_per_s", 0.0);
      p.predicted.bubble_ratio = q.value("bubble_ratio", 0.0);
      p.predicted.peak_device_bytes = integer(q, "peak_device_bytes", 0, 0, std::numeric_limits<i64>::max());
      p.predicted.exposed_copy_s = q.value("exposed_copy_s", 0.0);
      p.predicted.peak_host_bytes = integer(q, "peak_host_bytes", 0, 0, std::numeric_limits<i64>::max());
      p.predicted.host_update_s = q.value("host_update_s", 0.0);
    }
    p.notes = j.value("notes", std::vector<std::string>{});
  } catch (const nlohmann::json::exception& e) {
    SPPO_CHECK(false, "planner") << "plan JSON: " << e.what()
                                 << " (alpha: a list of numbers, msp: true or false, notes: a list of strings)";
  }
  SPPO_CHECK(p.seq_len >= 1, "planner") << "plan: seq_len must be positive (got " << p.seq_len << ")";
  SPPO_CHECK(!p.lengths.empty(), "planner") << "plan: lengths is empty; it lists each subsequence's tokens";
  SPPO_CHECK(int(p.lengths.size()) == p.subseqs, "planner")
      << "plan: subseqs = " << p.subseqs << " but lengths has " << p.lengths.size() << " entries";
  SPPO_CHECK(p.alpha.size() == p.lengths.size(), "planner")
      << "plan: alpha has " << p.alpha.size() << " entries for " << p.lengths.size() << " subsequences";
  i64 sum = 0;
  for (std::size_t i = 0; i < p.lengths.size(); ++i) {
    SPPO_CHECK(p.lengths[i] >= 1, "planner")
        << "plan: lengths[" << i << "] = " << p.lengths[i] << "; every subsequence needs at least one token";
    SPPO_CHECK(!__builtin_add_overflow(sum, p.lengths[i], &sum), "planner")
        << "plan: lengths sum past 2^63; seq_len is " << p.seq_len;
  }
  SPPO_CHECK(sum == p.seq_len, "planner") << "plan: lengths sum to " << sum << ", not seq_len " << p.seq_len;
  for (std::size_t i = 0; i < p.alpha.size(); ++i)
    SPPO_CHECK(p.alpha[i] >= 0 && p.alpha[i] <= 1, "planner")
        << "plan: alpha[" << i << "] = " << p.alpha[i] << " is outside [0, 1]";
  SPPO_CHECK(d.tp >= 1 && d.ulysses >= 1 && d.cp >= 1 && d.pp >= 1 && d.dp >= 1, "planner")
      << "plan: tp, ulysses, cp, pp and dp must be >= 1";
  SPPO_CHECK(!pl.weights_host() || (pl.optimizer_host() && d.tp == 1 && !d.msp.on && d.zero == ZeroStage::None),
             "planner")
      << "plan: weights host needs optimizer_state host, and runs without tp, msp and zero 1; set weights "
         "device";
  SPPO_CHECK(!pl.layer_major() || !d.msp.on, "planner")
      << "plan: backward_order layer does not run MSP's pieces, and the plan has msp; use backward_order subseq "
         "or msp false";
  SPPO_CHECK(!pl.residual_host() || pl.layer_major(), "planner")
      << "plan: residual_grads host keeps residual gradients between the layers of the layer-major backward; it "
         "needs backward_order layer (or set residual_grads device)";
  SPPO_CHECK(p.gpus >= 1 && p.gpus <= kMaxPlanDevices && p.gpus_per_node >= 1, "planner")
      << "plan: gpus must be in [1, " << kMaxPlanDevices << "] and gpus_per_node at least 1 (got "
      << p.gpus << ", " << p.gpus_per_node << ")";
  i64 product = 1;
  for (int n : {d.tp, d.ulysses, d.cp, d.pp, d.dp}) product = std::min<i64>(product * n, i64(kMaxPlanDevices) + 1);
  SPPO_CHECK(product == p.gpus, "planner")
      << "plan: tp * ulysses * cp * pp * dp = "
      << (product > kMaxPlanDevices ? "more than " + std::to_string(kMaxPlanDevices) : std::to_string(product))
      << " but gpus = " << p.gpus;
  SPPO_CHECK(p.budget >= 0, "planner") << "plan: budget_bytes must not be negative (got " << p.budget << ")";
  return p;
}

}  // namespace sppo::plan
