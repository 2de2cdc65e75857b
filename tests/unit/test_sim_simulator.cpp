// The simulator: bubbles of the sequence pipeline, memory against the validator's rules,
// copies hidden or exposed, the trace and SVG outputs, and the hardware profiles.
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "planner/partition.h"
#include "planner/profile.h"
#include "schedule/builders.h"
#include "schedule/memory.h"
#include "schedule/validate.h"
#include "sim/simulator.h"
#include "sim/solver.h"

namespace sppo::sim {
namespace {

// Compute only: GEMMs at 1 TFLOP/s, attention free, copies and messages instant.
HardwareProfile ideal() {
  HardwareProfile h;
  h.name = "ideal";
  h.gemm_flops = 1e12;
  h.attention_efficiency = 1e12;
  h.d2h_bw = h.h2d_bw = h.intra_node_bw = h.inter_node_bw = 1e30;
  h.device_memory = i64(1) << 40;
  h.devices_per_node = 8;
  return h;
}

ModelConfig small() {
  ModelConfig c = preset("small");
  c.layers = 8;
  return c;
}

TEST(Profiles, PresetsEqualTheFilesAndLoadAnywhere) {
  for (const auto& name : plan::profile_names()) {
    const std::string path = std::string(SPPO_SOURCE_DIR) + "/profiles/" + name + ".json";
    const HardwareProfile file = plan::load_profile(path);
    const HardwareProfile byname = plan::load_profile(name);
    EXPECT_EQ(plan::to_json(file), plan::to_json(byname)) << name;
    EXPECT_GT(file.usable_memory(), 0);
  }
  EXPECT_THROW(plan::load_profile("no-such-gpu"), Error);
}

TEST(Profiles, EveryFieldOfThePresetsStatesItsSource) {
  for (const auto& name : plan::profile_names()) {
    const nlohmann::json j = plan::to_json(plan::load_profile(name));
    ASSERT_TRUE(j["description"].is_array()) << name;
    std::string text;
    for (const auto& line : j["description"]) text += line.get<std::string>() + "\n";
    for (const auto& [key, value] : j.items()) {
      if (key == "name" || key == "description" || (value.is_array() && value.empty())) continue;
      EXPECT_NE(text.find(key), std::string::npos) << name << ": no source for " << key;
    }
    EXPECT_NE(text.find("Measured"), std::string::npos) << name;
  }
}

// Note [Attention after a prefix]: the prefix rate prices exactly the FLOPs against keys
// before the subsequence; a subsequence at offset 0 has none.
TEST(Profiles, PrefixRatePricesTheKeysBeforeTheSubsequence) {
  ModelConfig c = preset("small");
  HardwareProfile hw = plan::load_profile("h100-sxm");
  hw.elementwise_bw = 0;
  hw.layer_overhead = 0;
  HardwareProfile faster = hw;
  faster.attention_prefix_ratio = 2;
  const plan::CostModel a(hw, c, ActPrecision::BF16), b(faster, c, ActPrecision::BF16);
  const i64 T = 4096, o = 60000;
  EXPECT_DOUBLE_EQ(a.layer_forward_s(0, T), b.layer_forward_s(0, T));
  const double prefix_s = 4.0 * c.hidden * double(T) * double(o) / hw.attention_rate(c.head_size());
  EXPECT_NEAR(a.layer_forward_s(o, T) - b.layer_forward_s(o, T), prefix_s / 2, 1e-9 * prefix_s);
  nlohmann::json j = plan::to_json(faster);
  EXPECT_EQ(plan::profile_from_json(j, "test").attention_prefix_ratio, 2);
  j["attention_prefix_ratio"] = 0;
  EXPECT_THROW(plan::profile_from_json(j, "test"), Error);
}

// Packed documents: each query is priced against its own document's keys up to itself,
// those before the subsequence at the prefix rate; one document is the unpacked price.
TEST(Profiles, PackedAttentionPricesEachDocumentAlone) {
  const ModelConfig c = preset("small");
  HardwareProfile hw = plan::load_profile("h100-sxm");
  hw.elementwise_bw = 0;
  hw.layer_overhead = 0;
  const plan::CostModel cost(hw, c, ActPrecision::BF16);
  const std::vector<i64> one{0};
  for (const i64 o : {i64{0}, i64{6000}})
    EXPECT_DOUBLE_EQ(cost.attention_s(o, {{0, 4096}}, 0, &one), cost.attention_s(o, {{0, 4096}})) << o;
  // Two documents of 4096 at offset 0 cost two sequences of 4096.
  const std::vector<i64> halves{0, 4096};
  EXPECT_NEAR(cost.attention_s(0, {{0, 8192}}, 0, &halves), 2 * cost.attention_s(0, {{0, 4096}}),
              1e-12 * cost.attention_s(0, {{0, 4096}}));
  // A subsequence [4096, 8192) over documents beginning at 2048 and 6144: 2048 queries see
  // the 2048 keys of their document before 4096 (at the prefix rate), and each half of the
  // subsequence sees its own keys causally.
  const std::vector<i64> docs{0, 2048, 6144};
  const double H = c.hidden, A = c.head_size();
  const double want = 4 * H * 2048.0 * 2048 / hw.attention_prefix_rate(A, 4096) +
                      4 * H * 2048.0 * 2049 / hw.attention_rate(A);
  EXPECT_NEAR(cost.attention_s(4096, {{0, 4096}}, 0, &docs), want, 1e-12 * want);
  EXPECT_LT(cost.attention_s(4096, {{0, 4096}}, 0, &docs), 0.4 * cost.attention_s(4096, {{0, 4096}}));
}

// Note [Streamed chunks]: a host-K/V layer's forward pays copy_issue per copy and
// attention_chunk per chunk on top of the bytes; a short span of query rows runs its
// prefix attention at its own (lower) ratio; the fields round-trip and are range-checked.
TEST(Profiles, StreamedChunksPriceTheirFixedCosts) {
  const ModelConfig c = preset("small");
  HardwareProfile hw = plan::load_profile("h100-sxm");
  // Three subsequences of 1100 (longer than kKvChunkMinRows, no multiple of it): the third
  // at offset 2200 streams chunks of 1100 rows, [0, 1100) one piece and [1100, 2200) one:
  // 2 chunks, 2 pieces.
  sched::Schedule s = sched::build_single(c.layers, {1100, 1100, 1100}, {0, 0, 0});
  s.place.kv.assign(std::size_t(c.layers), KvPlace::Host);
  const sched::Op* f2 = nullptr;
  for (const auto& op : s.ops[0])
    if (op.kind == sched::OpKind::Forward && op.subseq == 2) f2 = &op;
  ASSERT_NE(f2, nullptr);
  HardwareProfile fixed = hw;
  fixed.copy_issue = 3e-6;
  fixed.attention_chunk = 7e-6;
  const plan::CostModel a(hw, c, ActPrecision::BF16), b(fixed, c, ActPrecision::BF16);
  const int layers = f2->layer_end - f2->layer_begin;
  // Per layer: 2 pieces x (K, V) in, the own K, V out, 2 chunks.
  const double extra = layers * ((2 * 2 + 2) * 3e-6 + 2 * 7e-6);
  EXPECT_NEAR(b.forward_s(*f2, s) - a.forward_s(*f2, s), extra, 1e-12);

  HardwareProfile by_rows = hw;
  by_rows.attention_prefix_ratio_by_queries = {{64, 0.5}, {1024, 1.0}};
  const plan::CostModel d(by_rows, c, ActPrecision::BF16);
  const double rate = hw.attention_rate(c.head_size());
  auto prefix_s = [&](i64 rows, double ratio) { return 4.0 * c.hidden * double(rows) * 60000.0 / (rate * ratio); };
  for (const auto& [rows, ratio] : {std::pair<i64, double>{64, 0.5}, {2048, 1.0}}) {
    const double moved = prefix_s(rows, ratio) - prefix_s(rows, hw.attention_prefix_ratio);
    EXPECT_NEAR(d.layer_forward_s(60000, rows) - a.layer_forward_s(60000, rows), moved, 1e-9 * prefix_s(rows, 1))
        << rows << " query rows";
  }

  nlohmann::json j = plan::to_json(fixed);
  j["copy_compute_share"] = 0.25;
  const HardwareProfile back = plan::profile_from_json(j, "test");
  EXPECT_DOUBLE_EQ(back.copy_issue, 3e-6);
  EXPECT_DOUBLE_EQ(back.attention_chunk, 7e-6);
  EXPECT_DOUBLE_EQ(back.copy_compute_share, 0.25);
  j["copy_compute_share"] = 1.5;
  EXPECT_THROW(plan::profile_from_json(j, "test"), Error);
}

// A CPU profile says how many threads it was measured with; a GPU preset has none.
TEST(Profiles, ThreadsRoundTrip) {
  EXPECT_EQ(plan::load_profile("h200").threads, 0);
  EXPECT_FALSE(plan::to_json(plan::load_profile("h200")).contains("threads"));
  nlohmann::json j = plan::to_json(plan::load_profile("h200"));
  j["threads"] = 3;
  EXPECT_EQ(plan::profile_from_json(j, "test").threads, 3);
  EXPECT_EQ(plan::to_json(plan::profile_from_json(j, "test"))["threads"], 3);
  j["threads"] = 1e9;
  EXPECT_THROW(plan::profile_from_json(j, "test"), Error);
}

// Note [Attention kernels by shape class]: the measured choice per class survives the file,
// and a class the runtime cannot read is refused naming what is wrong.
TEST(Profiles, AttentionKernelClassesRoundTrip) {
  EXPECT_FALSE(plan::to_json(plan::load_profile("h200")).contains("attention_kernels"));
  nlohmann::json j = plan::to_json(plan::load_profile("h200"));
  j["attention_kernels"] = {{{"head_size", 128}, {"pattern", "causal"}, {"rows", 8192}, {"kernel", "cudnn"},
                             {"cudnn_tflops", 600.0}, {"own_tflops", 170.0}},
                            {{"head_size", 64}, {"pattern", "after_keys"}, {"rows", 1024}, {"kernel", "own"}}};
  const HardwareProfile p = plan::profile_from_json(j, "test");
  ASSERT_EQ(p.attention_kernels.size(), 2u);
  EXPECT_TRUE(p.attention_kernels[0].causal);
  EXPECT_EQ(p.attention_kernels[0].kernel, "cudnn");
  EXPECT_DOUBLE_EQ(p.attention_kernels[0].cudnn_flops, 600e12);
  EXPECT_FALSE(p.attention_kernels[1].causal);
  EXPECT_EQ(plan::to_json(p)["attention_kernels"], plan::to_json(plan::profile_from_json(plan::to_json(p), "again"))["attention_kernels"]);
  for (const auto& [key, bad] : {std::pair<std::string, nlohmann::json>{"kernel", "flash"}, {"pattern", "diagonal"},
                                 {"rows", -1}, {"head_size", 0}}) {
    nlohmann::json b = j;
    b["attention_kernels"][0][key] = bad;
    try {
      plan::profile_from_json(b, "test");
      ADD_FAILURE() << key << " " << bad.dump() << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("attention_kernels"), std::string::npos) << e.what();
    }
  }
}

TEST(Profiles, MissingFieldIsNamedAndSaveRoundTrips) {
  nlohmann::json j = plan::to_json(plan::load_profile("h100-sxm"));
  j.erase("d2h_gbps");
  try {
    plan::profile_from_json(j, "x.json");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("d2h_gbps"), std::string::npos) << e.what();
  }
  const std::string path = std::string(SPPO_BINARY_DIR) + "/test_profile_roundtrip.json";
  plan::save_profile(plan::load_profile("h200"), path);
  EXPECT_EQ(plan::to_json(plan::load_profile(path)), plan::to_json(plan::load_profile("h200")));
}

