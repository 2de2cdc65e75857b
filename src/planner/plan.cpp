#include "planner/plan.h"

#include <nlohmann/json.hpp>
#include <algorithm>
#include <limits>
#include <string>

#include "core/check.h"
#include "core/json_fields.h"
#include "core/layout.h"

namespace sppo::plan {

std::string sp_kind(const Plan& p) {
  if (p.system == "deepspeed") return "ulysses";
  return "ring";
}

nlohmann::json to_json(const Plan& p) {
  nlohmann::json j = {
      {"system", p.system},
      {"model", p.model_name},
      {"model_config", sppo::to_json(p.model)},
      {"hardware", p.hardware},
      {"seq_len", p.seq_len},
      {"gpus", p.gpus},
      {"gpus_per_node", p.gpus_per_node},
      {"sp", p.sp},
      {"sp_kind", sp_kind(p)},
      {"pp", p.pp},
      {"dp", p.dp},
      {"tp", p.tp},
      {"subseqs", p.subseqs},
      {"lengths", p.lengths},
      {"alpha", p.alpha},
      {"msp", p.msp},
      {"msp_reach", p.msp_reach},
      {"zero", p.zero},
      {"optimizer_state", p.optimizer_state},
      {"weights", p.weights},
      {"ring_layout", p.ring_layout},
      {"stage_layers", p.stage_layers},
      {"offload", p.offload},
      {"alpha_rule", p.alpha_rule},
      {"budget_bytes", p.budget},
      {"kv_host_layers", p.kv_host_layers},
      {"kv_recompute_layers", p.kv_recompute_layers},
      {"kv_window_tokens", p.kv_window_tokens()},
      {"recompute_tensors", recompute_tensors_text(p.recompute)},
      {"backward_order", p.backward_order},
      {"rebuilt_inputs", p.rebuilt_inputs},
      {"mlp_tile_rows", p.mlp_tile_rows},
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

i64 Plan::kv_window_tokens() const {
  if (kv_host_layers.empty() && kv_recompute_layers.empty()) return 0;
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
  for (const char* field : {"hardware", "seq_len", "sp", "pp", "lengths"})
    if (!j.contains(field)) missing += std::string(missing.empty() ? "" : ", ") + "\"" + field + "\"";
  if (!j.contains("model_config") && !j.contains("model"))
    missing += std::string(missing.empty() ? "" : ", ") + "\"model_config\" (or \"model\" naming a preset)";
  SPPO_CHECK(missing.empty(), "planner")
      << "plan: missing field(s) " << missing << "; `sppo plan --json` writes a complete plan";
  Plan p;
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
  p.system = json_string_field(j, "system", "sppo", "planner", kWhere);
  p.model_name = json_string_field(j, "model", "custom", "planner", kWhere);
  if (j.contains("model_config")) p.model = model_config_from_json(j.at("model_config"));
  else p.model = preset(p.model_name);
  p.hardware = json_string_field(j, "hardware", "", "planner", kWhere);
  p.seq_len = integer(j, "seq_len", 0, std::numeric_limits<i64>::min(), std::numeric_limits<i64>::max());
  p.gpus = int(integer(j, "gpus", 1, -kIntMax, kIntMax));
  p.gpus_per_node = int(integer(j, "gpus_per_node", 8, -kIntMax, kIntMax));
  p.sp = int(integer(j, "sp", 1, -kIntMax, kIntMax));
  p.pp = int(integer(j, "pp", 1, -kIntMax, kIntMax));
  p.dp = int(integer(j, "dp", 1, -kIntMax, kIntMax));
  p.tp = int(integer(j, "tp", 1, -kIntMax, kIntMax));
  p.lengths = integers("lengths", std::numeric_limits<i64>::min(), std::numeric_limits<i64>::max());
  p.subseqs = int(integer(j, "subseqs", i64(p.lengths.size()), -kIntMax, kIntMax));
  for (const i64 n : integers("stage_layers", -kIntMax, kIntMax)) p.stage_layers.push_back(int(n));
  p.offload = json_string_field(j, "offload", "adaptive", "planner", kWhere);
  p.alpha_rule = json_string_field(j, "alpha_rule", "", "planner", kWhere);
  // Plans written before these fields: no ZeRO; the cost model then priced zigzag rings;
  // the optimizer state on the device.
  p.zero = int(integer(j, "zero", 0, -kIntMax, kIntMax));
  p.mlp_tile_rows = integer(j, "mlp_tile_rows", 0, 0, kIntMax);
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
  p.msp_reach = int(integer(j, "msp_reach", 0, 0, kIntMax));
  SPPO_CHECK(p.msp_reach != 1, "planner")
      << kWhere << "\"msp_reach\" 1: a split task runs on its own stage and at least one other; use 0 (every "
      << "idle group) or 2 or more";
  SPPO_CHECK(p.mlp_tile_rows == 0 || p.tp == 1, "planner")
      << kWhere << "\"mlp_tile_rows\" " << p.mlp_tile_rows << " with \"tp\" " << p.tp
      << ": MLP tiles run without tensor parallelism; set one of them to its default";
  p.ring_layout = json_string_field(j, "ring_layout", "zigzag", "planner", kWhere);
  p.optimizer_state = json_string_field(j, "optimizer_state", "device", "planner", kWhere);
  p.weights = json_string_field(j, "weights", "device", "planner", kWhere);
  p.backward_order = json_string_field(j, "backward_order", "subseq", "planner", kWhere);
  p.budget = integer(j, "budget_bytes", 0, std::numeric_limits<i64>::min(), std::numeric_limits<i64>::max());
  for (const i64 l : integers("kv_host_layers", 0, kIntMax)) {
    SPPO_CHECK(l < p.model.layers, "planner")
        << kWhere << "\"kv_host_layers\" names layer " << l << " of a model of " << p.model.layers << " layers";
    p.kv_host_layers.push_back(int(l));
  }
  for (const i64 l : integers("kv_recompute_layers", 0, kIntMax)) {
    SPPO_CHECK(l < p.model.layers, "planner")
        << kWhere << "\"kv_recompute_layers\" names layer " << l << " of a model of " << p.model.layers << " layers";
    SPPO_CHECK(std::find(p.kv_host_layers.begin(), p.kv_host_layers.end(), int(l)) == p.kv_host_layers.end(),
               "planner")
        << kWhere << "layer " << l << " is in both \"kv_host_layers\" and \"kv_recompute_layers\"; a layer keeps "
        << "its K/V on the host or recomputes them, not both";
    p.kv_recompute_layers.push_back(int(l));
  }
  for (const i64 l : integers("rebuilt_inputs", 1, kIntMax)) {
    SPPO_CHECK(l < p.model.layers, "planner")
        << kWhere << "\"rebuilt_inputs\" names layer " << l << " of a model of " << p.model.layers << " layers";
    p.rebuilt_inputs.push_back(int(l));
  }
  try {
    p.recompute = parse_recompute_tensors(json_string_field(j, "recompute_tensors", "none", "planner", kWhere));
  } catch (const Error& e) {
    SPPO_CHECK(false, "planner") << kWhere << "\"recompute_tensors\": " << e.what();
  }
  try {
    p.alpha = j.value("alpha", std::vector<double>(p.lengths.size(), 0.0));
    p.msp = j.value("msp", false);
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
  SPPO_CHECK(p.system == "sppo" || p.system == "megatron" || p.system == "deepspeed", "planner")
      << "plan: system must be sppo, megatron or deepspeed (got '" << p.system << "')";
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
  SPPO_CHECK(p.sp >= 1 && p.pp >= 1 && p.dp >= 1 && p.tp >= 1, "planner") << "plan: sp, pp, dp, tp must be >= 1";
  SPPO_CHECK(p.zero == 0 || p.zero == 1, "planner") << "plan: zero must be 0 or 1 (got " << p.zero << ")";
  SPPO_CHECK(p.optimizer_state == "device" || p.optimizer_state == "host", "planner")
      << "plan: optimizer_state must be device or host (got '" << p.optimizer_state << "')";
  SPPO_CHECK(p.weights == "device" || p.weights == "host", "planner")
      << "plan: weights must be device or host (got '" << p.weights << "')";
  SPPO_CHECK(p.weights == "device" || (p.optimizer_state == "host" && p.tp == 1 && !p.msp && p.zero == 0), "planner")
      << "plan: weights host needs optimizer_state host, and runs without tp, msp and zero 1; set weights "
         "device";
  SPPO_CHECK(p.backward_order == "subseq" || p.backward_order == "layer", "planner")
      << "plan: backward_order must be subseq or layer (got '" << p.backward_order << "')";
  SPPO_CHECK(p.backward_order == "subseq" || !p.msp, "planner")
      << "plan: backward_order layer does not run MSP's pieces, and the plan has msp; use backward_order subseq "
         "or msp false";
  SPPO_CHECK(p.ring_layout == "zigzag" || p.ring_layout == "contiguous", "planner")
      << "plan: ring_layout must be zigzag or contiguous (got '" << p.ring_layout << "')";
  SPPO_CHECK(p.gpus >= 1 && p.gpus <= kMaxPlanDevices && p.gpus_per_node >= 1, "planner")
      << "plan: gpus must be in [1, " << kMaxPlanDevices << "] and gpus_per_node at least 1 (got "
      << p.gpus << ", " << p.gpus_per_node << ")";
  i64 product = 1;
  for (int d : {p.sp, p.pp, p.dp, p.tp}) product = std::min<i64>(product * d, i64(kMaxPlanDevices) + 1);
  SPPO_CHECK(product == p.gpus, "planner")
      << "plan: sp * pp * dp * tp = " << (product > kMaxPlanDevices ? "more than " + std::to_string(kMaxPlanDevices)
                                                                     : std::to_string(product))
      << " but gpus = " << p.gpus;
  SPPO_CHECK(p.budget >= 0, "planner") << "plan: budget_bytes must not be negative (got " << p.budget << ")";
  return p;
}

}  // namespace sppo::plan
