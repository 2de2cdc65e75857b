#include "sim/solver.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>

#include "core/check.h"
#include "planner/partition.h"
#include "schedule/builders.h"
#include "schedule/msp.h"
#include "sim/baselines.h"

namespace sppo::sim {

using sched::MemoryRules;
using sched::Schedule;
using plan::divisors;

MemoryRules memory_rules(const ModelConfig& c, ActPrecision precision) {
  MemoryRules m;
  m.model = c;
  m.precision = precision;
  m.weight_copy_bytes = precision == ActPrecision::BF16 ? 2 : 0;
  return m;
}

MemoryRules memory_rules(const ModelConfig& c, ActPrecision precision, const StepShape& shape,
                         sched::Replicas replicas) {
  MemoryRules m = memory_rules(c, precision);
  m.zero = shape.par.zero != ZeroStage::None;
  m.zero_shards = m.zero && replicas == sched::Replicas::One ? shape.par.zero_shards() : 0;
  m.optimizer_host = shape.place.optimizer_host();
  m.block_scratch = shape.block_scratch;
  m.head_scratch = shape.head_scratch;
  return m;
}

std::vector<UnitProfile> unit_profiles(const Schedule& s, const CostModel& cost, const MemoryRules& rules) {
  const int N = int(s.lengths.size());
  std::vector<i64> offsets(N, 0);
  for (int i = 1; i < N; ++i) offsets[i] = offsets[i - 1] + s.lengths[i - 1];
  std::vector<UnitProfile> out;
  const sched::UnitSizes sizes(rules, s);
  for (int r = 0; r < s.ranks(); ++r) {
    UnitProfile u;
    u.rank = r;
    u.unit_bytes.assign(N, 0);
    u.fwd_s.assign(N, 0);
    u.bwd_s.assign(N, 0);
    // RankMemory sizes each subsequence's unit from the rank's forward ops.
    sched::RankMemory mem(rules, s, r, &sizes);
    for (int i = 0; i < N; ++i) {
      u.tensors.push_back(mem.unit_tensors(i));
      u.unit_bytes[i] = select_offload(u.tensors.back(), 1.0, nullptr);
    }
    for (const sched::Op& op : s.ops[r]) {
      if (op.kind == sched::OpKind::Forward) u.fwd_s[op.subseq] += cost.forward_s(op, s, offsets[op.subseq]);
      if (op.kind == sched::OpKind::Backward) u.bwd_s[op.subseq] += cost.backward_s(op, s, offsets[op.subseq]);
    }
    out.push_back(std::move(u));
  }
  return out;
}

namespace {

// The rank that offloads the most bytes (the first stage: it holds the most layers).
const UnitProfile& reference_rank(const std::vector<UnitProfile>& units) {
  SPPO_ASSERT(!units.empty());
  size_t best = 0;
  i64 most = -1;
  for (size_t r = 0; r < units.size(); ++r) {
    i64 sum = 0;
    for (i64 b : units[r].unit_bytes) sum += b;
    if (sum > most) most = sum, best = r;
  }
  return units[best];
}

// A device's share of host-link bandwidth when every device behind a shared link copies
// at once: what the fill order prices copies at (the simulator then shares the links as
// they are really used).
double shared_rate(const HardwareProfile& hw, double own) {
  double r = own;
  if (hw.gpus_per_pcie_switch > 1 && hw.pcie_switch_bw > 0) r = std::min(r, hw.pcie_switch_bw / hw.gpus_per_pcie_switch);
  if (hw.gpus_per_numa_node > 1 && hw.numa_host_bw > 0) r = std::min(r, hw.numa_host_bw / hw.gpus_per_numa_node);
  return r;
}

}  // namespace

// Note [The paper's alpha]: SPPO (§5.2) sizes the offload of subsequence i to take as long
// as the compute it hides behind, the next subsequence's forward; under a FLOPs-balanced
// partition that compute is the same for every subsequence, T_bal, so alpha_i A_i =
// BW_d2h T_bal is the same number of bytes for every i. Here T_bal is the reference rank's
// total forward time over N (exactly each subsequence's under a balanced partition).
// alpha is clipped to [0, 1] and made non-increasing (alpha_i <= alpha_{i-1}: an earlier
// unit stays off the device for longer, so it is never offloaded less than a later one),
// and alpha_{N-1} = 0: the last subsequence's backward comes first.
std::vector<double> paper_alpha(const std::vector<UnitProfile>& units, const CostModel& cost) {
  const UnitProfile& u = reference_rank(units);
  const int N = int(u.unit_bytes.size());
  std::vector<double> a(N, 0.0);
  double total = 0;
  for (double t : u.fwd_s) total += t;
  const double bytes = cost.hw().d2h_bw * total / std::max(1, N);
  for (int i = 0; i + 1 < N; ++i) {
    a[i] = u.unit_bytes[i] > 0 ? std::clamp(bytes / double(u.unit_bytes[i]), 0.0, 1.0) : 0.0;
    if (i > 0) a[i] = std::min(a[i], a[i - 1]);
  }
  return a;
}

namespace {

std::string bytes_text(i64 b) { return format_bytes(double(b)); }

// The searches below try many alphas that offload the same subsequences: the schedule
// last built stays, with what its simulation needs, and such an alpha only changes its
// fractions (sim::Resimulator); any other alpha builds anew, and the simulation keeps what
// does not depend on the copies. An alpha tried before (the directed fill starts from
// alpha = 0, already simulated) is answered from the results so far.
class Trials {
 public:
  using Build = std::function<Schedule(const std::vector<double>&)>;
  Trials(const Build& build, const CostModel& cost, const MemoryRules& rules)
      : build_(build), cost_(cost), rules_(rules) {}

  const Schedule& schedule(const std::vector<double>& alpha) {
    if (!sim_) sim_.emplace(build_(alpha), cost_, rules_);
    else if (!same_offloading(alpha)) sim_->replace(build_(alpha));
    else sim_->set_fractions(alpha);
    alpha_ = alpha;
    return sim_->schedule();
  }
  const SimResult& simulate(const std::vector<double>& alpha) {
    auto it = results_.find(alpha);
    if (it != results_.end()) return it->second;
    schedule(alpha);
    if (results_.size() >= kKept) results_.clear();
    return results_.emplace(alpha, sim_->simulate()).first->second;
  }
  i64 peak_floor(const std::vector<double>& alpha) {
    schedule(alpha);
    return sim_->peak_floor();
  }

 private:
  bool same_offloading(const std::vector<double>& alpha) const {
    if (alpha.size() != alpha_.size()) return false;
    for (std::size_t i = 0; i < alpha.size(); ++i)
      if ((alpha[i] > 0) != (alpha_[i] > 0)) return false;
    return true;
  }