TEST(Simulator, PipelineBubbleIsPMinusOneOverN) {
  const ModelConfig c = small();
  const CostModel cost(ideal(), c, ActPrecision::BF16);
  const auto rules = memory_rules(c, ActPrecision::BF16);
  for (int P : {2, 4})
    for (int N : {4, 8, 16}) {
      sched::PipelineSpec spec;
      spec.layers = c.layers;
      spec.par.pp = P;
      spec.lengths = plan::partition_length(1024 * N, N);
      ASSERT_EQ(c.layers % P, 0);
      // The LM head adds work to the last stage only; leave it out of the balance by
      // giving the head nothing to do (vocabulary 2).
      ModelConfig c2 = c;
      c2.vocab = 2;
      const CostModel cost2(ideal(), c2, ActPrecision::BF16);
      const SimResult r = simulate(sched::build_pipeline(spec), cost2, memory_rules(c2, ActPrecision::BF16));
      EXPECT_NEAR(r.bubble_ratio, double(P - 1) / N, 1e-3) << "P " << P << " N " << N;
      spec.par.msp.on = true;
      const SimResult m = simulate(sched::build_pipeline(spec), cost2, memory_rules(c2, ActPrecision::BF16));
      EXPECT_LT(m.bubble_ratio, r.bubble_ratio) << "MSP does not lower the bubbles, P " << P << " N " << N;
      EXPECT_LT(m.step_time_s, r.step_time_s);
    }
  (void)cost;
  (void)rules;
}

