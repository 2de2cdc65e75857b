// The offload ratios (alpha) of one schedule under a device budget: solve_alpha (Note [Alpha
// under a budget] in sim/solver.h) and the searches it runs, built on what offloading each
// subsequence means on each rank (unit_profiles) and the paper's rule (paper_alpha); and
// smallest_fitting_n, the least N whose alpha fits one device. Takes a schedule family
// (`build(alpha)`), its cost model, memory rules and budget; gives the fastest alpha that
// fits, or the closest miss and why. It is the judge of every layout the planner's search
// tries (evaluate in search.cpp, the alpha pass), of train's --offload adaptive, and of its
// automatic N: offloading only buys memory, so each search looks for the least offload, in
// the order of its cost in step time, that the simulator finds fits.
#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <sstream>

#include "core/check.h"
#include "planner/partition.h"
#include "sim/solver/search.h"

namespace sppo::sim {

using sched::MemoryRules;
using sched::Schedule;

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
  if (hw.gpus_per_pcie_switch > 1 && hw.pcie_switch_bw > 0)
    r = std::min(r, hw.pcie_switch_bw / hw.gpus_per_pcie_switch);
  if (hw.gpus_per_numa_node > 1 && hw.numa_host_bw > 0)
    r = std::min(r, hw.numa_host_bw / hw.gpus_per_numa_node);
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

using solver::bytes_text;

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

}  // namespace sppo::sim
