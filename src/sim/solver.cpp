#include "sim/solver.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "core/check.h"
#include "planner/partition.h"
#include "sim/baselines.h"

namespace sppo::sim {

using sched::MemoryRules;
using sched::Schedule;

OffloadMode parse_offload(const std::string& text) {
  if (text == "none") return OffloadMode::None;
  if (text == "full") return OffloadMode::Full;
  if (text == "adaptive") return OffloadMode::Adaptive;
  SPPO_CHECK(false, "planner") << "--offload must be none, full or adaptive (got '" << text << "')";
  return OffloadMode::Adaptive;
}

MemoryRules memory_rules(const ModelConfig& c, ActPrecision precision, bool zero) {
  MemoryRules m;
  m.model = c;
  m.precision = precision;
  m.zero = zero;
  m.weight_copy_bytes = precision == ActPrecision::BF16 ? 2 : 0;
  return m;
}

MemoryRules memory_rules(const ModelConfig& c, ActPrecision precision, const StepShape& shape) {
  MemoryRules m = memory_rules(c, precision, shape.zero);
  m.block_scratch = shape.block_scratch;
  m.head_scratch = shape.head_scratch;
  return m;
}

sched::Schedule build_step(const ModelConfig& c, const std::vector<i64>& lengths, const std::vector<double>& alpha,
                           const StepShape& shape) {
  if (shape.pp * shape.dp == 1) return sched::build_single(c.layers, lengths, alpha);
  sched::PipelineSpec spec;
  spec.layers = c.layers;
  spec.lengths = lengths;
  spec.alpha = alpha;
  spec.pp = shape.pp;
  spec.dp = shape.dp;
  spec.stage_layers = shape.stage_layers;
  return sched::build_pipeline(spec);
}

std::vector<double> paper_alpha(const std::vector<i64>& lengths, int layers, bool head, int sp,
                                const CostModel& cost, const MemoryRules& rules) {
  const int N = int(lengths.size());
  std::vector<double> a(N, 0.0);
  const ModelConfig& c = rules.model;
  const i64 unit_pt = offloadable_bytes_per_token(c, rules.precision);
  const i64 head_pt = total_bytes(head_saved_specs(c, 1, rules.precision));
  i64 o = 0;
  for (int i = 0; i + 1 < N; ++i) {
    o += lengths[i];
    const i64 t = (lengths[i] + sp - 1) / sp, t1 = (lengths[i + 1] + sp - 1) / sp;
    const double A = double(t) * (double(layers) * unit_pt + (head ? head_pt : 0));
    double fwd = layers * cost.layer_forward_s(o, lengths[i + 1], 0, t1, sp);
    if (head) fwd += cost.head_flops(t1) / cost.gemm_rate();
    a[i] = A > 0 ? std::min(1.0, cost.hw().d2h_bw * fwd / A) : 0.0;
  }
  return a;
}

namespace {

std::string bytes_text(i64 b) { return format_bytes(double(b)); }

}  // namespace

AlphaResult solve_alpha(const std::function<Schedule(const std::vector<double>&)>& build,
                        const std::vector<double>& paper, const CostModel& cost, const MemoryRules& rules,
                        i64 budget, OffloadMode mode) {
  const int N = int(paper.size());
  const i64 host_limit = cost.hw().host_memory;
  auto eval = [&](const std::vector<double>& alpha, const char* rule) {
    const SimResult r = simulate(build(alpha), cost, rules);
    AlphaResult a;
    a.alpha = alpha;
    a.peak_device_bytes = r.peak_device_bytes;
    a.step_time_s = r.step_time_s;
    a.exposed_copy_s = r.exposed_copy_s;
    a.rule = rule;
    a.fits = r.peak_device_bytes <= budget && (host_limit == 0 || r.peak_host_bytes <= host_limit);
    if (r.peak_device_bytes > budget)
      a.reason = "peak device memory " + bytes_text(r.peak_device_bytes) + " exceeds the budget of " +
                 bytes_text(budget);
    else if (!a.fits)
      a.reason = "offloaded bytes " + bytes_text(r.peak_host_bytes) + " exceed the host memory of " +
                 bytes_text(host_limit) + " per device";
    return a;
  };
  std::vector<double> zeros(N, 0.0), full(N, 1.0);
  full.back() = 0;
  if (mode == OffloadMode::None) return eval(zeros, "none");
  if (mode == OffloadMode::Full) return eval(full, "full");

  // No copies is never slower than the paper's rule (copies only add), so a fitting
  // alpha = 0 is the optimum.
  AlphaResult none = eval(zeros, "none");
  if (none.fits) return none;
  const AlphaResult by_paper = eval(paper, "paper");

  auto mix = [&](double lam, bool beyond) {
    std::vector<double> a(N);
    for (int i = 0; i < N; ++i) a[i] = beyond ? paper[i] + lam * (1 - paper[i]) : lam * paper[i];
    a.back() = 0;
    return a;
  };
  const bool beyond = !by_paper.fits;
  AlphaResult best;
  if (beyond) {
    best = eval(full, "full");
    if (!best.fits) {
      best.reason += " even with alpha = 1 for every subsequence but the last (the KV cache and the "
                     "dK/dV accumulators stay on the device); use more subsequences or devices, or a "
                     "larger budget";
      return best;
    }
  } else {
    best = by_paper;
  }
  double lo = 0, hi = 1;  // hi fits, lo does not
  for (int it = 0; it < 6 && hi - lo > 1.0 / 64; ++it) {
    const double mid = (lo + hi) / 2;
    AlphaResult a = eval(mix(mid, beyond), beyond ? "beyond paper" : "scaled paper");
    if (a.fits) {
      hi = mid;
      if (a.step_time_s <= best.step_time_s * (1 + 1e-9) || beyond) best = a;
    } else {
      lo = mid;
    }
  }
  if (!beyond && by_paper.step_time_s < best.step_time_s) best = by_paper;
  return best;
}

AlphaResult solve_alpha_single(const ModelConfig& c, const std::vector<i64>& lengths, const HardwareProfile& hw,
                               ActPrecision precision, i64 budget, OffloadMode mode, const StepShape& shape) {
  SPPO_CHECK(!lengths.empty(), "planner") << "no subsequences";
  const MemoryRules rules = memory_rules(c, precision, shape);
  const CostModel cost(hw, c, precision);
  auto build = [&](const std::vector<double>& a) { return build_step(c, lengths, a, shape); };
  sched::PipelineSpec spec;
  spec.layers = c.layers;
  spec.pp = shape.pp;
  spec.stage_layers = shape.stage_layers;
  const auto first = sched::stage_ranges(spec).front();
  return solve_alpha(build, paper_alpha(lengths, first.second - first.first, shape.pp == 1, 1, cost, rules), cost,
                     rules, budget, mode);
}

FitSearch smallest_fitting_n(const ModelConfig& c, i64 S, const HardwareProfile& hw, ActPrecision precision,
                             i64 budget, bool flops_balanced, int min_n, int max_n, const StepShape& shape) {
  // Note [Searching N]: the peak falls roughly as 1/N towards the K/V cache and dK/dV
  // accumulators, which no N removes. N grows by a quarter per try until one fits, then
  // bisection finds the smallest fitting N below it; when the least peak has not improved
  // by 1% over four tries, nothing larger will fit either.
  FitSearch f;
  min_n = std::max(1, min_n);
  max_n = int(std::min<i64>(max_n, S));
  auto lengths_of = [&](int n) {
    return flops_balanced ? plan::partition_flops(c, S, n) : plan::partition_length(S, n);
  };
  auto solve = [&](int n) {
    const AlphaResult a = solve_alpha_single(c, lengths_of(n), hw, precision, budget, OffloadMode::Adaptive, shape);
    if (f.least_peak_bytes == 0 || a.peak_device_bytes < f.least_peak_bytes) {
      f.least_peak_bytes = a.peak_device_bytes;
      f.least_peak_subseqs = n;
    }
    return a;
  };
  int lo = min_n - 1, hi = -1, stale = 0;
  AlphaResult at_hi;
  for (int n = min_n; n <= max_n; n = std::max(n + 1, n + n / 4)) {
    const i64 before = f.least_peak_bytes;
    AlphaResult a = solve(n);
    if (a.fits) {
      hi = n;
      at_hi = std::move(a);
      break;
    }
    lo = n;
    stale = before > 0 && f.least_peak_bytes > before * 0.99 ? stale + 1 : 0;
    if (stale >= 4) break;
  }
  if (hi < 0) {
    std::ostringstream os;
    os << "no N in [" << min_n << ", " << max_n << "] fits " << format_bytes(double(budget))
       << "; the least peak is " << format_bytes(double(f.least_peak_bytes)) << " at N = " << f.least_peak_subseqs;
    f.reason = os.str();
    return f;
  }
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    AlphaResult a = solve(mid);
    if (a.fits) {
      hi = mid;
      at_hi = std::move(a);
    } else {
      lo = mid;
    }
  }
  f.found = true;
  f.subseqs = hi;
  f.lengths = lengths_of(hi);
  f.alpha = std::move(at_hi);
  return f;
}