// The planner's search simulates one data-parallel replica and prices its weight
// gradients' all-reduce across all of them (CostModel::price_replicas): its step must be
// the whole plan's, also where one replica's own group is a single rank (no ring, one
// replica of each stage), which once built no all-reduce at all and made such layouts look
// faster than they run. No copies, so that no host link is shared between replicas.
TEST(Simulator, OneReplicaPricedAcrossReplicasStepsAsTheWholePlan) {
  const ModelConfig c = small();
  const auto rules = memory_rules(c, ActPrecision::BF16);
  const HardwareProfile hw = plan::load_profile("a100-80gb");
  struct Shape {
    int pp, sp, dp, per_node;
  };
  for (const Shape& sh :
       {Shape{1, 1, 4, 8}, Shape{2, 1, 4, 8}, Shape{2, 1, 4, 2}, Shape{1, 2, 2, 8}, Shape{2, 2, 2, 4}}) {
    sched::PipelineSpec spec;
    spec.layers = c.layers;
    spec.par.pp = sh.pp;
    spec.par.cp = sh.sp;
    spec.par.ring_layout = RingLayout::Contiguous;
    spec.par.dp = sh.dp;
    spec.lengths = plan::partition_flops(c, 8192, 4);
    HardwareProfile h = hw;
    h.devices_per_node = sh.per_node;
    const CostModel cost(h, c, ActPrecision::BF16);
    const SimResult whole = simulate(sched::build_pipeline(spec), cost, rules);
    CostModel priced = cost;
    priced.price_replicas(sh.dp, sh.pp * sh.sp);
    spec.par.dp = 1;
    spec.replicated = true;
    const SimResult one = simulate(sched::build_pipeline(spec), priced, rules);
    const std::string what = "pp " + std::to_string(sh.pp) + " sp " + std::to_string(sh.sp) + " dp " +
                             std::to_string(sh.dp) + ", " + std::to_string(sh.per_node) + " a node";
    EXPECT_NEAR(one.step_time_s, whole.step_time_s, 1e-9 * whole.step_time_s) << what;
    EXPECT_EQ(one.peak_device_bytes, whole.peak_device_bytes) << what;
    // Built as a lone replica (no all-reduce where its group is one rank), it is faster.
    spec.replicated = false;
    const SimResult alone = simulate(sched::build_pipeline(spec), priced, rules);
    if (sh.sp == 1) {
      EXPECT_LT(alone.step_time_s, whole.step_time_s) << what;
    }
  }
}

