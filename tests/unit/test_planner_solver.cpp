// The planner: partitions, alpha under a budget, the smallest N that fits, whole-cluster
// plans for SPPO and the baselines, and plan JSON.
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <numeric>

#include "core/check.h"
#include "planner/cost.h"
#include "planner/partition.h"
#include "planner/plan.h"
#include "planner/profile.h"
#include "schedule/builders.h"
#include "sim/simulator.h"
#include "sim/solver.h"
#include "sim/solver/search.h"
#include "support/expect_error.h"

namespace sppo::plan {
namespace {

i64 sum(const std::vector<i64>& v) { return std::accumulate(v.begin(), v.end(), i64(0)); }

TEST(Partition, Length) {
  for (i64 S : {7, 64, 1000})
    for (int N : {1, 3, 7}) {
      const auto l = partition_length(S, N);
      EXPECT_EQ(sum(l), S);
      EXPECT_LE(*std::max_element(l.begin(), l.end()) - *std::min_element(l.begin(), l.end()), 1);
    }
  EXPECT_THROW(partition_length(3, 4), Error);
}

TEST(Partition, FlopsBalanced) {
  const ModelConfig c = preset("gpt-7b");
  for (i64 S : {i64(65536), i64(1) << 20})
    for (int N : {2, 8, 32}) {
      const auto l = partition_flops(c, S, N);
      ASSERT_EQ(int(l.size()), N);
      EXPECT_EQ(sum(l), S);
      i64 o = 0;
      double lo = 1e300, hi = 0;
      for (int i = 0; i < N; ++i) {
        if (i) {
          EXPECT_LE(l[i], l[i - 1]) << "later subsequences are not shorter";
        }
        const double f = subseq_flops(c, o, l[i]);
        lo = std::min(lo, f);
        hi = std::max(hi, f);
        o += l[i];
      }
      // Boundaries round to whole tokens: up to half a token at each end of a subsequence,
      // one subsequence over and another under.
      EXPECT_LT((hi - lo) / hi, 2.0 / double(l.back())) << "S " << S << " N " << N;
    }
  const auto tiny = partition_flops(preset("tiny"), 5, 5);
  EXPECT_EQ(tiny, std::vector<i64>(5, 1));
}

TEST(Alpha, ZeroWhenItFitsMoreWhenTheBudgetDemands) {
  const ModelConfig c = preset("medium");
  const HardwareProfile hw = load_profile("a100-80gb");
  const auto lengths = partition_flops(c, 16384, 8);
  const auto roomy = sim::solve_alpha_single(c, lengths, hw, ActPrecision::F32, i64(1) << 40);
  ASSERT_TRUE(roomy.fits);
  for (double a : roomy.alpha) EXPECT_EQ(a, 0);
  // A budget between the full-offload peak and the no-offload peak.
  const auto full = sim::solve_alpha_single(c, lengths, hw, ActPrecision::F32, i64(1) << 40, sim::OffloadMode::Full);
  const i64 budget = (full.peak_device_bytes + roomy.peak_device_bytes) / 2;
  const auto tight = sim::solve_alpha_single(c, lengths, hw, ActPrecision::F32, budget);
  ASSERT_TRUE(tight.fits) << tight.reason;
  EXPECT_LE(tight.peak_device_bytes, budget);
  EXPECT_GT(*std::max_element(tight.alpha.begin(), tight.alpha.end()), 0);
  EXPECT_EQ(tight.alpha.back(), 0);
  const auto none = sim::solve_alpha_single(c, lengths, hw, ActPrecision::F32, full.peak_device_bytes - 1);
  EXPECT_FALSE(none.fits);
  EXPECT_NE(none.reason.find("budget"), std::string::npos) << none.reason;
}

TEST(Alpha, SmallestFittingN) {
  const ModelConfig c = preset("medium");
  const HardwareProfile hw = load_profile("a100-80gb");
  const i64 S = 16384;
  const auto one = sim::solve_alpha_single(c, {S}, hw, ActPrecision::F32, i64(1) << 40);
  const i64 budget = one.peak_device_bytes * 6 / 10;
  const auto f = sim::smallest_fitting_n(c, S, hw, ActPrecision::F32, budget, true, 1, 64);
  ASSERT_TRUE(f.found) << f.reason;
  EXPECT_GT(f.subseqs, 1);
  EXPECT_LE(f.alpha.peak_device_bytes, budget);
  const auto before = sim::solve_alpha_single(c, partition_flops(c, S, f.subseqs - 1), hw, ActPrecision::F32, budget);
  EXPECT_FALSE(before.fits);
  const auto never = sim::smallest_fitting_n(c, S, hw, ActPrecision::F32, 1 << 20, true, 1, 8);
  EXPECT_FALSE(never.found);
  EXPECT_GT(never.least_peak_bytes, 1 << 20);
}

sim::PlanRequest request(const char* model, i64 S, int gpus, const char* system) {
  sim::PlanRequest r;
  r.model_name = model;
  r.model = preset(model);
  r.seq_len = S;
  r.gpus = gpus;
  r.gpus_per_node = 8;
  r.hardware = "a100-80gb";
  r.hw = load_profile("a100-80gb");
  r.system = plan::parse_system(system);
  return r;
}

TEST(Solver, SppoPlanFitsAndRoundTrips) {
  const auto out = sim::solve_plan(request("gpt-7b", i64(256) * 1024, 16, "sppo"));
  ASSERT_TRUE(out.ok) << out.error;
  const Plan& p = out.plan;
  EXPECT_EQ(p.par.tp * p.par.cp * p.par.pp * p.par.dp, 16);
  EXPECT_LE(p.par.tp * p.par.cp, 8) << "sequence parallelism stays inside a node";
  EXPECT_LE(p.predicted.peak_device_bytes, p.budget);
  EXPECT_GT(p.predicted.tokens_per_gpu_per_s, 0);
  EXPECT_EQ(sum(p.lengths), p.seq_len);
  EXPECT_EQ(p.place.optimizer_state, Tier::Device) << "the device holds it, so it stays there";
  const Plan q = plan_from_json(nlohmann::json::parse(to_json(p).dump()));
  EXPECT_EQ(to_json(q), to_json(p));
  const auto r = sim::simulate_plan(q, load_profile("a100-80gb"));
  EXPECT_NEAR(r.step_time_s, p.predicted.step_time_s, 1e-9 * p.predicted.step_time_s);
  // The kernels' scratch goes through the JSON and into the peak.
  Plan scratched = p;
  scratched.block_scratch = {1000, 24};
  scratched.head_scratch = {512, 8};
  const Plan back = plan_from_json(nlohmann::json::parse(to_json(scratched).dump()));
  EXPECT_EQ(back.block_scratch.bytes(100), scratched.block_scratch.bytes(100));
  EXPECT_EQ(back.head_scratch.bytes(100), scratched.head_scratch.bytes(100));
  EXPECT_GT(sim::simulate_plan(back, load_profile("a100-80gb")).peak_device_bytes, r.peak_device_bytes);
}

// Qwen3 (Note [Head size]): qwen3-0.6b runs 16 heads of 128 on H 1024, so its attention
// costs 4 Z A FLOPs a query and key, twice 4 H, and its projections' GEMMs are [Z A + 2 G A,
// H] and [H, Z A]; the FLOPs-balanced partition weighs the same attention. qwen3-8b plans on
// 8 GPUs under the budget, as the simulator checks it.
TEST(Solver, Qwen3CountsItsHeadsWidth) {
  const ModelConfig c = preset("qwen3-0.6b");
  const CostModel cost(load_profile("h100-sxm"), c, ActPrecision::BF16);
  const i64 L = 4096;
  EXPECT_DOUBLE_EQ(cost.attention_flops(0, sched::Spans{{0, L}}), 4.0 * 2048 * double(L) * double(L + 1) / 2.0);
  EXPECT_DOUBLE_EQ(cost.gemm_flops(1), 2.0 * 1024 * ((2048 + 2 * 1024) + 2048 + 2 * 3072 + 3072));
  const double attention = cost.attention_flops(1000, 0, 10);
  EXPECT_NEAR(subseq_flops(c, 1000, 10) - cost.gemm_flops(10), attention, 1e-9 * attention);
  const auto out = sim::solve_plan(request("qwen3-8b", i64(128) * 1024, 8, "sppo"));
  ASSERT_TRUE(out.ok) << out.error;
  EXPECT_LE(out.plan.predicted.peak_device_bytes, out.plan.budget);
  const auto r = sim::simulate_plan(out.plan, load_profile("a100-80gb"));
  EXPECT_EQ(r.peak_device_bytes, out.plan.predicted.peak_device_bytes);
}

// The paper's SP (tensor parallel with sequence-parallel regions) and Ulysses divide the
// K/V cache and the dK/dV accumulators by heads, which ring attention leaves whole on each
// stage's ranks: on 32 A100s, with the K/V on the device, they fit a gpt-7b sequence that the
// same layout with a ring in their place does not.
TEST(Solver, SplittingTheHeadsFitsLongerSequences) {
  auto req = request("gpt-7b", i64(1536) * 1024, 32, "sppo");
  req.place.kv = KvPlace::Device;
  const auto out = sim::solve_plan(req);
  ASSERT_TRUE(out.ok) << out.error;
  const int heads_split = out.plan.par.tp * out.plan.par.ulysses;
  EXPECT_GT(heads_split, 1) << plan::layout_text(out.plan);
  EXPECT_LE(out.plan.predicted.peak_device_bytes, out.plan.budget);
  // The same layout with ring SP instead needs more than the budget.
  Plan ring = out.plan;
  ring.par.cp *= heads_split;
  ring.par.tp = ring.par.ulysses = 1;
  EXPECT_GT(sim::simulate_plan(ring, load_profile("a100-80gb")).peak_device_bytes, out.plan.budget)
      << plan::layout_text(out.plan);
}

// Note [ZeRO in the search]: on four nodes of one A100 (no tensor parallelism inside a node),
// gpt-7b at 32K trains fastest with its weights sharded over four replicas (ZeRO-3): each
// rank's device is free for a shorter recomputation than ZeRO-1 leaves room for. The plan,
// simulated whole, fits; under --zero 1 the search's best is slower; --zero 2 plans only
// layouts that run it; one device has nothing to shard over.
TEST(Solver, SearchesTheZeroStage) {
  auto req = request("gpt-7b", i64(32) * 1024, 4, "sppo");
  req.gpus_per_node = 1;
  const auto out = sim::solve_plan(req);
  ASSERT_TRUE(out.ok) << out.error;
  const Plan& p = out.plan;
  EXPECT_EQ(p.par.zero, ZeroStage::Weights) << plan::layout_text(p);
  EXPECT_TRUE(std::any_of(p.notes.begin(), p.notes.end(), [](const std::string& n) {
    return n.find("ZeRO-3") != n.npos && n.find("faster than the best plan sharding less") != n.npos;
  }));
  const auto whole = sim::simulate_plan(p, load_profile("a100-80gb"));
  EXPECT_EQ(whole.peak_device_bytes, p.predicted.peak_device_bytes);
  EXPECT_LE(whole.peak_device_bytes, p.budget);
  auto one = req;
  one.zero = ZeroStage::OptimizerState;
  const auto zero1 = sim::solve_plan(one);
  ASSERT_TRUE(zero1.ok) << zero1.error;
  EXPECT_LT(zero1.plan.predicted.tokens_per_gpu_per_s, p.predicted.tokens_per_gpu_per_s);
  auto two = request("gpt-7b", i64(512) * 1024, 8, "sppo");
  two.zero = ZeroStage::Gradients;
  const auto zero2 = sim::solve_plan(two);
  ASSERT_TRUE(zero2.ok) << zero2.error;
  EXPECT_EQ(zero2.plan.par.zero, ZeroStage::Gradients);
  EXPECT_EQ(zero2.plan.par.tp, 1);
  EXPECT_GE(zero2.plan.par.zero_shards(), 2);
  auto alone = request("gpt-7b", i64(32) * 1024, 1, "sppo");
  alone.zero = ZeroStage::Weights;
  const auto refused = sim::solve_plan(alone);
  EXPECT_FALSE(refused.ok);
  EXPECT_NE(refused.error.find("one device has none to shard over"), std::string::npos) << refused.error;
}

// Past the paper's memory wall (Note [Placing every tensor] in sim/solver/placements.cpp):
// at 4M tokens on 32 A100s no plan keeps K/V on the device, and one recomputes them from
// each layer's input and recomputes the cheap saved tensors; with only the device's K/V
// nothing fits. At 1M the plan is the device's, as before these placements.
TEST(Solver, RecomputingFitsWhatTheDeviceCacheCannot) {
  const auto out = sim::solve_plan(request("gpt-7b", i64(4) << 20, 32, "sppo"));
  ASSERT_TRUE(out.ok) << out.error;
  const Plan& p = out.plan;
  EXPECT_FALSE(p.place.kv_layers(KvPlace::Recompute).empty() && p.place.kv_layers(KvPlace::Host).empty());
  EXPECT_NE(p.place.recompute, 0u);
  EXPECT_LE(p.predicted.peak_device_bytes, p.budget);
  EXPECT_LE(p.predicted.peak_host_bytes, load_profile("a100-80gb").host_memory);
  const Plan q = plan_from_json(nlohmann::json::parse(to_json(p).dump()));
  EXPECT_EQ(to_json(q), to_json(p));
  auto device_only = request("gpt-7b", i64(4) << 20, 32, "sppo");
  device_only.place.kv = KvPlace::Device;
  device_only.place.recompute = SavedSet(0);
  EXPECT_FALSE(sim::solve_plan(device_only).ok);
  // At 1M, in the paper's backward order, a plan keeps the K/V on the device and recomputes
  // nothing (the search's best places them elsewhere where that is faster:
  // LayerMajorBackwardFitsWhatThePapersOrderCannot).
  auto short_req = request("gpt-7b", i64(1) << 20, 32, "sppo");
  short_req.place.backward = BackwardOrder::Subseq;
  short_req.place.kv = KvPlace::Device;
  short_req.place.recompute = SavedSet(0);
  const auto short_one = sim::solve_plan(short_req);
  ASSERT_TRUE(short_one.ok) << short_one.error;
  EXPECT_FALSE(short_one.plan.place.any_kv_streamed());
  EXPECT_EQ(short_one.plan.place.recompute, 0u);
}

// The layer-major backward (Note [Layer-major backward]): llama-3-8b at 512K on one H200
// fits only in it (every layer's dK/dV sums do not fit beside the K/V in the paper's
// order); the plan carries the order through its JSON, and its schedule simulates to the
// plan's step. --backward-order layer plans it on every layout, MSP's excepted.
TEST(Solver, LayerMajorBackwardFitsWhatThePapersOrderCannot) {
  auto req = request("llama-3-8b", i64(512) << 10, 1, "sppo");
  req.hardware = "h200";
  req.hw = load_profile("h200");
  req.place.backward = BackwardOrder::Subseq;
  EXPECT_FALSE(sim::solve_plan(req).ok);
  req.place.backward = kAuto;
  const auto out = sim::solve_plan(req);
  ASSERT_TRUE(out.ok) << out.error;
  EXPECT_EQ(out.plan.place.backward, BackwardOrder::Layer);
  const Plan q = plan_from_json(nlohmann::json::parse(to_json(out.plan).dump()));
  EXPECT_EQ(q.place.backward, BackwardOrder::Layer);
  EXPECT_EQ(sim::plan_schedule(q).place.backward, BackwardOrder::Layer);
  const auto r = sim::simulate_plan(q, load_profile("h200"));
  EXPECT_NEAR(r.step_time_s, out.plan.predicted.step_time_s, 1e-9 * out.plan.predicted.step_time_s);
  auto layered = request("gpt-7b", i64(256) << 10, 16, "sppo");
  layered.place.backward = BackwardOrder::Layer;
  const auto layer = sim::solve_plan(layered);
  ASSERT_TRUE(layer.ok) << layer.error;
  EXPECT_EQ(layer.plan.place.backward, BackwardOrder::Layer);
  EXPECT_FALSE(layer.plan.par.msp.on);
}

// Note [Optimizer state under a budget]: gpt-7b's weights, gradients and AdamW state (16 B
// a parameter, 99 GiB) cannot share one A100 with anything, so auto moves the state to
// the host and prices its update in the step; --optimizer-state device says why nothing
// fits. Where the device holds it all, the state stays there (SppoPlanFitsAndRoundTrips).
TEST(Solver, OptimizerStateOnTheHostWhereTheDeviceCannotHoldIt) {
  sim::PlanRequest req = request("gpt-7b", i64(16) * 1024, 1, "sppo");
  req.gpus_per_node = 1;
  const auto out = sim::solve_plan(req);
  ASSERT_TRUE(out.ok) << out.error;
  const Plan& p = out.plan;
  EXPECT_EQ(p.place.optimizer_state, Tier::Host);
  EXPECT_LE(p.predicted.peak_device_bytes, p.budget);
  EXPECT_GE(p.predicted.peak_host_bytes, 16 * p.model.num_params()) << "master, m, v and gradients on the host";
  const CostModel cost(load_profile("a100-80gb"), p.model, ActPrecision::BF16);
  EXPECT_DOUBLE_EQ(p.predicted.host_update_s, cost.host_update_s(p.model.num_params()));
  EXPECT_GT(p.predicted.host_update_s, 0);
  const Plan q = plan_from_json(nlohmann::json::parse(to_json(p).dump()));
  EXPECT_EQ(to_json(q), to_json(p));
  const auto r = sim::simulate_plan(q, load_profile("a100-80gb"));
  EXPECT_EQ(r.peak_host_bytes, p.predicted.peak_host_bytes);
  EXPECT_NEAR(r.step_time_s, p.predicted.step_time_s, 1e-9 * p.predicted.step_time_s);
  req.place.optimizer_state = Tier::Device;
  const auto device = sim::solve_plan(req);
  ASSERT_FALSE(device.ok);
  EXPECT_NE(device.error.find("weights, gradients and optimizer state alone"), std::string::npos) << device.error;
}

// When nothing fits, the error names the closest miss over every placement searched, need
// over limit: llama-3-8b at 12M tokens on 16 H100s misses by its host memory (about 408 GiB
// of 256 with tp 8 and 2 stages), not by a later tier's wider layouts (a Ulysses layout's
// bound of 832 GiB, which the error named when it took the last tier's closest).
TEST(Solver, NothingFitsNamesTheClosestMissOfEveryPlacement) {
  sim::PlanRequest req = request("llama-3-8b", i64(12) << 20, 16, "sppo");
  req.hw = load_profile("h100-sxm");
  const auto out = sim::solve_plan(req);
  ASSERT_FALSE(out.ok);
  const std::string& e = out.error;
  const std::size_t at = e.find(" of host memory, over its 256.00 GiB");
  ASSERT_NE(at, std::string::npos) << e;
  const std::size_t from = e.rfind("at least ", at);
  ASSERT_NE(from, std::string::npos) << e;
  const double gib = std::stod(e.substr(from + 9));
  EXPECT_GT(gib, 256) << e;
  EXPECT_LT(gib, 450) << e;
}

// Note [Weights in the search]: where nothing fits with the optimizer state alone on the
// host, the layers' weights and gradients follow it (ZeRO-1 off); --weights device keeps them
// and says what does not fit; the plan simulates as predicted.
TEST(Solver, WeightsOnTheHostWhereTheStateAloneThereDoesNotFit) {
  sim::PlanRequest req = request("llama-3.2-1b", i64(16) * 1024, 1, "sppo");
  req.hw = load_profile("h100-sxm");
  req.hardware = "h100-sxm";
  req.gpus_per_node = 1;
  req.budget = i64(10) << 30;
  req.hw.host_memory = i64(64) << 30;
  const auto out = sim::solve_plan(req);
  ASSERT_TRUE(out.ok) << out.error;
  const Plan& p = out.plan;
  EXPECT_EQ(p.place.weights, Tier::Host);
  EXPECT_EQ(p.place.optimizer_state, Tier::Host);
  EXPECT_EQ(p.par.zero, ZeroStage::None);
  EXPECT_LE(p.predicted.peak_device_bytes, p.budget);
  const Plan q = plan_from_json(nlohmann::json::parse(to_json(p).dump()));
  EXPECT_EQ(to_json(q), to_json(p));
  const auto r = sim::simulate_plan(q, req.hw);
  EXPECT_EQ(r.peak_device_bytes, p.predicted.peak_device_bytes);
  EXPECT_EQ(r.peak_host_bytes, p.predicted.peak_host_bytes);
  req.place.weights = Tier::Device;
  const auto device = sim::solve_plan(req);
  EXPECT_FALSE(device.ok);
}

// Note [Rebuilt inputs in the search]: llama-3-8b at 1M tokens on one H200 (the profile's
// 256 GiB of host memory) fits only rebuilding every other layer's input; the plan carries
// the rebuilt layers, the rebuilt layers keep the K/V the others recompute on the host, and
// its schedule simulates as planned. At 944K, which fits keeping every input, the rebuilt
// plan runs longer subsequences and is faster.
TEST(Solver, RebuiltInputsWhereKeepingThemDoesNotFit) {
  sim::PlanRequest req = request("llama-3-8b", i64(1) << 20, 1, "sppo");  // a GPU of a node of 8
  req.hw = load_profile("h200");
  req.hardware = "h200";
  const auto out = sim::solve_plan(req);
  ASSERT_TRUE(out.ok) << out.error;
  const Plan& p = out.plan;
  std::vector<int> odd;
  for (int l = 1; l < 32; l += 2) odd.push_back(l);
  EXPECT_EQ(p.place.rebuilt_layers(), odd);
  EXPECT_EQ(p.place.backward, BackwardOrder::Layer);
  for (int l : odd) {
    EXPECT_NE(p.place.kv_at(l), KvPlace::Recompute) << l;
  }
  EXPECT_LE(p.predicted.peak_device_bytes, p.budget);
  EXPECT_LE(p.predicted.peak_host_bytes, req.hw.host_memory);
  const Plan q = plan_from_json(nlohmann::json::parse(to_json(p).dump()));
  EXPECT_EQ(to_json(q), to_json(p));
  const auto r = sim::simulate_plan(q, req.hw);
  EXPECT_EQ(r.peak_device_bytes, p.predicted.peak_device_bytes);
  EXPECT_EQ(r.peak_host_bytes, p.predicted.peak_host_bytes);
  req.place.rebuild = parse_rebuild_inputs("none");
  const auto kept = sim::solve_plan(req);
  EXPECT_FALSE(kept.ok);
  req.seq_len = 944 * 1024;
  const auto keeping = sim::solve_plan(req);
  req.place.rebuild = parse_rebuild_inputs("auto");
  const auto rebuilding = sim::solve_plan(req);
  ASSERT_TRUE(keeping.ok && rebuilding.ok) << keeping.error << rebuilding.error;
  EXPECT_FALSE(keeping.plan.place.any_input_rebuilt());
  EXPECT_TRUE(rebuilding.plan.place.any_input_rebuilt());
  EXPECT_GT(rebuilding.plan.predicted.tokens_per_gpu_per_s, 1.5 * keeping.plan.predicted.tokens_per_gpu_per_s);
}

// Note [Optimizer state under a budget]: when nothing fits with the state on the device,
// the host-state search rules layouts out by their device-state floors less their AdamW
// bytes rather than building their schedules again. The closest layout it then names, and
// its floor, are those the host-state search finds when it simulates every layout; a
// bound that subtracted more (the state unsharded, say) would name a smaller floor.
TEST(Solver, KeptFloorsRuleOutAsTheHostStateSearchWould) {
  auto req = request("small", i64(64) << 10, 4, "sppo");
  req.gpus_per_node = 1;
  req.budget = i64(102) << 20;
  // Searches the optimizer state alone moves (no weights on the host, no inputs rebuilt):
  // the host-state search is then the last, and names its closest miss.
  req.place.kv = KvPlace::Device;
  req.place.weights = Tier::Device;
  req.place.rebuild = parse_rebuild_inputs("none");
  auto floor_named = [](const std::string& error) {
    const auto at = error.find("of at least ");
    return at == std::string::npos ? std::string() : error.substr(at, error.find(" MiB", at) - at);
  };
  req.place.optimizer_state = Tier::Host;
  const auto host = sim::solve_plan(req);
  ASSERT_FALSE(host.ok);
  req.place.optimizer_state = kAuto;
  const auto both = sim::solve_plan(req);
  ASSERT_FALSE(both.ok);
  ASSERT_NE(floor_named(host.error), "") << host.error;
  EXPECT_EQ(floor_named(both.error), floor_named(host.error)) << both.error << "\n" << host.error;
  EXPECT_NE(both.error.find("with the optimizer state on the host"), std::string::npos) << both.error;
  req.place.optimizer_state = Tier::Device;
  const auto device = sim::solve_plan(req);
  ASSERT_FALSE(device.ok);
  EXPECT_NE(floor_named(device.error), floor_named(host.error)) << "the state's bytes must matter here";
}

// MLP tiles (Note [Placing every tensor] in sim/solver/placements.cpp): with K/V on the
// device, nothing recomputed and nothing offloaded, a budget just under the best untiled
// plan's peak fits only with the MLP in tiles, which the wider search finds; the same plan
// untiled does not fit.
TEST(Solver, MlpTilesFitWhatTheWholeMlpCannot) {
  auto req = request("bench", i64(256) << 10, 1, "sppo");
  req.place.backward = BackwardOrder::Subseq;  // the layer-major order fits under that budget too
  req.gpus_per_node = 1;
  req.offload = sim::OffloadMode::None;
  req.place.kv = KvPlace::Device;
  req.place.recompute = SavedSet(0);
  const auto whole = sim::solve_plan(req);
  ASSERT_TRUE(whole.ok) << whole.error;
  EXPECT_EQ(whole.plan.place.mlp_tile_rows, 0);
  req.budget = whole.plan.predicted.peak_device_bytes - 1;
  const auto out = sim::solve_plan(req);
  ASSERT_TRUE(out.ok) << out.error;
  const Plan& p = out.plan;
  EXPECT_EQ(p.place.mlp_tile_rows, sim::kPlanMlpTileRows);
  EXPECT_LE(p.predicted.peak_device_bytes, req.budget);
  Plan untiled = p;
  untiled.place.mlp_tile_rows = 0;
  EXPECT_GT(sim::simulate_plan(untiled, load_profile("a100-80gb")).peak_device_bytes, req.budget);
  const Plan q = plan_from_json(nlohmann::json::parse(to_json(p).dump()));
  EXPECT_EQ(q.place.mlp_tile_rows, p.place.mlp_tile_rows);
}

// Full offload is one of the alphas the adaptive search weighs, so its plan is never the
// faster of the two, and on gpt-13b on 128 A100s (fp32 activations, with which the runtime
// runs MSP: Note [MSP in bf16]) it is slower at 512K: the paper's order, full
// offload < adaptive < adaptive + MSP. Where the search found full offload ahead, it had
// priced one data-parallel replica's weight-gradient all-reduce wrongly: over the replica's
// SP ranks, inside a node (512K: 192.2 against 191.6 tokens/GPU/s), and, where the replica
// had no ring, not at all (128K: tp 8 dp 16 looked 0.54 s a step faster than it runs, 632.7
// against 623.9). At 512K adaptive ties full with the K/V on the device (every copy hides)
// and wins by a placement that lets a faster layout fit (the K/V on the host).
// The paper's configurations run its backward order (the layer-major one, on layouts of one
// stage, outruns MSP's pipelines here: docs/planning.md).
TEST(Solver, ThePapersOrderOfOffloadAndMsp) {
  for (const i64 S : {i64(128) * 1024, i64(512) * 1024}) {
    auto req = request("gpt-13b", S, 128, "sppo");
    req.hw.precision = "f32";  // the runtime's MSP runs fp32 activations (Note [MSP in bf16])
    req.place.backward = BackwardOrder::Subseq;
    req.msp = false;
    req.offload = sim::OffloadMode::Full;
    const auto full = sim::solve_plan(req);
    req.offload = sim::OffloadMode::Adaptive;
    const auto adaptive = sim::solve_plan(req);
    req.msp = true;
    const auto msp = sim::solve_plan(req);
    ASSERT_TRUE(full.ok && adaptive.ok && msp.ok) << full.error << adaptive.error << msp.error;
    const double f = full.plan.predicted.tokens_per_gpu_per_s, a = adaptive.plan.predicted.tokens_per_gpu_per_s,
                 m = msp.plan.predicted.tokens_per_gpu_per_s;
    // (In fp32 at 128K every copy of full offload hides, and the two tie.)
    EXPECT_LE(f, a) << S << " tokens: full offload " << f << ", adaptive " << a;
    if (S > 128 * 1024) {
      EXPECT_LT(f, a) << S << " tokens: full offload " << f << ", adaptive " << a;
    }
    EXPECT_LT(a, m) << S << " tokens: adaptive " << a << ", with MSP " << m;
    // The paper's Table 3 case fits with MSP (Note [MSP in the search]), and a plan's JSON
    // keeps MSP's reach.
    EXPECT_TRUE(msp.plan.par.msp.on);
    EXPECT_LE(msp.plan.predicted.peak_device_bytes, msp.plan.budget);
    Plan reach = msp.plan;
    reach.par.msp.reach = 2;
    EXPECT_EQ(plan_from_json(to_json(reach)).par.msp.reach, 2);
  }
}

// The placements that save memory are searched whether or not a plan fits without them:
// gpt-65b at 640K on 128 A100s fits with the K/V on the device (tp 2 sp 4 pp 16, 37.7
// tokens/GPU/s), but with the K/V on the host a layout with fewer stages fits, and is
// faster (tp 4 sp 2 pp 8 dp 2, 42.6).
TEST(Solver, PlacementsThatSaveMemoryAreWeighedWhenOthersFit) {
  auto req = request("gpt-65b", i64(640) * 1024, 128, "sppo");
  req.msp = false;
  req.place.kv = KvPlace::Device;
  const auto device = sim::solve_plan(req);
  req.place.kv = kAuto;
  const auto any = sim::solve_plan(req);
  ASSERT_TRUE(device.ok && any.ok) << device.error << any.error;
  EXPECT_TRUE(!any.plan.place.kv_layers(KvPlace::Host).empty() || any.plan.place.recompute != 0);
  EXPECT_GT(any.plan.predicted.tokens_per_gpu_per_s, device.plan.predicted.tokens_per_gpu_per_s * 1.05);
}

TEST(Solver, SaysWhyNothingFits) {
  // gpt-65b on 4 A100s: with the layers' weights on the host the search runs and names the
  // host memory the activations would need; with them on the device, the weights alone.
  auto req = request("gpt-65b", i64(1) << 20, 4, "sppo");
  const auto out = sim::solve_plan(req);
  ASSERT_FALSE(out.ok);
  EXPECT_NE(out.error.find("of host memory"), std::string::npos) << out.error;
  req.place.weights = Tier::Device;
  const auto kept = sim::solve_plan(req);
  ASSERT_FALSE(kept.ok);
  EXPECT_NE(kept.error.find("weights and gradients alone"), std::string::npos) << kept.error;
  const auto big = sim::solve_plan(request("gpt-7b", i64(16) << 20, 8, "sppo"));
  ASSERT_FALSE(big.ok);
  EXPECT_FALSE(big.error.empty());
}

// Ulysses in the search (Note [Sequence parallelism in the search]): gpt-7b at 2M on two
// nodes of 8 H200s runs fastest as USP, a group of 8 Ulysses ranks in each node and a ring
// of 2 across them. The notes say so; the plan simulates again to its own figures, and to
// the search's, which simulated one member of each group; the same step with a ring of 8
// in each node instead (the nodes data-parallel) does not fit: each of its ranks keeps
// every head's K/V of the earlier rows, a Ulysses rank 1/8 of them.
TEST(Solver, UlyssesInsideANodeAndTheRingAcross) {
  auto req = request("gpt-7b", i64(2) << 20, 16, "sppo");
  req.hardware = "h200";
  req.hw = load_profile("h200");
  const auto out = sim::solve_plan(req);
  ASSERT_TRUE(out.ok) << out.error;
  const Plan& p = out.plan;
  EXPECT_EQ(p.par.ulysses, 8) << plan::layout_text(p);
  EXPECT_EQ(p.par.cp, 2) << plan::layout_text(p);
  EXPECT_EQ(p.par.tp, 1) << plan::layout_text(p);
  auto noted = [&](const std::string& text) {
    return std::any_of(p.notes.begin(), p.notes.end(), [&](const std::string& n) { return n.find(text) != n.npos; });
  };
  EXPECT_TRUE(noted("(USP)"));
  EXPECT_TRUE(noted("train --ulysses 8"));
  const Plan q = plan_from_json(nlohmann::json::parse(to_json(p).dump()));
  EXPECT_EQ(q.par.ulysses, 8);
  const auto r = sim::simulate_plan(q, req.hw);
  EXPECT_EQ(r.peak_device_bytes, p.predicted.peak_device_bytes);
  EXPECT_NEAR(r.step_time_s, p.predicted.step_time_s, 1e-9 * p.predicted.step_time_s);
  // The search simulated the first member of each Ulysses group alone (Note [One Ulysses
  // member in the search]): the busiest, so the same peak and step as every member.
  {
    const HardwareProfile hw = sim::solver::plan_hardware(req.hw, p.gpus_per_node);
    CostModel priced(hw, p.model, ActPrecision::BF16);
    priced.price_replicas(p.par.dp, p.par.ranks() / p.par.dp);
    const auto one = sim::simulate(sched::build_step(p.model, p.lengths, p.alpha, p, sched::Replicas::One), priced,
                                   sim::plan_rules(p, ActPrecision::BF16, sched::Replicas::One));
    EXPECT_EQ(one.peak_device_bytes, r.peak_device_bytes);
    EXPECT_NEAR(one.step_time_s, r.step_time_s, 1e-9 * r.step_time_s);
  }
  Plan ring = p;  // the same step with a ring of 8 in each node and the two nodes data-parallel
  ring.par.ulysses = 1;
  ring.par.cp = 8;
  ring.par.dp = 2;
  EXPECT_GT(sim::simulate_plan(ring, req.hw).peak_device_bytes, p.budget);
}

TEST(Solver, Baselines) {
  const sim::PlanRequest mreq = request("gpt-7b", i64(256) * 1024, 16, "megatron");
  const auto m = sim::solve_plan(mreq);
  ASSERT_TRUE(m.ok) << m.error;
  EXPECT_EQ(m.plan.par.tp * m.plan.par.cp * m.plan.par.pp * m.plan.par.dp, 16);
  EXPECT_LE(m.plan.predicted.peak_device_bytes, m.plan.budget);
  // Megatron-LM as a schedule (Note [Megatron-LM as a schedule]): one subsequence, nothing
  // offloaded, full recomputation; its prediction is its schedule's simulation.
  EXPECT_EQ(m.plan.subseqs, 1);
  EXPECT_EQ(m.plan.place.recompute, sim::solver::megatron_recompute(m.plan.par));
  EXPECT_EQ(sim::simulate_plan(m.plan, mreq.hw).peak_device_bytes, m.plan.predicted.peak_device_bytes);
  EXPECT_EQ(sim::simulate_plan(m.plan, mreq.hw).step_time_s, m.plan.predicted.step_time_s);
  const auto d = sim::solve_plan(request("gpt-7b", i64(256) * 1024, 64, "deepspeed"));
  ASSERT_TRUE(d.ok) << d.error;
  EXPECT_LE(d.plan.par.ulysses, 32) << "Ulysses degree above the head count";
  EXPECT_EQ(d.plan.par.ulysses * d.plan.par.dp, 64);
  EXPECT_EQ(d.plan.par.cp, 1);
  EXPECT_NE(plan::layout_text(d.plan).find("ulysses"), std::string::npos) << plan::layout_text(d.plan);
}

// Note [Megatron-LM's layouts in the search]: a Megatron-LM plan is an SPPO plan, so SPPO's
// plan is never slower where the request leaves the placements to the planner: on the
// README's case (gpt-7b at 1M on 32 A100s) it is Megatron-LM's own layout, noted as such, and
// an explicit --backward-order keeps the search's own plan, slower there.
TEST(Solver, SppoIsNoSlowerThanMegatronsSchedule) {
  for (const i64 S : {i64(256) * 1024, i64(1024) * 1024}) {
    const auto sppo = sim::solve_plan(request("gpt-7b", S, 32, "sppo"));
    const auto meg = sim::solve_plan(request("gpt-7b", S, 32, "megatron"));
    ASSERT_TRUE(sppo.ok && meg.ok) << sppo.error << meg.error;
    EXPECT_GE(sppo.plan.predicted.tokens_per_gpu_per_s, meg.plan.predicted.tokens_per_gpu_per_s) << S;
  }
  const auto at_1m = sim::solve_plan(request("gpt-7b", i64(1024) * 1024, 32, "sppo"));
  ASSERT_TRUE(at_1m.ok);
  EXPECT_EQ(at_1m.plan.subseqs, 1) << plan::layout_text(at_1m.plan);
  EXPECT_EQ(at_1m.plan.system, plan::System::Sppo);
  ASSERT_FALSE(at_1m.plan.notes.empty());
  EXPECT_NE(at_1m.plan.notes.front().find("Megatron-LM's layout"), std::string::npos) << at_1m.plan.notes.front();
  auto own = request("gpt-7b", i64(1024) * 1024, 32, "sppo");
  own.place.backward = BackwardOrder::Subseq;
  const auto searched = sim::solve_plan(own);
  ASSERT_TRUE(searched.ok) << searched.error;
  EXPECT_GT(searched.plan.subseqs, 1);
  EXPECT_LT(searched.plan.predicted.tokens_per_gpu_per_s, at_1m.plan.predicted.tokens_per_gpu_per_s);
}

TEST(PlanJson, NamesBadFields) {
  nlohmann::json j = {{"hardware", "a100-80gb"}, {"seq_len", 10}, {"cp", 1}, {"pp", 1}, {"lengths", {4, 4}},
                      {"gpus", 1}, {"model", "tiny"}};
  EXPECT_THROW(plan_from_json(j), Error);  // lengths sum to 8
  j["lengths"] = {6, 4};
  EXPECT_NO_THROW(plan_from_json(j));
  j.erase("pp");
  EXPECT_THROW(plan_from_json(j), Error);
}

// Plans written before each kind of sequence parallelism had its own name keep loading:
// their "sp" is the ring's ("sp_kind" ring), or DeepSpeed's Ulysses; a plan written now
// names "tp", "ulysses" and "cp" and no "sp".
TEST(PlanJson, PlansWrittenWithSpStillLoad) {
  nlohmann::json ring = {{"hardware", "a100-80gb"}, {"seq_len", 12}, {"sp", 2},    {"sp_kind", "ring"}, {"pp", 1},
                         {"lengths", {6, 6}},       {"gpus", 2},     {"model", "tiny"}};
  Plan p = plan_from_json(ring);
  EXPECT_EQ(p.par.cp, 2);
  EXPECT_EQ(p.par.ulysses, 1);
  ring.erase("sp_kind");
  EXPECT_EQ(plan_from_json(ring).par.cp, 2) << "an SPPO plan's sp without a kind is its ring";
  nlohmann::json ds = ring;
  ds["system"] = "deepspeed";
  ds["sp_kind"] = "ulysses";
  p = plan_from_json(ds);
  EXPECT_EQ(p.par.ulysses, 2);
  EXPECT_EQ(p.par.cp, 1);
  const nlohmann::json now = to_json(plan_from_json(ring));
  EXPECT_FALSE(now.contains("sp"));
  EXPECT_FALSE(now.contains("sp_kind"));
  EXPECT_EQ(now["cp"], 2);
  EXPECT_EQ(now["ulysses"], 1);
  EXPECT_EQ(now["tp"], 1);
  ring["sp_kind"] = "torus";
  EXPECT_ERROR_WITH(plan_from_json(ring), "\"sp_kind\" must be ring or ulysses");
}

TEST(PlanJson, EmptyPlanNamesEveryMissingField) {
  const std::string msg = sppo::testing::error_of([] { plan_from_json(nlohmann::json::object()); });
  for (const char* field : {"\"hardware\"", "\"seq_len\"", "\"pp\"", "\"lengths\"", "\"model_config\""})
    EXPECT_NE(msg.find(field), std::string::npos) << msg;
  EXPECT_EQ(msg.find("custom"), std::string::npos) << "blames a preset the plan never named: " << msg;
  EXPECT_ERROR_WITH(plan_from_json(nlohmann::json::array()), "JSON object");
}

TEST(PlanJson, RefusesValuesASimulationCannotUse) {
  const nlohmann::json good = {{"hardware", "a100-80gb"}, {"seq_len", 10}, {"sp", 1}, {"pp", 1},
                               {"lengths", {6, 4}},       {"gpus", 1},      {"model", "tiny"}};
  EXPECT_NO_THROW(plan_from_json(good));
  auto with = [&](const char* key, nlohmann::json v) {
    nlohmann::json j = good;
    j[key] = std::move(v);
    return j;
  };
  EXPECT_ERROR_WITH(plan_from_json(with("lengths", {12, -2})), "lengths[1] = -2");
  EXPECT_ERROR_WITH(plan_from_json(with("lengths", nlohmann::json::array())), "lengths is empty");
  EXPECT_ERROR_WITH(plan_from_json(with("seq_len", -10)), "seq_len");
  EXPECT_ERROR_WITH(plan_from_json(with("alpha", {0.5, 1.5})), "alpha[1]");
  EXPECT_ERROR_WITH(plan_from_json(with("gpus", 0)), "gpus");
  EXPECT_ERROR_WITH(plan_from_json(with("budget_bytes", -1)), "budget_bytes");
  EXPECT_ERROR_WITH(plan_from_json(with("kernel_scratch", {{"block", {-1, 0}}, {"head", {0, 0}}})), "kernel_scratch");
  EXPECT_ERROR_WITH(plan_from_json(with("kernel_scratch", {{"block", {0, 0}}})), "\"head\"");
  EXPECT_ERROR_WITH(plan_from_json(with("sp", "two")), "\"sp\" must be an integer");
  EXPECT_ERROR_WITH(plan_from_json(with("gpus", 1e300)), "\"gpus\" must be an integer");
  EXPECT_ERROR_WITH(plan_from_json(with("lengths", {6.5, 3.5})), "\"lengths\"[0] must be an integer");
  EXPECT_ERROR_WITH(plan_from_json(with("system", 7)), "\"system\" must be a string");
  EXPECT_ERROR_WITH(plan_from_json(with("lengths", {i64(1) << 62, i64(1) << 62, i64(1) << 62})), "2^63");
  EXPECT_ERROR_WITH(plan_from_json(with("recompute_tensors", "fc_post")), "\"recompute_tensors\"");
  EXPECT_ERROR_WITH(plan_from_json(with("mlp_tile_rows", -1)), "mlp_tile_rows");
  nlohmann::json tiled_tp = with("mlp_tile_rows", 64);
  tiled_tp["tp"] = 2;
  EXPECT_ERROR_WITH(plan_from_json(tiled_tp), "MLP tiles run without tensor parallelism");
  EXPECT_ERROR_WITH(plan_from_json(with("kv_recompute_layers", {7})), "\"kv_recompute_layers\" names layer 7");
  nlohmann::json both = with("kv_recompute_layers", {0});
  both["kv_host_layers"] = {0};
  EXPECT_ERROR_WITH(plan_from_json(both), "in both");
  // The degrees' product of ints near 2^31 must not overflow on the way to the comparison.
  nlohmann::json big = good;
  big.erase("sp");
  for (const char* k : {"tp", "ulysses", "cp", "pp", "dp"}) big[k] = 2147483647;
  EXPECT_ERROR_WITH(plan_from_json(big), "tp * ulysses * cp * pp * dp = more than");
}

TEST(Solver, SequenceBeyondTheSearchSaysHowLongItCanGo) {
  const auto out = sim::solve_plan(request("gpt-7b", 999999999999, 8, "sppo"));
  ASSERT_FALSE(out.ok);
  EXPECT_EQ(out.error.find("the closest: \n"), std::string::npos);
  EXPECT_NE(out.error.find("the longest sequence it plans on 8 devices is"), std::string::npos) << out.error;
}

}  // namespace
}  // namespace sppo::plan