namespace {

// The search's reach (solve_sppo): subsequences per sequence, and the longest subsequence
// share per device it starts from (it also tries 8K, 4K and 2K).
constexpr i64 kMaxPlanSubseqs = 4096;
constexpr i64 kMaxTokensPerSubseq = 16384;

ActPrecision precision_of(const HardwareProfile& hw) {
  return hw.precision == "f32" ? ActPrecision::F32 : ActPrecision::BF16;
}

sched::PipelineSpec spec_of(const plan::Plan& p) {
  sched::PipelineSpec s;
  s.layers = p.model.layers;
  s.lengths = p.lengths;
  s.alpha = p.alpha;
  s.pp = p.pp;
  s.sp = p.sp;
  s.dp = p.dp;
  s.msp = p.msp;
  s.stage_layers = p.stage_layers;
  return s;
}

struct Candidate {
  plan::Plan plan;
  AlphaResult alpha;
};

// Evaluates one (sp, pp, dp, N, msp) layout: the best alpha under the budget.
Candidate evaluate(const PlanRequest& req, plan::Plan p, const CostModel& cost, const MemoryRules& rules,
                   i64 budget) {
  sched::PipelineSpec spec = spec_of(p);
  spec.dp = 1;  // replicas are identical: the search simulates one, the final check all
  const auto ranges = sched::stage_ranges(spec);
  int most = 0;
  for (auto [b, e] : ranges) most = std::max(most, e - b);
  const auto paper = paper_alpha(p.lengths, most, p.pp == 1, p.sp, cost, rules);
  auto build = [&](const std::vector<double>& a) {
    sched::PipelineSpec s = spec;
    s.alpha = a;
    return sched::build_pipeline(s);
  };
  Candidate c{p, solve_alpha(build, paper, cost, rules, budget, req.offload)};
  c.plan.alpha = c.alpha.alpha;
  c.plan.alpha_rule = c.alpha.rule;
  return c;
}

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int k = 1; k <= n; ++k)
    if (n % k == 0) d.push_back(k);
  return d;
}

