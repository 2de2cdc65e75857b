#include "train/partition.h"

#include <cstdlib>

#include "core/check.h"
#include "planner/partition.h"
#include "schedule/builders.h"
#include "sim/simulator.h"
#include "sim/solver.h"
#include "train/profile_machine.h"

namespace sppo {

namespace {

std::vector<i64> lengths_for(const std::string& mode, const ModelConfig& c, i64 S, int N) {
  if (mode == "flops") return plan::partition_flops(c, S, N, kTileTokens);
  return plan::partition_length(S, N);
}

// alpha for a fixed --offload ratio (full = 1), last subsequence 0.
bool fixed_ratio(const std::string& mode, double* ratio) {
  if (mode == "none") return *ratio = 0, true;
  if (mode == "full") return *ratio = 1, true;
  if (mode == "adaptive" || mode == "paper") return false;
  char* end = nullptr;
  *ratio = std::strtod(mode.c_str(), &end);
  SPPO_CHECK(end != mode.c_str() && *end == '\0' && *ratio >= 0 && *ratio <= 1, "options")
      << "--offload '" << mode << "' is unknown; use none, full, paper, adaptive or a ratio in [0, 1]";
  return true;
}

SubseqChoice evaluate(const std::vector<i64>& lengths, const std::string& offload,
                      const ModelConfig& c, i64 budget, const plan::HardwareProfile& hw,
                      const StepShape& shape) {
  SubseqChoice ch;
  ch.lengths = lengths;
  double ratio = 0;
  double step_s = 0, exposed_s = 0;
  if (fixed_ratio(offload, &ratio)) {
    ch.alpha.assign(lengths.size(), ratio);
    ch.alpha.back() = 0;
    ch.alpha_rule = offload;
    const plan::CostModel cost(hw, c, shape.precision);
    const auto r = sim::simulate(sched::build_step(c, lengths, ch.alpha, shape), cost,
                                 sim::memory_rules(c, shape.precision, shape));
    ch.predicted_peak_bytes = r.peak_device_bytes;
    step_s = r.step_time_s;
    exposed_s = r.exposed_copy_s;
  } else {
    // The solver offloads only what the budget demands (without one, the machine's memory);
    // the paper's rule is sized by this machine's copy and compute rates.
    const auto r = sim::solve_alpha_single(c, lengths, hw, shape.precision,
                                           budget > 0 ? budget : hw.device_memory, sim::parse_offload(offload), shape);
    ch.alpha = r.alpha;
    ch.alpha_rule = r.rule;
    ch.predicted_peak_bytes = r.peak_device_bytes;
    step_s = r.step_time_s;
    exposed_s = r.exposed_copy_s;
  }
  ch.predicted_step_s = step_s;
  ch.predicted_exposed_copy_s = exposed_s;
  return ch;
}

}  // namespace

SubseqChoice choose_subseqs(const std::string& partition, const std::string& offload,
                            const ModelConfig& c, i64 S, int N, i64 budget,
                            const plan::HardwareProfile& hw, const StepShape& shape, bool hint) {
  SPPO_CHECK(partition == "length" || partition == "flops" || partition == "adaptive", "options")
      << "--partition '" << partition << "' is unknown; use length, flops or adaptive";
  double ratio = 0;
  (void)fixed_ratio(offload, &ratio);  // validates the spelling before any work
  // The paper's rule depends on this machine's copy and compute rates. One process given
  // no --hardware has only round nominal rates here (train/setup.cpp measures the machine
  // for adaptive choices only); measure them now. Several ranks already agreed on a
  // measured profile, so each computes the same alpha.
  const plan::HardwareProfile measured =
      offload == "paper" && hw.name == nominal_cpu_profile().name ? resolve_cpu_profile("") : hw;

  SubseqChoice ch;
  if (partition == "adaptive") {
    SubseqChoice a = evaluate(lengths_for("length", c, S, N), offload, c, budget, measured, shape);
    SubseqChoice b = evaluate(lengths_for("flops", c, S, N), offload, c, budget, measured, shape);
    const bool a_fits = budget == 0 || a.predicted_peak_bytes <= budget;
    const bool b_fits = budget == 0 || b.predicted_peak_bytes <= budget;
    ch = (b_fits && (!a_fits || b.predicted_step_s <= a.predicted_step_s)) ? b : a;
  } else {
    ch = evaluate(lengths_for(partition, c, S, N), offload, c, budget, measured, shape);
  }

  if (budget > 0 && ch.predicted_peak_bytes > budget) {
    const std::string over = "--subseqs " + std::to_string(N) + " --offload " + offload + " needs " +
                             format_bytes(double(ch.predicted_peak_bytes)) + " (" +
                             std::to_string(ch.predicted_peak_bytes) + " B) of device memory, over the " +
                             "--device-memory budget of " + format_bytes(double(budget));
    SPPO_CHECK_FITS(hint, "memory") << over;
    const auto fit = sim::smallest_fitting_n(c, S, measured, shape.precision, budget, partition != "length",
                                             1, int(std::min<i64>(S, 4096)), shape, kTileTokens);
    std::string what_fits;
    if (fit.found)
      what_fits = "the smallest that fits is --subseqs " + std::to_string(fit.subseqs) +
                  " --offload adaptive (predicted peak " + format_bytes(double(fit.alpha.peak_device_bytes)) + ")";
    else if (hw.host_memory > 0 && fit.least_peak_bytes <= budget)
      what_fits = "nothing fits both budgets: the N that fit the device budget offload more than the host memory "
                  "of " + format_bytes(double(hw.host_memory)) +
                  " (--host-memory) holds; raise --host-memory or --device-memory";
    else
      what_fits = "nothing fits: the least any N and offload needs is " + format_bytes(double(fit.least_peak_bytes)) +
                  " (at --subseqs " + std::to_string(fit.least_peak_subseqs) +
                  (!shape.place.any_kv_streamed() ? "), since K/V and their gradients stay on the device; --kv-cache host or "
                                            "recompute keeps them off it, or shorten --seq-len or raise --device-memory"
                                          : "); shorten --seq-len or raise --device-memory");
    SPPO_CHECK_FITS(false, "memory") << over << "; " << what_fits;
  }
  return ch;
}

}  // namespace sppo
