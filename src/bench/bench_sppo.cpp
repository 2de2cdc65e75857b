#include "bench/bench_sppo.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>
#include <vector>

#include "core/check.h"
#include "core/timing.h"
#include "io/fileutil.h"
#include "planner/cost.h"
#include "sim/simulator.h"
#include "sim/solver.h"
#include "train/profile_machine.h"
#include "train/parallel.h"
#include "train/setup.h"
#include "train/profile_device.h"

namespace sppo {

namespace {

struct Mode {
  const char* name;
  bool recompute;
  std::string offload;            // none | adaptive
  std::string kv_cache;           // device | auto (the planner's placement of every layer's K/V)
  std::string recompute_tensors;  // none | auto (train --recompute-tensors)
  std::string backward = "subseq";  // train --backward-order
  bool host_state = false;  // residual gradients, layers' weights and optimizer state on the host
  // train --partition: the paper's equal FLOPs, or adaptive: equal FLOPs where they fit and
  // are no slower, else equal lengths, whose longest subsequence, and so the device's
  // share of a step, is the shortest
  std::string partition = "flops";
};

// sppo_auto: the planner's placements: adaptive offload, each layer's K/V where it fits
// (device, host, or recomputed) and the saved tensors recomputed where nothing else fits,
// in the paper's backward order. sppo_layer: the same with the layer-major backward (one
// layer's dK/dV sums at a time; Note [Layer-major backward] in schedule/builders.cpp).
// sppo_layer_host: sppo_layer with what else it keeps on the device on the host: the
// residual gradients waiting between its layers (Note [Residual gradients on the host]),
// the layers' weights and the optimizer state (Note [Weights on the host]), and the
// partition adaptive. Equal FLOPs make the first subsequence the longest (S / sqrt(N)
// tokens), and with everything else on the host that subsequence is what the device
// holds; the bench also predicts sppo_auto's longest with that partition, so that the
// two parts of the gain are told apart.
const Mode kModes[] = {
    {"reference", false, "none", "device", "none"},
    {"recompute", true, "none", "device", "none"},
    {"sppo_none", false, "none", "device", "none"},
    {"sppo_adaptive", false, "adaptive", "device", "none"},
    {"sppo_auto", false, "adaptive", "auto", "auto"},
    {"sppo_layer", false, "adaptive", "auto", "auto", "layer"},
    {"sppo_layer_host", false, "adaptive", "auto", "auto", "layer", true, "adaptive"},
};
constexpr int kAdaptive = 3, kAutoMode = 4, kLayer = 5, kLayerHost = 6;  // indices of kModes

struct Point {
  bool ok = false;
  std::string error;
  int subseqs = 1;
  i64 longest_subseq = 0;  // tokens: the partition's longest subsequence
  double step_s = 0;
  i64 peak = 0, predicted_peak = 0, offloaded = 0;
  i64 host_peak = 0, predicted_host_peak = 0;  // the offloaded copies (and host K/V) on the host
  int kv_host_layers = 0;                      // layers whose K/V live on the host
  int kv_recompute_layers = 0;                 // layers that recompute their K/V
  std::string recompute = "none";              // what backward recomputes (recompute_tensors_text)
  double simulated_s = 0;                      // the simulator's step time (0: not simulated)
  double exposed = 0;
  std::vector<double> alpha;
};

constexpr int kSubseqCandidates[] = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512};
constexpr i64 kLengthQuantum = 256;  // the searches step sequence lengths in these units
constexpr double kLongStepS = 60;    // a timed point's first step this long is its measurement

StepOptions step_options(const BenchModelOptions& b, const Mode& m, i64 S, int N, i64 budget) {
  StepOptions o;
  o.model = b.model;
  o.model_name = b.model_name;
  o.seq_len = S;
  o.data = "repeat";
  o.subseqs = std::to_string(N);
  o.partition = m.partition;
  o.offload = m.offload;
  o.recompute = m.recompute;
  o.place.kv = parse_kv_cache(m.kv_cache);
  o.place.recompute = parse_recompute_option(m.recompute_tensors);
  o.place.backward = parse_backward_order_option(m.backward);
  if (m.host_state) {
    o.place.residual_grads = Tier::Host;
    o.place.weights = Tier::Host;
    o.place.optimizer_state = Tier::Host;
  }
  o.device_memory = budget;
  o.host_memory = budget > 0 ? b.host_budget : 0;
  o.hardware = b.hardware;
  o.backend = b.backend;
  o.precision = b.precision;
  o.attention_kernels = b.attention;
  return o;
}

// One configuration: set up (the planner refuses what it predicts will not fit), then real
// steps under the budget (the arena refuses what does not). reps < 0: set up only.
Point run_point(const BenchModelOptions& b, const Mode& m, i64 S, int N, i64 budget, int reps) {
  Point p;
  p.subseqs = N;
  try {
    StepSetup s = make_setup(step_options(b, m, S, N, budget));
    p.longest_subseq = *std::max_element(s.lengths.begin(), s.lengths.end());
    p.kv_host_layers = int(std::count(s.schedule.place.kv.begin(), s.schedule.place.kv.end(), KvPlace::Host));
    p.kv_recompute_layers =
        int(std::count(s.schedule.place.kv.begin(), s.schedule.place.kv.end(), KvPlace::Recompute));
    p.recompute = recompute_tensors_text(s.schedule.place.recompute);
    p.simulated_s = s.profile_measured ? s.predicted_step_s : 0;  // else priced on a nominal profile
    if (reps < 0) {  // a probe by prediction: setup refuses what would not fit
      p.predicted_peak = p.peak = s.predicted_peak_bytes;
      p.predicted_host_peak = p.host_peak = s.predicted_host_bytes;
      p.alpha = s.alpha;
      p.ok = true;
      return p;
    }
    std::vector<std::int32_t> tokens(std::size_t(S + 1));
    s.data->next(tokens.data(), S + 1);
    init_owned(*s.runtime, 1);  // written through the backend: params() may be device memory
    std::vector<double> times;
    // A probe (reps 0) runs one step and keeps its figures; a timed point discards a
    // warm-up step first, unless that step took kLongStepS or more: what only a first step
    // pays (the first touch of the arena's and the host pool's pages, the threads' start)
    // is lost in it, and a second step would double the bench's longest points.
    bool warm_up = reps > 0;
    while (int(times.size()) < std::max(reps, 1)) {
      StepResult res = s.runtime->step(s.schedule, tokens.data());
      if (std::exchange(warm_up, false) && res.step_s < kLongStepS) continue;
      times.push_back(res.step_s);
      p.peak = std::max(p.peak, res.device.peak);
      p.host_peak = std::max(p.host_peak, res.host.peak);
      p.offloaded = res.offloaded_bytes;
      p.exposed = res.exposed_copy_s;
    }
    p.step_s = median(times);
    p.predicted_peak = s.predicted_peak_bytes;
    p.predicted_host_peak = s.predicted_host_bytes;
    p.alpha = s.alpha;
    p.ok = true;
  } catch (const Error& e) {
    p.error = e.what();
  }
  return p;
}

// The mode at length S with the fewest subsequences that fit (the planner's prediction
// picks N; the real step confirms).
Point fit_at(const BenchModelOptions& b, const Mode& m, i64 S, i64 budget, int reps) {
  if (m.name == std::string("reference") || m.recompute) return run_point(b, m, S, 1, budget, reps);
  Point last;
  for (int N : kSubseqCandidates) {
    if (N > S) break;
    last = run_point(b, m, S, N, budget, reps);
    if (last.ok) return last;
  }
  return last;
}

// Longest S (in kLengthQuantum steps, at most `cap` when given) at which the mode trains
// under the budget: doubling, then bisection, each probe a real step, or the prediction
// when `predicted` (exact to the byte; the caller confirms the answer with a real step).
// `cap_first`: the cap is probed first, and is the answer where it fits.
std::pair<i64, Point> longest(const BenchModelOptions& b, const Mode& m, i64 budget, bool predicted = false,
                              i64 cap = 0, bool cap_first = false) {
  // A real step, or the prediction (see the header).
  const int probe = b.backend == "cpu" && !predicted ? 0 : -1;
  if (cap > 0 && cap_first) {
    Point p = fit_at(b, m, cap, budget, probe);
    if (p.ok) return {cap, p};
  }
  i64 lo = 0, hi = kLengthQuantum;
  Point best;
  for (;;) {
    if (cap > 0 && hi >= cap) {
      hi = cap;
      Point p = fit_at(b, m, hi, budget, probe);
      if (p.ok) return {hi, p};
      break;
    }
    Point p = fit_at(b, m, hi, budget, probe);
    if (!p.ok) break;
    lo = hi;
    best = p;
    hi *= 2;
    SPPO_CHECK(hi <= (i64(1) << 24), "bench") << "the budget holds more than 16M tokens; give a smaller --device-memory";
  }
  while (hi - lo > kLengthQuantum) {
    const i64 mid = (lo + hi) / 2 / kLengthQuantum * kLengthQuantum;
    Point p = fit_at(b, m, mid, budget, probe);
    if (p.ok) {
      lo = mid;
      best = p;
    } else {
      hi = mid;
    }
  }
  return {lo, best};
}

nlohmann::json point_json(const Point& p) {
  nlohmann::json j = {{"subseqs", p.subseqs}, {"longest_subseq", p.longest_subseq}, {"step_time_s", p.step_s},
                      {"peak_device_bytes", p.peak},
                      {"predicted_peak_device_bytes", p.predicted_peak}, {"peak_host_bytes", p.host_peak},
                      {"predicted_peak_host_bytes", p.predicted_host_peak}, {"offloaded_bytes", p.offloaded},
                      {"exposed_copy_s", p.exposed}, {"kv_host_layers", p.kv_host_layers},
                      {"kv_recompute_layers", p.kv_recompute_layers}, {"recompute_tensors", p.recompute},
                      {"simulated_step_time_s", p.simulated_s}};
  if (!p.ok) j["error"] = p.error;
  return j;
}

}  // namespace

