// The naive float64 Llama-family model of model_reference64_llama.h checked on its own
// (docs/design.md, Conventions 7), before the engine is compared with it:
//   1. its analytic backward against central finite differences of its forward, every
//      parameter of a tiny random model, with and without the q/k/v bias, with Qwen3's
//      query/key norms and a head size that is not H / Z, and for every RoPE scaling (none,
//      linear, dynamic, yarn, llama3), and once at given positions with a targets array;
//   2. its RoPE frequencies: plain theta^(-2j/A) without scaling, hand-evaluated values for
//      each scaling, and the engine's table (core/rope.h, written separately) for every
//      scaling type on tiny and released shapes;
//   3. properties any correct model has: grouped-query attention equals full attention with
//      each key/value head repeated, and a shift of every position leaves the loss unchanged;
//   4. its parameter layout against the engine's parameter_specs(), Qwen3's too.
// Parameters are random everywhere (norm gains away from 1, biases away from 0), large
// enough that attention is far from uniform, so a missing factor or a wrong index moves the
// results well past the tolerances. Each check prints one line with the largest error it saw.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/layout.h"
#include "core/rope.h"
#include "model_reference64_llama.h"

namespace sppo {
namespace {

namespace R = ref64llama;
using Tokens = std::vector<std::int32_t>;
using R::Vec;
using Type = RopeScaling::Type;

// float64 analytic backward against float64 central differences.
constexpr double kFdStep = 1e-5;
constexpr double kRefNormTol = 1e-7;  // per tensor, relative L2
constexpr double kRefAtol = 1e-6;     // per element, times the tensor's rms
constexpr double kRefRtol = 1e-6;
// The reference's frequencies against the engine's table.
constexpr double kFreqRtol = 1e-12;

struct Shape {
  int V, H, L, Z, G, F;
};
constexpr Shape kTiny{11, 32, 2, 4, 2, 12};  // A = 8: four frequencies per head
constexpr i64 kTinyS = 7;

// Qwen3's block: heads of 12 (not H / Z = 8: queries 48 wide on H 32), query/key norms.
constexpr int kQwen3HeadDim = 12;

ModelConfig make_config(const Shape& k, bool qkv_bias, RopeScaling scaling = {}, i64 max_positions = 2048,
                        i64 rope_seq_len = 0, bool qwen3 = false) {
  ModelConfig c;
  c.vocab = k.V;
  c.hidden = k.H;
  c.layers = k.L;
  c.heads = k.Z;
  c.family = Family::Llama;
  c.kv_heads = k.G;
  c.ffn_size = k.F;
  c.qkv_bias = qkv_bias;
  c.rope_theta = 10000.0f;
  c.ln_eps = 1e-5f;
  c.max_positions = max_positions;
  c.rope_scaling = scaling;
  c.rope_seq_len = rope_seq_len;
  if (qwen3) {
    c.head_dim = kQwen3HeadDim;
    c.qk_norm = true;
  }
  c.validate();
  return c;
}

RopeScaling scaling_linear(double factor) {
  RopeScaling s;
  s.type = Type::Linear;
  s.factor = factor;
  return s;
}
RopeScaling scaling_dynamic(double factor) {
  RopeScaling s;
  s.type = Type::Dynamic;
  s.factor = factor;
  return s;
}
RopeScaling scaling_yarn(double factor, double attention_factor = 0.0) {
  RopeScaling s;
  s.type = Type::Yarn;
  s.factor = factor;
  s.attention_factor = attention_factor;
  return s;
}
RopeScaling scaling_llama3(double factor, i64 original, double low = 1.0, double high = 4.0) {
  RopeScaling s;
  s.type = Type::Llama3;
  s.factor = factor;
  s.original_max_positions = original;
  s.low_freq_factor = low;
  s.high_freq_factor = high;
  return s;
}

// Matrices N(0, 1.5 / sqrt(fan_in)) (the LM head too: logits of order one; the embedding
// N(0, 1)), norm gains 1 + N(0, 0.3), biases N(0, 0.3): no element zero, attention scores of
// order one and above.
Vec make_params(const R::Dims& d, std::uint32_t seed) {
  const R::Layout lay = R::layout_of(d);
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  Vec p(static_cast<std::size_t>(lay.total));
  for (const R::Tensor& t : lay.tensors) {
    const bool matrix = t.shape.size() == 2;
    const bool gain = t.name.find("ln") != std::string::npos || t.name.find("_norm") != std::string::npos;  // ln1, ln2, ln_f, q_norm, k_norm
    const bool table = t.name == "embed.weight";
    for (i64 i = t.offset; i < t.offset + t.numel; ++i) {
      const double n = normal(rng);
      p[i] = table ? n : matrix ? 1.5 * n / std::sqrt(double(t.shape[1])) : gain ? 1.0 + 0.3 * n : 0.3 * n;
    }
  }
  return p;
}

Tokens make_tokens(i64 S, int V, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::int32_t> dist(0, V - 1);
  Tokens t(static_cast<std::size_t>(S + 1));
  for (auto& id : t) id = dist(rng);
  return t;
}

struct RefRun {
  double loss = 0;
  Vec grads;
};

RefRun run_ref(const R::Dims& d, const Vec& p, const Tokens& tokens, i64 S, const std::vector<i64>& pos = {},
            const std::int32_t* targets = nullptr) {
  R::Cache cache;
  RefRun r;
  r.loss = R::forward(d, p.data(), tokens.data(), S, &cache, pos, targets);
  r.grads.assign(p.size(), 0.0);
  R::backward(d, p.data(), tokens.data(), S, cache, r.grads.data(), pos, targets);
  return r;
}

Vec finite_differences(const R::Dims& d, Vec p, const Tokens& tokens, i64 S, const std::vector<i64>& pos = {},
                       const std::int32_t* targets = nullptr) {
  Vec g(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) {
    const double p0 = p[i];
    p[i] = p0 + kFdStep;
    const double lp = R::forward(d, p.data(), tokens.data(), S, nullptr, pos, targets);
    p[i] = p0 - kFdStep;
    const double lm = R::forward(d, p.data(), tokens.data(), S, nullptr, pos, targets);
    p[i] = p0;
    g[i] = (lp - lm) / (2.0 * kFdStep);
  }
  return g;
}

struct GradStats {
  double max_norm_err = 0;
  std::string worst_tensor;
  double max_scaled_err = 0;  // max over elements of |got - ref| / (atol rms(ref) + rtol |ref|)
};

GradStats compare_grads(const R::Dims& d, const Vec& got, const Vec& ref, const std::string& what) {
  GradStats st;
  EXPECT_EQ(got.size(), ref.size()) << what;
  if (got.size() != ref.size()) return st;
  for (const R::Tensor& t : R::layout_of(d).tensors) {
    double err2 = 0, ref2 = 0;
    for (i64 k = t.offset; k < t.offset + t.numel; ++k) {
      err2 += (got[k] - ref[k]) * (got[k] - ref[k]);
      ref2 += ref[k] * ref[k];
    }
    const double rms = std::sqrt(ref2 / double(t.numel));
    const double norm_err = std::sqrt(err2 / ref2);
    EXPECT_GT(ref2, 0.0) << what << " " << t.name << ": the reference gradient is zero";
    EXPECT_LT(norm_err, kRefNormTol) << what << " " << t.name << ": relative L2 error";
    if (!(norm_err <= st.max_norm_err)) {
      st.max_norm_err = norm_err;
      st.worst_tensor = t.name;
    }
    int bad = 0;
    for (i64 k = t.offset; k < t.offset + t.numel; ++k) {
      const double e = std::fabs(got[k] - ref[k]);
      const double bound = kRefAtol * rms + kRefRtol * std::fabs(ref[k]);
      st.max_scaled_err = std::max(st.max_scaled_err, e / bound);
      if (!(e <= bound) && bad++ < 3)
        ADD_FAILURE() << what << " " << t.name << "[" << (k - t.offset) << "]: got " << got[k] << ", want "
                      << ref[k] << " (tensor rms " << rms << ")";
    }
    EXPECT_EQ(bad, 0) << what << " " << t.name << ": " << bad << " of " << t.numel << " elements out of tolerance";
  }
  return st;
}

double rel_err(double got, double ref) { return std::fabs(got - ref) / std::fabs(ref); }

// ---- 1. the backward against finite differences ---------------------------------------------

struct ScalingCase {
  const char* name;
  RopeScaling scaling;
  i64 max_positions;
  i64 rope_seq_len;
};

// Each scaling changes the tiny model's frequencies (checked below): A = 8, theta = 1e4, so
// inv_freq = 1, 0.1, 0.01, 0.001 (wavelengths 6.3, 63, 628, 6283 positions).
std::vector<ScalingCase> tiny_scalings() {
  return {
      {"none", RopeScaling{}, 2048, 0},
      {"linear x2", scaling_linear(2.0), 2048, 0},
      // theta' = theta (2 * 16 / 4 - 1)^(8/6)
      {"dynamic x2, 16 > 4 positions", scaling_dynamic(2.0), 4, 16},
      // low = floor(1.008) = 1, high = ceil(2.513) = 3: ramp 0, 0, 1/2, 1; scale 0.1 ln 4 + 1
      {"yarn x4, M 2048", scaling_yarn(4.0), 2048, 0},
      {"yarn x4, M 2048, attention_factor 0.7", scaling_yarn(4.0, 0.7), 2048, 0},
      // wavelengths > 64 divided, 16..64 blended (63), < 16 kept (6.3)
      {"llama3 x8, original 64", scaling_llama3(8.0, 64), 2048, 0},
  };
}

void check_backward(const ModelConfig& c, const std::string& what, std::uint32_t seed,
                    const std::vector<i64>& pos = {}, const std::vector<std::int32_t>* targets = nullptr) {
  const R::Dims d = R::dims_of(c);
  const Vec p = make_params(d, seed);
  const Tokens tokens = make_tokens(kTinyS, c.vocab, seed + 1000u);
  const std::int32_t* tg = targets ? targets->data() : nullptr;
  const RefRun r = run_ref(d, p, tokens, kTinyS, pos, tg);
  ASSERT_TRUE(std::isfinite(r.loss)) << what;
  const Vec fd = finite_differences(d, p, tokens, kTinyS, pos, tg);
  const GradStats st = compare_grads(d, r.grads, fd, what);
  std::printf("[check 1] float64 backward vs FD, %s (%zu params, loss %.6f): max tensor rel L2 %.3e (%s), "
              "max err/bound %.3f\n",
              what.c_str(), p.size(), r.loss, st.max_norm_err, st.worst_tensor.c_str(), st.max_scaled_err);
}

TEST(ModelReferenceLlama, BackwardMatchesFiniteDifferences) {
  std::uint32_t seed = 1;
  for (const bool bias : {false, true})
    for (const ScalingCase& s : tiny_scalings()) {
      const ModelConfig c = make_config(kTiny, bias, s.scaling, s.max_positions, s.rope_seq_len);
      check_backward(c, std::string(s.name) + (bias ? ", qkv bias" : ", no bias"), seed++);
    }
}

// Qwen3: each query and key head normed before RoPE, heads of 12 on H 32.
TEST(ModelReferenceLlama, Qwen3BackwardMatchesFiniteDifferences) {
  std::uint32_t seed = 101;
  for (const ScalingCase& s : tiny_scalings()) {
    const ModelConfig c = make_config(kTiny, false, s.scaling, s.max_positions, s.rope_seq_len, true);
    check_backward(c, std::string(s.name) + ", qwen3 (q/k norms, A 12)", seed++);
  }
}

// Given positions far apart (large angles on every frequency) and a targets array with
// unpredicted positions (-1), yarn's scale on: the conventions of forward()'s optional
// arguments, through the backward too.
TEST(ModelReferenceLlama, BackwardMatchesFiniteDifferencesAtGivenPositionsWithTargets) {
  const ModelConfig c = make_config(kTiny, true, scaling_yarn(4.0), 2048);
  const std::vector<i64> pos = {3, 10, 50, 51, 400, 1999, 2000};
  const std::vector<std::int32_t> targets = {4, -1, 0, 10, -1, 7, 2};
  check_backward(c, "yarn x4, qkv bias, positions {3..2000}, 5 of 7 targets", 77, pos, &targets);
}

// ---- 2. RoPE frequencies ----------------------------------------------------------------------

// Without scaling (and with G = Z) the frequencies are plain theta^(-2j/A) and the scale 1.
TEST(ModelReferenceLlama, UnscaledFrequenciesArePlainTheta) {
  for (const Shape& k : {Shape{11, 32, 2, 4, 4, 12}, Shape{11, 64, 1, 1, 1, 8}, Shape{11, 256, 1, 2, 2, 8}}) {
    for (const float theta : {10000.0f, 500000.0f, 1000000.0f}) {
      ModelConfig c = make_config(k, false);
      c.rope_theta = theta;
      const R::Dims d = R::dims_of(c);
      ASSERT_EQ(d.G, d.Z);
      ASSERT_EQ(i64(d.rope.inv_freq.size()), d.A / 2);
      EXPECT_EQ(d.rope.scale, 1.0);
      for (i64 j = 0; j < d.A / 2; ++j) {
        const double want = 1.0 / std::pow(double(theta), double(2 * j) / double(d.A));
        EXPECT_LE(rel_err(d.rope.inv_freq[j], want), 1e-14) << "A " << d.A << " theta " << theta << " j " << j;
      }
      // Dynamic scaling at or below the reference length is no scaling at all.
      c.rope_scaling = scaling_dynamic(4.0);
      c.rope_seq_len = c.max_positions;
      const R::Rope dyn = R::rope_frequencies(c);
      for (i64 j = 0; j < d.A / 2; ++j) EXPECT_EQ(dyn.inv_freq[j], d.rope.inv_freq[j]) << "dynamic at M, j " << j;
    }
  }
}

// The tiny model's scaled frequencies, evaluated by hand from the formulas (the numbers in
// tiny_scalings()'s comments): each scaling changes them, as the FD cases rely on.
TEST(ModelReferenceLlama, TinyScaledFrequenciesByHand) {
  const double base[4] = {1.0, 0.1, 0.01, 0.001};
  auto freqs = [](const ScalingCase& s) {
    return R::rope_frequencies(make_config(kTiny, false, s.scaling, s.max_positions, s.rope_seq_len));
  };
  const std::vector<ScalingCase> cases = tiny_scalings();
  const R::Rope none = freqs(cases[0]);
  for (int j = 0; j < 4; ++j) EXPECT_LE(rel_err(none.inv_freq[j], base[j]), 1e-14);

  const R::Rope lin = freqs(cases[1]);
  for (int j = 0; j < 4; ++j) EXPECT_LE(rel_err(lin.inv_freq[j], base[j] / 2.0), 1e-14) << "linear j " << j;
  EXPECT_EQ(lin.scale, 1.0);

  const R::Rope dyn = freqs(cases[2]);
  const double theta2 = 10000.0 * std::pow(7.0, 8.0 / 6.0);
  for (int j = 0; j < 4; ++j)
    EXPECT_LE(rel_err(dyn.inv_freq[j], std::pow(theta2, -2.0 * j / 8.0)), 1e-14) << "dynamic j " << j;
  EXPECT_EQ(dyn.scale, 1.0);

  const double ramp[4] = {0.0, 0.0, 0.5, 1.0};
  for (int k = 3; k <= 4; ++k) {
    const R::Rope yarn = freqs(cases[k]);
    for (int j = 0; j < 4; ++j)
      EXPECT_LE(rel_err(yarn.inv_freq[j], base[j] / 4.0 * ramp[j] + base[j] * (1.0 - ramp[j])), 1e-14)
          << cases[k].name << " j " << j;
    EXPECT_DOUBLE_EQ(yarn.scale, k == 3 ? 0.1 * std::log(4.0) + 1.0 : 0.7) << cases[k].name;
  }

  const R::Rope l3 = freqs(cases[5]);
  const double s1 = (64.0 / (2.0 * std::numbers::pi / 0.1) - 1.0) / 3.0;
  const double want_l3[4] = {1.0, (1.0 - s1) * 0.1 / 8.0 + s1 * 0.1, 0.01 / 8.0, 0.001 / 8.0};
  for (int j = 0; j < 4; ++j) EXPECT_LE(rel_err(l3.inv_freq[j], want_l3[j]), 1e-14) << "llama3 j " << j;
  EXPECT_EQ(l3.scale, 1.0);
}

// The engine's table (core/rope.h, its own code) against the reference's, for every scaling
// type, on the tiny shape and on released models' head sizes and thetas.
TEST(ModelReferenceLlama, FrequenciesMatchEngineRopeTable) {
  struct Case {
    const char* name;
    Shape shape;
    float theta;
    RopeScaling scaling;
    i64 max_positions, rope_seq_len;
  };
  const Shape llama8b{11, 4096, 1, 32, 8, 8};   // A = 128
  const Shape qwen7b{11, 3584, 1, 28, 4, 8};    // A = 128
  const Shape small{11, 96, 1, 4, 2, 8};        // A = 24
  std::vector<Case> cases;
  for (const ScalingCase& s : tiny_scalings())
    cases.push_back({s.name, kTiny, 10000.0f, s.scaling, s.max_positions, s.rope_seq_len});
  cases.push_back({"llama-3-8b none", llama8b, 500000.0f, {}, 8192, 0});
  cases.push_back({"llama-3.1-8b llama3 x8", llama8b, 500000.0f, scaling_llama3(8.0, 8192), 131072, 0});
  cases.push_back({"llama3 x32, 2..8", llama8b, 500000.0f, scaling_llama3(32.0, 8192, 2.0, 8.0), 131072, 0});
  cases.push_back({"qwen2.5-7b yarn x4", qwen7b, 1000000.0f, scaling_yarn(4.0), 32768, 0});
  cases.push_back({"yarn x1 (scale 1)", qwen7b, 1000000.0f, scaling_yarn(1.0), 32768, 0});
  cases.push_back({"yarn x16, attention_factor 1.3", small, 10000.0f, scaling_yarn(16.0, 1.3), 4096, 0});
  cases.push_back({"linear x4", llama8b, 10000.0f, scaling_linear(4.0), 4096, 0});
  cases.push_back({"dynamic x2, 16K > 4K", llama8b, 10000.0f, scaling_dynamic(2.0), 4096, 16384});
  cases.push_back({"dynamic x2, 4K = 4K", llama8b, 10000.0f, scaling_dynamic(2.0), 4096, 4096});
  cases.push_back({"dynamic x8, 1M > 32K", small, 1000000.0f, scaling_dynamic(8.0), 32768, 1 << 20});
  {
    // The yarn correction range collapsing to one dim (low == high: high += 0.001).
    RopeScaling y = scaling_yarn(8.0);
    y.beta_fast = 2.0;
    y.beta_slow = 2.0;
    cases.push_back({"yarn x8, beta 2/2 (low == high)", small, 10000.0f, y, 4096, 0});
  }

  double worst = 0;
  for (const Case& k : cases) {
    ModelConfig c = make_config(k.shape, false, k.scaling, k.max_positions, k.rope_seq_len);
    c.rope_theta = k.theta;
    const R::Rope ref = R::rope_frequencies(c);
    const RopeTable eng = rope_table(c);
    ASSERT_EQ(eng.half, c.head_size() / 2) << k.name;
    ASSERT_EQ(i64(ref.inv_freq.size()), i64(eng.half)) << k.name;
    EXPECT_EQ(eng.scale, ref.scale) << k.name;
    for (int j = 0; j < eng.half; ++j) {
      const double e = rel_err(eng.inv_freq[j], ref.inv_freq[j]);
      worst = std::max(worst, e);
      EXPECT_LE(e, kFreqRtol) << k.name << " j " << j << ": engine " << eng.inv_freq[j] << ", reference "
                              << ref.inv_freq[j];
    }
  }
  std::printf("[check 2] RoPE frequencies vs engine rope_table, %zu configs: max rel err %.3e\n", cases.size(), worst);
}

// ---- 3. properties ------------------------------------------------------------------------------

// Grouped-query attention (G key/value heads) is full attention (G = Z) with key/value head
// z / (Z / G) copied to query head z: the same loss, and the gradient of each shared head is
// the sum of its copies' gradients. Run with the q/k/v bias, so its rows are mapped too.
TEST(ModelReferenceLlama, GroupedQueryAttentionEqualsRepeatedKvHeads) {
  const ModelConfig cg = make_config(kTiny, true, scaling_yarn(4.0), 2048);
  Shape full = kTiny;
  full.G = full.Z;
  const ModelConfig cf = make_config(full, true, scaling_yarn(4.0), 2048);
  const R::Dims dg = R::dims_of(cg), df = R::dims_of(cf);
  const R::Layout lg = R::layout_of(dg), lf = R::layout_of(df);
  const Vec pg = make_params(dg, 5);
  const Tokens tokens = make_tokens(kTinyS, kTiny.V, 6);
  const i64 H = dg.H, A = dg.A, ZA = dg.Z * A, group = dg.group();

  // Row r of the full model's qkv -> row of the grouped model's.
  auto source_row = [&](i64 r) -> i64 {
    if (r < ZA) return r;
    const i64 part = (r - ZA) / (df.G * A), within = (r - ZA) % (df.G * A);  // 0: k, 1: v
    const i64 z = within / A, a = within % A;
    return ZA + part * dg.G * A + (z / group) * A + a;
  };
  // Full model's parameter index -> grouped model's (every tensor but qkv maps one to one).
  std::vector<i64> src(static_cast<std::size_t>(lf.total));
  for (std::size_t t = 0; t < lf.tensors.size(); ++t) {
    const R::Tensor& f = lf.tensors[t];
    const R::Tensor& g = lg.tensors[t];
    ASSERT_EQ(f.name, g.name);
    const bool qkv_w = f.name.ends_with("attn.qkv.weight"), qkv_b = f.name.ends_with("attn.qkv.bias");
    for (i64 i = 0; i < f.numel; ++i) {
      i64 gi = i;
      if (qkv_w) gi = source_row(i / H) * H + i % H;
      if (qkv_b) gi = source_row(i);
      src[f.offset + i] = g.offset + gi;
    }
  }
  Vec pf(static_cast<std::size_t>(lf.total));
  for (i64 i = 0; i < lf.total; ++i) pf[i] = pg[src[i]];

  const RefRun rg = run_ref(dg, pg, tokens, kTinyS), rf = run_ref(df, pf, tokens, kTinyS);
  const double loss_err = rel_err(rg.loss, rf.loss);
  EXPECT_LE(loss_err, 1e-13);
  Vec summed(pg.size(), 0.0);
  for (i64 i = 0; i < lf.total; ++i) summed[src[i]] += rf.grads[i];
  double worst = 0, scale = 0;
  for (std::size_t i = 0; i < pg.size(); ++i) scale = std::max(scale, std::fabs(rg.grads[i]));
  for (std::size_t i = 0; i < pg.size(); ++i) worst = std::max(worst, std::fabs(summed[i] - rg.grads[i]));
  EXPECT_LE(worst, 1e-12 * scale);
  std::printf("[check 3] GQA G=%d vs repeated kv heads G=%d: loss rel err %.3e, max grad err %.3e (max |grad| %.3e)\n",
              kTiny.G, kTiny.Z, loss_err, worst, scale);
}

// RoPE makes attention depend on relative positions only: moving every position by the same
// amount leaves the loss (and the gradients) unchanged, for every scaling (fixed frequencies
// and scale). A rotation applied to q and k inconsistently, or a scale applied once, breaks it.
TEST(ModelReferenceLlama, ShiftingAllPositionsLeavesLossUnchanged) {
  std::vector<i64> pos0(kTinyS), pos1(kTinyS);
  for (i64 s = 0; s < kTinyS; ++s) {
    pos0[s] = s;
    pos1[s] = s + 1234;
  }
  double worst_loss = 0, worst_grad = 0;
  for (const ScalingCase& s : tiny_scalings()) {
    const ModelConfig c = make_config(kTiny, true, s.scaling, s.max_positions, s.rope_seq_len);
    const R::Dims d = R::dims_of(c);
    const Vec p = make_params(d, 9);
    const Tokens tokens = make_tokens(kTinyS, kTiny.V, 10);
    const RefRun a = run_ref(d, p, tokens, kTinyS, pos0), b = run_ref(d, p, tokens, kTinyS, pos1);
    const RefRun dflt = run_ref(d, p, tokens, kTinyS);
    EXPECT_EQ(a.loss, dflt.loss) << s.name << ": empty positions are 0..S-1";
    const double le = rel_err(b.loss, a.loss);
    double ge = 0, gs = 0;
    for (std::size_t i = 0; i < p.size(); ++i) {
      ge = std::max(ge, std::fabs(a.grads[i] - b.grads[i]));
      gs = std::max(gs, std::fabs(a.grads[i]));
    }
    EXPECT_LE(le, 1e-11) << s.name;
    EXPECT_LE(ge, 1e-9 * gs) << s.name;
    worst_loss = std::max(worst_loss, le);
    worst_grad = std::max(worst_grad, ge / gs);
    // The check can tell: positions not shifted together change the loss.
    std::vector<i64> bent = pos0;
    bent[kTinyS - 1] += 3;
    EXPECT_GT(rel_err(R::forward(d, p.data(), tokens.data(), kTinyS, nullptr, bent), a.loss), 1e-6) << s.name;
  }
  std::printf("[check 3] positions shifted by 1234: max loss rel err %.3e, max grad err / max |grad| %.3e\n",
              worst_loss, worst_grad);
}

// ---- 4. layout ----------------------------------------------------------------------------------

TEST(ModelReferenceLlama, LayoutMatchesParameterSpecs) {
  for (const int kind : {0, 1, 2}) {  // no bias, qkv bias, Qwen3
    const bool bias = kind == 1;
    const ModelConfig c = make_config(kTiny, bias, {}, 2048, 0, kind == 2);
    const R::Layout lay = R::layout_of(R::dims_of(c));
    const std::vector<TensorSpec> specs = parameter_specs(c);
    ASSERT_EQ(lay.tensors.size(), specs.size()) << "kind " << kind;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      EXPECT_EQ(lay.tensors[i].name, specs[i].name);
      EXPECT_EQ(lay.tensors[i].shape, specs[i].shape) << specs[i].name;
    }
    EXPECT_EQ(lay.total, c.num_params()) << "kind " << kind;
  }
}

}  // namespace
}  // namespace sppo
