// Builders of the schedule IR: the single-process order, the sequence pipeline, MSP and
// ring steps, each checked by the one validator over a grid (docs/design.md, Conventions 2).
#include <gtest/gtest.h>

#include <algorithm>

#include "core/check.h"
#include "core/config.h"
#include "schedule/builders.h"
#include "schedule/memory.h"
#include "schedule/msp.h"
#include "schedule/validate.h"
#include "schedule/weights.h"

namespace sppo::sched {
namespace {

std::vector<std::string> texts(const std::vector<Op>& ops) {
  std::vector<std::string> t;
  for (const Op& op : ops) t.push_back(to_string(op));
  return t;
}

MemoryRules tiny_rules() {
  MemoryRules m;
  m.model = preset("tiny");
  m.precision = ActPrecision::F32;
  return m;
}

TEST(BuildSingle, OrderMatchesTheRuntimeContract) {
  const Schedule s = build_single(2, {4, 3, 2, 1}, {0.5, 1.0, 0.25, 0.0});
  const std::vector<std::string> want = {
      "F L0-1 s0", "O s0 0.5",  "F L0-1 s1", "WO s0", "O s1 1",   "F L0-1 s2",
      "WO s1",     "O s2 0.25", "F L0-1 s3", "WO s2", "P s2 0.25", "B L0-1 s3",
      "WP s2",     "P s1 1",    "B L0-1 s2", "WP s1", "P s0 0.5",  "B L0-1 s1",
      "WP s0",     "B L0-1 s0"};
  EXPECT_EQ(texts(s.ops[0]), want);
  EXPECT_EQ(s.seq_len(), 10);
  EXPECT_EQ(s.offset(2), 7);
}

TEST(BuildSingle, ZeroAlphaOmitsCopies) {
  const Schedule s = build_single(1, {2, 2, 2}, {0.0, 0.5, 0.0});
  const std::vector<std::string> want = {"F L0-0 s0", "F L0-0 s1", "O s1 0.5", "F L0-0 s2", "WO s1",
                                         "P s1 0.5",  "B L0-0 s2", "WP s1",    "B L0-0 s1", "B L0-0 s0"};
  EXPECT_EQ(texts(s.ops[0]), want);
}

TEST(BuildSingle, RejectsBadAlpha) {
  EXPECT_THROW(build_single(2, {2, 2}, {0.5, 0.5}), Error);
  EXPECT_THROW(build_single(2, {2, 2}, {0.5}), Error);
  EXPECT_THROW(build_single(2, {2, 2}, {1.5, 0.0}), Error);
}

TEST(BuildSingle, ValidAndEmptyAtTheEnd) {
  const MemoryRules rules = tiny_rules();
  for (int n = 1; n <= 6; ++n) {
    std::vector<i64> lengths(n, 8);
    std::vector<double> alpha(n, 0.75);
    alpha.back() = 0;
    const Validation v = validate(build_single(2, lengths, alpha), {&rules, 0});
    EXPECT_TRUE(v.ok()) << v.message();
  }
}

TEST(BuildPipeline, OneStageEqualsSingle) {
  PipelineSpec spec;
  spec.layers = 3;
  spec.lengths = {5, 4, 3};
  spec.alpha = {0.5, 0.25, 0.0};
  EXPECT_EQ(build_pipeline(spec).ops, build_single(3, spec.lengths, spec.alpha).ops);
}

// Note [Layer-major backward]: the same forward; then each layer from the last, its blocks
// of the paper's order on that layer alone, prefetches included.
TEST(LayerMajor, OrderIsTheLayersFromTheLast) {
  const Schedule s = to_layer_major(build_single(2, {4, 3, 2}, {0.5, 1.0, 0.0}));
  const std::vector<std::string> want = {
      "F L0-1 s0", "O s0 0.5",     "F L0-1 s1",  "WO s0",        "O s1 1",       "F L0-1 s2",  "WO s1",
      "P L1-1 s1 1", "B L1-1 s2",  "WP L1-1 s1", "P L1-1 s0 0.5", "B L1-1 s1",   "WP L1-1 s0", "B L1-1 s0",
      "P L0-0 s1 1", "B L0-0 s2",  "WP L0-0 s1", "P L0-0 s0 0.5", "B L0-0 s1",   "WP L0-0 s0", "B L0-0 s0"};
  EXPECT_EQ(texts(s.ops[0]), want);
  EXPECT_EQ(s.place.backward, BackwardOrder::Layer);
  EXPECT_EQ(to_layer_major(s).ops, s.ops);  // once is enough
}

// Any pipeline, ring and replicas: valid (the messages match without deadlock), every byte
// freed at the end; on one stage a layer's dK/dV sums never outlive it, so the peak is no
// higher than the paper's order's. MSP's pieces are refused, naming what runs.
TEST(LayerMajor, ValidOverAGrid) {
  MemoryRules rules = tiny_rules();
  rules.model.layers = 4;
  for (int pp : {1, 2, 4})
    for (int sp : {1, 2, 3})
      for (int n : {1, 2, 5})
        for (int dp : {1, 2})
          for (double a : {0.0, 0.5, 1.0}) {
            PipelineSpec spec;
            spec.layers = 4;
            spec.par.pp = pp;
            spec.par.cp = sp;
            spec.par.ring_layout = RingLayout::Contiguous;
            spec.par.dp = dp;
            for (int i = 0; i < n; ++i) spec.lengths.push_back(24 - i);
            spec.alpha.assign(n, a);
            spec.alpha.back() = 0;
            const Schedule paper = build_pipeline(spec);
            const Schedule s = to_layer_major(paper);
            const Validation v = validate(s, {&rules, 0});
            ASSERT_TRUE(v.ok()) << "pp " << pp << " sp " << sp << " n " << n << " dp " << dp << " alpha " << a
                                << "\n" << v.message() << "\n" << to_string(s);
            const Validation w = validate(paper, {&rules, 0});
            for (int r = 0; r < s.ranks() && pp == 1; ++r) {
              EXPECT_LE(v.peak_bytes[r], w.peak_bytes[r]) << "sp " << sp << " n " << n;
            }
          }
  PipelineSpec two;
  two.layers = 4;
  two.par.pp = 2;
  two.par.msp.on = true;
  two.lengths = {8, 8, 8};
  two.alpha = {0.0, 0.0, 0.0};
  try {
    to_layer_major(build_pipeline(two));
    ADD_FAILURE() << "a layer-major backward of MSP's pieces should be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--msp off"), std::string::npos) << e.what();
  }
}