nlohmann::json bench_memory(const BenchModelOptions& given) {
  SPPO_CHECK(given.budget > 0, "bench") << "bench memory needs a device budget (--device-memory)";
  const auto started = std::chrono::steady_clock::now();
  // On the CPU every mode is priced with one full profile measured here, unless --hardware
  // names one: the quick profile a run measures for itself varies between runs on a shared
  // machine by more than the 15% the comparison at sppo_auto's longest length is held to
  // (two a minute apart: the prefix attention's chunk cost 17.9 against 73.9 us, the share
  // of compute a copy takes 0.02 against 0.71).
  BenchModelOptions b = given;
  io::TempDir dir("sppo-bench-memory");
  nlohmann::json profile = nullptr;  // the one every mode is priced with, where the bench knows it
  if (b.hardware.empty() && b.backend == "cpu") {
    const plan::HardwareProfile hw = measure_cpu_profile(false);
    b.hardware = dir.path() + "/profile.json";
    plan::save_profile(hw, b.hardware);
    profile = plan::to_json(hw);
  } else if (!b.hardware.empty()) {
    profile = plan::to_json(plan::load_profile(b.hardware));
  }
  if (b.at_seq_len > 0) {
    const Mode& m = kModes[kAdaptive];
    const auto [S, probe] = longest(b, m, b.budget);
    const Point p = fit_at(b, m, b.at_seq_len, b.budget, b.reps);
    nlohmann::json j = {{"model", b.model_name},
                        {"config", to_json(b.model)},
                        {"backend", b.backend},
                        {"budget_bytes", b.budget},
                        {"longest_seq", S},
                        {"longest_by", b.backend == "cpu" ? "real steps" : "predicted peak"},
                        {"at_longest", point_json(probe)},
                        {"at_seq_len", b.at_seq_len},
                        {"step_time_at_seq_s", p.ok ? nlohmann::json(p.step_s) : nlohmann::json(nullptr)},
                        {"at_seq", point_json(p)},
                        {"profile", profile}};
    return j;
  }
  nlohmann::json modes = nlohmann::json::object();
  std::vector<i64> max_len;
  for (const Mode& m : kModes) {
    const auto mode_started = std::chrono::steady_clock::now();
    // The lengths of the modes with the planner's placements are probed by prediction, up
    // to 64x sppo_adaptive's, and their longest confirmed by a real step below.
    // sppo_layer_host's are probed from twice sppo_auto's, where the search stops if that
    // fits: a step there is already minutes long (its attention is 4x that at sppo_auto's
    // longest), and the bench keeps to its 20 minutes.
    const auto i = &m - kModes;
    const bool automatic = i >= kAutoMode;
    const i64 cap = i == kLayerHost ? 2 * max_len[kAutoMode] : automatic ? 64 * max_len[kAdaptive] : 0;
    auto [S, probe] = longest(b, m, b.budget, automatic, cap, i == kLayerHost);
    // Time the longest length properly (the probes ran one step each).
    Point p = S > 0 ? run_point(b, m, S, probe.subseqs, b.budget, b.reps) : Point{};
    max_len.push_back(S);
    nlohmann::json j = {{"max_seq_len", S}, {"step_time_s", p.ok ? nlohmann::json(p.step_s) : nlohmann::json(nullptr)},
                        {"max_seq_len_is_cap", cap > 0 && S == cap}, {"at_max", point_json(p)}};
    if (i == kLayerHost) {
      // Past the cap by prediction alone (no step), up to 64x sppo_adaptive's, and
      // sppo_auto's with the same partition.
      const i64 far = 64 * max_len[kAdaptive];
      const i64 beyond = S == cap ? longest(b, m, b.budget, true, far).first : S;
      j["predicted_max_seq_len"] = beyond;
      j["predicted_max_seq_len_is_cap"] = beyond == far;
      Mode auto_adaptive = kModes[kAutoMode];
      auto_adaptive.partition = m.partition;
      const i64 auto_beyond = longest(b, auto_adaptive, b.budget, true, far).first;
      modes["sppo_auto"]["predicted_max_seq_len_partition_adaptive"] = auto_beyond;
      modes["sppo_auto"]["predicted_max_seq_len_partition_adaptive_is_cap"] = auto_beyond == far;
    }
    j["search_and_step_s"] = seconds_since(mode_started);
    modes[m.name] = j;
  }
  // Every mode at recompute's longest length; modes that do not fit the budget there run
  // without it (marked), so the speed comparison still exists.
  const i64 S_rc = max_len[1];
  for (const Mode& m : kModes) {
    Point p = fit_at(b, m, S_rc, b.budget, b.reps);
    bool over = false;
    if (!p.ok) {
      p = fit_at(b, m, S_rc, 0, b.reps);
      over = true;
    }
    modes[m.name]["step_time_at_recompute_max_s"] = p.ok ? nlohmann::json(p.step_s) : nlohmann::json(nullptr);
    modes[m.name]["at_recompute_max"] = point_json(p);
    modes[m.name]["at_recompute_max"]["over_budget"] = over;
  }
  const double ref = modes["reference"]["max_seq_len"].get<double>();
  nlohmann::json j = {{"model", b.model_name},
                      {"config", to_json(b.model)},
                      {"budget_bytes", b.budget},
                      {"recompute_max_seq_len", S_rc},
                      {"modes", modes},
                      {"profile", profile}};
  j["host_budget_bytes"] = b.host_budget;
  if (ref > 0) j["sppo_adaptive_over_reference_length"] = modes["sppo_adaptive"]["max_seq_len"].get<double>() / ref;
  if (ref > 0) j["sppo_auto_over_reference_length"] = modes["sppo_auto"]["max_seq_len"].get<double>() / ref;
  if (max_len[kAdaptive] > 0) {
    j["sppo_auto_over_adaptive_length"] = double(max_len[kAutoMode]) / double(max_len[kAdaptive]);
    // Speed where both fit: sppo_auto at sppo_adaptive's longest length.
    const Point a = fit_at(b, kModes[kAutoMode], max_len[kAdaptive], b.budget, b.reps);
    const auto& ad = modes["sppo_adaptive"]["step_time_s"];
    j["modes"]["sppo_auto"]["at_adaptive_max"] = point_json(a);
    if (a.ok && ad.is_number()) j["sppo_auto_step_time_over_adaptive_at_its_max"] = a.step_s / ad.get<double>();
  }
  if (const auto& a = j["modes"]["sppo_auto"]["at_max"]; a["simulated_step_time_s"].get<double>() > 0) {
    j["sppo_auto_measured_over_simulated_at_max"] =
        a["step_time_s"].get<double>() / a["simulated_step_time_s"].get<double>();
  }
  for (const int i : {kLayer, kLayerHost}) {
    const std::string name = kModes[i].name;
    if (max_len[kAutoMode] > 0) j[name + "_over_auto_length"] = double(max_len[i]) / double(max_len[kAutoMode]);
    if (const auto& a = j["modes"][name]["at_max"]; a["simulated_step_time_s"].get<double>() > 0) {
      j[name + "_measured_over_simulated_at_max"] =
          a["step_time_s"].get<double>() / a["simulated_step_time_s"].get<double>();
    }
  }
  j["bench_s"] = seconds_since(started);  // the whole bench, its profile measurement included
  const auto rc_t = modes["recompute"]["step_time_at_recompute_max_s"], sp_t = modes["sppo_adaptive"]["step_time_at_recompute_max_s"];
  if (rc_t.is_number() && sp_t.is_number()) j["sppo_adaptive_speedup_over_recompute"] = rc_t.get<double>() / sp_t.get<double>();
  return j;
}