PlanOutcome solve_sppo(const PlanRequest& req) {
  const ModelConfig& c = req.model;
  HardwareProfile hw = req.hw;
  hw.devices_per_node = req.gpus_per_node;
  const ActPrecision prec = precision_of(hw);
  const MemoryRules rules = memory_rules(c, prec);
  const CostModel cost(hw, c, prec);
  const i64 budget = req.budget > 0 ? req.budget : hw.usable_memory();
  const i64 S = req.seq_len;
  const int G = req.gpus, gpn = req.gpus_per_node;
  PlanOutcome out;

  // Weights alone: even split over the most stages possible.
  const int max_pp = std::min(G, c.layers);
  const i64 least_weights = sched::param_count(c, 0, (c.layers + max_pp - 1) / max_pp, true, max_pp == 1) *
                            rules.param_state_bytes;
  if (least_weights > budget) {
    out.error = "weights, gradients and optimizer state alone need " + format_bytes(double(least_weights)) +
                " per device even over " + std::to_string(max_pp) + " pipeline stages, more than the budget of " +
                format_bytes(double(budget));
    return out;
  }

  // The LM head in layers' worth of compute, over the whole sequence (Note [Stage split]:
  // the last stage runs it after every forward, so it gets fewer layers).
  auto head_layers = [&](const std::vector<i64>& lengths, int sp) {
    double layer = 0, head = 0;
    i64 o = 0;
    for (i64 l : lengths) {
      const i64 t = l / sp;
      layer += cost.layer_forward_s(o, l, 0, t, sp) + cost.layer_backward_s(o, l, 0, t, sp);
      head += cost.head_flops(t) / hw.gemm_flops;
      o += l;
    }
    return layer > 0 ? head / layer : 0.0;
  };
  std::vector<Candidate> fits;
  std::vector<plan::Plan> layouts;
  std::string last_reason;
  i64 least_peak = 0;
  for (int sp : divisors(std::min(G, gpn))) {
    if (G % sp) continue;
    for (int dp : divisors(G / sp)) {
      const int pp = G / sp / dp;
      if (pp > c.layers) continue;
      for (i64 per_device : {kMaxTokensPerSubseq, i64(8192), i64(4096), i64(2048)}) {
        const i64 n64 = std::max<i64>(1, S / (i64(sp) * per_device));
        if (n64 > kMaxPlanSubseqs || n64 * sp > S) continue;
        const int N = int(n64);
        plan::Plan p;
        p.system = "sppo";
        p.model_name = req.model_name;
        p.model = c;
        p.hardware = req.hardware;
        p.seq_len = S;
        p.gpus = G;
        p.gpus_per_node = gpn;
        p.sp = sp;
        p.pp = pp;
        p.dp = dp;
        p.subseqs = N;
        p.lengths = plan::partition_flops(c, S, N);
        if (p.lengths.back() < sp) continue;
        p.msp = req.msp == 1 && pp > 1 && N >= pp;
        if (req.msp == 1 && !p.msp) continue;
        p.offload = req.offload == OffloadMode::None ? "none" : req.offload == OffloadMode::Full ? "full" : "adaptive";
        p.budget = budget;
        p.stage_layers = plan::balanced_stage_layers(c.layers, pp, head_layers(p.lengths, sp));
        layouts.push_back(p);
      }
    }
  }
  // Note [Pruning the search]: two bounds skip simulations that cannot win.
  //  - memory: at the end of B(N-1) a stage holds its weights, the K/V of every other
  //    subsequence and the dK/dV accumulators of every layer, whatever alpha is;
  //  - time: a step takes at least its compute (forward + backward of the stage's layers
  //    on every subsequence) times 1 + (P-1)/N without MSP.
  // Layouts are tried in order of the time bound, so the second prunes most of the rest.
  const i64 kv_acc_pt = skeletal_bytes_per_token(c, prec) + 2 * i64(c.hidden) * rules.accum_bytes;
  auto bounds = [&](const plan::Plan& p) {
    const int n_s = *std::max_element(p.stage_layers.begin(), p.stage_layers.end());
    const i64 weights = sched::param_count(c, 0, n_s, true, p.pp == 1) * rules.param_state_bytes;
    const i64 mem = weights + i64(n_s) * kv_acc_pt * ((S - p.lengths.back()) / p.sp);
    double compute = 0;
    i64 o = 0;
    for (i64 l : p.lengths) {
      const i64 t = l / p.sp;
      compute += n_s * (cost.layer_forward_s(o, l, 0, t, p.sp) + cost.layer_backward_s(o, l, 0, t, p.sp));
      o += l;
    }
    const double step = compute * (p.msp ? 1.0 : 1.0 + double(p.pp - 1) / p.subseqs);
    return std::make_pair(mem, double(S) * p.dp / (G * step));
  };
  std::sort(layouts.begin(), layouts.end(),
            [&](const plan::Plan& a, const plan::Plan& b) { return bounds(a).second > bounds(b).second; });
  double best_tput = 0;
  for (const plan::Plan& p : layouts) {
    {
      {
        const auto [mem_bound, tput_bound] = bounds(p);
        if (mem_bound > budget) {
          if (least_peak == 0 || mem_bound < least_peak) {
            least_peak = mem_bound;
            last_reason = "weights, the K/V cache and the dK/dV accumulators alone need " +
                          format_bytes(double(mem_bound)) + " with " + std::to_string(p.sp) + "-way SP and " +
                          std::to_string(p.pp) + " stages";
          }
          continue;
        }
        if (tput_bound <= best_tput) continue;
        Candidate cand = evaluate(req, p, cost, rules, budget);
        if (cand.alpha.fits) {
          best_tput = std::max(best_tput, double(S) * p.dp / (G * cand.alpha.step_time_s));
          fits.push_back(std::move(cand));
        } else if (least_peak == 0 || cand.alpha.peak_device_bytes < least_peak) {
          least_peak = cand.alpha.peak_device_bytes;
          last_reason = "with " + std::to_string(p.sp) + "-way SP, " + std::to_string(p.pp) + " stages and N = " +
                        std::to_string(p.subseqs) + ": " + cand.alpha.reason;
        }
      }
    }
  }
  if (layouts.empty()) {
    // Every layout needs more subsequences than the search allows (or has subsequences
    // shorter than its SP degree): say which lengths it covers.
    i64 longest = 0;
    for (int sp : divisors(std::min(G, gpn)))
      if (G % sp == 0) longest = std::max(longest, (kMaxPlanSubseqs + 1) * kMaxTokensPerSubseq * sp - 1);
    out.error = "no layout of " + std::to_string(G) + " devices was tried for " + std::to_string(S) +
                " tokens: the planner cuts a sequence into at most " + std::to_string(kMaxPlanSubseqs) +
                " subsequences of about " + std::to_string(kMaxTokensPerSubseq) +
                " tokens per device at the longest, so the longest sequence it plans on " + std::to_string(G) +
                " devices is " + std::to_string(longest) + " tokens; use a shorter --seq-len or more --gpus";
    return out;
  }
  if (fits.empty()) {
    out.error = "no layout of " + std::to_string(G) + " devices fits " + std::to_string(S) +
                " tokens in " + format_bytes(double(budget)) + " per device; the closest: " + last_reason;
    return out;
  }
  auto tput = [&](const Candidate& a) { return double(S) * a.plan.dp / (G * a.alpha.step_time_s); };
  std::sort(fits.begin(), fits.end(), [&](const Candidate& a, const Candidate& b) { return tput(a) > tput(b); });
  // MSP when it pays: try it on the best few pipelined layouts.
  if (req.msp == -1) {
    const size_t top = std::min<size_t>(fits.size(), 3);
    for (size_t k = 0; k < top; ++k) {
      plan::Plan p = fits[k].plan;
      if (p.pp == 1 || p.subseqs < p.pp) continue;
      p.msp = true;
      bool ok = true;
      for (i64 l : p.lengths) ok &= l >= i64(p.sp) * p.pp;
      if (!ok) continue;
      Candidate cand = evaluate(req, p, cost, rules, budget);
      if (cand.alpha.fits) fits.push_back(std::move(cand));
    }
    std::sort(fits.begin(), fits.end(), [&](const Candidate& a, const Candidate& b) { return tput(a) > tput(b); });
  }
  plan::Plan best = fits.front().plan;
  const SimResult r = simulate_plan(best, hw);
  best.predicted = {r.step_time_s, r.tokens_per_device_per_s, r.bubble_ratio, r.peak_device_bytes, r.exposed_copy_s};
  if (best.sp * best.pp > gpn) best.notes.push_back("pipeline stages span nodes (SP stays inside a node)");
  if (best.msp) best.notes.push_back("MSP on: it beat the plain sequence pipeline in simulation");
  out.ok = true;
  out.plan = best;
  return out;
}

}  // namespace