// Note [Weights on the host] (schedule/weights.h): a run of uses of one layer brings its
// weights once, one layer ahead; each layer's gradient lives from its first backward to
// the use after its last. So the paper's order brings every layer for every subsequence
// both ways (the last forward and the first backward share a run), the layer order once a
// layer in backward; at most two layers' weights are on the device, and in the layer order
// at most two layers' gradients. Valid over a grid of rings, replicas and stages, every
// byte freed at the end, and never above the weights on the device.
TEST(WeightsOnTheHost, UsesBringEachLayerAheadAndLetItGo) {
  MemoryRules rules = tiny_rules();
  rules.model.layers = 4;
  rules.optimizer_host = true;
  const int L = 4, N = 3;
  auto loads = [](const LayerUses& u) {
    int n = 0;
    for (const LayerUse& x : u.uses()) n += (x.load_now >= 0) + (x.load_next >= 0);
    return n;
  };
  for (bool layer_major : {false, true}) {
    Schedule s = build_single(L, {8, 7, 6}, {0.5, 1.0, 0.0});
    if (layer_major) s = to_layer_major(std::move(s));
    s.place.weights = true ? Tier::Host : Tier::Device;
    const LayerUses u(s, 0);
    ASSERT_EQ(int(u.uses().size()), 2 * N * L);
    EXPECT_EQ(loads(u), layer_major ? N * L + L - 1 : 2 * N * L - 1) << "layer-major " << layer_major;
    for (int l = 0; l < L; ++l) {
      int first = 0, last = 0;
      for (const LayerUse& x : u.uses()) first += x.layer == l && x.grad_first, last += x.layer == l && x.grad_last;
      EXPECT_EQ(first, 1);
      EXPECT_EQ(last, 1);
    }
    // What is on the device, event by event.
    RankMemory mem(rules, s, 0);
    std::vector<MemEvent> ev;
    i64 w = 0, g = 0, most_w = 0, most_g = 0;
    for (const Op& op : s.ops[0]) {
      ev.clear();
      mem.events(op, &ev);
      std::stable_sort(ev.begin(), ev.end(), [](const MemEvent& a, const MemEvent& b) { return a.at < b.at; });
      for (const MemEvent& e : ev) {
        if (e.term == MemTerm::LayerWeights) most_w = std::max(most_w, w += e.delta);
        if (e.term == MemTerm::LayerGrads) most_g = std::max(most_g, g += e.delta);
      }
    }
    EXPECT_EQ(w, 0);
    EXPECT_EQ(g, 0);
    EXPECT_EQ(most_w, 2 * mem.layer_copy());
    EXPECT_EQ(most_g, (layer_major ? 2 : L) * mem.layer_grad()) << "layer-major " << layer_major;
    EXPECT_EQ(mem.layer_copy(), layer_params(rules.model, {}) * 4);
    EXPECT_EQ(mem.fixed_bytes() + L * (mem.layer_copy() + mem.layer_grad()),
              RankMemory(rules, build_single(L, {8, 7, 6}, {0.5, 1.0, 0.0}), 0).fixed_bytes());
  }
  // In bf16 a layer arrives in fp32 (4 B a parameter copied) and its GEMMs' working copy is
  // converted beside it (6 B on the device); the host keeps its fp32 master and nothing more,
  // and the device what a device-resident model keeps less the layers' weights, working
  // copies and gradients.
  {
    MemoryRules bf16 = rules;
    bf16.precision = ActPrecision::BF16;
    bf16.weight_copy_bytes = 2;
    Schedule s = to_layer_major(build_single(L, {8, 7, 6}, {0.5, 1.0, 0.0}));
    s.place.weights = true ? Tier::Host : Tier::Device;
    const RankMemory mem(bf16, s, 0);
    const i64 P = layer_params(bf16.model, {});
    EXPECT_EQ(mem.layer_copy(), 6 * P);
    EXPECT_EQ(mem.layer_copy_in(), 4 * P);
    const RankMemory resident(bf16, to_layer_major(build_single(L, {8, 7, 6}, {0.5, 1.0, 0.0})), 0);
    EXPECT_EQ(mem.fixed_bytes() + L * P * (4 + 2 + 4), resident.fixed_bytes());
    EXPECT_EQ(mem.host_fixed_bytes(), resident.host_fixed_bytes());
  }
  for (int pp : {1, 2})
    for (int sp : {1, 2})
      for (int dp : {1, 2})
        for (int n : {1, 2, 5})
          for (bool layer_major : {false, true}) {
            if (layer_major && pp > 1) continue;
            PipelineSpec spec;
            spec.layers = L;
            spec.par.pp = pp;
            spec.par.cp = sp;
            spec.par.ring_layout = RingLayout::Contiguous;
            spec.par.dp = dp;
            for (int i = 0; i < n; ++i) spec.lengths.push_back(24 - i);
            spec.alpha.assign(std::size_t(n), 0.5);
            spec.alpha.back() = 0;
            Schedule device = build_pipeline(spec);
            if (layer_major) device = to_layer_major(std::move(device));
            Schedule host = device;
            host.place.weights = Tier::Host;
            const std::string what = "pp " + std::to_string(pp) + " sp " + std::to_string(sp) + " dp " +
                                     std::to_string(dp) + " n " + std::to_string(n) + " layer-major " +
                                     std::to_string(layer_major);
            const Validation v = validate(host, {&rules, 0}), d = validate(device, {&rules, 0});
            ASSERT_TRUE(v.ok()) << what << "\n" << v.message();
            for (int r = 0; r < host.ranks(); ++r) EXPECT_LE(v.peak_bytes[r], d.peak_bytes[r]) << what;
          }
}