nlohmann::json bench_offload(const BenchModelOptions& b) {
  const i64 S = b.seq_len;
  const int N = b.subseqs;
  SPPO_CHECK(S >= 2 && N >= 2 && N <= S, "bench") << "bench offload needs --seq-len >= 2 and 2 <= --subseqs <= S";
  const Mode none{"none", false, "none", "device", "none"}, full{"full", false, "full", "device", "none"},
      paper{"paper", false, "paper", "device", "none"};
  const Point p_none = run_point(b, none, S, N, 0, b.reps);
  const Point p_full = run_point(b, full, S, N, 0, b.reps);
  SPPO_CHECK(p_none.ok && p_full.ok, "bench") << (p_none.ok ? p_full.error : p_none.error);
  const Point p_paper = run_point(b, paper, S, N, 0, b.reps);
  SPPO_CHECK(p_paper.ok, "bench") << p_paper.error;
  // Adaptive needs a reason to offload: a budget halfway between full's and none's peaks.
  const i64 budget = b.budget > 0 ? b.budget : (p_none.peak + p_full.peak) / 2;
  const Mode adaptive{"adaptive", false, "adaptive", "device", "none"};
  const Point p_ad = run_point(b, adaptive, S, N, budget, b.reps);
  SPPO_CHECK(p_ad.ok, "bench") << p_ad.error;
  nlohmann::json modes = {{"none", point_json(p_none)}, {"full", point_json(p_full)}, {"paper", point_json(p_paper)},
                          {"adaptive", point_json(p_ad)}};
  modes["paper"]["alpha"] = p_paper.alpha;
  modes["adaptive"]["alpha"] = p_ad.alpha;
  return {{"model", b.model_name},
          {"config", to_json(b.model)},
          {"seq_len", S},
          {"subseqs", N},
          {"backend", b.backend},
          {"adaptive_budget_bytes", budget},
          {"adaptive_over_none_step_time", p_ad.step_s / p_none.step_s},
          {"modes", modes}};
}