TEST(Simulator, PeakMatchesTheRulesWithoutCopies) {
  const ModelConfig c = small();
  const auto rules = memory_rules(c, ActPrecision::F32);
  const CostModel cost(plan::load_profile("a100-80gb"), c, ActPrecision::F32);
  const auto lengths = plan::partition_flops(c, 4096, 4);
  const sched::Schedule s = sched::build_single(c.layers, lengths, {0, 0, 0, 0});
  const sched::Validation v = sched::validate(s, {&rules, 0});
  ASSERT_TRUE(v.ok()) << v.message();
  const SimResult r = simulate(s, cost, rules);
  EXPECT_EQ(r.peak_device_bytes, v.peak_bytes[0]);
  // By hand: weights + every K/V and unit + the last subsequence's head_grad, then B(N-1)
  // allocates the first layer's accumulators and workspace: the peak is at its first layer.
  sched::RankMemory m(rules, s, 0);
  const i64 S = 4096, T = lengths.back();
  const i64 kv = m.kv_per_token(), unit = m.unit_per_token(), head = m.head_grad_per_token();
  const i64 ws = m.ws_per_token(), acc = m.acc_per_token();
  const i64 at_b = m.fixed_bytes() + c.layers * (kv + unit) * S + head * (S - T) + ws * T + acc * S;
  EXPECT_EQ(r.peak_device_bytes, std::max(at_b, r.peak_device_bytes));
  EXPECT_GE(r.peak_device_bytes, at_b);
}