// Note [ZeRO-3 gathers] (schedule/weights.h): under ZeRO-3 each F and B op is preceded by
// the gathers its uses start, over the rank's layer group, in the training step and in the
// forward-only step alike; the validator catches a gather missing, moved or over another
// group. Under ZeRO the step's gradient reduction is a ReduceScatter.
TEST(ZeroThreeGathers, AreTheUsesLoadsOverTheLayerGroup) {
  ModelConfig c = preset("tiny");
  c.layers = 4;
  struct Layout {
    int pp, cp, ulysses, dp;
  };
  for (const Layout& l : {Layout{1, 1, 1, 2}, Layout{1, 2, 1, 2}, Layout{2, 1, 1, 2}, Layout{1, 1, 2, 2}})
    for (bool layer_major : {false, true})
      for (bool forward_only : {false, true}) {
        if (layer_major && (l.pp > 1 || forward_only)) continue;
        StepShape shape;
        shape.par.pp = l.pp;
        shape.par.cp = l.cp;
        shape.par.ulysses = l.ulysses;
        shape.par.dp = l.dp;
        shape.par.zero = ZeroStage::Weights;
        shape.forward_only = forward_only;
        if (layer_major) shape.place.backward = BackwardOrder::Layer;
        const std::string what = "pp " + std::to_string(l.pp) + " cp " + std::to_string(l.cp) + " ulysses " +
                                 std::to_string(l.ulysses) + " layer-major " + std::to_string(layer_major) +
                                 " forward-only " + std::to_string(forward_only);
        const Schedule s = build_step(c, {24, 20, 16}, {0.5, 0.5, 0.0}, shape);
        const Validation v = validate(s);
        ASSERT_TRUE(v.ok()) << what << "\n" << v.message();
        for (int r = 0; r < s.ranks(); ++r) {
          const auto& ops = s.ops[std::size_t(r)];
          const LayerUses uses(s, r);
          int gathers = 0, loads = 0, computes = 0;
          for (std::size_t k = 0; k < ops.size(); ++k) {
            if (ops[k].kind == OpKind::AllGather) {
              ++gathers;
              EXPECT_EQ(ops[k].group, s.par.layer_group(r)) << what;
              EXPECT_EQ(ops[k].payload, Payload::Weights) << what;
            }
            if (ops[k].kind == OpKind::Forward || ops[k].kind == OpKind::Backward) ++computes;
            loads += int(gathered_layers(uses, k).size());
          }
          EXPECT_EQ(gathers, loads) << what << " rank " << r;
          // Every use of a layer not the one before brings one: at least a layer an op.
          EXPECT_GE(gathers, layer_major ? computes / 3 : computes) << what << " rank " << r;
        }
        // ZeRO-2 streams the gradients alone: no gathers.
        shape.par.zero = ZeroStage::Gradients;
        for (const auto& ops : build_step(c, {24, 20, 16}, {0.5, 0.5, 0.0}, shape).ops)
          for (const Op& op : ops) EXPECT_NE(op.kind, OpKind::AllGather) << what;
      }
  StepShape shape;
  shape.par.dp = 2;
  shape.par.zero = ZeroStage::Weights;
  const Schedule s = build_step(c, {24, 20}, {0.5, 0.0}, shape);
  ASSERT_EQ(to_string(s.ops[0].at(0)), "allgather weights L0-0 [0,1]");
  ASSERT_EQ(to_string(s.ops[0].at(1)), "allgather weights L1-1 [0,1]");
  // Under every ZeRO stage the gradients are reduce-scattered over the layer group; without
  // ZeRO all-reduced.
  for (ZeroStage z : {ZeroStage::None, ZeroStage::OptimizerState, ZeroStage::Gradients, ZeroStage::Weights}) {
    StepShape shape_z = shape;
    shape_z.par.zero = z;
    const Schedule t = build_step(c, {24, 20}, {0.5, 0.0}, shape_z);
    const std::string want = z == ZeroStage::None ? "allreduce weight_grads L0-3 [0,1]"
                                                   : "reducescatter weight_grads L0-3 [0,1]";
    EXPECT_EQ(to_string(t.ops[0].back()), want) << stage_number(z);
    EXPECT_TRUE(reduces_weight_grads(t.ops[1].back())) << stage_number(z);
  }
  auto broken = [&](auto&& edit, const std::string& says) {
    Schedule t = s;
    edit(t);
    const Validation v = validate(t);
    EXPECT_FALSE(v.ok()) << says;
    EXPECT_NE(v.message().find(says), std::string::npos) << v.message();
  };
  broken([](Schedule& t) { t.ops[0].erase(t.ops[0].begin() + 1); }, "where its uses gather L0, L1");
  broken([](Schedule& t) { std::swap(t.ops[0][0], t.ops[0][1]); }, "where its uses gather L0, L1");
  broken([](Schedule& t) { t.ops[0][0].group = {0}; }, "another group than the layer group");
  broken([](Schedule& t) { t.par.zero = ZeroStage::Gradients; }, "the step does not shard");
  broken([](Schedule& t) { t.ops[1].erase(t.ops[1].begin()); }, "meets");
}