nlohmann::json bench_sim(const BenchModelOptions& b) {
  struct Config {
    const char* model;
    int layers;  // 0: the preset's
    i64 S;
    int N;
    const char* offload;
    const char* kv_cache = "device";     // train --kv-cache
    const char* recompute = "none";      // train --recompute-tensors
  };
  // On the CPU, 4K to 64K tokens and 1 to 32 subsequences: long sequences spend most of
  // their attention after a prefix (Note [Attention after a prefix]), short ones in GEMMs;
  // and the placements past the paper: K/V on the host or recomputed, saved tensors
  // recomputed.
  const std::vector<Config> cpu_configs = {
      {"small", 0, 4096, 2, "none"},       {"small", 0, 8192, 1, "none"},   {"small", 0, 8192, 8, "0.5"},
      {"small", 0, 16384, 16, "full"},     {"medium", 0, 4096, 4, "none"},  {"medium", 0, 8192, 8, "full"},
      {"bench-memory", 0, 8192, 4, "0.75"}, {"small", 0, 32768, 16, "0.5"}, {"small", 0, 65536, 20, "0.5"},
      {"small", 0, 65536, 32, "full"},
      {"small", 0, 16384, 8, "0.5", "host"},
      {"small", 0, 16384, 8, "0.5", "recompute"},
      {"small", 0, 16384, 8, "none", "device", "ln1,ln2,fc_pre"},
      {"small", 0, 32768, 16, "0.5", "recompute", "ln1,q,x_mid,ln2,fc_pre"},
  };
  // On a GPU, one-device SPPO configurations of gpt-7b's layer shape (4 of its layers, so
  // that weights, Adam state and 128K tokens of activations fit one card): the placements
  // past the paper at 64K (K/V on the host and recomputed, streamed beside the offload's
  // copies; saved tensors recomputed), then no offload, half, and all of it with 16
  // subsequences.
  const std::vector<Config> gpu_configs = {
      {"gpt-7b", 4, 65536, 8, "0.5", "host"},
      {"gpt-7b", 4, 65536, 8, "0.5", "recompute"},
      {"gpt-7b", 4, 65536, 8, "none", "device", "ln1,ln2,fc_pre"},
      {"gpt-7b", 4, 32768, 4, "none"},
      {"gpt-7b", 4, 65536, 8, "0.5"},
      {"gpt-7b", 4, 131072, 16, "full"}};
  const auto probe_backend = make_backend(b.backend, b.precision, b.attention);
  const bool on_cpu = std::string(probe_backend->name()) == "cpu";
  const plan::HardwareProfile hw = !b.hardware.empty() ? plan::load_profile(b.hardware)
                                   : on_cpu            ? measure_cpu_profile(false)
                                                       : measure_backend_profile(*probe_backend, false);
  nlohmann::json rows = nlohmann::json::array();
  double worst_time = 0, worst_peak = 0;
  for (const Config& cfg : on_cpu ? cpu_configs : gpu_configs) {
    StepOptions o;
    o.model = preset(cfg.model);
    if (cfg.layers > 0) o.model.layers = cfg.layers;
    o.model_name = cfg.model;
    o.seq_len = cfg.S;
    o.subseqs = std::to_string(cfg.N);
    o.partition = "flops";
    o.offload = cfg.offload;
    o.place.kv = parse_kv_cache(cfg.kv_cache);
    o.place.recompute = parse_recompute_option(cfg.recompute);
    o.backend = b.backend;
    o.precision = b.precision;
    o.attention_kernels = b.attention;
    StepSetup s = make_setup(o);
    const ActPrecision prec = s.backend->act() == DType::F32 ? ActPrecision::F32 : ActPrecision::BF16;
    const plan::CostModel cost(hw, s.config, prec);
    // The runtime's rules, its kernels' scratch from the device tier included.
    StepShape shape;
    shape.precision = prec;
    shape.block_scratch = s.backend->block_scratch(s.config);
    shape.head_scratch = s.backend->head_scratch(s.config, RuntimeOptions{}.head_chunk);
    const auto sim_r = sim::simulate(s.schedule, cost, sim::memory_rules(s.config, prec, shape));
    std::vector<std::int32_t> tokens(std::size_t(cfg.S + 1));
    s.data->next(tokens.data(), cfg.S + 1);
    init_owned(*s.runtime, 1);  // written through the backend: params() may be device memory
    std::vector<double> times;
    i64 peak = 0;
    for (int r = 0; r < b.reps + 1; ++r) {
      const StepResult res = s.runtime->step(s.schedule, tokens.data());
      if (r == 0) continue;
      times.push_back(res.step_s);
      peak = std::max(peak, res.device.peak);
    }
    const double measured = median(times);
    const double time_err = (sim_r.step_time_s - measured) / measured;
    const double peak_err = double(sim_r.peak_device_bytes - peak) / double(peak);
    worst_time = std::max(worst_time, std::fabs(time_err));
    worst_peak = std::max(worst_peak, std::fabs(peak_err));
    std::fprintf(stderr, "bench sim: %s S %lld N %d offload %s: measured %.3f s, simulated %.3f s\n", cfg.model,
                 (long long)cfg.S, cfg.N, cfg.offload, measured, sim_r.step_time_s);
    rows.push_back({{"model", cfg.model}, {"layers", s.config.layers}, {"seq_len", cfg.S}, {"subseqs", cfg.N},
                    {"offload", cfg.offload}, {"kv_cache", cfg.kv_cache}, {"recompute_tensors", cfg.recompute},
                    {"measured_step_time_s", measured},
                    {"simulated_step_time_s", sim_r.step_time_s}, {"step_time_error", time_err},
                    {"measured_peak_device_bytes", peak}, {"simulated_peak_device_bytes", sim_r.peak_device_bytes},
                    {"peak_error", peak_err}});
  }
  return {{"backend", probe_backend->name()}, {"profile", plan::to_json(hw)},     {"configs", rows},
          {"worst_step_time_error", worst_time}, {"worst_peak_error", worst_peak}};
}

