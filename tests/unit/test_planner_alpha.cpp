// Alpha per subsequence: the paper's rule, the adaptive search against none, full, the
// paper and an exhaustive grid; MSP chosen by simulation; ZeRO-1 and the ring layout in
// plan JSON.
#include <gtest/gtest.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <regex>

#include "core/check.h"
#include "planner/partition.h"
#include "planner/plan.h"
#include "planner/profile.h"
#include "schedule/builders.h"
#include "sim/solver.h"

namespace sppo::sim {
namespace {

HardwareProfile slow_copies() {
  HardwareProfile hw = plan::load_profile("a100-80gb");
  hw.d2h_bw = hw.h2d_bw = 2e9;  // copies that cannot hide behind everything
  return hw;
}

TEST(PaperAlpha, NonIncreasingAndTheSameBytesWhereNotClipped) {
  const ModelConfig c = preset("medium");
  const HardwareProfile hw = slow_copies();
  const CostModel cost(hw, c, ActPrecision::F32);
  const auto rules = memory_rules(c, ActPrecision::F32);
  for (const bool flops : {true, false}) {
    const int N = 8;
    const auto lengths = flops ? plan::partition_flops(c, 16384, N) : plan::partition_length(16384, N);
    const auto units = unit_profiles(sched::build_single(c.layers, lengths, std::vector<double>(N, 0.0)), cost, rules);
    const auto a = paper_alpha(units, cost);
    ASSERT_EQ(int(a.size()), N);
    EXPECT_EQ(a.back(), 0);
    double total = 0;
    for (double t : units[0].fwd_s) total += t;
    const double bytes = hw.d2h_bw * total / N;  // BW_d2h x the balanced forward time
    int unclipped = 0;
    for (int i = 0; i + 1 < N; ++i) {
      EXPECT_GE(a[i], 0);
      EXPECT_LE(a[i], 1);
      if (i > 0) {
        EXPECT_LE(a[i], a[i - 1]) << "alpha increases at " << i;
      }
      const bool clipped = a[i] == 1 || (i > 0 && a[i] == a[i - 1] && a[i] * units[0].unit_bytes[i] < bytes * (1 - 1e-9));
      if (clipped) continue;
      ++unclipped;
      EXPECT_NEAR(a[i] * double(units[0].unit_bytes[i]), bytes, 1e-9 * bytes) << "i " << i;
    }
    EXPECT_GE(unclipped, 1);
    // Equal lengths: equal units, so nothing is clipped and every subsequence moves the same bytes.
    if (!flops) {
      EXPECT_EQ(unclipped, N - 1);
    }
  }
}

TEST(PaperAlpha, TheTrainOptionComputesIt) {
  const ModelConfig c = preset("medium");
  const auto lengths = plan::partition_length(8192, 4);
  const auto r = solve_alpha_single(c, lengths, slow_copies(), ActPrecision::F32, 0, OffloadMode::Paper);
  EXPECT_EQ(r.rule, "paper");
  EXPECT_GT(r.alpha.front(), 0);
  EXPECT_EQ(r.alpha.back(), 0);
  EXPECT_EQ(parse_offload("paper"), OffloadMode::Paper);
}

struct Shape {
  const char* name;
  StepShape shape;
};

TEST(AdaptiveAlpha, NeverSlowerThanPaperFullOrNone) {
  const ModelConfig c = preset("medium");
  StepShape pipe;
  pipe.par.pp = 2;
  for (const Shape& sh : {Shape{"one process", {}}, Shape{"two stages", pipe}})
    for (const HardwareProfile& hw : {plan::load_profile("a100-80gb"), slow_copies()}) {
      const auto lengths = plan::partition_flops(c, 16384, 8);
      const i64 roomy = i64(1) << 40;
      const auto none = solve_alpha_single(c, lengths, hw, ActPrecision::F32, roomy, OffloadMode::None, sh.shape);
      const auto full = solve_alpha_single(c, lengths, hw, ActPrecision::F32, roomy, OffloadMode::Full, sh.shape);
      for (int k = 0; k <= 6; ++k) {
        const i64 budget = full.peak_device_bytes + (none.peak_device_bytes - full.peak_device_bytes) * k / 6;
        const auto ad = solve_alpha_single(c, lengths, hw, ActPrecision::F32, budget, OffloadMode::Adaptive, sh.shape);
        ASSERT_TRUE(ad.fits) << sh.name << " budget " << budget << ": " << ad.reason;
        EXPECT_LE(ad.peak_device_bytes, budget);
        for (const OffloadMode m : {OffloadMode::None, OffloadMode::Full, OffloadMode::Paper}) {
          const auto other = solve_alpha_single(c, lengths, hw, ActPrecision::F32, budget, m, sh.shape);
          if (other.fits) {
            EXPECT_LE(ad.step_time_s, other.step_time_s * (1 + 1e-9))
                << sh.name << ", budget step " << k << ": adaptive (" << ad.rule << ") slower than " << to_string(m);
          }
        }
      }
    }
}

TEST(AdaptiveAlpha, CloseToAnExhaustiveSearch) {
  // Every alpha on a grid of eighths for N = 4 (the last is 0): the adaptive fill is within
  // the grid's resolution of the best that fits, at budgets from tight to loose.
  const ModelConfig c = preset("medium");
  const HardwareProfile hw = slow_copies();
  const auto lengths = plan::partition_flops(c, 8192, 4);
  const CostModel cost(hw, c, ActPrecision::F32);
  const auto rules = memory_rules(c, ActPrecision::F32);
  std::vector<std::pair<i64, double>> grid;  // (peak, step) of every point
  for (int a = 0; a <= 8; ++a)
    for (int b = 0; b <= 8; ++b)
      for (int d = 0; d <= 8; ++d) {
        const SimResult r = simulate(sched::build_single(c.layers, lengths, {a / 8.0, b / 8.0, d / 8.0, 0.0}), cost, rules);
        grid.push_back({r.peak_device_bytes, r.step_time_s});
      }
  i64 lo = grid.front().first, hi = lo;
  for (const auto& [peak, step] : grid) lo = std::min(lo, peak), hi = std::max(hi, peak);
  for (int k = 1; k <= 5; ++k) {
    const i64 budget = lo + (hi - lo) * k / 6;
    double best = 1e300;
    for (const auto& [peak, step] : grid)
      if (peak <= budget) best = std::min(best, step);
    const auto ad = solve_alpha_single(c, lengths, hw, ActPrecision::F32, budget);
    ASSERT_TRUE(ad.fits);
    EXPECT_LE(ad.step_time_s, best * 1.01) << "budget step " << k << ": adaptive " << ad.step_time_s << " s ("
                                           << ad.rule << "), grid best " << best << " s";
  }
}

TEST(AdaptiveAlpha, StopsAtNoneOnlyWhenNoneIsAlreadyTooSlow) {
  // The planner's pruning (Note [Pruning the search]): alpha = 0 is a layout's fastest, so a
  // caller that has no use for a step of no_use_s or more loses nothing when the search
  // stops there; and a no_use_s above what the search finds changes nothing.
  const ModelConfig c = preset("medium");
  const HardwareProfile hw = slow_copies();
  const auto lengths = plan::partition_flops(c, 16384, 8);
  const CostModel cost(hw, c, ActPrecision::F32);
  const auto rules = memory_rules(c, ActPrecision::F32);
  auto build = [&](const std::vector<double>& a) { return sched::build_single(c.layers, lengths, a); };
  const i64 roomy = i64(1) << 40;
  const AlphaResult none = solve_alpha(build, 8, cost, rules, roomy, OffloadMode::None);
  const AlphaResult full = solve_alpha(build, 8, cost, rules, roomy, OffloadMode::Full);
  ASSERT_TRUE(none.fits && full.fits);
  const i64 budget = (none.peak_device_bytes + full.peak_device_bytes) / 2;  // alpha = 0 does not fit
  const AlphaResult searched = solve_alpha(build, 8, cost, rules, budget, OffloadMode::Adaptive);
  ASSERT_TRUE(searched.fits) << searched.reason;
  ASSERT_GT(searched.step_time_s, none.step_time_s) << "the copies should cost time at these bandwidths";

  const AlphaResult stopped = solve_alpha(build, 8, cost, rules, budget, OffloadMode::Adaptive, none.step_time_s * 0.99);
  EXPECT_TRUE(stopped.slow);
  EXPECT_FALSE(stopped.fits);
  EXPECT_EQ(stopped.alpha, std::vector<double>(8, 0.0));
  EXPECT_NE(stopped.reason.find("no faster than"), std::string::npos) << stopped.reason;

  for (const double no_use : {searched.step_time_s * 1.01, (none.step_time_s + searched.step_time_s) / 2}) {
    const AlphaResult r = solve_alpha(build, 8, cost, rules, budget, OffloadMode::Adaptive, no_use);
    EXPECT_FALSE(r.slow) << "no_use_s " << no_use;
    EXPECT_EQ(r.fits, searched.fits);
    EXPECT_EQ(r.alpha, searched.alpha);
    EXPECT_EQ(r.step_time_s, searched.step_time_s);
  }
  // A fitting alpha = 0 is returned as it is, however slow.
  const AlphaResult roomy_stop = solve_alpha(build, 8, cost, rules, roomy, OffloadMode::Adaptive, none.step_time_s * 0.5);
  EXPECT_TRUE(roomy_stop.fits);
  EXPECT_FALSE(roomy_stop.slow);
}

PlanRequest request(const char* model, i64 S, int gpus) {
  PlanRequest r;
  r.model_name = model;
  r.model = preset(model);
  r.seq_len = S;
  r.gpus = gpus;
  r.gpus_per_node = 8;
  r.hardware = "a100-80gb";
  r.hw = plan::load_profile("a100-80gb");
  return r;
}

// The step times a note states, in order.
std::vector<double> seconds_in(const std::string& note) {
  std::vector<double> v;
  const std::regex num("([0-9][0-9.e+-]*) s\\b");
  for (auto it = std::sregex_iterator(note.begin(), note.end(), num); it != std::sregex_iterator(); ++it)
    v.push_back(std::stod((*it)[1].str()));
  return v;
}

double four_digits(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return std::stod(buf);
}

TEST(Msp, TheNoteAgreesWithTheTwoSimulatedFigures) {
  // A roomy budget, so that the helpers' borrowed weights fit and both plans exist.
  PlanRequest req = request("gpt-7b", i64(128) << 10, 16);
  req.budget = i64(160) << 30;
  plan::Plan layout;
  layout.system = plan::System::Sppo;
  layout.model_name = req.model_name;
  layout.model = req.model;
  layout.hardware = req.hardware;
  layout.seq_len = req.seq_len;
  layout.gpus = 16;
  layout.gpus_per_node = 8;
  layout.par.cp = 1;
  layout.par.pp = 4;
  layout.par.dp = 4;
  layout.par.zero = ZeroStage::OptimizerState;
  layout.subseqs = 16;
  layout.lengths = plan::partition_flops(req.model, req.seq_len, 16);
  layout.stage_layers = plan::balanced_stage_layers(req.model.layers, 4, 0.5);
  layout.budget = req.budget;
  const MspChoice m = choose_msp(req, layout);
  ASSERT_TRUE(m.off_fits && m.on_fits) << m.note;
  const auto figures = seconds_in(m.note);
  ASSERT_EQ(figures.size(), 2u) << m.note;
  const plan::Plan& other = m.chosen.par.msp.on ? m.off : m.on;
  EXPECT_EQ(figures[0], four_digits(m.chosen.predicted.step_time_s)) << m.note;
  EXPECT_EQ(figures[1], four_digits(other.predicted.step_time_s)) << m.note;
  EXPECT_LE(m.chosen.predicted.step_time_s, other.predicted.step_time_s);
  // The figures are those of the plans as simulated whole.
  EXPECT_NEAR(simulate_plan(m.on, req.hw).step_time_s, m.on.predicted.step_time_s, 1e-12);
  EXPECT_NEAR(simulate_plan(m.off, req.hw).step_time_s, m.off.predicted.step_time_s, 1e-12);
  EXPECT_NE(m.note.find(m.chosen.par.msp.on ? "MSP on" : "MSP off"), std::string::npos) << m.note;
}

TEST(PlanJson, ZeroAndRingLayoutRoundTripAndOldPlansRead) {
  const auto out = solve_plan(request("gpt-7b", i64(256) << 10, 16));
  ASSERT_TRUE(out.ok) << out.error;
  const nlohmann::json j = plan::to_json(out.plan);
  EXPECT_TRUE(j.contains("zero"));
  EXPECT_EQ(j["ring_layout"], "zigzag");
  if (out.plan.par.cp * out.plan.par.dp > 1) {
    EXPECT_EQ(j["zero"], 1);
  }
  EXPECT_EQ(plan::to_json(plan::plan_from_json(j)), j);
  nlohmann::json old = j;
  old.erase("zero");
  old.erase("ring_layout");
  const plan::Plan p = plan::plan_from_json(old);
  EXPECT_EQ(p.par.zero, ZeroStage::None);
  EXPECT_EQ(p.par.ring_layout, RingLayout::Zigzag);
  old["zero"] = 3;  // ZeRO-3 reads back; a stage that does not exist is refused
  EXPECT_EQ(plan::plan_from_json(old).par.zero, ZeroStage::Weights);
  old["zero"] = 4;
  EXPECT_THROW(plan::plan_from_json(old), Error);
}

TEST(Zero, ShardsTheOptimizerStateOfAPlan) {
  PlanRequest req = request("gpt-7b", i64(256) << 10, 16);
  req.zero = ZeroStage::None;
  const auto off = solve_plan(req);
  req.zero = ZeroStage::OptimizerState;
  const auto on = solve_plan(req);
  ASSERT_TRUE(off.ok && on.ok);
  EXPECT_EQ(off.plan.par.zero, ZeroStage::None);
  EXPECT_EQ(on.plan.par.zero, ZeroStage::OptimizerState);
  plan::Plan flipped = on.plan;
  flipped.par.zero = ZeroStage::None;
  if (on.plan.par.cp * on.plan.par.dp > 1) {
    EXPECT_LT(simulate_plan(on.plan, req.hw).peak_device_bytes, simulate_plan(flipped, req.hw).peak_device_bytes);
  }
}

}  // namespace
}  // namespace sppo::sim