// Rebuilt layer inputs (Note [Rebuilt layer inputs] in builders.cpp): with the weights on
// the host the layer below comes with the first B op of a rebuilt layer's run and is not
// brought again, still two layers at a time; the layouts that cannot rebuild are named.
TEST(RebuiltInputs, UsesAndRefusals) {
  MemoryRules rules = tiny_rules();
  rules.model.layers = 4;
  rules.optimizer_host = true;
  const int L = 4;
  Schedule s = to_layer_major(build_single(L, {8, 7, 6}, {0.5, 1.0, 0.0}));
  s.place.inputs_rebuilt = {false, true, false, true};
  ASSERT_EQ(rebuilt_inputs_error(s), "");
  ASSERT_TRUE(validate(s, {&rules, 0}).ok()) << validate(s, {&rules, 0}).message();
  s.place.weights = true ? Tier::Host : Tier::Device;
  const LayerUses u(s, 0);
  std::vector<int> below;
  int brought = 0;
  for (std::size_t k = 0; k < u.uses().size(); ++k) {
    const LayerUse& x = u.uses()[k];
    brought += (x.load_now >= 0) + (x.load_next >= 0) + (x.load_below >= 0);
    if (x.load_below < 0) continue;
    below.push_back(x.load_below);
    EXPECT_TRUE(x.backward && (k == 0 || !u.uses()[k - 1].backward || u.uses()[k - 1].layer != x.layer));
  }
  EXPECT_EQ(below, (std::vector<int>{2, 0}));
  EXPECT_EQ(brought, 3 * L + L - 1) << "each layer once a forward and once in the backward";
  RankMemory mem(rules, s, 0);
  std::vector<MemEvent> ev;
  i64 w = 0, most_w = 0;
  for (const Op& op : s.ops[0]) {
    ev.clear();
    mem.events(op, &ev);
    std::stable_sort(ev.begin(), ev.end(), [](const MemEvent& a, const MemEvent& b) { return a.at < b.at; });
    for (const MemEvent& e : ev)
      if (e.term == MemTerm::LayerWeights) most_w = std::max(most_w, w += e.delta);
  }
  EXPECT_EQ(w, 0);
  EXPECT_EQ(most_w, 2 * mem.layer_copy());
  ASSERT_TRUE(validate(s, {&rules, 0}).ok()) << validate(s, {&rules, 0}).message();

  auto refused = [&](Schedule t, const std::string& why) {
    const std::string got = rebuilt_inputs_error(t);
    EXPECT_NE(got.find(why), std::string::npos) << "'" << got << "' does not say '" << why << "'";
    EXPECT_FALSE(validate(t).ok()) << why;
  };
  Schedule paper = build_single(L, {8, 7, 6}, {0.5, 1.0, 0.0});
  paper.place.inputs_rebuilt = s.place.inputs_rebuilt;
  refused(paper, "use --backward-order layer");
  Schedule first = s;
  first.place.inputs_rebuilt = {true, false, false, false};
  refused(first, "the first layer's input has no layer below");
  Schedule chain = s;
  chain.place.inputs_rebuilt = {false, true, true, false};
  refused(chain, "the layer below (1) must keep its input");
  Schedule kv = s;
  kv.place.kv = {KvPlace::Recompute, KvPlace::Recompute, KvPlace::Recompute, KvPlace::Host};
  refused(kv, "layer 1: its K/V are recomputed");
  kv.place.kv = {KvPlace::Host, KvPlace::Host, KvPlace::Recompute, KvPlace::Host};
  refused(kv, "layer 1: the layer below streams its K/V from the host");
  PipelineSpec spec;
  spec.layers = L;
  spec.par.pp = 2;
  spec.lengths = {8, 7};
  spec.alpha = {0.5, 0.0};
  Schedule staged = to_layer_major(build_pipeline(spec));
  staged.place.inputs_rebuilt = {false, false, true, false};
  refused(staged, "layer 2 is the first of a pipeline stage");
  staged.place.inputs_rebuilt = {false, true, false, true};
  EXPECT_EQ(rebuilt_inputs_error(staged), "");
  EXPECT_TRUE(validate(staged, {&rules, 0}).ok()) << validate(staged, {&rules, 0}).message();
  Schedule tp = expand_tensor_parallel(s, 2);
  refused(tp, "without --tp and --cp");
}

