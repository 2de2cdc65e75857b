#include "planner/plan.h"

#include <nlohmann/json.hpp>
#include <numeric>

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
      {"zero", p.zero},
      {"ring_layout", p.ring_layout},
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
  SPPO_CHECK(j.is_object(), "planner") << "a plan is a JSON object";
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
    // Plans written before these fields: no ZeRO; the cost model then priced zigzag rings.
    p.zero = j.value("zero", 0);
    p.ring_layout = j.value("ring_layout", "zigzag");
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
  SPPO_CHECK(int(p.lengths.size()) == p.subseqs, "planner")
      << "plan: subseqs = " << p.subseqs << " but lengths has " << p.lengths.size() << " entries";
  SPPO_CHECK(p.alpha.size() == p.lengths.size(), "planner")
      << "plan: alpha has " << p.alpha.size() << " entries for " << p.lengths.size() << " subsequences";
  const i64 sum = std::accumulate(p.lengths.begin(), p.lengths.end(), i64(0));
  SPPO_CHECK(sum == p.seq_len, "planner") << "plan: lengths sum to " << sum << ", not seq_len " << p.seq_len;
  SPPO_CHECK(p.sp >= 1 && p.pp >= 1 && p.dp >= 1 && p.tp >= 1, "planner") << "plan: sp, pp, dp, tp must be >= 1";
  SPPO_CHECK(p.zero == 0 || p.zero == 1, "planner") << "plan: zero must be 0 or 1 (got " << p.zero << ")";
  SPPO_CHECK(p.ring_layout == "zigzag" || p.ring_layout == "contiguous", "planner")
      << "plan: ring_layout must be zigzag or contiguous (got '" << p.ring_layout << "')";
  SPPO_CHECK(p.sp * p.pp * p.dp * p.tp == p.gpus, "planner")
      << "plan: sp * pp * dp * tp = " << p.sp * p.pp * p.dp * p.tp << " but gpus = " << p.gpus;
  return p;
}

}  // namespace sppo::plan
