// Memory term by term (`sppo plan --explain`): SPPO's terms from the simulator's accounting
// and the baselines' published accounting, each against a hand computation on a small
// config; the terms sum to the peak.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <numeric>

#include "core/layout.h"
#include "planner/partition.h"
#include "planner/profile.h"
#include "schedule/builders.h"
#include "schedule/memory.h"
#include "sim/baselines.h"
#include "sim/explain.h"
#include "sim/simulator.h"
#include "sim/solver.h"

namespace sppo::sim {
namespace {

using sched::MemTerm;

// H 64, 4 heads, FFN 4H, vocabulary 128, 2 layers.
ModelConfig small_config() {
  ModelConfig c = preset("tiny");
  c.vocab = 128;
  c.hidden = 64;
  c.heads = 4;
  c.layers = 2;
  return c;
}

i64 term(const SimResult& r, int rank, MemTerm t) { return r.peak_terms.at(std::size_t(rank))[std::size_t(t)]; }

TEST(MemoryTerms, SppoByHand) {
  // One process, one subsequence of T tokens, bf16 activations, no offload. The peak is at
  // the first layer of the backward: every K, V and unit is held, head_grad has become the
  // residual gradient, the last layer's accumulators and workspace are allocated.
  const ModelConfig c = small_config();
  const i64 H = c.hidden, F = c.ffn(), Z = c.heads, V = c.vocab, T = 512;
  const auto rules = memory_rules(c, ActPrecision::BF16);
  const sched::Schedule s = sched::build_single(c.layers, {T}, {0.0});
  const SimResult r = simulate(s, CostModel(plan::load_profile("a100-80gb"), c, ActPrecision::BF16), rules);
  const i64 per_layer = 2 * H + (3 * H * H + 3 * H) + (H * H + H) + 2 * H + (F * H + F) + (H * F + H);
  const i64 P = V * H + c.layers * per_layer + 2 * H;
  EXPECT_EQ(term(r, 0, MemTerm::Weights), 4 * P);
  EXPECT_EQ(term(r, 0, MemTerm::WeightCopy), 2 * P);                            // bf16, for the GEMMs
  EXPECT_EQ(term(r, 0, MemTerm::Gradients), 4 * P);
  EXPECT_EQ(term(r, 0, MemTerm::Optimizer), 8 * P);
  EXPECT_EQ(term(r, 0, MemTerm::KVCache), c.layers * (2 * H * 2) * T);          // K, V in bf16, both layers
  EXPECT_EQ(term(r, 0, MemTerm::KVGradAccum), (2 * H * 4) * T);                 // fp32, the last layer's
  // x, LN1 out, q, attention out, x_mid, LN2 out (bf16), fc_pre [T, 4H] (bf16), the four LN
  // statistics (fp32) and the LSE [Z, T] (fp32).
  const i64 unit = 6 * 2 * H + 2 * F + 4 * 4 + 4 * Z;
  EXPECT_EQ(term(r, 0, MemTerm::Units), c.layers * unit * T);
  EXPECT_EQ(term(r, 0, MemTerm::Hidden), 2 * H * T);                            // the residual gradient
  EXPECT_EQ(term(r, 0, MemTerm::Workspace), (2 * 3 * H + 2 * F + 2 * H + 4 * Z) * T);  // qkv, mlp_act, d_tmp, delta
  EXPECT_EQ(term(r, 0, MemTerm::HeadWorkspace), 0);
  EXPECT_EQ(term(r, 0, MemTerm::RingBuffers), 0);
  EXPECT_EQ(term(r, 0, MemTerm::StepInputs), (T + 1) * 4 + 8);                  // int32 tokens, double loss
  const auto& t = r.peak_terms[0];
  EXPECT_EQ(std::accumulate(t.begin(), t.end(), i64(0)), r.peak_device_bytes);
  EXPECT_EQ(r.host_at_peak[0], 0);
}

// The optimizer state on the host: the device loses AdamW m, v (8 B a parameter), the
// host holds the fp32 master, m, v and the gradients' copy (16 B) through the step, and the
// step is longer by the host's update (gradients down, AdamW, weights up).
TEST(MemoryTerms, OptimizerStateOnTheHostByHand) {
  const ModelConfig c = small_config();
  const i64 T = 512;
  const auto hw = plan::load_profile("a100-80gb");
  const CostModel cost(hw, c, ActPrecision::BF16);
  auto rules = memory_rules(c, ActPrecision::BF16);
  const sched::Schedule s = sched::build_single(c.layers, {T}, {0.0});
  const SimResult on_device = simulate(s, cost, rules);
  rules.optimizer_host = true;
  const SimResult on_host = simulate(s, cost, rules);
  const i64 P = c.num_params();
  EXPECT_EQ(term(on_host, 0, MemTerm::Optimizer), 0);
  EXPECT_EQ(term(on_host, 0, MemTerm::Weights), 4 * P);
  EXPECT_EQ(on_device.peak_device_bytes - on_host.peak_device_bytes, 8 * P);
  EXPECT_EQ(on_host.peak_host_bytes, 16 * P);
  EXPECT_EQ(on_host.host_at_peak[0], 16 * P);
  const double update = 4.0 * P / hw.d2h_bw + 28.0 * P / hw.elementwise_bw + 4.0 * P / hw.h2d_bw;
  EXPECT_DOUBLE_EQ(on_host.host_update_s, update);
  EXPECT_NEAR(on_host.step_time_s, on_device.step_time_s + update, 1e-12);
  EXPECT_EQ(on_device.host_update_s, 0);
}

// Recomputed tensors (Note [Recomputed tensors] in core/layout.h) leave the units: at the
// same peak, the first layer of the backward, the units hold every layer's kept tensors
// and the running layer holds its recomputed ones. A layer that recomputes its K/V keeps
// none: the running layer's K, V are back (recomputed), with its own zeroed dK/dV and the
// d(LayerNorm-1 output) sums [T, H] fp32 of its rows.
TEST(MemoryTerms, RecomputedTensorsByHand) {
  const ModelConfig c = small_config();
  const i64 H = c.hidden, F = c.ffn(), Z = c.heads, T = 512;
  const auto rules = memory_rules(c, ActPrecision::BF16);
  const CostModel cost(plan::load_profile("a100-80gb"), c, ActPrecision::BF16);
  const i64 unit = 6 * 2 * H + 2 * F + 4 * 4 + 4 * Z;
  const i64 mlp = 2 * F + 2 * H + 2 * 4;  // fc_pre, ln2_out, ln2_mean, ln2_rstd
  sched::Schedule s = sched::build_single(c.layers, {T}, {0.0});
  s.place.recompute = parse_recompute_tensors("fc_pre,ln2");
  const SimResult r = simulate(s, cost, rules);
  EXPECT_EQ(term(r, 0, MemTerm::Units), c.layers * (unit - mlp) * T);
  EXPECT_EQ(term(r, 0, MemTerm::Recomputed), mlp * T);
  EXPECT_EQ(term(r, 0, MemTerm::KVCache), c.layers * (2 * H * 2) * T);
  const SimResult none = simulate(sched::build_single(c.layers, {T}, {0.0}), cost, rules);
  EXPECT_EQ(none.peak_device_bytes - r.peak_device_bytes, (c.layers - 1) * mlp * T);

  sched::Schedule k = sched::build_single(c.layers, {T}, {0.0});
  k.place.kv.assign(std::size_t(c.layers), KvPlace::Recompute);
  const SimResult kr = simulate(k, cost, rules);
  EXPECT_EQ(term(kr, 0, MemTerm::KVCache), (2 * H * 2) * T);                   // the running layer's, recomputed
  EXPECT_EQ(term(kr, 0, MemTerm::KVGradAccum), (2 * H * 4 + H * 4) * T);       // its dK, dV and d LN1-output sums
  EXPECT_EQ(term(kr, 0, MemTerm::KVWindow), 0);                                // no earlier block
  EXPECT_EQ(kr.peak_host_bytes, 0);                                            // nothing summed for a later block
  const auto& t = kr.peak_terms[0];
  EXPECT_EQ(std::accumulate(t.begin(), t.end(), i64(0)), kr.peak_device_bytes);
}

// MLP tiles (Note [MLP tiles] in core/layout.h): at the same peak the workspace holds R
// rows of mlp_act instead of T, and a recomputed fc_pre leaves the recomputed tensors for
// R rows of fc_tile in the workspace. The explain row says so.
TEST(MemoryTerms, MlpTilesByHand) {
  const ModelConfig c = small_config();
  const i64 H = c.hidden, F = c.ffn(), Z = c.heads, T = 512, R = 100;
  const auto rules = memory_rules(c, ActPrecision::BF16);
  const CostModel cost(plan::load_profile("a100-80gb"), c, ActPrecision::BF16);
  sched::Schedule s = sched::build_single(c.layers, {T}, {0.0});
  s.place.mlp_tile_rows = R;
  const SimResult r = simulate(s, cost, rules);
  EXPECT_EQ(term(r, 0, MemTerm::Workspace), (2 * 3 * H + 2 * H + 4 * Z) * T + 2 * F * R);
  const SimResult none = simulate(sched::build_single(c.layers, {T}, {0.0}), cost, rules);
  EXPECT_EQ(none.peak_device_bytes - r.peak_device_bytes, 2 * F * (T - R));

  s.place.recompute = parse_recompute_tensors("fc_pre");
  const SimResult rc = simulate(s, cost, rules);
  EXPECT_EQ(term(rc, 0, MemTerm::Recomputed), 0);
  EXPECT_EQ(term(rc, 0, MemTerm::Workspace), (2 * 3 * H + 2 * H + 4 * Z) * T + 2 * 2 * F * R);
  sched::Schedule whole = sched::build_single(c.layers, {T}, {0.0});
  whole.place.recompute = s.place.recompute;
  const SimResult whole_rc = simulate(whole, cost, rules);
  EXPECT_EQ(term(whole_rc, 0, MemTerm::Recomputed), 2 * F * T);
  EXPECT_EQ(whole_rc.peak_device_bytes - rc.peak_device_bytes, 2 * F * T + 2 * F * (T - R) - 2 * F * R);
  const auto& t = rc.peak_terms[0];
  EXPECT_EQ(std::accumulate(t.begin(), t.end(), i64(0)), rc.peak_device_bytes);
}

TEST(MemoryTerms, OffloadedBytesAreOnTheHostAtThePeak) {
  // Subsequence 0's whole unit leaves during F(1) and comes back behind B(1): the peak, in
  // the backward of a later subsequence, is the same moment with and without it, lower by
  // exactly that unit, which the host holds then.
  const ModelConfig c = small_config();
  const auto rules = memory_rules(c, ActPrecision::BF16);
  const std::vector<i64> lengths = {256, 256, 256, 256};
  const sched::Schedule s = sched::build_single(c.layers, lengths, {1.0, 0.0, 0.0, 0.0});
  const CostModel cost(plan::load_profile("a100-80gb"), c, ActPrecision::BF16);
  const SimResult r = simulate(s, cost, rules);
  const SimResult none = simulate(sched::build_single(c.layers, lengths, {0, 0, 0, 0}), cost, rules);
  sched::RankMemory m(rules, s, 0);
  const i64 unit_bytes = (c.layers * m.unit_per_token() + m.head_grad_per_token()) * 256;
  EXPECT_EQ(r.host_at_peak[0], unit_bytes);
  EXPECT_EQ(term(none, 0, MemTerm::Units) - term(r, 0, MemTerm::Units), unit_bytes);
  EXPECT_EQ(none.peak_device_bytes - r.peak_device_bytes, unit_bytes);
}

TEST(MemoryTerms, SumToThePeakOnEveryRank) {
  // Pipeline, ring attention, MSP helpers, offload and ZeRO-1: every term is accounted.
  const ModelConfig c = small_config();
  sched::PipelineSpec spec;
  spec.layers = 4;
  spec.par.pp = 2;
  spec.par.cp = 2;
  spec.par.dp = 2;
  spec.par.msp.on = true;
  spec.lengths = {96, 80, 64, 48};
  spec.alpha = {0.5, 0.5, 0.25, 0};
  spec.par.ring_layout = RingLayout::Zigzag;
  ModelConfig c4 = c;
  c4.layers = 4;
  auto rules = memory_rules(c4, ActPrecision::BF16);
  rules.zero = true;
  const sched::Schedule s = sched::build_pipeline(spec);
  const SimResult r = simulate(s, CostModel(plan::load_profile("h100-sxm"), c4, ActPrecision::BF16), rules);
  bool borrowed = false, ring = false;
  for (int rank = 0; rank < s.ranks(); ++rank) {
    const auto& t = r.peak_terms[std::size_t(rank)];
    EXPECT_EQ(std::accumulate(t.begin(), t.end(), i64(0)), r.peak_bytes[std::size_t(rank)]) << "rank " << rank;
    for (i64 v : t) EXPECT_GE(v, 0) << "rank " << rank;
    borrowed |= t[std::size_t(MemTerm::BorrowedWeights)] > 0;
    ring |= t[std::size_t(MemTerm::RingBuffers)] > 0;
    // ZeRO-1: the AdamW state of a quarter of the owned parameters (4 ranks per stage).
    sched::RankMemory m(rules, s, rank);
    EXPECT_EQ(t[std::size_t(MemTerm::Optimizer)], 8 * m.state_params());
    EXPECT_LT(m.state_params() * 3, m.owned_params());
  }
  EXPECT_TRUE(borrowed || ring);
}

// A baseline's layout: `sp` is Megatron-LM's ring (cp) or DeepSpeed's Ulysses degree.
plan::Plan baseline_plan(const char* system, int tp, int sp, int pp, int dp, i64 S) {
  plan::Plan p;
  p.system = plan::parse_system(system);
  p.model_name = "gpt-7b";
  p.model = preset("gpt-7b");
  p.hardware = "a100-80gb";
  p.seq_len = S;
  p.par.tp = tp;
  (p.system == plan::System::Deepspeed ? p.par.ulysses : p.par.cp) = sp;
  p.par.pp = pp;
  p.par.dp = dp;
  p.gpus = tp * sp * pp * dp;
  p.gpus_per_node = 8;
  p.lengths = {S};
  p.subseqs = 1;
  p.alpha = {0.0};
  p.budget = i64(77) << 30;
  return p;
}

i64 line(const MemoryExplain& m, Row row, bool host = false) {
  for (const auto& l : m.lines)
    if (l.row == row) return host ? l.host : l.device;
  return -1;
}

// The baselines' closed forms (Note [Baseline memory]), which their plans' notes cite; the
// plans themselves are schedules (Notes [Megatron-LM as a schedule], [DeepSpeed-Ulysses as a
// schedule]).
TEST(MemoryTerms, MegatronByHand) {
  // tp 2, cp 4, pp 2, dp 1 at 256K: s = 64K tokens per CP rank, 16 layers a stage.
  const plan::Plan p = baseline_plan("megatron", 2, 4, 2, 1, i64(256) << 10);
  const MemoryExplain m = explain_baseline(p, plan::load_profile("a100-80gb"));
  const double H = 4096, V = 50304, s = 65536, t = 2;
  const double layer = double(sched::param_count(p.model, 0, 1, false, false));
  // The last stage: 16 layers, the tied output embedding and the final LayerNorm.
  const double psi = 16 * layer + V * H + 2 * H;
  EXPECT_EQ(line(m, Row::Weights), i64(std::llround(2 * psi / t)));
  EXPECT_EQ(line(m, Row::Gradients), i64(std::llround(4 * psi / t)));
  EXPECT_EQ(line(m, Row::Optimizer), i64(std::llround(12 * psi / t / 4)));  // over d x cp = 4
  EXPECT_EQ(line(m, Row::Checkpoints), i64(std::llround(16 * s * H * 2 / t)));
  // At this length the loss outweighs a layer's backward: bf16 logits and their fp32 copy,
  // the final hidden state, the pipeline's send and receive buffers.
  EXPECT_EQ(line(m, Row::Logits), i64(std::llround(6 * s * V / t)));
  EXPECT_EQ(line(m, Row::Recompute), 0);
  EXPECT_EQ(line(m, Row::CommBuffers), i64(std::llround(2 * 2 * s * H / t)));
  EXPECT_EQ(line(m, Row::Hidden), i64(std::llround(s * H * 2 / t)));
  EXPECT_EQ(m.device_total(), simulate_baseline(p, plan::load_profile("a100-80gb")).peak_device_bytes);
  // Without the loss (an earlier stage holds the embedding instead): the layer phase.
  const plan::Plan q = baseline_plan("megatron", 2, 4, 1, 1, i64(256) << 10);
  const MemoryExplain n = explain_baseline(q, plan::load_profile("a100-80gb"));
  EXPECT_EQ(line(n, Row::Checkpoints), i64(std::llround(32 * s * H * 2 / t)));
}

TEST(MemoryTerms, MegatronLayerPhaseByHand) {
  // A small vocabulary makes a layer's backward the peak: its recomputed activations, the
  // flash dQ accumulator, dK/dV, the CP ring buffers and the TP all-gather buffer.
  plan::Plan p = baseline_plan("megatron", 2, 2, 1, 1, i64(64) << 10);
  p.model.vocab = 256;
  const MemoryExplain m = explain_baseline(p, plan::load_profile("a100-80gb"));
  const double H = 4096, s = 32768, t = 2, e = 2;
  EXPECT_EQ(line(m, Row::Recompute), i64(std::llround(34 * s * H / t)));
  EXPECT_EQ(line(m, Row::AttentionWorkspace), i64(std::llround(4 * s * H / t)));
  EXPECT_EQ(line(m, Row::KVGradAccum), i64(std::llround(2 * s * H * e / t)));
  EXPECT_EQ(line(m, Row::CommBuffers), i64(std::llround(8 * s * H * e / t + 2 * s * H)));
  EXPECT_EQ(line(m, Row::Logits), 0);
}

TEST(MemoryTerms, DeepSpeedByHand) {
  // Ulysses 8 x dp 2 at 1M: s = 128K local tokens, 16 FPDT chunks of 8K.
  const plan::Plan p = baseline_plan("deepspeed", 1, 8, 1, 2, i64(1) << 20);
  const MemoryExplain m = explain_baseline(p, plan::load_profile("a100-80gb"));
  const double H = 4096, V = 50304, s = 131072, G = 16, L = 32;
  const double psi = double(p.model.num_params()), layer = double(sched::param_count(p.model, 0, 1, false, false));
  EXPECT_EQ(line(m, Row::Weights), i64(std::llround(2 * psi / G + 2 * (layer + 5e7))));
  EXPECT_EQ(line(m, Row::Gradients), i64(std::llround(2 * psi / G + 2 * layer)));
  EXPECT_EQ(line(m, Row::Optimizer), i64(std::llround(12 * psi / G)));
  EXPECT_EQ(line(m, Row::Checkpoints, true), i64(std::llround(L * s * H * 2)));
  EXPECT_EQ(line(m, Row::Units, true), i64(std::llround(4 * s * H * 2 + 4 * s * H)));
  // The loss of the whole local sequence is the peak here.
  EXPECT_EQ(line(m, Row::Logits), i64(std::llround(6 * s * V)));
  EXPECT_EQ(line(m, Row::Hidden), i64(std::llround(s * H * 2)));
  EXPECT_EQ(m.device_total(), simulate_baseline(p, plan::load_profile("a100-80gb")).peak_device_bytes);
}

TEST(MemoryTerms, ExplainOfAnSppoPlanIsItsPredictedPeak) {
  sim::PlanRequest req;
  req.model_name = "gpt-7b";
  req.model = preset("gpt-7b");
  req.seq_len = i64(256) << 10;
  req.gpus = 16;
  req.gpus_per_node = 8;
  req.hardware = "a100-80gb";
  req.hw = plan::load_profile("a100-80gb");
  const auto out = solve_plan(req);
  ASSERT_TRUE(out.ok) << out.error;
  const MemoryExplain m = explain_memory(out.plan, req.hw);
  EXPECT_EQ(m.device_total(), out.plan.predicted.peak_device_bytes);
  EXPECT_EQ(int(m.lines.size()), int(Row::kCount));
  const auto j = to_json(m);
  EXPECT_EQ(j["device_bytes"].get<i64>(), m.device_total());
  EXPECT_NE(explain_text(m).find("dK/dV accumulators"), std::string::npos);
  EXPECT_NE(explain_text(m).find("optimizer state on the device"), std::string::npos);
  // The same plan with its optimizer state on the host: the state's rows move there.
  plan::Plan host = out.plan;
  host.place.optimizer_state = Tier::Host;
  const SimResult r = simulate_plan(host, req.hw);
  const MemoryExplain h = explain_memory(host, req.hw);
  EXPECT_EQ(h.device_total(), r.peak_device_bytes);
  EXPECT_EQ(line(h, Row::Optimizer), 0);
  EXPECT_EQ(line(h, Row::Optimizer, true), line(m, Row::Optimizer));
  EXPECT_EQ(line(h, Row::Gradients, true), line(m, Row::Optimizer) / 2);
  EXPECT_EQ(line(h, Row::Weights, true), line(m, Row::Optimizer) / 2);
  EXPECT_EQ(h.host_total(), r.host_at_peak.at(std::size_t(r.peak_rank)));
  EXPECT_NE(explain_text(h).find("optimizer state on the host"), std::string::npos);
}

// MLP tiles (Note [MLP tiles]) in a plan: one device, one subsequence of S tokens, whose
// peak is at the first layer of the backward. Tiles of R rows take (S - R) rows of the
// bf16 [S, F] MLP activation off it, and the workspace row's formula says so.
TEST(MemoryTerms, ExplainOfAnSppoPlanWithMlpTiles) {
  const i64 S = i64(16) << 10;
  plan::Plan one = baseline_plan("sppo", 1, 1, 1, 1, S);
  one.stage_layers = {one.model.layers};
  one.offload = plan::OffloadMode::None;
  plan::Plan tiled = one;
  tiled.place.mlp_tile_rows = kPlanMlpTileRows;
  const auto hw = plan::load_profile("a100-80gb");
  const MemoryExplain m = explain_memory(one, hw), mt = explain_memory(tiled, hw);
  EXPECT_EQ(mt.device_total(), simulate_plan(tiled, hw).peak_device_bytes);
  EXPECT_EQ(m.device_total() - mt.device_total(), (S - kPlanMlpTileRows) * one.model.ffn() * 2);
  EXPECT_EQ(line(m, Row::LayerWorkspace) - line(mt, Row::LayerWorkspace),
            (S - kPlanMlpTileRows) * one.model.ffn() * 2);
  EXPECT_NE(explain_text(mt).find("the MLP activation in tiles of min(T, 4096) rows"), std::string::npos)
      << explain_text(mt);
}

}  // namespace
}  // namespace sppo::sim