// The validator holds a layer-major backward to its order: a layer before the one above
// it, a backward whose layer was not prefetched back.
TEST(LayerMajor, ValidatorCatchesItsBreaks) {
  const MemoryRules rules = tiny_rules();
  Schedule s = to_layer_major(build_single(2, {4, 3, 2}, {0.5, 1.0, 0.0}));
  ASSERT_TRUE(validate(s, {&rules, 0}).ok());
  Schedule early = s;  // B L0 s2 before B L1 s2
  std::swap(early.ops[0][8], early.ops[0][15]);
  EXPECT_FALSE(validate(early, {&rules, 0}).ok()) << to_string(early);
  Schedule unfetched = s;  // P L1 s1 dropped with its wait
  unfetched.ops[0].erase(unfetched.ops[0].begin() + 9);
  unfetched.ops[0].erase(unfetched.ops[0].begin() + 7);
  const Validation v = validate(unfetched, {&rules, 0});
  EXPECT_FALSE(v.ok());
  EXPECT_NE(v.message().find("not back on the device"), std::string::npos) << v.message();
}

TEST(Msp, ReproducesTable3) {
  using V = std::vector<int>;
  const V left[] = {{0, 1, 2}, {0, 1}, {0}, {}};
  const V steady[] = {{3, 4, 5, 6, 7}, {2, 3, 4, 5, 6}, {1, 2, 3, 4, 5}, {0, 1, 2, 3, 4}};
  const V right[] = {{}, {7}, {6, 7}, {5, 6, 7}};
  const V left_gpus[] = {{0, 1, 2, 3}, {1, 2, 3}, {2, 3}, {}};
  const V right_gpus[] = {{}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}};
  for (int i = 0; i < 4; ++i) {
    const MspPhases m = msp_phases(4, 8, i);
    EXPECT_EQ(m.left, left[i]) << "stage " << i;
    EXPECT_EQ(m.steady, steady[i]) << "stage " << i;
    EXPECT_EQ(m.right, right[i]) << "stage " << i;
    EXPECT_EQ(m.left_gpus, left_gpus[i]) << "stage " << i;
    EXPECT_EQ(m.right_gpus, right_gpus[i]) << "stage " << i;
  }
}