  const Build& build_;
  const CostModel& cost_;
  const MemoryRules& rules_;
  std::optional<Resimulator> sim_;
  std::vector<double> alpha_;
  static constexpr std::size_t kKept = 32;
  std::map<std::vector<double>, SimResult> results_;
};

// Note [Filling alpha]: the cost in step time of offloading x_i bytes of subsequence i is,
// on one rank, about max(0, x_i / BW_d2h - F_{i+1}) + max(0, x_i / BW_h2d - B_{i+1}): its
// copy out hides behind the next forward, its copy back behind the next backward. So each
// alpha_i has up to three segments of rising cost per byte: free up to the smaller of the
// two breakpoints, then exposed one way, then both. The memory it buys: while F(j) or B(j)
// runs, the units on the host are those of subsequences 0..j-2 (j-1's copy is in flight,
// or it is being prefetched), so every memory constraint, wherever the peak falls, is a
// sum of alpha_i A_i over a prefix of the subsequences. For costs separable like this and
// prefix constraints, filling segments in order of cost, and within a cost earlier
// subsequences first, is optimal (an exchange argument: moving a byte of the same cost to
// an earlier subsequence covers every prefix the later one did, and more); the least
// fill that fits is then the optimum, up to the bisection's resolution (1/128 of a
// segment) and the granularity of whole tensors. Breakpoints use every rank's forward
// and backward times (the tightest) at its share of shared host links. Where the model is
// rough (MSP pieces, pipeline bubbles that hide exposed copies, contention as it really
// happens), the simulator judges every candidate, and the result is compared with the
// paper's rule and full offload.
struct Segment {
  int i;
  double from, to;
};

std::vector<Segment> fill_order(const std::vector<UnitProfile>& units, const HardwareProfile& hw, int N) {
  const double out = shared_rate(hw, hw.d2h_bw), in = shared_rate(hw, hw.h2d_bw);
  std::vector<double> b1(N, 0.0), b2(N, 0.0);
  for (int i = 0; i + 1 < N; ++i) {
    double xf = 1, xb = 1;
    for (const UnitProfile& u : units) {
      if (u.unit_bytes[i] <= 0) continue;
      xf = std::min(xf, out * u.fwd_s[i + 1] / double(u.unit_bytes[i]));
      xb = std::min(xb, in * u.bwd_s[i + 1] / double(u.unit_bytes[i]));
    }
    b1[i] = std::min(xf, xb);
    b2[i] = std::max(xf, xb);
  }
  std::vector<Segment> seg;
  for (int i = 0; i + 1 < N; ++i)
    if (b1[i] > 0) seg.push_back({i, 0, b1[i]});
  for (int i = 0; i + 1 < N; ++i)
    if (b2[i] > b1[i]) seg.push_back({i, b1[i], b2[i]});
  for (int i = 0; i + 1 < N; ++i)
    if (b2[i] < 1) seg.push_back({i, b2[i], 1});
  return seg;
}

// Note [Filling alpha], directed: from alpha = 0, simulate; at the peak of the fullest
// rank, the units that can be off the device then are those of the subsequences i whose
// next forward has ended there and whose next backward has not begun (their offload is
// complete, their prefetch not started); the peak's excess is taken from those, the
// cheapest segments first, and the step simulated again, until it fits. This follows the
// constraints that actually bind, where the plain fill order also spends bytes on
// subsequences that do not lower the peak.
struct Directed {
  bool fits = false;
  std::vector<double> alpha;
};

Directed directed_fill(Trials& trials, const std::vector<Segment>& seg, const std::vector<UnitProfile>& units,
                       int N, i64 budget) {
  Directed d;
  d.alpha.assign(N, 0.0);
  for (int it = 0; it < 3 * N + 10; ++it) {
    const SimResult& r = trials.simulate(d.alpha);
    if (r.peak_device_bytes <= budget) {
      d.fits = true;
      return d;
    }
    const int rank = r.peak_rank;
    const double t = r.peak_time_s[std::size_t(rank)];
    const auto& fe = r.forward_end[std::size_t(rank)];
    const auto& bs = r.backward_start[std::size_t(rank)];
    const auto& unit = units[std::size_t(rank)].unit_bytes;
    std::vector<bool> useful(N, false);
    for (int i = 0; i + 1 < N; ++i)
      useful[i] = unit[i] > 0 && d.alpha[i] < 1 && fe[i + 1] >= 0 && fe[i + 1] <= t && (bs[i + 1] < 0 || t < bs[i + 1]);
    // The excess, in whole tensors: alpha_i moves to the tensor boundary that covers it.
    i64 left = r.peak_device_bytes - budget;
    bool added = false;
    for (const Segment& sg : seg) {
      if (left <= 0) break;
      if (!useful[sg.i] || d.alpha[sg.i] >= sg.to) continue;
      const auto& sizes = units[std::size_t(rank)].tensors[std::size_t(sg.i)];
      const i64 A = unit[sg.i];
      const i64 now = select_offload(sizes, d.alpha[sg.i], nullptr);
      const i64 target = std::min<i64>(i64(sg.to * double(A)), std::max<i64>(now, i64(sg.from * double(A))) + left);
      i64 cum = 0;
      for (i64 b : sizes) {
        if (cum >= target) break;
        cum += b;
      }
      if (cum <= now) continue;
      d.alpha[sg.i] = std::min(1.0, double(cum) / double(A));
      left -= cum - now;
      added = true;
    }
    if (!added) return d;
  }
  return d;
}

// Takes back, from the subsequences whose alpha is past its free breakpoint (the later
// first), the whole tensors the fill added that the budget does not need: the least
// boundary that still fits, by bisection over the tensors of the peak rank's unit.
void trim(std::vector<double>* alpha, Trials& trials, const std::vector<Segment>& seg,
          const std::vector<UnitProfile>& units, i64 budget) {
  const int N = int(alpha->size());
  std::vector<double> free_to(N, 0.0);
  for (const Segment& sg : seg)
    if (sg.from == 0) free_to[sg.i] = sg.to;
  const UnitProfile& u = reference_rank(units);
  for (int i = N - 2; i >= 0; --i) {
    if ((*alpha)[i] <= free_to[i] || u.unit_bytes[i] <= 0) continue;
    const auto& sizes = u.tensors[std::size_t(i)];
    const double A = double(u.unit_bytes[i]);
    std::vector<double> bound;  // alpha at each tensor boundary above the free part
    i64 cum = 0;
    for (i64 b : sizes) {
      cum += b;
      const double a = double(cum) / A;
      if (a > free_to[i] && a < (*alpha)[i]) bound.push_back(a);
    }
    // bound ascending; the largest index that fails sits below the answer.
    int lo = -1, hi = int(bound.size());  // hi: the current alpha (fits)
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      std::vector<double> a = *alpha;
      a[i] = bound[std::size_t(mid)];
      if (trials.simulate(a).peak_device_bytes <= budget) hi = mid;
      else lo = mid;
    }
    if (hi < int(bound.size())) (*alpha)[i] = bound[std::size_t(hi)];
  }
}

// alpha with segments [0, k) applied and segment k to fraction f.
std::vector<double> filled(const std::vector<Segment>& seg, int N, size_t k, double f) {
  std::vector<double> a(N, 0.0);
  for (size_t j = 0; j < seg.size() && j <= k; ++j) {
    const Segment& s = seg[j];
    a[s.i] = j < k ? s.to : s.from + f * (s.to - s.from);
  }
  return a;
}

AlphaResult solve_alpha_floored(const std::function<Schedule(const std::vector<double>&)>& build, int N,
                                const CostModel& cost, const MemoryRules& rules, i64 budget, OffloadMode mode,
                                double no_use_s, i64* floor_seen, double* least_seen) {
  Trials trials(build, cost, rules);
  const i64 host_limit = cost.hw().host_memory;
  auto eval = [&](const std::vector<double>& alpha, const char* rule) {
    const SimResult& r = trials.simulate(alpha);
    AlphaResult a;
    a.alpha = alpha;
    a.peak_device_bytes = r.peak_device_bytes;
    a.step_time_s = r.step_time_s;
    a.exposed_copy_s = r.exposed_copy_s;
    a.host_bytes = r.peak_host_bytes;
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
  auto paper_of = [&] { return paper_alpha(unit_profiles(trials.schedule(zeros), cost, rules), cost); };
  if (mode == OffloadMode::Paper) return eval(paper_of(), "paper");
  // Note [A floor under the peak] (simulator.cpp): a layout whose floor at the largest
  // fractions exceeds the budget fits at no alpha, which one walk of its events tells
  // rather than two simulations. Until some layout fits, most layouts tried do not, so the
  // floor comes first; after, most are ruled out by their alpha = 0 step, which comes first
  // then, and the floor only before the full-offload trial (on the schedule it builds).
  auto over_floor = [&]() -> std::optional<AlphaResult> {
    const i64 floor = trials.peak_floor(full);
    *floor_seen = floor;
    if (floor <= budget) return std::nullopt;
    AlphaResult a;
    a.alpha = full;
    a.rule = "full";
    a.peak_device_bytes = floor;
    a.reason = "peak device memory of at least " + bytes_text(floor) + " exceeds the budget of " +
               bytes_text(budget) + " even with alpha = 1 for every subsequence but the last (the KV cache and the "
               "dK/dV accumulators stay on the device); use more subsequences or devices, or a larger budget";
    return a;
  };
  if (no_use_s == 0)
    if (auto a = over_floor()) return *a;
  // No copies is never slower (copies only add), so a fitting alpha = 0 is the optimum.
  AlphaResult none = eval(zeros, "none");
  *least_seen = none.step_time_s;
  if (none.fits) return none;
  if (no_use_s > 0 && none.step_time_s >= no_use_s) {
    none.fits = false;
    none.slow = true;
    none.reason = "alpha = 0 already takes " + std::to_string(none.step_time_s) + " s, no faster than " +
                  std::to_string(no_use_s) + " s";
    return none;
  }
  const std::vector<UnitProfile> units = unit_profiles(trials.schedule(zeros), cost, rules);
  const std::vector<double> paper = paper_alpha(units, cost);
  if (no_use_s > 0)
    if (auto a = over_floor()) return *a;
  // The searches below look for the least offload that fits the device budget, which is
  // also the least host memory; a host limit then decides whether that fits too (full
  // offload may fit the device and not the host, while less offload fits both).
  auto fits_device = [&](const AlphaResult& a) { return a.peak_device_bytes <= budget; };
  AlphaResult best = eval(full, "full");
  if (!fits_device(best)) {
    best.reason += " even with alpha = 1 for every subsequence but the last (the KV cache and the "
                   "dK/dV accumulators stay on the device); use more subsequences or devices, or a "
                   "larger budget";
    return best;
  }
  auto better = [](const AlphaResult& a, const AlphaResult& b) {
    if (!a.fits) return false;
    if (!b.fits) return true;
    if (a.step_time_s < b.step_time_s * (1 - 1e-9)) return true;
    return a.step_time_s <= b.step_time_s * (1 + 1e-9) && a.host_bytes < b.host_bytes;
  };
  const AlphaResult by_paper = eval(paper, "paper");
  if (better(by_paper, best)) best = by_paper;

  // Note [Filling alpha]: the fill directed by the binding peaks, and the least plain fill
  // that fits.
  const std::vector<Segment> seg = fill_order(units, cost.hw(), N);
  {
    Directed d = directed_fill(trials, seg, units, N, budget);
    if (d.fits) {
      // Trimming takes back copies that cost time; where the fill already runs at alpha =
      // 0's time its copies cost none, and the least fill below decides the host's bytes.
      if (trials.simulate(d.alpha).step_time_s > none.step_time_s * (1 + 1e-9))
        trim(&d.alpha, trials, seg, units, budget);
      AlphaResult a = eval(d.alpha, "directed");
      if (better(a, best)) best = a;
    }
  }
  // The least plain fill: where the directed one already runs at alpha = 0's time, no
  // alpha is faster (copies only add), and the plain fill could only offload a little less
  // (the host's bytes, which break ties, and a dozen simulations of the whole step).
  const bool at_least_time = best.fits && best.step_time_s <= none.step_time_s * (1 + 1e-9);
  if (!seg.empty() && !at_least_time) {
    auto rule_of = [&](size_t k) {
      const Segment& s = seg[k];
      return s.from == 0 ? "hidden" : "exposed";
    };
    // Smallest k whose segment, fully applied, fits (it does at the end: alpha = full).
    size_t lo = 0, hi = seg.size() - 1;
    AlphaResult at_hi;
    bool have_hi = false;
    while (lo < hi) {
      const size_t mid = (lo + hi) / 2;
      AlphaResult a = eval(filled(seg, N, mid, 1.0), rule_of(mid));
      if (fits_device(a)) {
        hi = mid;
        at_hi = std::move(a);
        have_hi = true;
      } else {
        lo = mid + 1;
      }
    }
    if (!have_hi) {
      at_hi = eval(filled(seg, N, hi, 1.0), rule_of(hi));
    }
    if (fits_device(at_hi)) {
      // The least part of segment hi that fits.
      double flo = 0, fhi = 1;
      for (int it = 0; it < 7; ++it) {
        const double mid = (flo + fhi) / 2;
        AlphaResult a = eval(filled(seg, N, hi, mid), rule_of(hi));
        if (fits_device(a)) {
          fhi = mid;
          at_hi = std::move(a);
        } else {
          flo = mid;
        }
      }
      if (better(at_hi, best)) best = at_hi;
    }
  }
  return best;
}

}  // namespace

AlphaResult solve_alpha(const std::function<Schedule(const std::vector<double>&)>& build, int N,
                        const CostModel& cost, const MemoryRules& rules, i64 budget, OffloadMode mode,
                        double no_use_s) {
  SPPO_CHECK(N >= 1, "planner") << "no subsequences";
  i64 floor = 0;
  double least = 0;
  AlphaResult a = solve_alpha_floored(build, N, cost, rules, budget, mode, no_use_s, &floor, &least);
  a.floor_bytes = floor;
  a.least_step_s = least;
  return a;
}

AlphaResult solve_alpha_single(const ModelConfig& c, const std::vector<i64>& lengths, const HardwareProfile& hw,
                               ActPrecision precision, i64 budget, OffloadMode mode, const StepShape& shape) {
  SPPO_CHECK(!lengths.empty(), "planner") << "no subsequences";
  const MemoryRules rules = memory_rules(c, precision, shape);
  const CostModel cost(hw, c, precision);
  auto build = [&](const std::vector<double>& a) { return sched::build_step(c, lengths, a, shape); };
  return solve_alpha(build, int(lengths.size()), cost, rules, budget, mode);
}

FitSearch smallest_fitting_n(const ModelConfig& c, i64 S, const HardwareProfile& hw, ActPrecision precision,
                             i64 budget, bool flops_balanced, int min_n, int max_n, const StepShape& shape,
                             i64 quantum) {
  // Note [Searching N]: the peak falls roughly as 1/N towards the K/V cache and dK/dV
  // accumulators, which no N removes. N grows by a quarter per try until one fits, then
  // bisection finds the smallest fitting N below it; when the least peak has not improved
  // by 1% over four tries, nothing larger will fit either.
  FitSearch f;
  min_n = std::max(1, min_n);
  max_n = int(std::min<i64>(max_n, S));
  auto lengths_of = [&](int n) {
    return flops_balanced ? plan::partition_flops(c, S, n, quantum) : plan::partition_length(S, n);
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
  i64 least_floor = 0;  // the staleness below is judged on floors: one measure for every N
  for (int n = min_n; n <= max_n; n = std::max(n + 1, n + n / 4)) {
    AlphaResult a = solve(n);
    if (a.fits) {
      hi = n;
      at_hi = std::move(a);
      break;
    }
    lo = n;
    const i64 floor = a.floor_bytes > 0 ? a.floor_bytes : a.peak_device_bytes;
    stale = least_floor > 0 && floor > least_floor * 0.99 ? stale + 1 : 0;
    if (least_floor == 0 || floor < least_floor) least_floor = floor;
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

ActPrecision precision_of(const HardwareProfile& hw) {
  return hw.precision == "f32" ? ActPrecision::F32 : ActPrecision::BF16;
}

namespace {

// The search's reach (solve_sppo): subsequences per sequence, and the longest subsequence
// share per device it starts from (it also tries 8K, 4K and 2K).
constexpr i64 kMaxPlanSubseqs = 4096;
constexpr i64 kMaxTokensPerSubseq = 16384;

HardwareProfile plan_hardware(const HardwareProfile& hw_in, int gpus_per_node) {
  HardwareProfile hw = hw_in;
  hw.devices_per_node = gpus_per_node;
  return hw;
}

struct Candidate {
  plan::Plan plan;
  AlphaResult alpha;
};

// Evaluates one (tp, cp, pp, dp, N, msp) layout: the best alpha under the budget
// (solve_alpha's no_use_s: stop early when it cannot be faster than that).
Candidate evaluate(const PlanRequest& req, plan::Plan p, const CostModel& cost, i64 budget, double no_use_s = 0) {
  // Replicas are identical: the search simulates one, the final check all, and the weight
  // gradients' all-reduce as the whole plan runs it, over every replica (across nodes where
  // they are), even where one replica's own group is a single rank.
  CostModel priced = cost;
  priced.price_replicas(p.par.dp, p.par.ranks() / p.par.dp);
  const MemoryRules rules = plan_rules(p, cost.precision(), sched::Replicas::One);
  auto build = [&](const std::vector<double>& a) {
    return sched::build_step(p.model, p.lengths, a, p, sched::Replicas::One);
  };
  Candidate c{p, solve_alpha(build, p.subseqs, priced, rules, budget, req.offload, no_use_s)};
  c.plan.alpha = c.alpha.alpha;
  c.plan.alpha_rule = c.alpha.rule;
  return c;
}

void predict(plan::Plan* p, const HardwareProfile& hw) {
  const SimResult r = simulate_plan(*p, hw);
  p->predicted = {r.step_time_s,    r.tokens_per_device_per_s, r.bubble_ratio, r.peak_device_bytes,
                  r.exposed_copy_s, r.peak_host_bytes,         r.host_update_s};
}

// Note [MSP in the search]: MSP's split tasks run over every idle stage group (reach 0, the
// paper's) in a plan that keeps K/V on the device and recomputes nothing more, so every plan
// that fitted before is the same plan. A plan placed to save memory (K/V on the host, tensors
// recomputed, MLP tiles) splits over its own and the nearest idle group only (reach 2, Note
// [MSP reach] in schedule/msp.h): over every group, helpers borrow most stages' weights (at
// gpt-13b 512K on 128 A100s, 70 of a 96 GiB peak in 32 stages, and no fit), and searching
// those layouts took 70 s for gpt-65b at 640K. On a ring (cp > 1) MSP runs at reach 2 (over
// every group: 134 s for gpt-13b at 512K, and no fit), and so it does past
// kMspEveryGroupStages stages, where a split task has up to pp pieces, each helper
// borrowing a stage's weights (gpt-65b at 384K, tp 2 pp 64 N 96 over every group: 17 GB of
// memory and 83 s to simulate its alpha = 0, a step of 261 s; at reach 2, 0.04 s for a step
// of 84 s). --msp on searches it (with the placements that save memory, where a plan fits
// without them, on pipelines of at most kMspWiderTasks tasks a replica). --msp auto weighs
// MSP for ring-less layouts only, since on a ring it won none of the README's plans and
// doubled the time of the longest searches (gpt-7b 8M on 128 H200s: 8.0 s against 3.8):
// it simulates each such layout with MSP as well where the first placement is searched and
// the pipeline has at most kAutoMspTasks tasks a replica (pp x N; with every one, gpt-7b 4M
// on 32 A100s took 55 s against 0.6 s, and MSP gains least where N is large), and weighs
// MSP again for its cp 1 finalists. So gpt-13b at 512K on 128 A100s finds tp 8 pp 4 dp 4
// with MSP (198.0 tokens/GPU/s), which without MSP (87.02 s a step) the search prunes.
constexpr int kAutoMspTasks = 256;
constexpr const char* kMspOffNote = "MSP off (--msp off)";
constexpr int kMspEveryGroupStages = 16;
constexpr int kMspWiderTasks = 512;
int msp_search_reach(const plan::Plan& p) {
  const bool saving = !p.place.kv_layers(KvPlace::Host).empty() || !p.place.kv_layers(KvPlace::Recompute).empty() || p.place.recompute != 0 ||
                      p.place.mlp_tile_rows > 0;
  return saving || p.par.cp > 1 || p.par.pp > kMspEveryGroupStages ? 2 : 0;
}

// Layout p with MSP as the search runs it, at its reach.
plan::Plan with_msp(plan::Plan p) {
  p.par.msp.on = true;
  p.par.msp.reach = msp_search_reach(p);
  return p;
}

bool msp_possible(const plan::Plan& p) {
  // The runtime runs MSP's pieces as one ring over the stage groups' cp ranks (Note [MSP
  // pieces]), each piece's rows over the group's TP members. Recomputed K/V and the
  // attention recomputed in backward need a rank's whole rows, head_grad recomputed a
  // stage's own head: not under MSP.
  if (p.par.pp == 1 || p.subseqs < p.par.pp || !p.place.kv_layers(KvPlace::Recompute).empty() ||
      (p.place.recompute & (kAttentionGroup | kHeadGradGroup)))
    return false;
  for (i64 l : p.lengths)
    if (l < i64(p.par.cp) * p.par.pp * p.par.tp) return false;
  return true;
}

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g s", s);
  return buf;
}

// How a layer runs on each piece busiest_piece_s weighs (its arguments after `layout`).
struct PieceOptions {
  int tp = 1;
  KvPlace kv = KvPlace::Device;
  bool last = false;
};
// Forward (backward) seconds of one layer on the busiest piece of a subsequence [o, o+l)
// split over `cp` ring ranks laid out by `layout`, each piece's layer split over `run.tp`
// tensor-parallel ranks (CostModel::forward_s: compute over tp, ten collectives). With the
// K/V streamed (run.kv Host or Recompute), what the attention does not hide of the earlier
// rows' chunks (CostModel::layer_stream_s; `run.last`: the sequence's last subsequence,
// whose backward finds no sums on the host).
double busiest_piece_s(const CostModel& cost, i64 o, i64 l, int cp, RingLayout layout, const PieceOptions& run = {}) {
  const int tp = run.tp;
  double most = 0;
  for (int r = 0; r < cp; ++r) {
    const sched::Spans piece = sched::piece_spans(l, r, cp, cp > 1 ? layout : RingLayout::Contiguous);
    const double overhead = 2 * cost.hw().layer_overhead;
    const double t = cost.layer_forward_s(o, piece, l) + cost.layer_backward_s(o, piece, l) - overhead;
    double streamed = 0;
    if (run.kv != KvPlace::Device) {
      const bool rc = run.kv == KvPlace::Recompute;
      const CostModel::StreamedLayer forward{.recompute_kv = rc};
      const CostModel::StreamedLayer backward{.recompute_kv = rc, .backward = true, .sums_back = !run.last};
      streamed = cost.layer_stream_s(o, piece, l, cp, tp, forward) + cost.layer_stream_s(o, piece, l, cp, tp, backward);
    }
    most = std::max(most, t / tp + overhead + 10 * cost.tp_collective_s(sched::span_tokens(piece), tp) + streamed);
  }
  return most;
}

// solve_sppo's search, in passes. A SearchContext holds what the request fixes, a
// SearchState what the searches learn and keep from one to the next. The passes, in the
// order a plan goes through them:
//  1. layouts (layout_pass): every (tp, cp, dp, pp) and the N of each the search considers;
//  2. placements (placement_pass): each layout under each placement of its tensors (K/V,
//     recompute set, MLP tiles) and MSP setting, a candidate apiece;
//  3. bounds (bound_pass): each candidate's memory, host and throughput bounds, which rule
//     candidates out and set the order the next pass tries them in;
//  4. alpha (alpha_pass): the candidates the bounds leave, simulated for their best alpha
//     (offload ratios) under the budget, pruned as faster plans are found;
//  5. ranking (rank_pass): the fastest that fit, MSP weighed for the best few, and the
//     notes that explain the plan (or why nothing fits).
// Passes 2 to 4 run once a search (search()), and solve_sppo runs up to four searches:
// the first placement, the wider ones, and both again with the optimizer state on the host.

// What the request fixes for every pass.
struct SearchContext {
  explicit SearchContext(const PlanRequest& r)
      : req(r),
        c(r.model),
        hw(plan_hardware(r.hw, r.gpus_per_node)),
        prec(precision_of(hw)),
        rules(memory_rules(c, prec)),
        cost(hw, c, prec),
        budget(r.budget > 0 ? r.budget : hw.usable_memory()),
        S(r.seq_len),
        G(r.gpus),
        gpn(r.gpus_per_node),
        host_allowed(r.place.optimizer_state != Tier::Device),
        kv_pt(skeletal_bytes_per_token(c, prec)),
        acc_pt(2 * i64(c.kv_width()) * rules.accum_bytes),
        saved_table(block_saved_specs(c, 1, prec)),
        host_limit(hw.host_memory) {}
  SearchContext(const SearchContext&) = delete;
  SearchContext& operator=(const SearchContext&) = delete;

  const PlanRequest& req;
  const ModelConfig& c;
  const HardwareProfile hw;
  const ActPrecision prec;
  const MemoryRules rules;
  const CostModel cost;
  const i64 budget;
  const i64 S;
  const int G, gpn;
  // Note [Optimizer state under a budget]: the fp32 master weights and AdamW m, v stay
  // on the device unless --optimizer-state says host, or, under auto, no plan fits with
  // them there (every layout, K/V placement and recompute level tried): moving them costs
  // each step its gradients' and weights' copies and the host's update (CostModel::
  // host_update_s), which only buys memory. Then the whole search runs again with the
  // state on the host, where the device keeps the weights and gradients alone.
  const bool host_allowed;
  // Bytes a token of the K/V and of their dK/dV accumulators, and a layer's saved tensors
  // (the bounds' per-token rates).
  const i64 kv_pt, acc_pt;
  const std::vector<TensorSpec> saved_table;
  const i64 host_limit;

  // Device bytes of the weights, gradients and (with `state` on the device) AdamW state of
  // `params` parameters, the state sharded `shards` ways; and the host's, with the state there.
  i64 device_fixed(i64 params, int shards, Tier state) const {
    return params * (rules.param_state_bytes - rules.optimizer_bytes) +
           (state == Tier::Host ? 0 : params * rules.optimizer_bytes / shards);
  }
  i64 host_fixed(i64 params, int shards, Tier state) const {
    return state == Tier::Host ? params / shards * rules.param_state_bytes : i64(0);
  }
  i64 unit_pt(SavedSet recompute) const {  // offloadable bytes a token, less the recomputed
    i64 b = 0;
    for (std::size_t k = 0; k < saved_table.size(); ++k)
      if (saved_table[k].role == Role::Offloadable && !in_set(recompute, int(k))) b += saved_table[k].bytes();
    return b;
  }
  // Tokens/GPU/s of layout p at a step of `step_s` seconds.
  double tput(const plan::Plan& p, double step_s) const { return double(S) * p.par.dp / (G * step_s); }
};

// The layout's sequence parallelism in words, for the reasons a search gives.
std::string sp_text(const plan::Plan& p) {
  if (p.par.tp == 1 && p.par.cp == 1 && p.par.ulysses == 1) return "no sequence parallelism";
  ParallelDims sp;  // the layout's sequence parallelism alone
  sp.tp = p.par.tp;
  sp.ulysses = p.par.ulysses;
  sp.cp = p.par.cp;
  const std::string text = layout_text(sp);
  return text.substr(0, text.find(" pp "));
}

// Takes the context; gives the error when no layout can hold even the weights: an even
// split over the most stages possible, optimizer state sharded over the rest of the
// devices when ZeRO-1 may be used.
std::optional<std::string> weights_alone_error(const SearchContext& ctx) {
  const ModelConfig& c = ctx.c;
  const int max_pp = std::min(ctx.G, c.layers);
  const int most_shards = ctx.req.zero == ZeroStage::None ? 1 : ctx.G / max_pp;
  // With the layers' weights on the host (Note [Weights in the search]), the embedding and
  // head alone.
  const bool layers_host = ctx.host_allowed && ctx.req.place.weights != Tier::Device;
  const i64 least_params =
      sched::param_count(c, 0, layers_host ? 0 : (c.layers + max_pp - 1) / max_pp, true, max_pp == 1);
  const Tier state = ctx.host_allowed ? Tier::Host : Tier::Device;  // where the optimizer state may go
  const i64 least_weights = ctx.device_fixed(least_params, layers_host ? 1 : most_shards, state);
  if (least_weights <= ctx.budget) return std::nullopt;
  return std::string(layers_host          ? "the embedding's and LM head's weights and gradients alone need "
                     : ctx.host_allowed ? "weights and gradients alone (the optimizer state on the host) need "
                                        : "weights, gradients and optimizer state alone need ") +
         format_bytes(double(least_weights)) + " per device even over " + std::to_string(max_pp) +
         " pipeline stages, more than the budget of " + format_bytes(double(ctx.budget));
}

// ---- 1. Layouts

// The LM head in layers' worth of compute, over the whole sequence (Note [Stage split]:
// the last stage runs it after every forward, so it gets fewer layers).
double head_layers(const SearchContext& ctx, const std::vector<i64>& lengths, int cp, int tp) {
  double layer = 0, head = 0;
  i64 o = 0;
  for (i64 l : lengths) {
    layer += busiest_piece_s(ctx.cost, o, l, cp, ctx.req.ring_layout, {.tp = tp});
    head += ctx.cost.head_flops((l + cp - 1) / cp) / ctx.hw.gemm_flops / tp;
    o += l;
  }
  return layer > 0 ? head / layer : 0.0;
}

// The layouts pass. Takes the context; gives every layout the search considers, as plans
// with no placement: (tp, cp, dp, pp), and N at a few sizes of subsequence per device,
// each with its FLOPs-balanced lengths and stage split. Empty where every layout needs
// more subsequences than the search allows.
std::vector<plan::Plan> layout_pass(const SearchContext& ctx) {
  const PlanRequest& req = ctx.req;
  const ModelConfig& c = ctx.c;
  const i64 S = ctx.S;
  const int G = ctx.G, gpn = ctx.gpn;
  std::vector<plan::Plan> layouts;
  // The two kinds of sequence parallelism, together inside a node (§6.1): tensor
  // parallelism with sequence-parallel regions (tp, the paper's SP) and ring attention (cp).
  for (int tp : divisors(std::min(G, gpn)))
    for (int cp : divisors(std::min(G, gpn) / tp)) {
      if (G % (cp * tp) || tp > c.heads) continue;
      if (c.llama() && !sched::llama_tp_runs(c, tp)) continue;
      for (int dp : divisors(G / cp / tp)) {
        const int pp = G / cp / tp / dp;
        if (pp > c.layers) continue;
        for (i64 per_device : {kMaxTokensPerSubseq, i64(8192), i64(4096), i64(2048)}) {
          const i64 n64 = std::max<i64>(1, S / (i64(cp) * tp * per_device));
          if (n64 > kMaxPlanSubseqs || n64 * cp * tp > S) continue;
          const int N = int(n64);
          plan::Plan p;
          p.system = plan::System::Sppo;
          p.model_name = req.model_name;
          p.model = c;
          p.hardware = req.hardware;
          p.seq_len = S;
          p.gpus = G;
          p.gpus_per_node = gpn;
          p.par.cp = cp;
          p.par.tp = tp;
          p.par.pp = pp;
          p.par.dp = dp;
          p.subseqs = N;
          p.lengths = plan::partition_flops(c, S, N);
          if (p.lengths.back() < i64(cp) * tp) continue;
          p.par.zero = req.zero.value_or(cp * dp > 1 ? ZeroStage::OptimizerState : ZeroStage::None);
          p.place.optimizer_state = req.place.optimizer_state == Tier::Host ? Tier::Host : Tier::Device;
          p.precision = ctx.prec;
          p.block_scratch = req.block_scratch;
          p.head_scratch = req.head_scratch;
          p.par.ring_layout = req.ring_layout;
          p.offload = req.offload;
          p.budget = ctx.budget;
          p.stage_layers = plan::balanced_stage_layers(c.layers, pp, head_layers(ctx, p.lengths, cp, tp));
          if (std::find_if(layouts.begin(), layouts.end(), [&](const plan::Plan& q) {
                return q.par.cp == p.par.cp && q.par.tp == p.par.tp && q.par.pp == p.par.pp && q.par.dp == p.par.dp && q.subseqs == p.subseqs;
              }) != layouts.end())
            continue;
          layouts.push_back(p);
        }
      }
    }
  return layouts;
}

// Note [Weights in the search]: the layers' weights and gradients go to the host (Note
// [Weights on the host] in schedule/weights.h) under --weights host, or under auto where no
// plan fits even with the optimizer state there: it frees 10 B a parameter of the device in
// bf16 (the fp32 weights, their working copy, the fp32 gradient) but copies every layer's
// weights in for each forward and backward that runs it, which only buys memory. It runs on
// layouts without tensor parallelism and with no ZeRO-1 (the host's master is whole on
// each rank; under --zero auto it is turned off there), and without MSP.
// Takes the layouts; gives those that can keep their weights on the host, so placed.
std::vector<plan::Plan> weights_on_host(const PlanRequest& req, const std::vector<plan::Plan>& layouts) {
  std::vector<plan::Plan> out;
  for (plan::Plan p : layouts) {
    if (p.par.tp > 1 || req.zero == ZeroStage::OptimizerState) continue;
    p.par.zero = ZeroStage::None;
    p.place.optimizer_state = Tier::Host;
    p.place.weights = Tier::Host;
    out.push_back(std::move(p));
  }
  return out;
}

// Note [Rebuilt inputs in the search]: rebuilding every other layer's input (Note [Rebuilt
// layer inputs] in schedule/builders.cpp) frees H e bytes a token of each rebuilt layer
// (less the K/V it keeps where the others recompute theirs) for a layer's forward more in
// its backward: it buys memory, and with memory fewer, longer subsequences (each
// subsequence's backward recomputes or streams the K/V of every earlier one, so near the
// limit a plan keeping every input runs hundreds of short ones and is several times
// slower). So it is searched last: where the plans found already run the layer-major order
// (which only memory makes the planner choose), against them, over the layouts searched
// last; and where nothing fits keeping every input, over each tier of layouts the
// searches before it tried (the state on the device, then on the host, then the layers'
// weights there too). In the layer-major order, with every placement whose K/V are on the
// device or recomputed, on layouts without TP, rings or MSP. A stage rebuilds its second,
// fourth, ... layers (those at odd offsets from its first), each from the one below it.

// ---- 2. Placements

// Note [Placing every tensor]: besides alpha, a plan places the K/V of its layers (kept
// on the device, on the host, or recomputed from the layer input) and the rest of each
// layer's saved tensors (kept or offloaded, or recomputed: one of recompute_levels(),
// which add groups in order of their seconds per byte saved). One placement serves every
// layer. The search runs twice: first with the K/V on the device and nothing recomputed
// beyond --recompute-tensors, then over every other placement --kv-cache and
// --recompute-tensors allow, each (layout, placement) a candidate with its own bounds,
// and the fastest that fits of both wins. The first search's best prunes most of the
// second (Note [Pruning the search]). A placement that saves memory can be faster where
// it lets a faster layout fit: gpt-65b at 640K on 128 A100s, tp 4 cp 2 pp 8 dp 2 with the
// K/V on the host and ln1, ln2 and fc_pre recomputed, 42.6 tokens/GPU/s, against 37.7 for
// the best plan that keeps the K/V on the device (tp 2 cp 4 pp 16), which was the plan
// while the second search ran only where the first found nothing. The wider search also
// runs each of those placements with the MLP in tiles of kPlanMlpTileRows rows (Note [MLP
// tiles] in core/layout.h) on layouts without tensor parallelism whose subsequences are longer:
// the workspace's [T, F] MLP activation, and a recomputed fc_pre, become [R, F]. The
// same FLOPs in GEMMs of R rows, which run at the rate of whole ones; the cost model
// prices the tiles' kernel launches (CostModel::mlp_tiles_s).
// Note [Layer-major backward in the search]: each placement runs in the paper's backward
// order and, under --backward-order auto or layer, in the layer-major order too (Note [Layer-major backward] in
// schedule/builders.cpp): the same ops in another order, so it costs the prefetches'
// smaller overlap, the residual gradients' rows and, between pipeline stages, the
// backwards' overlap (a stage sends its first gradient in its last pass), and holds one
// layer's dK/dV sums (on the device, or the host's for streamed K/V) where the paper's
// order holds every layer's. It only saves memory, so under auto a third search runs the
// layer-major twins of the candidates the first two could not fit (SearchState::settled),
// on layouts of one stage; its schedules have a B op for every (layer, subsequence), and
// searching every twin took llama-3-8b at 3584K on 8 H100s from 1.2 to 23 s of CPU.
struct Placement {
  KvPlace kv = KvPlace::Device;
  SavedSet recompute = 0;
  i64 mlp_tile_rows = 0;
  BackwardOrder backward = BackwardOrder::Subseq;
  bool rebuilt = false;  // every other layer of a stage rebuilds its input (Plan::rebuilt_inputs)
  bool operator==(const Placement&) const = default;
};

// The placements the request allows: the first search's, and the wider search's (every
// other one, then the first and those others with the MLP in tiles).
struct PlacementSets {
  Placement first;
  std::vector<Placement> wider;
  std::vector<Placement> layered;  // --backward-order auto: the first and wider in the layer-major order
  std::vector<Placement> rebuilt;  // the layer-major ones that can rebuild inputs, rebuilding them
};
PlacementSets placement_sets(const PlanRequest& req) {
  PlacementSets out;
  const auto order = req.place.backward == BackwardOrder::Layer ? BackwardOrder::Layer : BackwardOrder::Subseq;
  out.first = {req.place.kv.value_or(KvPlace::Device), req.recompute_least(), 0, order};
  const Placement& first = out.first;
  std::vector<Placement>& wider = out.wider;
  std::vector<KvPlace> kvs = {first.kv};
  if (req.place.kv == kAuto) kvs = {KvPlace::Device, KvPlace::Host, KvPlace::Recompute};
  std::vector<SavedSet> sets = {req.recompute_least()};
  if (req.recompute_auto())
    for (SavedSet level : recompute_levels())
      if (std::find(sets.begin(), sets.end(), level | req.recompute_least()) == sets.end())
        sets.push_back(level | req.recompute_least());
  for (KvPlace kv : kvs)
    for (SavedSet set : sets) {
      const Placement pl{kv, set, 0, order};
      if (!(pl == first)) wider.push_back(pl);
    }
  const std::size_t untiled = wider.size();
  wider.push_back({first.kv, first.recompute, kPlanMlpTileRows, order});
  for (std::size_t k = 0; k < untiled; ++k)
    wider.push_back({wider[k].kv, wider[k].recompute, kPlanMlpTileRows, order});
  // --backward-order auto: every placement in the layer-major order too.
  if (req.place.backward == kAuto) {
    out.layered.push_back({first.kv, first.recompute, 0, BackwardOrder::Layer});
    for (Placement pl : wider) {
      pl.backward = BackwardOrder::Layer;
      out.layered.push_back(pl);
    }
  }
  // Note [Rebuilt inputs in the search]: in the layer-major order, every placement whose
  // K/V are not on the host (the layer below a rebuilt one cannot stream them) again with
  // every other layer's input rebuilt; the rebuilt layers keep the K/V that the others
  // recompute on the host.
  if (req.place.rebuild.kind == RebuildRequest::Kind::Auto)
    for (const std::vector<Placement>* from : {&out.layered, &out.wider})
      for (Placement pl : *from)
        if (pl.backward == BackwardOrder::Layer && pl.kv != KvPlace::Host) {
          pl.rebuilt = true;
          if (std::find(out.rebuilt.begin(), out.rebuilt.end(), pl) == out.rebuilt.end()) out.rebuilt.push_back(pl);
        }
  if (req.place.rebuild.kind == RebuildRequest::Kind::Auto && out.first.backward == BackwardOrder::Layer &&
      out.first.kv != KvPlace::Host) {
    Placement pl = out.first;
    pl.rebuilt = true;
    out.rebuilt.insert(out.rebuilt.begin(), pl);
  }
  // --rebuild-inputs odd (with --backward-order layer, and K/V not on the host): every
  // placement rebuilds them.
  if (req.place.rebuild.kind == RebuildRequest::Kind::Odd) {
    SPPO_ASSERT(out.first.backward == BackwardOrder::Layer && out.first.kv != KvPlace::Host);
    out.first.rebuilt = true;
    std::erase_if(out.wider, [](const Placement& pl) { return pl.kv == KvPlace::Host; });
    for (Placement& pl : out.wider) pl.rebuilt = true;
    out.layered.clear();
  }
  return out;
}

// The layers a stage [b, e) rebuilds the inputs of: every other one from its second.
bool rebuilt_in_stage(int l, int b) { return l > b && (l - b) % 2 == 1; }

// What a layout can recompute: the attention needs a rank's whole rows (no ring, no MSP),
// head_grad a stage's own head (no MSP: Note [The loss in backward] in core/layout.h). A
// placement recomputes the rest of its set there.
SavedSet runnable(const PlanRequest& req, const plan::Plan& p) {
  SavedSet out = ~SavedSet(0);
  if (p.par.cp > 1 || req.msp == true) out &= ~kAttentionGroup;
  if (req.msp == true) out &= ~kHeadGradGroup;
  return out;
}

// Layout p under placement pl: the set it recomputes cut to what it can, its K/V placed
// on every layer.
plan::Plan placed(const PlanRequest& req, plan::Plan p, const Placement& pl) {
  p.place.recompute = pl.recompute & runnable(req, p);
  p.place.mlp_tile_rows = pl.mlp_tile_rows;
  p.place.backward = pl.backward;
  const int L = req.model.layers;
  if (pl.rebuilt) {
    p.place.inputs_rebuilt.assign(std::size_t(L), false);
    int b = 0;
    for (int n : p.stage_layers) {
      for (int l = b; l < b + n; ++l)
        if (rebuilt_in_stage(l, b)) p.place.inputs_rebuilt[std::size_t(l)] = true;
      b += n;
    }
  }
  if (pl.kv != KvPlace::Device) {
    // A rebuilt layer keeps the K/V the others recompute, on the host.
    p.place.kv.assign(std::size_t(L), pl.kv);
    for (int l = 0; l < L; ++l)
      if (pl.kv == KvPlace::Recompute && p.place.input_rebuilt(l)) p.place.kv[std::size_t(l)] = KvPlace::Host;
  }
  return p;
}

// Whether a layout can run a placement: streamed K/V are a rank's own blocks (its ring
// pieces, or an MSP owner's with its helpers'); recomputed K/V need a rank's whole rows of
// x of every earlier position (no tensor parallelism, no ring, no MSP).
bool runs(const PlanRequest& req, const plan::Plan& p, const Placement& pl) {
  // The layer-major order: not MSP's pieces; under auto, on layouts of one stage only. A
  // pipeline loses its backwards' overlap in it, and its schedules have a B op for every
  // (layer, subsequence): searching them too took llama-3-8b at 3584K on 8 H100s from 1.3
  // to 23 s of the planner's time, for no plan that won.
  if (pl.backward == BackwardOrder::Layer && (req.msp == true || (p.par.pp > 1 && req.place.backward == kAuto)))
    return false;
  if (pl.mlp_tile_rows > 0 &&
      (p.par.tp > 1 || *std::max_element(p.lengths.begin(), p.lengths.end()) <= pl.mlp_tile_rows * p.par.cp))
    return false;
  // Rebuilt inputs (Note [Rebuilt layer inputs]): without TP, rings and MSP.
  if (pl.rebuilt && (p.par.tp > 1 || p.par.cp > 1 || req.msp == true)) return false;
  if (pl.kv != KvPlace::Recompute) return true;
  return req.msp != true && p.par.tp == 1 && p.par.cp == 1;
}

// A layout as a search varies it: its index among the layouts searched, with MSP or not,
// rebuilding inputs or not, in the layer-major backward order or not.
struct Variant {
  std::size_t layout = 0;
  bool msp = false, rebuilt = false, layer_major = false;
  auto operator<=>(const Variant&) const = default;
};
// A candidate's (layout variant, K/V placement, recomputed set, MLP tile rows): what the
// pruning of the alpha pass tells candidates apart by.
struct FloorKey {
  Variant variant;
  KvPlace kv = KvPlace::Device;
  SavedSet recompute = 0;
  i64 mlp_tile_rows = 0;
  auto operator<=>(const FloorKey&) const = default;
};
// Where a search keeps the optimizer state and the layers' weights: both on the device; the
// state on the host; the weights there too.
enum class StateTier : char { Device, OptimizerHost, WeightsHost };
StateTier state_tier(const plan::Plan& p) {
  return !p.place.optimizer_host() ? StateTier::Device
         : p.place.weights_host()  ? StateTier::WeightsHost
                                   : StateTier::OptimizerHost;
}
// The candidates searched so far, with where their search kept the state.
struct Tried {
  FloorKey key;
  StateTier state = StateTier::Device;
  auto operator<=>(const Tried&) const = default;
};
using PlacementsTried = std::set<Tried>;
// Candidates of one layout variant and K/V placement, tiled or not, whose recompute sets
// nest (Note [Pruning the search], continued, below).
struct GroupKey {
  Variant variant;
  KvPlace kv = KvPlace::Device;
  bool tiled = false;
  auto operator<=>(const GroupKey&) const = default;
};

// One candidate of a search: a layout placed, with MSP or without.
// Note [Pruning the search], continued: the recompute sets are nested (each level holds
// the one before), so within one layout and K/V placement a level that does not fit
// means no lower one does. `group` names that (layout variant, K/V placement, tiled or
// not), `level` the rank of the candidate's set in it.
struct SearchCandidate {
  plan::Plan plan;
  Placement pl;
  GroupKey group;
  std::size_t level = 0;
  FloorKey key;
};

// How one search treats MSP and the plans found before it.
struct SearchOptions {
  // Under --msp auto, ring-less layouts are simulated with MSP too.
  bool weigh_msp = false;
  // Under --msp on, MSP layouts of at most that many tasks a replica (0: all).
  int msp_tasks = 0;
  // Candidates no faster than the best plan earlier searches found are of no use (the
  // layer-major twins' search); else only this search's own plans prune.
  bool prune_by_fits = false;
};

// The placements pass. Takes the layouts and the placements `pls` of one search, and the
// candidates earlier searches tried (`tried`, which it adds to); gives a candidate for
// every (layout, placement, MSP setting) a layout runs and no search has tried yet, in
// that order, MSP weighed as `options` say (SearchOptions: weigh_msp, msp_tasks).
// Every choice a candidate makes is enumerated here; a new one (a field of Placement, or a
// loop beside MSP's) enters the candidate's keys too (the variant, FloorKey, group,
// LeastStep), since the alpha pass prunes a candidate only by others that share them.
std::vector<SearchCandidate> placement_pass(const SearchContext& ctx, const std::vector<plan::Plan>& layouts,
                                            const std::vector<Placement>& pls, const SearchOptions& options,
                                            StateTier state, PlacementsTried& tried,
                                            const std::set<FloorKey>& settled) {
  const PlanRequest& req = ctx.req;
  std::vector<SearchCandidate> cands;
  // --msp on runs every layout with MSP; --msp auto, with its first placement, each
  // ring-less one both ways too (Note [MSP in the search]).
  for (std::size_t base = 0; base < layouts.size(); ++base)
    for (std::size_t q = 0; q < pls.size(); ++q) {
      const Placement& pl = pls[q];
      if (!runs(req, layouts[base], pl)) continue;
      const plan::Plan without = placed(req, layouts[base], pl);
      const bool weighed = options.weigh_msp && req.msp == kAuto && without.par.cp == 1 &&
                           without.par.pp * without.subseqs <= kAutoMspTasks;
      for (const bool msp : {false, true}) {
        if (!(msp ? req.msp == true || weighed : req.msp != true)) continue;
        if (msp && (!msp_possible(without) ||
                    (options.msp_tasks > 0 && without.par.pp * without.subseqs > options.msp_tasks)))
          continue;
        if (msp && pl.backward == BackwardOrder::Layer) continue;
        SearchCandidate cand;
        cand.plan = msp ? with_msp(without) : without;
        cand.pl = pl;
        const plan::Plan& p = cand.plan;
        // A set the layout cannot recompute whole may equal one already tried there.
        const bool layer = pl.backward == BackwardOrder::Layer;
        const Variant variant{.layout = base, .msp = msp, .rebuilt = pl.rebuilt, .layer_major = layer};
        // Its twin in the paper's order, settled: no faster in this one.
        const FloorKey twin{.variant = {.layout = base, .msp = msp, .rebuilt = pl.rebuilt, .layer_major = false},
                            .kv = pl.kv,
                            .recompute = p.place.recompute,
                            .mlp_tile_rows = pl.mlp_tile_rows};
        if (layer && settled.count(twin)) continue;
        if (msp && p.place.weights_host()) continue;  // a helper borrows a stage's weights whole
        cand.key = {variant, pl.kv, p.place.recompute, pl.mlp_tile_rows};
        if (!tried.insert({cand.key, state}).second) continue;
        cand.group = {.variant = variant, .kv = pl.kv, .tiled = pl.mlp_tile_rows > 0};
        cand.level = std::size_t(std::count_if(pls.begin(), pls.end(), [&](const Placement& o) {
          return o.kv == pl.kv && o.mlp_tile_rows == pl.mlp_tile_rows && o.backward == pl.backward &&
                 (o.recompute & pl.recompute) == o.recompute && o.recompute != pl.recompute;
        }));
        cands.push_back(std::move(cand));
      }
    }
  return cands;
}

// ---- 3. Bounds

// Note [Pruning the search]: two bounds skip simulations that cannot win.
//  - memory: at the end of B(N-1) a stage holds its weights, the K/V of every other
//    subsequence and the dK/dV accumulators of every layer, whatever alpha is (with
//    K/V streamed, the weights alone on the device); and what of those (K/V not at all
//    where they are recomputed) and of the other subsequences' kept activations the
//    device cannot hold must fit the host memory;
//  - time: a step takes at least its compute (forward + backward of the stage's layers
//    on every subsequence, on the busiest ring piece, with what it recomputes and, with
//    the K/V streamed, what the attention does not hide of the earlier rows' chunks)
//    times 1 + (P-1)/N without MSP.
// Candidates are tried in order of the time bound, so the second prunes most of the rest.
struct Bounds {
  i64 mem = 0;      // device bytes, at least
  double tput = 0;  // tokens/GPU/s, at most
  i64 host = 0;     // host bytes, at least
};

// The bounds of candidate p, placed by pl.
Bounds candidate_bounds(const SearchContext& ctx, const plan::Plan& p, const Placement& pl) {
  const ModelConfig& c = ctx.c;
  const MemoryRules& rules = ctx.rules;
  const int n_s = *std::max_element(p.stage_layers.begin(), p.stage_layers.end());
  const int shards = p.par.zero_shards();
  const i64 heads_share = TpShard{0, p.par.tp}.local_heads(c);
  const i64 before_last = (ctx.S - p.lengths.back()) / p.par.cp;
  // The paper's backward order holds every layer's dK/dV sums at the end of B(N-1); the
  // layer-major one, one layer's (and every layer's K/V) at the end of B(L-1, N-1).
  const bool layer_major = pl.backward == BackwardOrder::Layer;
  const bool on_device = pl.kv == KvPlace::Device;
  const i64 kv_dev = on_device ? ctx.kv_pt * heads_share / c.heads : 0;
  const i64 acc_dev = on_device ? ctx.acc_pt * heads_share / c.heads : 0;
  // A Recompute layer keeps no K/V, and sums its dK/dV into the layer input's gradient
  // (H fp32 a position, not 2H).
  const bool kv_kept = pl.kv != KvPlace::Recompute;
  const i64 sums_pt = kv_kept ? ctx.acc_pt : i64(c.hidden) * rules.accum_bytes;
  const i64 per_token = ctx.unit_pt(p.place.recompute) + (kv_kept ? ctx.kv_pt : 0) + (layer_major ? 0 : sums_pt);
  // A token's sums of the one layer alive; with rebuilt inputs a rebuilt layer's K/V are
  // on the host, its sums those of a Host layer (the lesser of the two kinds counts).
  const i64 once_pt = !layer_major ? 0 : pl.rebuilt && !kv_kept ? std::min(sums_pt, ctx.acc_pt) : sums_pt;
  // Note [Rebuilt layer inputs]: a rebuilt layer keeps no x but keeps its K/V (those the
  // placement recomputes, on the host).
  const i64 rebuilt_pt = i64(c.hidden) * rules.act_bytes() - (kv_kept ? 0 : ctx.kv_pt);
  const auto rebuilt_of = [&](int n) { return pl.rebuilt ? i64(n / 2) : 0; };
  const i64 head_grad_pt = in_set(p.place.recompute, kSavedHeadGrad) ? 0 : i64(c.hidden) * rules.act_bytes();
  // Stage by stage: its weights (tensor parallelism divides them and the K/V by heads;
  // member 0's shards are the largest); the device holds them with the K/V and the
  // dK/dV accumulators, whatever alpha is. What cannot be on the device is on the host:
  // when B(N-1) ends, a stage holds the saved activations, K/V and dK/dV sums of every
  // other subsequence, at least their share a member (the last stage with their head
  // gradients), less what the device holds beside its weights. Under MSP helpers hold
  // the pieces of a stage's split subsequences (msp_phases: its first pp - 1 - st and last
  // st), so the host bound counts its steady ones alone, which it holds whole once its
  // forwards end.
  i64 mem = 0, host = 0;
  int first = 0;
  const Tier state = p.place.optimizer_state;
  const int N = p.subseqs;
  for (std::size_t st = 0; st < p.stage_layers.size(); ++st) {
    const int n = p.stage_layers[st], end = first + n;
    const i64 params = p.par.tp > 1 ? sched::param_count(c, first, end, TpShard{0, p.par.tp})
                                : sched::param_count(c, first, end, first == 0, end == c.layers);
    // With the layers' weights on the host the device keeps the embedding's, final norm's
    // and head's (and the two layers in flight, not counted: this is a bound).
    const i64 layers_host = p.place.weights_host() ? i64(n) * sched::layer_params(c, TpShard{0, p.par.tp}) : 0;
    const i64 weights = ctx.device_fixed(params - layers_host, shards, state);
    mem = std::max(mem, weights + (i64(n) * kv_dev + (layer_major ? 1 : n) * acc_dev) * before_last);
    i64 held = before_last;
    if (p.par.msp.on) {
      held = 0;
      for (int k : sched::msp_phases(p.par.pp, N, int(st), p.par.msp.reach).steady)
        if (k < N - 1) held += p.lengths[std::size_t(k)];
      held /= p.par.cp;
    }
    const i64 saved =
        (i64(n) * per_token - rebuilt_of(n) * rebuilt_pt + once_pt + (end == c.layers ? head_grad_pt : 0)) * held /
        p.par.tp;
    const i64 spilled = std::max<i64>(0, weights + saved - ctx.budget);
    host = std::max(host, ctx.host_fixed(params, shards, state) + spilled);
    first = end;
  }
  double compute = 0;
  i64 o = 0;
  const bool kv_rc = pl.kv == KvPlace::Recompute;
  for (std::size_t i = 0; i < p.lengths.size(); ++i) {
    const i64 l = p.lengths[i];
    // An MSP helper keeps its pieces on the device: no stream where tasks may split.
    const KvPlace streamed = p.par.msp.on ? KvPlace::Device : pl.kv;
    double layer = busiest_piece_s(ctx.cost, o, l, p.par.cp, ctx.req.ring_layout,
                                   {.tp = p.par.tp, .kv = streamed, .last = i + 1 == p.lengths.size()});
    if (p.place.recompute || kv_rc) {
      const sched::Spans whole{{0, l}};
      const SavedSet groups = p.place.recompute;
      layer += (ctx.cost.layer_recompute_s(o, whole, groups, {.kv = kv_rc}, p.par.tp) +
                ctx.cost.layer_recompute_s(o, whole, groups, {.kv = kv_rc, .backward = true}, p.par.tp)) / p.par.cp;
    }
    // A rebuilt layer's backward runs the layer below's forward again.
    compute += n_s * layer + double(rebuilt_of(n_s)) * ctx.cost.layer_forward_s(o, l);
    o += l;
  }
  const double step = compute * (p.par.msp.on ? 1.0 : 1.0 + double(p.par.pp - 1) / p.subseqs);
  return {mem, ctx.tput(p, step), host};
}

// The bounds pass. Takes a search's candidates; gives each one's bounds (by index) and the
// order the alpha pass tries them in: the highest throughput bound first, ties in the
// candidates' order.
struct BoundedCandidates {
  std::vector<Bounds> bound;
  std::vector<std::size_t> order;
};
BoundedCandidates bound_pass(const SearchContext& ctx, const std::vector<SearchCandidate>& cands) {
  BoundedCandidates b;
  b.bound.resize(cands.size());
  b.order.resize(cands.size());
  for (std::size_t k = 0; k < cands.size(); ++k) {
    b.bound[k] = candidate_bounds(ctx, cands[k].plan, cands[k].pl);
    b.order[k] = k;
  }
  std::stable_sort(b.order.begin(), b.order.end(),
                   [&](std::size_t i, std::size_t j) { return b.bound[i].tput > b.bound[j].tput; });
  return b;
}

// ---- 4. Alpha

// Note [Pruning the search], continued: a placement's alpha = 0 step bounds from below
// every placement of the same layout that adds to it: K/V streamed from the host or
// recomputed rather than kept, more tensors recomputed, the MLP in tiles (each only adds
// copies or compute to the same schedule). So once such a step is no faster than the best
// plan found, the placements that add to it are not simulated. (MSP's reach changes with
// the placement, and with it the schedule: only placements at one reach compare.)
struct LeastStep {
  KvPlace kv;
  SavedSet recompute;
  i64 tiles;
  int reach;
  double step_s;
};

// What the searches learn, kept from one to the next.
struct SearchState {
  std::vector<Candidate> fits;  // every candidate that fitted, with its alpha
  // The closest miss (the least peak, or before any peak the least host memory, that a
  // candidate needed), for the error when nothing fits: of the last placement of the state
  // searched (`state_place`), which moves the most off the device (another_placement).
  std::string last_reason;
  i64 least_peak = 0;
  i64 least_host = 0;  // the least host memory a layout pruned by its host bound needs
  std::string state_place;

  // A search of the state placed as `place` says (e.g. "the optimizer state on the host")
  // begins: its misses, not the last one's, are the closest.
  void another_placement(std::string place) {
    state_place = std::move(place);
    least_peak = least_host = 0;
  }
  int layouts_tried = 0;
  PlacementsTried placements_tried;
  // Note [Optimizer state under a budget], continued: when nothing fits, every layout the
  // device-state search simulated was ruled out by its floor (Note [A floor under the peak]),
  // and the host-state search would rebuild the same schedules: moving the state changes a
  // rank's fixed bytes by its AdamW m and v alone, so a rank's floor drops by exactly that,
  // and a layout's by at most its largest stage's. The floors are kept by (layout,
  // placement), and a layout whose kept floor less that still exceeds the budget is dropped
  // as a simulation would drop it.
  std::map<FloorKey, i64> device_floors;
  std::map<Variant, std::vector<LeastStep>> least_steps;  // by layout variant
  // Candidates that fitted, or whose step was of no use (slower than a plan found): their
  // twins in the layer-major order, the same ops in another order, are no faster, so only
  // the twins of candidates that did not fit are searched (Note [Layer-major backward in
  // the search]).
  std::set<FloorKey> settled;
};

// The most AdamW bytes of one rank of layout p (what a floor drops by with the state on
// the host).
i64 state_bound(const SearchContext& ctx, const plan::Plan& p) {
  i64 most = 0;
  int first = 0;
  for (int n : p.stage_layers) {
    const int end = first + n;
    const TpShard tp{0, p.par.tp};
    const int shards = p.par.zero_shards();  // plan_rules(p, ..., Replicas::One): shard 0 everywhere
    const i64 state = shards > 1 ? sched::zero_state_params(ctx.c, first, end, shards, 0, tp)
                                 : sched::param_count(ctx.c, first, end, tp);
    // With the layers' weights on the host their weights, working copies and gradients
    // leave too (less the two layers in flight: not subtracted, so this stays a bound).
    const i64 layers = p.place.weights_host() ? i64(n) * sched::layer_params(ctx.c, tp) *
                                                 (ctx.rules.weight_bytes() + ctx.rules.weight_copy_bytes +
                                                  ctx.rules.grad_bytes)
                                           : 0;
    most = std::max(most, state * ctx.rules.optimizer_bytes + layers);
    first = end;
  }
  return most;
}

// The alpha pass. Takes a search's candidates with their bounds and order; simulates, in
// that order, each one that its bounds and what the search has found so far do not rule
// out, for its best alpha under the budget (evaluate). Gives, in `st`: the candidates that
// fit, the closest miss, and the floors and alpha = 0 steps that prune later candidates.
// `state`: where this search keeps the optimizer state; off the device, the floors the
// device-state search kept rule candidates out (Note [Optimizer state under a budget],
// continued). `best_tput`: the tokens/GPU/s a candidate must beat to be of use (0: none
// yet); it rises as candidates fit.
void alpha_pass(const SearchContext& ctx, const std::vector<SearchCandidate>& cands, const BoundedCandidates& b,
                StateTier state, SearchState& st, double best_tput) {
  const i64 budget = ctx.budget;
  // Note [Pruning the search], continued: the wider search first simulates each group's
  // highest level; a group where that does not fit is dropped whole, and a level that does
  // not fit drops the levels below it.
  std::map<GroupKey, std::size_t> fails_below;  // group -> levels under this do not fit
  std::vector<char> done(cands.size(), 0);
  // Whether candidate k cannot fit by its bounds (and why, kept for the error).
  auto out_of_bounds = [&](std::size_t k) {
    const plan::Plan& p = cands[k].plan;
    const Bounds& bk = b.bound[k];
    if (ctx.host_limit > 0 && bk.host > ctx.host_limit) {
      if (st.least_peak == 0 && (st.least_host == 0 || bk.host < st.least_host)) {
        st.least_host = bk.host;
        st.last_reason = "with " + sp_text(p) + " and " + std::to_string(p.par.pp) +
                         " stages, the activations, K/V and dK/dV sums that do not fit the device need at least " +
                         format_bytes(double(bk.host)) + " of host memory, over its " +
                         format_bytes(double(ctx.host_limit)) + " (more --gpus, or a larger --host-budget where "
                         "the host has it)";
      }
      return true;
    }
    if (bk.mem > budget) {
      if (st.least_peak == 0 || bk.mem < st.least_peak) {
        st.least_peak = bk.mem;
        st.last_reason = "weights, the K/V cache and the dK/dV accumulators alone need " +
                         format_bytes(double(bk.mem)) + " with " + sp_text(p) + " and " + std::to_string(p.par.pp) +
                         " stages";
      }
      return true;
    }
    return false;
  };
  // Simulates candidate k (no_use_s as below); false when it does not fit.
  auto try_candidate = [&](std::size_t k, double no_use_s) {
    const SearchCandidate& ck = cands[k];
    const plan::Plan& p = ck.plan;
    done[k] = 1;
    auto mark_failed = [&] {
      std::size_t& below = fails_below[ck.group];
      below = std::max(below, ck.level + 1);
      return false;
    };
    if (state != StateTier::Device) {
      const auto kept = st.device_floors.find(ck.key);
      const i64 lower = kept == st.device_floors.end() ? 0 : kept->second - state_bound(ctx, p);
      if (lower > budget) {
        if (st.least_peak == 0 || lower < st.least_peak) {
          st.least_peak = lower;
          st.last_reason = "with " + sp_text(p) + ", " + std::to_string(p.par.pp) + " stages and N = " +
                           std::to_string(p.subseqs) + ": peak device memory of at least " + bytes_text(lower) +
                           " with the optimizer state on the host exceeds the budget of " + bytes_text(budget);
        }
        return mark_failed();
      }
    }
    Candidate cand = evaluate(ctx.req, p, ctx.cost, budget, no_use_s);
    if (state == StateTier::Device && cand.alpha.floor_bytes > 0) st.device_floors[ck.key] = cand.alpha.floor_bytes;
    if (cand.alpha.least_step_s > 0)
      st.least_steps[ck.key.variant].push_back(
          {ck.pl.kv, p.place.recompute, p.place.mlp_tile_rows, p.par.msp.reach, cand.alpha.least_step_s});
    if (cand.alpha.slow) {
      st.settled.insert(ck.key);
      return true;
    }
    if (cand.alpha.fits) {
      st.settled.insert(ck.key);
      best_tput = std::max(best_tput, ctx.tput(p, cand.alpha.step_time_s));
      st.fits.push_back(std::move(cand));
      return true;
    }
    if (st.least_peak == 0 || cand.alpha.peak_device_bytes < st.least_peak) {
      st.least_peak = cand.alpha.peak_device_bytes;
      st.last_reason = "with " + sp_text(p) + ", " + std::to_string(p.par.pp) + " stages and N = " +
                       std::to_string(p.subseqs) + ": " + cand.alpha.reason;
    }
    return mark_failed();
  };
  std::map<GroupKey, std::size_t> top;  // group -> its candidate of the highest level
  for (std::size_t k = 0; k < cands.size(); ++k) {
    auto [it, fresh] = top.try_emplace(cands[k].group, k);
    if (!fresh && cands[k].level > cands[it->second].level) it->second = k;
  }
  auto no_use_s = [&](const plan::Plan& p) {
    return best_tput > 0 ? double(ctx.S) * p.par.dp / (ctx.G * best_tput) * (1 + 1e-9) : 0.0;
  };
  auto dropped = [&](std::size_t k) {
    auto f = fails_below.find(cands[k].group);
    return f != fails_below.end() && cands[k].level < f->second;
  };
  // Whether a placement of k's layout that k adds to is already no faster than the best.
  auto outrun = [&](std::size_t k) {
    const plan::Plan& p = cands[k].plan;
    const double limit = no_use_s(p);
    const auto seen = st.least_steps.find(cands[k].key.variant);
    if (limit == 0 || seen == st.least_steps.end()) return false;
    for (const LeastStep& l : seen->second)
      if (l.step_s >= limit && l.reach == p.par.msp.reach &&
          (l.kv == KvPlace::Device || l.kv == cands[k].pl.kv) && (l.recompute & p.place.recompute) == l.recompute &&
          (l.tiles == 0 || l.tiles == p.place.mlp_tile_rows))
        return true;
    return false;
  };
  for (const std::size_t k : b.order) {
    if (done[k] || dropped(k)) continue;
    const plan::Plan& p = cands[k].plan;
    if (out_of_bounds(k)) continue;
    if (b.bound[k].tput <= best_tput || outrun(k)) continue;
    // The group's highest level first: where it does not fit, nothing of the group does.
    const std::size_t t = top.at(cands[k].group);
    if (t != k && !done[t] && !out_of_bounds(t) && !outrun(t)) {
      try_candidate(t, no_use_s(cands[t].plan));
      if (dropped(k)) continue;
    }
    // Note [Pruning the search], continued: alpha = 0 is a layout's fastest alpha (copies
    // only add), so a layout whose alpha = 0 step is already slower than the best found, by
    // more than rounding, is dropped after that one simulation.
    try_candidate(k, no_use_s(p));
  }
}

// One search over every layout in each of `pls`: the placements, bounds and alpha passes
// (MSP as `options` say, SearchOptions). Adds what it finds to `st`.
void search(const SearchContext& ctx, const std::vector<plan::Plan>& layouts, const std::vector<Placement>& pls,
            SearchState& st, const SearchOptions& options = {}) {
  const StateTier where = layouts.empty() ? StateTier::Device : state_tier(layouts.front());
  const std::vector<SearchCandidate> cands =
      placement_pass(ctx, layouts, pls, options, where, st.placements_tried, st.settled);
  const BoundedCandidates b = bound_pass(ctx, cands);
  double best_tput = 0;
  if (options.prune_by_fits)
    for (const Candidate& f : st.fits) best_tput = std::max(best_tput, ctx.tput(f.plan, f.alpha.step_time_s));
  alpha_pass(ctx, cands, b, where, st, best_tput);
  st.layouts_tried += int(cands.size());
}

// ---- 5. Ranking

// Takes the context and the searches' state; gives why no plan came out, where none did.
std::optional<std::string> no_plan_error(const SearchContext& ctx, const SearchState& st) {
  const i64 S = ctx.S;
  const int G = ctx.G;
  if (st.layouts_tried == 0) {
    // Every layout needs more subsequences than the search allows (or has subsequences
    // shorter than its sequence-parallel degree): say which lengths it covers.
    i64 longest = 0;
    for (int n : divisors(std::min(G, ctx.gpn)))
      if (G % n == 0) longest = std::max(longest, (kMaxPlanSubseqs + 1) * kMaxTokensPerSubseq * n - 1);
    return "no layout of " + std::to_string(G) + " devices was tried for " + std::to_string(S) +
           " tokens: the planner cuts a sequence into at most " + std::to_string(kMaxPlanSubseqs) +
           " subsequences of about " + std::to_string(kMaxTokensPerSubseq) +
           " tokens per device at the longest, so the longest sequence it plans on " + std::to_string(G) +
           " devices is " + std::to_string(longest) + " tokens; use a shorter --seq-len or more --gpus";
  }
  if (st.fits.empty())
    return "no layout of " + std::to_string(G) + " devices fits " + std::to_string(S) + " tokens in " +
           format_bytes(double(ctx.budget)) + " per device; the closest" +
           (st.state_place.empty() ? "" : ", with " + st.state_place) + ": " + st.last_reason;
  return std::nullopt;
}

// The notes that explain the best plan: how its layout runs, and why it places what it
// does where that is not K/V on the device with nothing more recomputed (`first_best`:
// tokens/GPU/s of the best plan of the first placement, 0 where none fits).
void explain_best(const SearchContext& ctx, plan::Plan& best, double first_best, double kept_best) {
  const PlanRequest& req = ctx.req;
  if (best.par.stage_ranks() * best.par.pp > ctx.gpn)
    best.notes.push_back("pipeline stages span nodes (tp and cp stay inside a node)");
  if (best.par.tp > 1)
    best.notes.push_back("tp " + std::to_string(best.par.tp) + ": tensor parallel with sequence-parallel regions over " + std::to_string(best.par.tp) +
                         " devices (train --tp): weights, K/V cache and activations divided among them");
  std::string why_wider = "no plan with K/V on the device and no more recomputed fits";
  if (first_best > 0) {
    char buf[160];
    std::snprintf(buf, sizeof buf,
                  "faster than the best plan with K/V on the device and no more recomputed, %.1f tokens/GPU/s",
                  first_best);
    why_wider = buf;
  }
  if (!best.place.kv_layers(KvPlace::Host).empty())
    best.notes.push_back(std::string("K/V and their dK/dV sums on the host, every layer (") +
                         (req.place.kv == KvPlace::Host ? "--kv-cache host" : why_wider) +
                         "): later subsequences stream them back through a window of " +
                         std::to_string(best.kv_window_tokens()) + " tokens a layer (train --kv-cache host)");
  if (!best.place.kv_layers(KvPlace::Recompute).empty())
    best.notes.push_back(std::string("K/V recomputed from each layer's input, every layer, their dK/dV sums on the "
                                     "host (") +
                         (req.place.kv == KvPlace::Recompute ? "--kv-cache recompute" : why_wider) +
                         "): later subsequences stream the inputs of earlier ones through a window of " +
                         std::to_string(best.kv_window_tokens()) + " tokens a layer (train --kv-cache recompute)");
  if (best.place.mlp_tile_rows > 0)
    best.notes.push_back("the MLP runs in tiles of " + std::to_string(best.place.mlp_tile_rows) + " rows (" + why_wider +
                         "; train --mlp-tile-rows " + std::to_string(best.place.mlp_tile_rows) + ")");
  if (best.place.recompute != req.recompute_least())
    best.notes.push_back("backward recomputes " + recompute_tensors_text(best.place.recompute) + " (" + why_wider +
                         "; train --recompute-tensors " + recompute_tensors_text(best.place.recompute) + ")");
  if (best.place.layer_major())
    best.notes.push_back(std::string("the backward runs a layer at a time, one layer's dK/dV sums alive (") +
                         (req.place.backward == BackwardOrder::Layer ? "--backward-order layer" : why_wider) +
                         "; train --backward-order layer)");
  if (best.place.any_input_rebuilt()) {
    std::string layers;
    for (int l : best.place.rebuilt_layers()) layers += (layers.empty() ? "" : ",") + std::to_string(l);
    char kept[120];
    std::snprintf(kept, sizeof kept, "faster than the best plan keeping every input, %.1f tokens/GPU/s", kept_best);
    const std::string why = req.place.rebuild.kind == RebuildRequest::Kind::Odd ? "--rebuild-inputs odd"
                            : kept_best > 0             ? kept
                                                        : "no plan keeping every input fits";
    best.notes.push_back("the inputs of layers " + layers + " rebuilt: their forward drops them, and each of their "
                         "backward's ops runs the layer below's forward again to make them (" + why +
                         "; a layer's forward more per rebuilt layer; train --rebuild-inputs " + layers + ")");
  }
  if (best.par.zero == ZeroStage::OptimizerState)
    best.notes.push_back("ZeRO-1: AdamW state sharded over the " + std::to_string(best.par.zero_shards()) +
                         " ranks of each stage's gradient all-reduce");
  if (best.place.optimizer_host())
    best.notes.push_back(std::string("optimizer state on the host (") +
                         (req.place.optimizer_state == Tier::Host ? "--optimizer-state host"
                                                        : "no plan with it on the device fits") +
                         "): fp32 master weights, AdamW m, v and a gradient copy, 16 B a parameter of each rank's "
                         "shard; each step the gradients go down, the host's processor updates them, the weights "
                         "come back up (" + seconds_text(best.predicted.host_update_s) +
                         " a step, priced in the step time; train --optimizer-state host)");
  if (best.place.weights_host())
    best.notes.push_back(std::string("the layers' weights and gradients on the host (") +
                         (req.place.weights == Tier::Host ? "--weights host" : "no plan with them on the device fits") +
                         "): each layer's fp32 weights come to the device a layer ahead of the forward or backward "
                         "that runs it (its bf16 working copy converted there) and go after; its gradient goes to "
                         "the host after its last backward; the device keeps the embedding, final norm and head "
                         "(train --weights host)");
}

// The ranking pass. Takes the searches' state (its fits, which it sorts) and `first_best`
// (as explain_best takes it); gives the outcome: the fastest plan, predicted as a whole,
// with its notes, or why nothing fits.
PlanOutcome rank_pass(const SearchContext& ctx, SearchState& st, double first_best) {
  const PlanRequest& req = ctx.req;
  PlanOutcome out;
  if (std::optional<std::string> error = no_plan_error(ctx, st)) {
    out.error = *error;
    return out;
  }
  std::vector<Candidate>& fits = st.fits;
  std::sort(fits.begin(), fits.end(), [&](const Candidate& a, const Candidate& b) {
    return ctx.tput(a.plan, a.alpha.step_time_s) > ctx.tput(b.plan, b.alpha.step_time_s);
  });
  // MSP when it pays: each of the best few pipelined layouts is simulated with and without
  // it as a whole plan; the faster that fits stays, and says both figures.
  std::vector<plan::Plan> finalists;
  const size_t top = std::min<size_t>(fits.size(), req.msp == kAuto ? 3 : 1);
  for (size_t k = 0; k < top; ++k) {
    plan::Plan p = fits[k].plan;
    // --msp auto weighs MSP for its cp 1 finalists only (Note [MSP in the search]).
    if (req.msp != false && msp_possible(p) && (req.msp == true || p.par.cp == 1)) {
      finalists.push_back(choose_msp(req, p).chosen);
    } else {
      predict(&p, ctx.hw);
      if (req.msp == false) p.notes.push_back(kMspOffNote);
      finalists.push_back(p);
    }
  }
  plan::Plan best = *std::max_element(finalists.begin(), finalists.end(), [](const plan::Plan& a, const plan::Plan& b) {
    return a.predicted.tokens_per_gpu_per_s < b.predicted.tokens_per_gpu_per_s;
  });
  // The best plan keeping every layer's input, where one fitted (its tokens/GPU/s as searched).
  double kept_best = 0;
  for (const Candidate& f : fits)
    if (!f.plan.place.any_input_rebuilt()) kept_best = std::max(kept_best, ctx.tput(f.plan, f.alpha.step_time_s));
  explain_best(ctx, best, first_best, kept_best);
  out.ok = true;
  out.plan = best;
  return out;
}

// The planner's search for system "sppo" (docs/design.md 5), pass by pass (above).
PlanOutcome solve_sppo(const PlanRequest& req) {
  const SearchContext ctx(req);
  if (std::optional<std::string> error = weights_alone_error(ctx)) {
    PlanOutcome out;
    out.error = *error;
    return out;
  }
  std::vector<plan::Plan> layouts = layout_pass(ctx);
  if (req.place.weights == Tier::Host) layouts = weights_on_host(req, layouts);
  const PlacementSets placements = placement_sets(req);
  const Placement& first = placements.first;
  const std::vector<Placement>& wider = placements.wider;
  const std::vector<Placement>& layered = placements.layered;
  SearchState st;
  search(ctx, layouts, {first}, st, {.weigh_msp = true});
  double first_best = 0;  // tokens/GPU/s of the best plan of the first placement, as searched
  for (const Candidate& f : st.fits) first_best = std::max(first_best, ctx.tput(f.plan, f.alpha.step_time_s));
  if (!wider.empty()) search(ctx, layouts, wider, st, {.msp_tasks = st.fits.empty() ? 0 : kMspWiderTasks});
  if (!layered.empty()) search(ctx, layouts, layered, st, {.prune_by_fits = true});
  // Where nothing fitted: the same placements again over layouts that keep less on the device.
  const auto search_again = [&](const std::vector<plan::Plan>& moved, const std::string& what) {
    if (moved.empty()) return;
    st.another_placement(what);
    search(ctx, moved, {first}, st);
    if (st.fits.empty() && !wider.empty()) search(ctx, moved, wider, st);
    if (st.fits.empty() && !layered.empty()) search(ctx, moved, layered, st, {.prune_by_fits = true});
  };
  // The layouts searched, each keeping less on the device than the one before.
  std::vector<std::pair<std::vector<plan::Plan>, std::string>> tiers = {{layouts, ""}};
  if (st.fits.empty() && req.place.optimizer_state == kAuto) {  // Note [Optimizer state under a budget]
    for (plan::Plan& p : layouts) p.place.optimizer_state = Tier::Host;
    search_again(layouts, "the optimizer state on the host");
    tiers.push_back({layouts, "the optimizer state on the host"});
  }
  if (st.fits.empty() && req.place.weights == kAuto && req.place.optimizer_state != Tier::Device) {  // Note [Weights in the search]
    tiers.push_back({weights_on_host(req, layouts), "the optimizer state and the layers' weights on the host"});
    search_again(tiers.back().first, tiers.back().second);
  }
  // Note [Rebuilt inputs in the search]: where nothing fits keeping every layer's input,
  // every other layer's rebuilt, over each tier of layouts in turn; where the plans that
  // fit already run the layer-major order, over the last tier, against them.
  const auto layer_major = [](const Candidate& f) { return f.plan.place.layer_major(); };
  if (!st.fits.empty() && std::any_of(st.fits.begin(), st.fits.end(), layer_major) && !tiers.back().first.empty())
    search(ctx, tiers.back().first, placements.rebuilt, st, {.prune_by_fits = true});
  for (const auto& [tier, what] : tiers) {
    if (!st.fits.empty() || placements.rebuilt.empty() || tier.empty()) break;
    st.another_placement(what.empty() ? "every other layer's input rebuilt"
                                      : what + " and every other layer's input rebuilt");
    search(ctx, tier, placements.rebuilt, st, {.prune_by_fits = true});
  }
  return rank_pass(ctx, st, first_best);
}

}  // namespace

MspChoice choose_msp(const PlanRequest& req, const plan::Plan& layout) {
  const HardwareProfile hw = plan_hardware(req.hw, req.gpus_per_node);
  const ActPrecision prec = precision_of(hw);
  const CostModel cost(hw, layout.model, prec);
  const i64 budget = layout.budget > 0 ? layout.budget : hw.usable_memory();
  MspChoice m;
  plan::Plan off = layout, on = layout;
  off.par.msp.on = false;
  off.par.msp.reach = 0;
  on = with_msp(on);
  Candidate c_off = evaluate(req, off, cost, budget);
  m.off = c_off.plan;
  predict(&m.off, hw);
  m.off_fits = c_off.alpha.fits && m.off.predicted.peak_device_bytes <= budget;
  if (msp_possible(on)) {
    Candidate c_on = evaluate(req, on, cost, budget);
    m.on = c_on.plan;
    predict(&m.on, hw);
    m.on_fits = c_on.alpha.fits && m.on.predicted.peak_device_bytes <= budget;
  }
  const double t_off = m.off.predicted.step_time_s, t_on = m.on.predicted.step_time_s;
  const bool use_on = m.on_fits && (req.msp == true || !m.off_fits || t_on < t_off);
  const bool neither = !m.on_fits && !m.off_fits;
  m.chosen = neither ? (layout.par.msp.on && msp_possible(on) ? m.on : m.off) : use_on ? m.on : m.off;
  std::string note;
  if (!msp_possible(on))
    note = "MSP off: it needs N >= P and every subsequence at least P x cp x tp tokens";
  else if (use_on)
    note = std::string(req.msp == true ? "MSP on (--msp on): " : "MSP on: ") + seconds_text(t_on) + " per step, against " +
           (m.off_fits ? seconds_text(t_off) + " without it" : "no plan without it that fits (peak " +
                                                                   format_bytes(double(m.off.predicted.peak_device_bytes)) + ")") +
           " (both simulated)";
  else if (m.off_fits)
    note = "MSP off: " + seconds_text(t_off) + " per step, against " +
           (m.on_fits ? seconds_text(t_on) + " with it" : "a peak of " +
                                                              format_bytes(double(m.on.predicted.peak_device_bytes)) +
                                                              " with it, over the budget") +
           " (both simulated)";
  else
    note = "MSP: neither with it (" + seconds_text(t_on) + ") nor without it (" + seconds_text(t_off) + ") fits";
  m.note = note;
  m.chosen.notes.push_back(note);
  return m;
}

MemoryRules plan_rules(const plan::Plan& p, ActPrecision prec, sched::Replicas replicas) {
  return memory_rules(p.model, prec, p, replicas);
}

Schedule plan_schedule(const plan::Plan& p) { return sched::build_step(p.model, p.lengths, p.alpha, p); }

SimResult simulate_plan(const plan::Plan& p, const HardwareProfile& hw_in, const SimOptions& options) {
  if (p.system != plan::System::Sppo) return simulate_baseline(p, hw_in, options);
  const HardwareProfile hw = plan_hardware(hw_in, p.gpus_per_node);
  const ActPrecision prec = precision_of(hw);
  return simulate(plan_schedule(p), CostModel(hw, p.model, prec), plan_rules(p, prec), options);
}

PlanOutcome solve_plan(const PlanRequest& req) {
  SPPO_CHECK(req.seq_len >= 1, "planner") << "--seq-len must be positive";
  SPPO_CHECK(req.gpus >= 1 && req.gpus_per_node >= 1, "planner") << "--gpus and --gpus-per-node must be positive";
  SPPO_CHECK(req.gpus <= req.gpus_per_node || req.gpus % req.gpus_per_node == 0, "planner")
      << "--gpus " << req.gpus << " is not a whole number of nodes of " << req.gpus_per_node;
  if (req.system == plan::System::Sppo) {
    // Note [MSP in bf16]: the runtime runs MSP's pieces with fp32 activations only (its
    // helpers borrow a stage's fp32 weights and return fp32 gradients, and no GPU has run
    // them), so a plan for a profile whose activations are bf16 does not use MSP: every plan
    // returned is one `train --plan` runs on that hardware.
    if (precision_of(plan_hardware(req.hw, req.gpus_per_node)) == ActPrecision::BF16) {
      SPPO_CHECK(req.msp != true, "planner")
          << "--msp on: train runs MSP's pieces with fp32 activations only (CPU ranks), and the profile "
          << req.hardware << " computes in bf16; use --msp off or auto (auto leaves MSP off on this profile)";
      PlanRequest off = req;
      off.msp = false;
      PlanOutcome out = solve_sppo(off);
      for (std::string& note : out.plan.notes)
        if (note == kMspOffNote)
          note = "MSP off: train runs MSP's pieces with fp32 activations only, and this profile computes in bf16";
      return out;
    }
    return solve_sppo(req);
  }
  if (req.system == plan::System::Megatron || req.system == plan::System::Deepspeed) return solve_baseline(req);
  SPPO_ASSERT(false);
  return {};
}

}  // namespace sppo::sim
