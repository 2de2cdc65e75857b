#include "planner/plan.h"

#include <nlohmann/json.hpp>
#include <algorithm>
#include <string>

#include "core/check.h"

namespace sppo::plan {

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
      {"pp", p.pp},
      {"dp", p.dp},
      {"tp", p.tp},
      {"subseqs", p.subseqs},
      {"lengths", p.lengths},
      {"alpha", p.alpha},
      {"msp", p.msp},
      {"stage_layers", p.stage_layers},
      {"offload", p.offload},
      {"alpha_rule", p.alpha_rule},
      {"budget_bytes", p.budget},
      {"predicted",
       {{"step_time_s", p.predicted.step_time_s},
        {"tokens_per_gpu_per_s", p.predicted.tokens_per_gpu_per_s},
        {"bubble_ratio", p.predicted.bubble_ratio},
        {"peak_device_bytes", p.predicted.peak_device_bytes},
        {"exposed_copy_s", p.predicted.exposed_copy_s}}},
  };
  if (!p.notes.empty()) j["notes"] = p.notes;
  return j;
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
  try {
    p.system = j.value("system", "sppo");
    p.model_name = j.value("model", "custom");
    if (j.contains("model_config")) p.model = model_config_from_json(j.at("model_config"));
    else p.model = preset(p.model_name);
    p.hardware = j.at("hardware").get<std::string>();
    p.seq_len = j.at("seq_len").get<i64>();
    p.gpus = j.value("gpus", 1);
    p.gpus_per_node = j.value("gpus_per_node", 8);
    p.sp = j.at("sp").get<int>();
    p.pp = j.at("pp").get<int>();
    p.dp = j.value("dp", 1);
    p.tp = j.value("tp", 1);
    p.lengths = j.at("lengths").get<std::vector<i64>>();
    p.subseqs = j.value("subseqs", int(p.lengths.size()));
    p.alpha = j.value("alpha", std::vector<double>(p.lengths.size(), 0.0));
    p.msp = j.value("msp", false);
    p.stage_layers = j.value("stage_layers", std::vector<int>{});
    p.offload = j.value("offload", "adaptive");
    p.alpha_rule = j.value("alpha_rule", "");
    p.budget = j.value("budget_bytes", i64(0));
    if (j.contains("predicted")) {
      const auto& q = j.at("predicted");
      p.predicted.step_time_s = q.value("step_time_s", 0.0);
      p.predicted.tokens_per_gpu_per_s = q.value("tokens_per_gpu_per_s", 0.0);
      p.predicted.bubble_ratio = q.value("bubble_ratio", 0.0);
      p.predicted.peak_device_bytes = q.value("peak_device_bytes", i64(0));
      p.predicted.exposed_copy_s = q.value("exposed_copy_s", 0.0);
    }
    p.notes = j.value("notes", std::vector<std::string>{});
  } catch (const nlohmann::json::exception& e) {
    SPPO_CHECK(false, "planner") << "plan JSON: " << e.what()
                                 << " (required: hardware, seq_len, sp, pp, lengths)";
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