TEST(Msp, GeneralFormulasOverAGrid) {
  for (int P = 1; P <= 8; ++P)
    for (int N = P; N <= 12; ++N) {
      // Every subsequence is in exactly one phase; the phase sets follow docs/design.md 6.
      for (int i = 0; i < P; ++i) {
        const MspPhases m = msp_phases(P, N, i);
        std::vector<int> all;
        for (auto* v : {&m.left, &m.steady, &m.right}) all.insert(all.end(), v->begin(), v->end());
        std::vector<int> want(N);
        for (int k = 0; k < N; ++k) want[k] = k;
        EXPECT_EQ(all, want) << "P " << P << " N " << N << " stage " << i;
        EXPECT_EQ(int(m.left.size()), P - 1 - i);
        EXPECT_EQ(int(m.right.size()), i);
        // In forward slot i + k of a Left k, each Left group g is before its own Steady
        // phase (its own subsequence i + k - g is Left or not started); in the slot of a
        // Right k, each Right group is past its Steady phase (Right or finished).
        for (int k : m.left) {
          EXPECT_EQ(int(m.left_gpus.size()), P - i);
          for (int g : m.left_gpus) {
            const int own = i + k - g;
            EXPECT_TRUE(own < 0 || own <= P - 2 - g) << "left group " << g << " is steady";
          }
        }
        for (int k : m.right) {
          EXPECT_EQ(int(m.right_gpus.size()), i + 1);
          for (int g : m.right_gpus) {
            const int own = i + k - g;
            EXPECT_TRUE(own >= N - g) << "right group " << g << " is steady";
          }
        }
      }
    }
  EXPECT_THROW(msp_phases(4, 3, 0), Error);
}