TEST(Simulator, OffloadLowersPeakAndHidesBehindCompute) {
  const ModelConfig c = preset("medium");
  const auto rules = memory_rules(c, ActPrecision::F32);
  HardwareProfile hw = plan::load_profile("a100-80gb");
  const CostModel cost(hw, c, ActPrecision::F32);
  const auto lengths = plan::partition_length(8192, 8);
  std::vector<double> none(8, 0.0), full(8, 1.0);
  full.back() = 0;
  const SimResult a = simulate(sched::build_single(c.layers, lengths, none), cost, rules);
  const SimResult b = simulate(sched::build_single(c.layers, lengths, full), cost, rules);
  EXPECT_LT(b.peak_device_bytes, a.peak_device_bytes);
  EXPECT_EQ(a.exposed_copy_s, 0);
  // A slow host link exposes the copies.
  hw.d2h_bw = hw.h2d_bw = 1e6;
  const SimResult slow = simulate(sched::build_single(c.layers, lengths, full), CostModel(hw, c, ActPrecision::F32), rules);
  EXPECT_GT(slow.exposed_copy_s, 0);
  EXPECT_GT(slow.step_time_s, b.step_time_s);
}

// Note [Weights on the host]: each layer's weights on the copy-in lane one layer ahead, its
// gradient on the copy-out lane after its last backward. Over an instant link they cost
// nothing and the device holds less; over a slow one the layers wait for their weights,
// which shows as exposed copy time and a longer step, and the update copies only the
// embedding's, final norm's and head's gradients and weights.
TEST(Simulator, WeightsOnTheHostWaitForSlowCopies) {
  const ModelConfig c = small();
  sched::MemoryRules rules = memory_rules(c, ActPrecision::F32);
  rules.optimizer_host = true;
  HardwareProfile hw = ideal();
  const auto lengths = plan::partition_length(4096, 4);
  for (bool layer_major : {false, true}) {
    sched::Schedule device = sched::build_single(c.layers, lengths, {0, 0, 0, 0});
    if (layer_major) device = sched::to_layer_major(std::move(device));
    sched::Schedule host = device;
    host.place.weights = Tier::Host;
    const SimResult a = simulate(device, CostModel(hw, c, ActPrecision::F32), rules);
    const SimResult b = simulate(host, CostModel(hw, c, ActPrecision::F32), rules);
    EXPECT_LT(b.peak_device_bytes, a.peak_device_bytes);
    EXPECT_EQ(b.peak_host_bytes, a.peak_host_bytes);
    EXPECT_LT(b.exposed_copy_s, 1e-20);
    EXPECT_LT(b.host_update_s, a.host_update_s);
    EXPECT_NEAR(b.step_time_s - b.host_update_s, a.step_time_s - a.host_update_s, 1e-9 * a.step_time_s);
    const sched::Validation v = sched::validate(host, {&rules, 0});
    ASSERT_TRUE(v.ok()) << v.message();
    EXPECT_EQ(b.peak_device_bytes, v.peak_bytes[0]) << "no copy releases memory at its own time";
    HardwareProfile slow = hw;
    slow.h2d_bw = slow.d2h_bw = 1e6;
    const SimResult w = simulate(host, CostModel(slow, c, ActPrecision::F32), rules);
    const i64 layer = sched::layer_params(c, TpShard{}) * 4;
    EXPECT_GT(w.exposed_copy_s, double(layer) / 1e6) << "the first layer's weights, at least";
    EXPECT_GT(w.step_time_s, b.step_time_s + w.exposed_copy_s * 0.99);
    EXPECT_EQ(w.peak_device_bytes, b.peak_device_bytes);
  }
}

