#include "bench/bench_eval.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/longest.h"
#include "core/check.h"
#include "io/fileutil.h"
#include "planner/profile.h"
#include "train/parallel.h"
#include "train/profile_machine.h"
#include "train/setup.h"

namespace sppo {

namespace {


StepOptions options_for(const BenchEvalOptions& o, const std::string& profile, i64 S, bool eval,
                        const std::string& kv) {
  StepOptions s;
  s.model = preset(o.model);
  s.model_name = o.model;
  s.seq_len = S;
  s.subseqs = "auto";
  s.offload = eval ? "none" : "adaptive";
  s.device_memory = o.budget;
  s.host_memory = o.host_budget;
  s.hardware = profile;  // nominal rates: the fit depends on memory alone
  s.place.kv = parse_kv_cache(kv);
  s.forward_only = eval;
  return s;
}

// Whether the setup fits S tokens (its budget checks, before any step).
bool fits(const BenchEvalOptions& o, const std::string& profile, i64 S, bool eval, const std::string& kv) {
  try {
    (void)make_setup(options_for(o, profile, S, eval, kv));
    return true;
  } catch (const DoesNotFit&) {
    return false;
  }
}

// The longest multiple of kLengthStep up to the cap that fits (0: none does).
i64 longest(const BenchEvalOptions& o, const std::string& profile, bool eval, const std::string& kv) {
  return longest_fitting(kLengthStep, o.cap, [&](i64 S) { return fits(o, profile, S, eval, kv); });
}

}  // namespace

nlohmann::json bench_eval(const BenchEvalOptions& o) {
  SPPO_CHECK(o.budget > 0 && o.host_budget > 0 && o.cap >= kLengthStep && o.measure_cap >= kLengthStep, "options")
      << "bench eval needs device and host budgets and caps of at least " << kLengthStep << " tokens";
  io::TempDir dir("sppo-bench-eval");
  const std::string profile = dir.file("nominal.json");
  plan::save_profile(nominal_cpu_profile(), profile);
  nlohmann::json rows = nlohmann::json::array();
  for (const char* kv : {"device", "host"}) {
    const i64 train = longest(o, profile, false, kv), eval = longest(o, profile, true, kv);
    nlohmann::json row = {{"kv_cache", kv},
                          {"train_max_seq_len", train},
                          {"train_at_cap", train == o.cap / kLengthStep * kLengthStep},
                          {"eval_max_seq_len", eval},
                          {"eval_at_cap", eval == o.cap / kLengthStep * kLengthStep},
                          {"ratio", train > 0 ? double(eval) / double(train) : 0.0}};
    // One evaluation, at its longest or the measuring cap if shorter, from seeded weights.
    const i64 measured = std::min(eval, o.measure_cap / kLengthStep * kLengthStep);
    if (measured > 0) {
      StepSetup s = make_setup(options_for(o, profile, measured, true, kv));
      init_owned(*s.runtime, 1234);
      std::vector<std::int32_t> tokens(std::size_t(measured + 1));
      s.data->next(tokens.data(), measured + 1);
      const StepResult r = s.runtime->step(s.schedule, tokens.data());
      row["eval_measured_seq_len"] = measured;
      row["eval_measured_ratio"] = train > 0 ? double(measured) / double(train) : 0.0;
      row["eval_subseqs"] = s.lengths.size();
      row["eval_measured_peak_device_bytes"] = r.device.peak;
      row["eval_predicted_peak_device_bytes"] = s.predicted_peak_bytes;
      row["eval_measured_peak_host_bytes"] = r.host.peak;
      row["eval_predicted_peak_host_bytes"] = s.predicted_host_bytes;
      row["eval_step_s"] = r.step_s;
    }
    rows.push_back(row);
  }
  return {{"model", o.model},         {"device_budget_bytes", o.budget}, {"host_budget_bytes", o.host_budget},
          {"cap", o.cap / kLengthStep * kLengthStep}, {"measure_cap", o.measure_cap}, {"rows", rows}};
}

void print_bench_eval(const nlohmann::json& j) {
  std::printf("bench eval: %s under a device budget of %s and a host budget of %s; lengths searched in steps of "
              "%lld up to %lld\n",
              j["model"].get<std::string>().c_str(), format_bytes(j["device_budget_bytes"].get<double>()).c_str(),
              format_bytes(j["host_budget_bytes"].get<double>()).c_str(),
              (long long)kLengthStep, j["cap"].get<long long>());
  std::printf("%-8s %14s %14s %8s %20s %24s %24s\n", "K/V", "train longest", "eval longest", "ratio",
              "eval measured at", "peak device (pred.)", "peak host (pred.)");
  for (const auto& r : j["rows"]) {
    auto len = [&](const char* key, const char* cap) {
      return std::to_string(r[key].get<long long>()) + (r[cap].get<bool>() ? "+" : "");
    };
    std::string at = "not measured", dev = "", host = "";
    if (r.contains("eval_measured_peak_device_bytes")) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%lld (%.2fx)", r["eval_measured_seq_len"].get<long long>(),
                    r["eval_measured_ratio"].get<double>());
      at = buf;
      dev = format_bytes(r["eval_measured_peak_device_bytes"].get<double>()) + " (" +
            format_bytes(r["eval_predicted_peak_device_bytes"].get<double>()) + ")";
      host = format_bytes(r["eval_measured_peak_host_bytes"].get<double>()) + " (" +
             format_bytes(r["eval_predicted_peak_host_bytes"].get<double>()) + ")";
    }
    std::printf("%-8s %14s %14s %7.2fx %20s %24s %24s\n", r["kv_cache"].get<std::string>().c_str(),
                len("train_max_seq_len", "train_at_cap").c_str(), len("eval_max_seq_len", "eval_at_cap").c_str(),
                r["ratio"].get<double>(), at.c_str(), dev.c_str(), host.c_str());
  }
  std::printf("(+: at the cap, the longest searched; peaks measured on one evaluation at its longest or at "
              "--measure-cap, whichever is shorter, its length's ratio to train's longest beside it)\n");
}

}  // namespace sppo