// At reach >= 2 a task goes only to groups that idle through its slot in the pipeline
// without MSP. Here that pipeline is laid out in time units (a forward 1, a backward 2, each
// stage as early as its inputs allow) and the idle groups read off it.
TEST(Msp, IdleGroupsAreIdleInThePipelineWithoutMsp) {
  for (int P = 2; P <= 6; ++P)
    for (int N = P; N <= 9; ++N) {
      // start[f][i][k]: when stage i starts its forward (f 1) or backward (f 0) of k.
      std::vector<std::vector<int>> fs(P, std::vector<int>(N)), bs(P, std::vector<int>(N));
      for (int i = 0; i < P; ++i)
        for (int k = 0; k < N; ++k)
          fs[i][k] = std::max(i > 0 ? fs[i - 1][k] + 1 : 0, k > 0 ? fs[i][k - 1] + 1 : 0);
      for (int i = P - 1; i >= 0; --i)
        for (int k = N - 1; k >= 0; --k)
          bs[i][k] = std::max({i < P - 1 ? bs[i + 1][k] + 2 : 0, k < N - 1 ? bs[i][k + 1] + 2 : 0,
                               i == P - 1 ? fs[i][N - 1] + 1 : 0});
      auto busy = [&](int g, int from, int to) {  // does group g work in [from, to)?
        for (int k = 0; k < N; ++k)
          if ((fs[g][k] < to && from < fs[g][k] + 1) || (bs[g][k] < to && from < bs[g][k] + 2)) return true;
        return false;
      };
      for (int reach : {2, 3, P})
        for (int i = 0; i < P; ++i)
          for (int k = 0; k < N; ++k) {
            const std::vector<int> g = msp_groups(P, N, i, k, reach);
            std::vector<int> want;
            for (int j = std::max(0, i - reach + 1); j < std::min(P, i + reach); ++j)
              if (j == i || (!busy(j, fs[i][k], fs[i][k] + 1) && !busy(j, bs[i][k], bs[i][k] + 2))) want.push_back(j);
            EXPECT_EQ(g, want) << "P " << P << " N " << N << " reach " << reach << " stage " << i << " k " << k;
          }
    }
  // Reach 0 is Table 3's: stage 1 of P 4, N 8 splits its subsequence 0 over 1..3, 7 over 0..1.
  EXPECT_EQ(msp_groups(4, 8, 1, 0, 0), (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(msp_groups(4, 8, 1, 7, 0), (std::vector<int>{0, 1}));
  EXPECT_EQ(msp_groups(4, 8, 1, 3, 0), (std::vector<int>{1}));
  EXPECT_THROW(msp_groups(4, 8, 1, 8, 2), Error);
}

TEST(BuildPipeline, GridIsValid) {
  MemoryRules rules = tiny_rules();
  rules.model.layers = 4;
  for (int pp : {1, 2, 3, 4})
    for (int sp : {1, 2, 3})
      for (int n : {1, 2, 4, 5, 8})
        for (bool msp : {false, true})
          for (int dp : {1, 2}) {
            if (msp && n < pp) continue;
            PipelineSpec spec;
            spec.layers = 4;
            spec.par.pp = pp;
            spec.par.cp = sp;
            spec.par.ring_layout = RingLayout::Contiguous;
            spec.par.dp = dp;
            spec.par.msp.on = msp;
            for (int i = 0; i < n; ++i) spec.lengths.push_back(24 - i);
            spec.alpha.assign(n, 0.5);
            spec.alpha.back() = 0;
            const Schedule s = build_pipeline(spec);
            ASSERT_EQ(s.ranks(), pp * sp * dp);
            const Validation v = validate(s, {&rules, 0});
            EXPECT_TRUE(v.ok()) << "pp " << pp << " sp " << sp << " n " << n << " msp " << msp << " dp "
                                << dp << "\n" << v.message() << "\n" << to_string(s);
          }
}

// The planner's alpha search rewrites the fractions of a schedule it built instead of
// building again (sim/solver/solve_alpha.cpp); that must give exactly what the builder
// gives.
TEST(SetOffloadFractions, EqualsBuildingAgain) {
  auto alphas = [](int n, int variant) {
    std::vector<double> a(n, 0.0);
    for (int i = 0; i + 1 < n; ++i)
      if (i % 3 != 1) a[i] = variant == 0 ? 0.25 + 0.5 * i / n : 1.0 - 0.125 * (i % 4);
    return a;
  };
  for (int n : {2, 3, 5, 8}) {
    const Schedule want = build_single(3, std::vector<i64>(n, 6), alphas(n, 1));
    Schedule s = build_single(3, std::vector<i64>(n, 6), alphas(n, 0));
    ASSERT_NE(s.ops, want.ops);
    set_offload_fractions(&s, alphas(n, 1));
    EXPECT_EQ(s.ops, want.ops) << "single, n " << n;
  }
  for (int pp : {1, 2, 3})
    for (int sp : {1, 2})
      for (int tp : {1, 2})
        for (int n : {3, 5, 8})
          for (bool msp : {false, true}) {
            if (msp && (n < pp || sp > 1 || tp > 1)) continue;  // MSP runs without rings and TP
            PipelineSpec spec;
            spec.layers = 4;
            spec.par.pp = pp;
            spec.par.cp = sp;
            spec.par.ring_layout = RingLayout::Contiguous;
            spec.par.msp.on = msp;
            for (int i = 0; i < n; ++i) spec.lengths.push_back(24 - i);
            auto build = [&](int variant) {
              PipelineSpec v = spec;
              v.alpha = alphas(n, variant);
              return expand_tensor_parallel(build_pipeline(v), tp);
            };
            const Schedule want = build(1);
            Schedule s = build(0);
            set_offload_fractions(&s, alphas(n, 1));
            EXPECT_EQ(s.ops, want.ops) << "pp " << pp << " sp " << sp << " tp " << tp << " n " << n << " msp " << msp;
          }
}

TEST(Validate, CatchesBrokenSchedules) {
  const MemoryRules rules = tiny_rules();
  Schedule s = build_single(2, {4, 4}, {0.5, 0.0});
  {
    Schedule t = s;  // backward before forward
    std::swap(t.ops[0].front(), t.ops[0].back());
    EXPECT_FALSE(validate(t).ok());
  }
  {
    Schedule t = s;  // prefetch never waited for
    t.ops[0].erase(t.ops[0].end() - 2);
    EXPECT_FALSE(validate(t).ok());
  }
  {
    Schedule t = s;  // a forward without backward leaves its activations
    t.ops[0].pop_back();
    const Validation v = validate(t, {&rules, 0});
    EXPECT_FALSE(v.ok());
  }
  {
    const Validation v = validate(s, {&rules, 1000});  // over budget
    EXPECT_FALSE(v.ok());
    EXPECT_NE(v.message().find("budget"), std::string::npos);
  }
  {
    // Unmatched receive: a deadlock.
    PipelineSpec spec;
    spec.layers = 2;
    spec.par.pp = 2;
    spec.lengths = {4, 4};
    Schedule t = build_pipeline(spec);
    for (auto it = t.ops[0].begin(); it != t.ops[0].end(); ++it)
      if (it->kind == OpKind::Send) {
        t.ops[0].erase(it);
        break;
      }
    const Validation v = validate(t);
    EXPECT_FALSE(v.ok());
    EXPECT_NE(v.message().find("blocked"), std::string::npos) << v.message();
  }
}

}  // namespace
}  // namespace sppo::sched