TEST(Simulator, DeadlockIsAnError) {
  sched::PipelineSpec spec;
  spec.layers = 2;
  spec.par.pp = 2;
  spec.lengths = {4, 4};
  sched::Schedule s = sched::build_pipeline(spec);
  for (auto it = s.ops[0].begin(); it != s.ops[0].end(); ++it)
    if (it->kind == sched::OpKind::Send) {
      s.ops[0].erase(it);
      break;
    }
  const ModelConfig c = preset("tiny");
  EXPECT_THROW(simulate(s, CostModel(ideal(), c, ActPrecision::F32), memory_rules(c, ActPrecision::F32)), Error);
}

// A causal ring's buffers (runtime/ring.h): a partial result travels only between a member
// that holds a key a span sees and the span's owner. In subsequence 0 of a contiguous ring
// member m gets partials from the members before it and sends them to those after, R - 1
// pieces in all; in a later subsequence every member holds earlier keys, so every pair
// exchanges, 2 (R - 1) pieces. Each F/B op's ring bytes are these, exactly.
TEST(Simulator, RingBuffersCountOnlyThePartialsThatTravel) {
  const ModelConfig c = preset("tiny");
  const i64 R = 4, P = 64, row = c.hidden * 2, stats = c.heads * 4;  // bf16 rows, fp32 LSE/delta
  sched::PipelineSpec spec;
  spec.layers = 1;
  spec.par.cp = int(R);
  spec.par.ring_layout = RingLayout::Contiguous;
  spec.lengths = {R * P, R * P};
  spec.alpha = {0, 0};
  const sched::Schedule s = sched::build_pipeline(spec);
  const auto rules = memory_rules(c, ActPrecision::BF16);
  for (int rank = 0; rank < int(R); ++rank) {
    sched::RankMemory m(rules, s, rank);
    int checked = 0;
    for (const sched::Op& op : s.ops[std::size_t(rank)]) {
      std::vector<sched::MemEvent> ev;
      m.events(op, &ev);
      if (op.kind != sched::OpKind::Forward && op.kind != sched::OpKind::Backward) continue;
      i64 ring = 0;
      for (const auto& e : ev)
        if (e.term == sched::MemTerm::RingBuffers && e.delta > 0) ring += e.delta;
      const i64 partials = (op.subseq == 0 ? R - 1 : 2 * (R - 1)) * P, others = (R - 1) * P;
      const i64 want = op.kind == sched::OpKind::Forward ? others * row + partials * (row + stats)
                                                         : others * 2 * (row + stats) + partials * row + P * row;
      EXPECT_EQ(ring, want) << "rank " << rank << " subseq " << op.subseq << (op.kind == sched::OpKind::Forward ? " F" : " B");
      ++checked;
    }
    EXPECT_EQ(checked, 4) << "rank " << rank;  // an F and a B of each subsequence
  }
}

TEST(Simulator, TraceAndSvg) {
  sched::PipelineSpec spec;
  spec.layers = 4;
  spec.par.pp = 2;
  spec.par.cp = 2;
  spec.par.ring_layout = RingLayout::Contiguous;
  spec.lengths = {64, 48, 32};
  spec.alpha = {0.5, 0.5, 0};
  const ModelConfig c = preset("tiny");
  SimOptions o;
  o.record = true;
  const SimResult r = simulate(sched::build_pipeline(spec), CostModel(plan::load_profile("h100-sxm"), c, ActPrecision::BF16),
                               memory_rules(c, ActPrecision::BF16), o);
  const nlohmann::json t = nlohmann::json::parse(chrome_trace(r));
  int complete = 0;
  std::set<int> lanes;
  for (const auto& e : t["traceEvents"])
    if (e["ph"] == "X") {
      ++complete;
      EXPECT_GE(e["dur"].get<double>(), 0);
      lanes.insert(e["tid"].get<int>());
    }
  EXPECT_GT(complete, 20);
  EXPECT_TRUE(lanes.count(0) && lanes.count(1) && lanes.count(2) && lanes.count(3));
  const std::string svg = svg_timeline(r, "test <pipeline>");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  for (const char* word : {"forward", "backward", "offload", "onload", "communication", "device 3", "&lt;pipeline&gt;"})
    EXPECT_NE(svg.find(word), std::string::npos) << word;
}

}  // namespace
}  // namespace sppo::sim