Schedule plan_schedule(const plan::Plan& p) { return sched::build_pipeline(spec_of(p)); }

SimResult simulate_plan(const plan::Plan& p, const HardwareProfile& hw_in, const SimOptions& options) {
  if (p.system != "sppo") return simulate_baseline(p, hw_in, options);
  HardwareProfile hw = hw_in;
  hw.devices_per_node = p.gpus_per_node;
  const ActPrecision prec = precision_of(hw);
  return simulate(plan_schedule(p), CostModel(hw, p.model, prec), memory_rules(p.model, prec), options);
}

PlanOutcome solve_plan(const PlanRequest& req) {
  SPPO_CHECK(req.seq_len >= 1, "planner") << "--seq-len must be positive";
  SPPO_CHECK(req.gpus >= 1 && req.gpus_per_node >= 1, "planner") << "--gpus and --gpus-per-node must be positive";
  SPPO_CHECK(req.gpus <= req.gpus_per_node || req.gpus % req.gpus_per_node == 0, "planner")
      << "--gpus " << req.gpus << " is not a whole number of nodes of " << req.gpus_per_node;
  if (req.system == "sppo") return solve_sppo(req);
  if (req.system == "megatron" || req.system == "deepspeed") return solve_baseline(req);
  SPPO_CHECK(false, "planner") << "--system must be sppo, megatron or deepspeed (got '" << req.system << "')";
  return {};
}

}  // namespace sppo::sim
