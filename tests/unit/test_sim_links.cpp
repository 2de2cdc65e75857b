// Host links in the simulator: a profile's copy bandwidth moves a copy-bound plan; links
// that several devices share (PCIe switch, NUMA node, NIC) slow the transfers that cross
// them at the same time. And the ring layout: the builder and the cost model agree, and a
// contiguous layout shows its causal imbalance.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "planner/partition.h"
#include "planner/profile.h"
#include "schedule/builders.h"
#include "schedule/validate.h"
#include "sim/simulator.h"
#include "sim/solver.h"

namespace sppo::sim {
namespace {

// A copy-bound step: every unit offloaded over a slow host link.
SimResult copy_bound(const HardwareProfile& hw, int dp = 1) {
  const ModelConfig c = preset("medium");
  const auto lengths = plan::partition_length(8192, 8);
  std::vector<double> full(8, 1.0);
  full.back() = 0;
  sched::PipelineSpec spec;
  spec.layers = c.layers;
  spec.lengths = lengths;
  spec.alpha = full;
  spec.par.dp = dp;
  return simulate(sched::build_pipeline(spec), CostModel(hw, c, ActPrecision::F32), memory_rules(c, ActPrecision::F32));
}

TEST(HostLinks, ProfileBandwidthMovesACopyBoundPlan) {
  nlohmann::json j = plan::to_json(plan::load_profile("a100-80gb"));
  j["d2h_gbps"] = j["h2d_gbps"] = 1.0;
  const SimResult one = copy_bound(plan::profile_from_json(j, "test"));
  j["d2h_gbps"] = j["h2d_gbps"] = 2.0;
  const SimResult two = copy_bound(plan::profile_from_json(j, "test"));
  EXPECT_GT(one.exposed_copy_s, 0);
  EXPECT_GT(one.step_time_s, two.step_time_s * 1.3) << "halving the host bandwidth hardly moved a copy-bound step";
}

TEST(HostLinks, ASharedSwitchSlowsCopiesThatOverlap) {
  nlohmann::json j = plan::to_json(plan::load_profile("a100-80gb"));
  j["d2h_gbps"] = j["h2d_gbps"] = 2.0;
  j.erase("gpus_per_pcie_switch");
  j.erase("pcie_switch_gbps");
  j.erase("gpus_per_numa_node");
  j.erase("numa_host_gbps");
  j.erase("gpus_per_nic");
  j.erase("nic_gbps");
  // Two replicas copy at the same moments.
  const SimResult alone = copy_bound(plan::profile_from_json(j, "test"), 2);
  EXPECT_EQ(alone.passes, 1);
  j["gpus_per_pcie_switch"] = 2;
  j["pcie_switch_gbps"] = 2.0;  // one device's worth for two
  const SimResult shared = copy_bound(plan::profile_from_json(j, "test"), 2);
  EXPECT_GT(shared.passes, 1);
  EXPECT_GT(shared.copy_slowdown, 1.5);
  EXPECT_GT(shared.step_time_s, alone.step_time_s * 1.3);
  j["pcie_switch_gbps"] = 4.0;  // enough for both
  const SimResult wide = copy_bound(plan::profile_from_json(j, "test"), 2);
  EXPECT_NEAR(wide.step_time_s, alone.step_time_s, 1e-6 * alone.step_time_s);
  j["pcie_switch_gbps"] = 3.0;
  const SimResult between = copy_bound(plan::profile_from_json(j, "test"), 2);
  EXPECT_LT(between.step_time_s, shared.step_time_s);
  EXPECT_GT(between.step_time_s, wide.step_time_s);
  // One device alone behind the switch is not slowed.
  j["pcie_switch_gbps"] = 2.0;
  const SimResult one = copy_bound(plan::profile_from_json(j, "test"), 1);
  j["gpus_per_pcie_switch"] = 0;
  j["pcie_switch_gbps"] = 0;
  EXPECT_NEAR(one.step_time_s, copy_bound(plan::profile_from_json(j, "test"), 1).step_time_s, 1e-9);
  // Host memory shared by a NUMA node counts both directions together.
  j["gpus_per_numa_node"] = 2;
  j["numa_host_gbps"] = 2.0;
  const SimResult numa = copy_bound(plan::profile_from_json(j, "test"), 2);
  EXPECT_GT(numa.step_time_s, alone.step_time_s * 1.3);
}

// The planner's alpha search simulates one schedule again with other fractions
// (Resimulator); every figure must equal simulating the rebuilt schedule from scratch,
// including under shared links (several passes) and on rings and tensor parallelism.
void expect_same(const SimResult& got, const SimResult& want, const std::string& what) {
  EXPECT_EQ(got.step_time_s, want.step_time_s) << what;
  EXPECT_EQ(got.peak_bytes, want.peak_bytes) << what;
  EXPECT_EQ(got.peak_host_bytes, want.peak_host_bytes) << what;
  EXPECT_EQ(got.peak_terms, want.peak_terms) << what;
  EXPECT_EQ(got.host_at_peak, want.host_at_peak) << what;
  EXPECT_EQ(got.exposed_copy_s, want.exposed_copy_s) << what;
  EXPECT_EQ(got.passes, want.passes) << what;
  EXPECT_EQ(got.sent_bytes, want.sent_bytes) << what;
  EXPECT_EQ(got.forward_end, want.forward_end) << what;
  EXPECT_EQ(got.backward_start, want.backward_start) << what;
}

// Note [Streams on the copy streams]: a backward's K/V chunks go on the copy stream behind
// the prefetch queued before it, so over a slow host link that backward waits for the
// prefetch, then takes its chunks; a copy queued after it waits for the chunks in turn.
TEST(HostLinks, StreamedChunksQueueBehindThePrefetch) {
  const ModelConfig c = preset("medium");
  nlohmann::json j = plan::to_json(plan::load_profile("a100-80gb"));
  j["d2h_gbps"] = j["h2d_gbps"] = 0.5;
  const HardwareProfile hw = plan::profile_from_json(j, "test");
  const CostModel cost(hw, c, ActPrecision::F32);
  const auto rules = memory_rules(c, ActPrecision::F32);
  const std::vector<i64> lengths = plan::partition_length(4096, 3);
  auto with_host_kv = [&](std::vector<double> alpha) {
    sched::Schedule s = sched::build_single(c.layers, lengths, alpha);
    s.place.kv.assign(std::size_t(c.layers), KvPlace::Host);
    SimOptions o;
    o.record = true;
    return simulate(s, cost, rules, o);
  };
  const SimResult plain = with_host_kv({0, 0, 0});
  const SimResult off = with_host_kv({1, 1, 0});
  auto event = [](const SimResult& r, const std::string& name) {
    for (const TraceEvent& e : r.events)
      if (e.name == name) return e;
    ADD_FAILURE() << "no event " << name;
    return TraceEvent{};
  };
  // The prefetch of s1 is queued just before B s2; B s2's chunks (s0 and s1's K, V and
  // sums) follow it on the copy stream.
  const TraceEvent prefetch = event(off, "P s1 1");
  const TraceEvent b2 = event(off, "B L0-" + std::to_string(c.layers - 1) + " s2");
  const TraceEvent b2_plain = event(plain, "B L0-" + std::to_string(c.layers - 1) + " s2");
  const double b2_alone = b2_plain.dur;
  EXPECT_GT(prefetch.dur, 0.1 * b2_alone) << "the prefetch should be long over this link";
  EXPECT_GE(b2.dur, b2_alone + 0.5 * (prefetch.start + prefetch.dur - b2.start))
      << "B s2 should wait for the prefetch queued before its chunks";
  // And the prefetch of s0, queued after B s2, starts once B s2's chunks are through.
  const TraceEvent prefetch0 = event(off, "P s0 1");
  EXPECT_GE(prefetch0.start, prefetch.start + prefetch.dur);
  EXPECT_GT(off.step_time_s, plain.step_time_s);
}

TEST(Resimulator, EqualsSimulatingFromScratch) {
  const ModelConfig c = preset("medium");
  const CostModel cost(plan::load_profile("a100-80gb"), c, ActPrecision::BF16);
  const sched::MemoryRules rules = memory_rules(c, ActPrecision::BF16);
  struct Shape {
    int pp, sp, dp, tp;
    bool msp;
    bool kv_host = false;  // every other layer's K/V on the host
  };
  for (const Shape& sh : {Shape{1, 1, 1, 1, false}, Shape{2, 1, 2, 1, false}, Shape{3, 1, 1, 1, true},
                          Shape{2, 2, 1, 1, false}, Shape{2, 1, 1, 2, false}, Shape{2, 1, 1, 1, false, true},
                          Shape{1, 1, 2, 2, false, true}, Shape{2, 2, 1, 1, false, true}, Shape{3, 1, 1, 1, true, true}}) {
    const int N = 6;
    auto build = [&](const std::vector<double>& alpha) {
      sched::PipelineSpec spec;
      spec.layers = c.layers;
      spec.lengths = plan::partition_flops(c, 6 * 4096, N);
      spec.alpha = alpha;
      spec.par.pp = sh.pp;
      spec.par.cp = sh.sp;
      spec.par.ring_layout = RingLayout::Contiguous;
      spec.par.dp = sh.dp;
      spec.par.msp.on = sh.msp;
      sched::Schedule s = sched::expand_tensor_parallel(sched::build_pipeline(spec), sh.tp);
      if (sh.kv_host)
        for (int l = 0; l < c.layers; ++l) s.place.kv.push_back(l % 2 ? KvPlace::Host : KvPlace::Device);
      return s;
    };
    const std::vector<double> first = {1.0, 0.75, 0.0, 0.5, 0.25, 0.0};
    Resimulator again(build(first), cost, rules);
    const std::string what = "pp " + std::to_string(sh.pp) + " sp " + std::to_string(sh.sp) + " dp " +
                             std::to_string(sh.dp) + " tp " + std::to_string(sh.tp) + " msp " + std::to_string(sh.msp) +
                             " kv host " + std::to_string(sh.kv_host);
    for (const std::vector<double>& alpha : {std::vector<double>{0.5, 0.25, 0.0, 1.0, 0.125, 0.0},
                                             std::vector<double>{0.05, 1.0, 0.0, 0.3, 0.9, 0.0}}) {
      again.set_fractions(alpha);
      const SimResult got = again.simulate();
      expect_same(got, simulate(build(alpha), cost, rules), what);
      EXPECT_NE(got.peak_host_bytes, simulate(build(first), cost, rules).peak_host_bytes) << what;
    }
    // Schedules that offload other subsequences, then one of another layout (worked out anew).
    for (const std::vector<double>& alpha : {std::vector<double>{0.0, 0.5, 1.0, 0.0, 0.25, 0.0},
                                             std::vector<double>{0.7, 0.0, 0.0, 0.0, 0.0, 0.0},
                                             std::vector<double>{0.0, 0.0, 0.0, 0.0, 0.0, 0.0},
                                             std::vector<double>{1.0, 1.0, 1.0, 1.0, 1.0, 0.0}}) {
      EXPECT_TRUE(again.replace(build(alpha))) << what;
      expect_same(again.simulate(), simulate(build(alpha), cost, rules), what);
    }
  }
  // A schedule of another layout in place of one: nothing of the old one is kept.
  sched::PipelineSpec one, two;
  one.layers = two.layers = c.layers;
  one.lengths = plan::partition_flops(c, 4 * 4096, 4);
  two.lengths = plan::partition_length(4 * 4096, 4);
  one.alpha = two.alpha = {0.5, 0.5, 0.5, 0.0};
  one.par.pp = 2;
  two.par.pp = 2;
  two.par.cp = 2;
  two.par.ring_layout = RingLayout::Contiguous;
  Resimulator again(sched::build_pipeline(one), cost, rules);
  EXPECT_FALSE(again.replace(sched::build_pipeline(two)));
  expect_same(again.simulate(), simulate(sched::build_pipeline(two), cost, rules), "another layout");
}

// Note [A floor under the peak]: the floor at the largest fractions is at most the
// simulated peak of every alpha, on every layout; on one rank with no copies it is that
// peak; and on a slow host link, where the copies finish late, it lies below the peak.
TEST(Resimulator, PeakFloorIsUnderEveryTimedPeak) {
  const ModelConfig c = preset("medium");
  const sched::MemoryRules rules = memory_rules(c, ActPrecision::BF16);
  nlohmann::json slow_link = plan::to_json(plan::load_profile("a100-80gb"));
  slow_link["d2h_gbps"] = slow_link["h2d_gbps"] = 0.5;
  const CostModel fast(plan::load_profile("a100-80gb"), c, ActPrecision::BF16),
      slow(plan::profile_from_json(slow_link, "test"), c, ActPrecision::BF16);
  struct Shape {
    int pp, sp, tp;
    bool msp;
    KvPlace kv = KvPlace::Device;
  };
  const int N = 6;
  const std::vector<double> full = {1, 1, 1, 1, 1, 0}, zeros(N, 0.0);
  bool below = false;
  for (const Shape& sh : {Shape{1, 1, 1, false}, Shape{2, 1, 1, false}, Shape{3, 1, 1, true}, Shape{2, 2, 1, false},
                          Shape{2, 1, 2, false}, Shape{2, 1, 1, false, KvPlace::Host},
                          Shape{2, 2, 1, false, KvPlace::Host}, Shape{3, 1, 1, true, KvPlace::Host},
                          Shape{1, 1, 1, false, KvPlace::Recompute}}) {
    auto build = [&](const std::vector<double>& alpha) {
      sched::PipelineSpec spec;
      spec.layers = c.layers;
      spec.lengths = plan::partition_flops(c, 6 * 4096, N);
      spec.alpha = alpha;
      spec.par.pp = sh.pp;
      spec.par.cp = sh.sp;
      spec.par.ring_layout = RingLayout::Contiguous;
      spec.par.msp.on = sh.msp;
      sched::Schedule s = sched::expand_tensor_parallel(sched::build_pipeline(spec), sh.tp);
      s.place.kv.assign(std::size_t(c.layers), sh.kv);
      return s;
    };
    const std::string what = "pp " + std::to_string(sh.pp) + " sp " + std::to_string(sh.sp) + " tp " +
                             std::to_string(sh.tp) + " msp " + std::to_string(sh.msp) + " kv " + to_string(sh.kv);
    for (const CostModel* cost : {&fast, &slow}) {
      const i64 floor = Resimulator(build(full), *cost, rules).peak_floor();
      EXPECT_GT(floor, 0) << what;
      for (const std::vector<double>& alpha : {full, zeros, std::vector<double>{0.5, 0.25, 1.0, 0.0, 0.75, 0.0}}) {
        const i64 peak = simulate(build(alpha), *cost, rules).peak_device_bytes;
        EXPECT_LE(floor, peak) << what;
        below = below || floor < peak;
      }
      if (sh.pp == 1 && sh.sp == 1 && sh.tp == 1) {
        EXPECT_EQ(Resimulator(build(zeros), *cost, rules).peak_floor(),
                  simulate(build(zeros), *cost, rules).peak_device_bytes)
            << what;
      }
    }
  }
  EXPECT_TRUE(below) << "the floor was the peak everywhere: no test of a copy finishing late";
}

TEST(HostLinks, ASharedNicSlowsMessagesBetweenNodes) {
  // Two stages of two SP ranks, one node each: both SP ranks of stage 0 send their hidden
  // states to stage 1 at once, through one NIC when they share it.
  const ModelConfig c = preset("medium");
  sched::PipelineSpec spec;
  spec.layers = c.layers;
  spec.par.pp = 2;
  spec.par.cp = 2;
  spec.par.ring_layout = RingLayout::Contiguous;
  spec.lengths = plan::partition_length(65536, 4);
  HardwareProfile hw = plan::load_profile("a100-80gb");
  hw.devices_per_node = 2;
  hw.gpus_per_pcie_switch = hw.gpus_per_numa_node = 0;
  hw.pcie_switch_bw = hw.numa_host_bw = 0;
  hw.inter_node_bw = 1e8;
  hw.gpus_per_nic = 1;
  hw.nic_bw = 1e8;
  const auto rules = memory_rules(c, ActPrecision::BF16);
  const sched::Schedule s = sched::build_pipeline(spec);
  const SimResult own = simulate(s, CostModel(hw, c, ActPrecision::BF16), rules);
  hw.gpus_per_nic = 2;
  const SimResult shared = simulate(s, CostModel(hw, c, ActPrecision::BF16), rules);
  EXPECT_GT(shared.step_time_s, own.step_time_s * 1.05);
}

TEST(RingLayout, BuilderAndCostModelAgree) {
  // Zigzag: piece r of R holds chunks r and 2R-1-r of 2R; the messages carry those tokens.
  sched::PipelineSpec spec;
  spec.layers = 2;
  spec.par.cp = 4;
  spec.par.pp = 2;
  spec.lengths = {800, 640};
  spec.par.ring_layout = RingLayout::Zigzag;
  const sched::Schedule s = sched::build_pipeline(spec);
  ASSERT_TRUE(sched::validate(s).ok()) << sched::validate(s).message();
  EXPECT_EQ(s.par.ring_layout, RingLayout::Zigzag);
  for (int rank = 0; rank < s.ranks(); ++rank)
    for (const sched::Op& op : s.ops[rank]) {
      if (op.kind != sched::OpKind::Forward && op.kind != sched::OpKind::RingStep && op.kind != sched::OpKind::Send)
        continue;
      if (op.kind == sched::OpKind::Send && op.payload != sched::Payload::Hidden) continue;
      const sched::Spans sp = s.spans(op);
      ASSERT_EQ(sp.size(), 2u);
      const i64 l = s.lengths[op.subseq];
      EXPECT_EQ(sp[0], piece_range(l, op.piece, 8));
      EXPECT_EQ(sp[1], piece_range(l, 7 - op.piece, 8));
      if (op.kind != sched::OpKind::Forward) {
        EXPECT_EQ(op.tokens, sched::span_tokens(sp)) << to_string(op);
      }
    }
  // The cost of a piece is the attention of its own query positions.
  const ModelConfig c = preset("tiny");
  const CostModel cost(plan::load_profile("a100-80gb"), c, ActPrecision::BF16);
  const sched::Spans z = sched::piece_spans(800, 1, 4, RingLayout::Zigzag);
  EXPECT_DOUBLE_EQ(cost.attention_flops(640, z), cost.attention_flops(640, 100, 200) + cost.attention_flops(640, 600, 700));
}

TEST(RingLayout, ContiguousShowsTheCausalImbalance) {
  const ModelConfig c = preset("medium");
  HardwareProfile hw = plan::load_profile("a100-80gb");
  hw.attention_efficiency = 0.05;  // attention-bound, so the split of the triangle shows
  const CostModel cost(hw, c, ActPrecision::BF16);
  const auto rules = memory_rules(c, ActPrecision::BF16);
  SimResult r[2];
  for (int k = 0; k < 2; ++k) {
    sched::PipelineSpec spec;
    spec.layers = c.layers;
    spec.par.cp = 4;
    spec.lengths = plan::partition_flops(c, 65536, 4);
    spec.par.ring_layout = k == 0 ? RingLayout::Contiguous : RingLayout::Zigzag;
    SimOptions o;
    o.record = true;
    r[k] = simulate(sched::build_pipeline(spec), cost, rules, o);
  }
  // The pieces of a subsequence all attend to its whole prefix; only its own triangle
  // splits unevenly (the last of R contiguous pieces does 2R - 1 times the first's).
  EXPECT_GT(r[0].step_time_s, r[1].step_time_s * 1.15) << "contiguous " << r[0].step_time_s << " s, zigzag "
                                                       << r[1].step_time_s << " s";
  EXPECT_GT(r[0].bubble_ratio, r[1].bubble_ratio + 0.1) << r[0].bubble_ratio << " vs " << r[1].bubble_ratio;
  // Zigzag pieces do nearly the same work.
  EXPECT_LT(r[1].bubble_ratio, 0.05);
}

// A bidirectional model's queries see every key of their subsequence, wherever a ring
// piece holds them: 4 H T L FLOPs, twice the causal triangle of a whole subsequence, the
// same for each piece of a ring (no imbalance to balance). RSA pieces run the same FLOPs
// as GEMMs of the head size and move their fp32 score rows, so they cost more than the
// flash ring's, forward and backward.
TEST(Bidirectional, EveryQuerySeesTheWholeSubsequence) {
  ModelConfig c = preset("medium");
  const HardwareProfile hw = plan::load_profile("a100-80gb");
  const CostModel causal(hw, c, ActPrecision::F32);
  c.causal = false;
  const CostModel bidi(hw, c, ActPrecision::F32);
  const i64 L = 4096;
  const double H = c.hidden;
  EXPECT_DOUBLE_EQ(bidi.attention_flops(0, sched::Spans{{0, L}}), 4 * H * L * L);
  EXPECT_DOUBLE_EQ(causal.attention_flops(0, sched::Spans{{0, L}}), 4 * H * L * (L + 1) / 2.0);
  for (int piece = 0; piece < 4; ++piece) {
    const sched::Spans sp = sched::piece_spans(L, piece, 4, RingLayout::Contiguous);
    EXPECT_DOUBLE_EQ(bidi.attention_flops(0, sp, L), 4 * H * (L / 4) * L) << "piece " << piece;
  }
  // In a step: one ring of 4 over one subsequence, flash against RSA.
  sched::PipelineSpec spec;
  spec.layers = c.layers;
  spec.par.cp = 4;
  spec.lengths = {L};
  spec.par.ring_layout = RingLayout::Contiguous;
  sched::Schedule s = sched::build_pipeline(spec);
  const auto rules = memory_rules(c, ActPrecision::F32);
  const SimResult flash = simulate(s, bidi, rules), causal_run = simulate(s, causal, rules);
  EXPECT_GT(flash.step_time_s, causal_run.step_time_s);
  s.par.ring_algorithm = RingAlgorithm::Rsa;
  const SimResult rsa = simulate(s, bidi, rules);
  EXPECT_GT(rsa.step_time_s, flash.step_time_s);
  // Its score rows: [Z, L / 4, L] fp32 forward, twice that in backward, on every rank.
  EXPECT_GE(rsa.peak_device_bytes - flash.peak_device_bytes, 2 * i64(c.heads) * (L / 4) * L * 4 -
                                                                  i64(c.hidden) * L * 8);
  for (int rank = 0; rank < s.ranks(); ++rank)
    for (const sched::Op& op : s.ops[std::size_t(rank)]) {
      if (op.kind != sched::OpKind::RingStep || op.step < 1 || op.step > 3) continue;
      const i64 row = i64(c.hidden) * 4;
      EXPECT_EQ(bidi.message_bytes(op, s),
                (op.payload == sched::Payload::KV ? 2 : 5) * (L / 4) * row * (op.layer_end - op.layer_begin))
          << to_string(op);
    }
}

}  // namespace
}  // namespace sppo::sim