void print_bench_sim(const nlohmann::json& j) {
  std::printf("simulator vs runtime on this machine, %s backend (profile %s)\n", j["backend"].get<std::string>().c_str(),
              j["profile"]["name"].get<std::string>().c_str());
  std::printf("| model | S | N | offload | K/V | recomputed | measured s | simulated s | error | measured peak | "
              "simulated peak | error |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& r : j["configs"])
    std::printf("| %s | %lld | %d | %s | %s | %s | %.3f | %.3f | %+.1f%% | %s | %s | %+.2f%% |\n",
                r["model"].get<std::string>().c_str(), (long long)r["seq_len"].get<i64>(), r["subseqs"].get<int>(),
                r["offload"].get<std::string>().c_str(), r.value("kv_cache", std::string("device")).c_str(),
                r.value("recompute_tensors", std::string("none")).c_str(), r["measured_step_time_s"].get<double>(),
                r["simulated_step_time_s"].get<double>(), 100 * r["step_time_error"].get<double>(),
                format_bytes(r["measured_peak_device_bytes"].get<double>()).c_str(),
                format_bytes(r["simulated_peak_device_bytes"].get<double>()).c_str(), 100 * r["peak_error"].get<double>());
  std::printf("worst step-time error %.1f%%, worst peak error %.2f%%\n", 100 * j["worst_step_time_error"].get<double>(),
              100 * j["worst_peak_error"].get<double>());
}

void print_bench_memory(const nlohmann::json& j) {
  std::printf("longest sequence under a %s device budget (%s)\n",
              format_bytes(j["budget_bytes"].get<double>()).c_str(), j["model"].get<std::string>().c_str());
  if (j.contains("longest_seq")) {  // --at-seq-len: SPPO adaptive alone
    const auto& t = j["step_time_at_seq_s"];
    std::printf("SPPO adaptive: longest %lld tokens (by %s); at %lld tokens one step takes %s\n",
                (long long)j["longest_seq"].get<i64>(), j["longest_by"].get<std::string>().c_str(),
                (long long)j["at_seq_len"].get<i64>(),
                t.is_number() ? (std::to_string(t.get<double>()) + " s").c_str() : "(does not fit)");
    return;
  }
  std::printf("| mode | max seq len | N | step s | peak (measured) | peak (predicted) | step s at S=%lld |\n",
              (long long)j["recompute_max_seq_len"].get<i64>());
  std::printf("|---|---|---|---|---|---|---|\n");
  for (const Mode& mode : kModes) {
    const char* m = mode.name;
    const auto& r = j["modes"][m];
    const auto& a = r["at_max"];
    const auto& rc = r["at_recompute_max"];
    const double predicted = a["predicted_peak_device_bytes"].get<double>();
    std::printf("| %s | %s%lld | %d | %.3f | %s | %s | %s%s |\n", m, r.value("max_seq_len_is_cap", false) ? ">= " : "",
                (long long)r["max_seq_len"].get<i64>(),
                a["subseqs"].get<int>(), a["step_time_s"].get<double>(),
                format_bytes(a["peak_device_bytes"].get<double>()).c_str(),
                predicted > 0 ? format_bytes(predicted).c_str() : "not modelled",
                rc.contains("error") ? "-" : (std::to_string(rc["step_time_s"].get<double>()).substr(0, 6)).c_str(),
                rc["over_budget"].get<bool>() ? " (over budget)" : "");
  }
  if (j.contains("sppo_adaptive_over_reference_length"))
    std::printf("sppo adaptive trains %.2fx the reference's length\n", j["sppo_adaptive_over_reference_length"].get<double>());
  if (j.contains("sppo_adaptive_speedup_over_recompute"))
    std::printf("at recompute's longest length, sppo adaptive is %.2fx faster than recompute\n",
                j["sppo_adaptive_speedup_over_recompute"].get<double>());
  if (j.contains("sppo_auto_over_adaptive_length")) {
    const auto& a = j["modes"]["sppo_auto"]["at_max"];
    std::printf("sppo auto (K/V of %d layers on the host and %d recomputed, recomputing %s; %s host budget) trains "
                "%.2fx sppo adaptive's length and %.2fx the reference's; host peak %s measured, %s predicted\n",
                a["kv_host_layers"].get<int>(), a.value("kv_recompute_layers", 0),
                a.value("recompute_tensors", std::string("none")).c_str(),
                format_bytes(j["host_budget_bytes"].get<double>()).c_str(),
                j["sppo_auto_over_adaptive_length"].get<double>(), j.value("sppo_auto_over_reference_length", 0.0),
                format_bytes(a["peak_host_bytes"].get<double>()).c_str(),
                format_bytes(a["predicted_peak_host_bytes"].get<double>()).c_str());
  }
  if (j.contains("sppo_layer_over_auto_length"))
    std::printf("sppo layer (the layer-major backward) trains %.2fx sppo auto's length\n",
                j["sppo_layer_over_auto_length"].get<double>());
  if (j.contains("sppo_layer_measured_over_simulated_at_max"))
    std::printf("at its longest, sppo layer's step took %.3fx the simulated time\n",
                j["sppo_layer_measured_over_simulated_at_max"].get<double>());
  if (j.contains("sppo_layer_host_over_auto_length")) {
    const auto& r = j["modes"]["sppo_layer_host"];
    const auto& a = r["at_max"];
    std::printf("sppo layer host (the layer-major backward; residual gradients, weights and optimizer state on the "
                "host; partition adaptive) trains %s%.2fx sppo auto's length; host peak %s measured, %s predicted\n",
                r.value("max_seq_len_is_cap", false) ? "at least " : "",
                j["sppo_layer_host_over_auto_length"].get<double>(),
                format_bytes(a["peak_host_bytes"].get<double>()).c_str(),
                format_bytes(a["predicted_peak_host_bytes"].get<double>()).c_str());
    if (r.contains("predicted_max_seq_len")) {
      const auto& au = j["modes"]["sppo_auto"];
      std::printf("predicted longest (no step): sppo layer host %s%lld tokens; sppo auto with its partition (adaptive) "
                  "%s%lld\n",
                  r.value("predicted_max_seq_len_is_cap", false) ? "at least " : "",
                  (long long)r["predicted_max_seq_len"].get<i64>(),
                  au.value("predicted_max_seq_len_partition_adaptive_is_cap", false) ? "at least " : "",
                  (long long)au.value("predicted_max_seq_len_partition_adaptive", i64{0}));
    }
  }
  if (j.contains("sppo_layer_host_measured_over_simulated_at_max"))
    std::printf("at its longest, sppo layer host's step took %.3fx the simulated time\n",
                j["sppo_layer_host_measured_over_simulated_at_max"].get<double>());
  if (j.contains("sppo_auto_measured_over_simulated_at_max"))
    std::printf("at its longest, sppo auto's step took %.3fx the simulated time\n",
                j["sppo_auto_measured_over_simulated_at_max"].get<double>());
  if (j.contains("sppo_auto_step_time_over_adaptive_at_its_max"))
    std::printf("at sppo adaptive's longest length, sppo auto takes %.3fx its step time\n",
                j["sppo_auto_step_time_over_adaptive_at_its_max"].get<double>());
  if (j.contains("bench_s")) std::printf("the bench took %.1f minutes\n", j["bench_s"].get<double>() / 60);
}

void print_bench_offload(const nlohmann::json& j) {
  std::printf("offload modes at S = %lld, N = %d (%s; adaptive under a %s budget)\n", (long long)j["seq_len"].get<i64>(),
              j["subseqs"].get<int>(), j["model"].get<std::string>().c_str(),
              format_bytes(j["adaptive_budget_bytes"].get<double>()).c_str());
  std::printf("| offload | step s | peak (measured) | peak (predicted) | error | offloaded | exposed copy s |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (const char* m : {"none", "full", "paper", "adaptive"}) {
    const auto& r = j["modes"][m];
    const double peak = r["peak_device_bytes"].get<double>(), pred = r["predicted_peak_device_bytes"].get<double>();
    std::printf("| %s | %.3f | %s | %s | %+.1f%% | %s | %.3f |\n", m, r["step_time_s"].get<double>(),
                format_bytes(peak).c_str(), format_bytes(pred).c_str(), 100.0 * (pred - peak) / peak,
                format_bytes(r["offloaded_bytes"].get<double>()).c_str(), r["exposed_copy_s"].get<double>());
  }
  std::printf("adaptive / none step time: %.3f\n", j["adaptive_over_none_step_time"].get<double>());
  for (const char* m : {"paper", "adaptive"}) {
    std::printf("%s alpha:", m);
    for (const auto& a : j["modes"][m]["alpha"]) std::printf(" %.3f", a.get<double>());
    std::printf("\n");
  }
}

}  // namespace sppo
