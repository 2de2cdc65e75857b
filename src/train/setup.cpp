#include "train/setup.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "core/check.h"
#include "planner/plan.h"
#include "schedule/builders.h"
#include "sim/simulator.h"
#include "sim/solver.h"
#include "train/partition.h"
#include "train/profile_machine.h"

namespace sppo {

namespace {

int resolve_subseqs(const StepOptions& o, i64 S) {
  // Without a budget, auto aims at about 8K tokens a subsequence (make_setup refines it
  // under a budget).
  if (o.subseqs == "auto") return int(std::max<i64>(1, std::min<i64>(S, (S + 8191) / 8192)));
  i64 n = 0;
  try {
    n = parse_count(o.subseqs, "--subseqs");
  } catch (const Error&) {
    SPPO_CHECK(false, "options") << "--subseqs '" << o.subseqs
                                 << "' is not a count; give a positive integer or 'auto'";
  }
  SPPO_CHECK(n >= 1 && n <= S, "options")
      << "--subseqs " << n << " must be between 1 and --seq-len (" << S << ")";
  return int(n);
}

}  // namespace

double mean_loss(const std::vector<float>& losses, i64 begin, i64 end) {
  double s = 0;
  for (i64 t = begin; t < end; ++t) s += losses[std::size_t(t)];
  return end > begin ? s / double(end - begin) : 0.0;
}

void init_params(const ModelConfig& c, float* params, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float std_w = 0.02f, std_resid = 0.02f / std::sqrt(2.0f * float(c.layers));
  float* p = params;
  for (const auto& spec : parameter_specs(c)) {
    const i64 n = spec.numel();
    const std::string& name = spec.name;
    auto ends_with = [&](const char* suf) {
      const std::string s(suf);
      return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
    };
    if (spec.shape.size() == 2) {
      const bool resid = ends_with("attn.out.weight") || ends_with("mlp.proj.weight");
      const float sd = resid ? std_resid : std_w;
      for (i64 k = 0; k < n; ++k) p[k] = sd * normal(rng);
    } else {
      const float fill = (ends_with("ln1.weight") || ends_with("ln2.weight") || ends_with("ln_f.weight")) ? 1.0f : 0.0f;
      std::fill(p, p + n, fill);
    }
    p += n;
  }
}

namespace {

// --plan: a plan for one device fixes the lengths and alpha; the model and S must agree.
void apply_plan(const StepOptions& o, StepSetup* s) {
  std::ifstream f(o.plan_path);
  SPPO_CHECK(f.good(), "options") << "cannot read --plan " << o.plan_path;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    SPPO_CHECK(false, "options") << "--plan " << o.plan_path << " is not JSON: " << e.what();
  }
  const plan::Plan p = plan::plan_from_json(j);
  SPPO_CHECK(p.system == "sppo" && p.sp == 1 && p.pp == 1 && p.dp == 1, "options")
      << "--plan " << o.plan_path << " is a " << p.system << " plan with sp " << p.sp << ", pp " << p.pp
      << ", dp " << p.dp << "; this runtime runs one process: plan with --gpus 1";
  SPPO_CHECK(p.seq_len == o.seq_len, "options")
      << "--plan " << o.plan_path << " is for --seq-len " << p.seq_len << ", not " << o.seq_len;
  SPPO_CHECK(to_json(p.model) == to_json(s->config), "options")
      << "--plan " << o.plan_path << " is for the model " << to_json(p.model).dump()
      << ", not " << to_json(s->config).dump() << "; pass the same model options";
  s->lengths = p.lengths;
  s->alpha = p.alpha;
  s->profile_measured = true;
  s->profile = resolve_cpu_profile(o.hardware);
  const plan::CostModel cost(s->profile, s->config, ActPrecision::F32);
  const auto r = sim::simulate(sched::build_single(s->config.layers, s->lengths, s->alpha), cost,
                               sim::memory_rules(s->config, ActPrecision::F32));
  s->predicted_peak_bytes = r.peak_device_bytes;
  s->predicted_step_s = r.step_time_s;
  SPPO_CHECK(o.device_memory == 0 || r.peak_device_bytes <= o.device_memory, "memory")
      << "--plan " << o.plan_path << " needs " << format_bytes(double(r.peak_device_bytes))
      << " of device memory, over the --device-memory budget of " << format_bytes(double(o.device_memory));
}

}  // namespace

StepSetup make_setup(const StepOptions& o) {
  StepSetup s;
  s.config = o.model;
  s.config.validate();
  SPPO_CHECK(o.seq_len >= 2, "options") << "--seq-len " << o.seq_len << " is too short; use at least 2";
  const i64 S = o.seq_len;

  s.data = io::open_data(o.data, s.config.vocab, o.seed, io::DataOptions{0, o.data_dtype});
  s.data->check_vocab(s.config.vocab);
  s.repeat_task = o.data.empty() || o.data.rfind("repeat", 0) == 0;

  if (!o.plan_path.empty()) {
    apply_plan(o, &s);
  } else {
    // Timing matters only to adaptive choices; a budget check needs the memory model alone.
    const bool adaptive = o.partition == "adaptive" || o.offload == "adaptive";
    s.profile_measured = adaptive || !o.hardware.empty();
    const plan::HardwareProfile hw = s.profile_measured ? resolve_cpu_profile(o.hardware) : nominal_cpu_profile();
    int N = resolve_subseqs(o, S);
    if (o.subseqs == "auto" && o.device_memory > 0 && !o.recompute) {
      // Under a budget, auto is the fewest subsequences that fit with adaptive offload.
      const auto fit = sim::smallest_fitting_n(s.config, S, hw, ActPrecision::F32, o.device_memory,
                                               o.partition != "length", 1, int(std::min<i64>(S, 4096)));
      if (fit.found) N = fit.subseqs;
    }
    SPPO_CHECK(!o.recompute || N == 1, "options")
        << "--recompute runs the whole sequence at once; drop --subseqs or set it to 1";
    // The simulator does not model recomputation: that baseline is checked by the arena
    // alone, and has no prediction.
    SubseqChoice choice = choose_subseqs(o.partition, o.offload, s.config, S, N,
                                         o.recompute ? 0 : o.device_memory, hw);
    s.lengths = choice.lengths;
    s.alpha = choice.alpha;
    s.predicted_peak_bytes = o.recompute ? 0 : choice.predicted_peak_bytes;
    s.predicted_step_s = choice.predicted_step_s;
    s.profile_measured = s.profile_measured && !o.recompute;
    s.profile = hw;
  }
  s.schedule = sched::build_single(s.config.layers, s.lengths, s.alpha);

  RuntimeOptions ro;
  ro.device_budget = o.device_memory;
  ro.recompute = o.recompute;
  s.runtime = std::make_unique<Runtime>(s.config, ro);
  return s;
}

}  // namespace sppo
