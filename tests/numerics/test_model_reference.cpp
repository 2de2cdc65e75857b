// The whole GPT model of the engine (fp32, CPU runtime) against the naive float64 model of
// model_reference64.h (docs/design.md, Conventions 7):
//   1. the loss on the same weights, relative error < 1e-5;
//   2. every parameter gradient of a tiny model against central finite differences of the
//      float64 model, and a larger model's gradients against the float64 analytic backward
//      (itself checked against finite differences first);
//   3. a step split into subsequences (RoPE at global positions, earlier K/V reused) against
//      the whole-sequence step and the float64 model.
// Weights are init_params() plus noise on every tensor (LayerNorm gains and all biases
// included), large enough that attention is far from uniform and GeLU far from linear, so
// a missing factor, a flipped sign or a transposed weight moves the results well past the
// tolerances. Each check prints one line with the largest errors it saw.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/layout.h"
#include "model_reference64.h"
#include "runtime/executor.h"
#include "schedule/builders.h"
#include "train/setup.h"

namespace sppo {
namespace {

using Tokens = std::vector<std::int32_t>;
using ref64::Vec;

// fp32 engine against float64: loss relative error, per-tensor relative L2 error of the
// gradients, and element-wise |got - ref| <= atol * rms(ref) + rtol |ref| per tensor
// (atol scaled by the tensor's own size, as fp32 rounding in a sum scales with its terms).
constexpr double kLossRtol = 1e-5;
constexpr double kGradNormTol = 1e-4;
constexpr double kGradAtol = 1e-4;   // times the tensor's rms
constexpr double kGradRtol = 1e-3;
// Two fp32 runs of the same model that differ only in how the sequence is split.
constexpr double kSplitNormTol = 1e-5;
// float64 analytic backward against float64 central differences.
constexpr double kFdStep = 1e-5;
constexpr double kRefNormTol = 1e-7;

ModelConfig make_config(int V, int H, int L, int Z) {
  ModelConfig c;
  c.vocab = V;
  c.hidden = H;
  c.layers = L;
  c.heads = Z;
  c.validate();
  return c;
}

// init_params() and then noise on every element: matrices N(0, 1/sqrt(fan_in)) so every
// projection has unit-scale outputs, vectors N(0, 0.2) so no gain is 1 and no bias is 0.
std::vector<float> make_params(const ModelConfig& c, std::uint64_t seed) {
  std::vector<float> p(static_cast<std::size_t>(c.num_params()));
  init_params(c, p.data(), seed);
  std::mt19937 rng(static_cast<std::uint32_t>(seed) * 7919u + 17u);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  float* w = p.data();
  for (const TensorSpec& spec : parameter_specs(c)) {
    const float sd = spec.shape.size() == 2 ? 1.0f / std::sqrt(float(spec.shape[1])) : 0.2f;
    for (i64 k = 0; k < spec.numel(); ++k) w[k] += sd * normal(rng);
    w += spec.numel();
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

Vec to_double(const std::vector<float>& v) { return Vec(v.begin(), v.end()); }

struct EngineRun {
  double loss = 0;
  std::vector<float> grads;
};

EngineRun run_engine(const ModelConfig& c, const std::vector<float>& params, const Tokens& tokens,
                     const std::vector<i64>& lengths, const std::vector<double>& alpha) {
  Runtime rt(c, RuntimeOptions{});
  std::copy(params.begin(), params.end(), rt.params());
  const sched::Schedule s = sched::build_single(c.layers, lengths, alpha);
  const StepResult r = rt.step(s, tokens.data());
  return {r.loss, std::vector<float>(rt.grads(), rt.grads() + rt.num_params())};
}

struct RefRun {
  double loss = 0;
  Vec grads;
};

RefRun run_ref(const ModelConfig& c, const Vec& params, const Tokens& tokens) {
  const ref64::Dims d = ref64::dims_of(c);
  const i64 S = i64(tokens.size()) - 1;
  ref64::Cache cache;
  RefRun r;
  r.loss = ref64::forward(d, params.data(), tokens.data(), S, &cache);
  r.grads.assign(static_cast<std::size_t>(ref64::layout_of(d).total), 0.0);
  ref64::backward(d, params.data(), tokens.data(), S, cache, r.grads.data());
  return r;
}

// d loss / d p_i for every i, central differences of the float64 model.
Vec finite_differences(const ModelConfig& c, Vec params, const Tokens& tokens) {
  const ref64::Dims d = ref64::dims_of(c);
  const i64 S = i64(tokens.size()) - 1;
  Vec g(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    const double p0 = params[i];
    params[i] = p0 + kFdStep;
    const double lp = ref64::forward(d, params.data(), tokens.data(), S);
    params[i] = p0 - kFdStep;
    const double lm = ref64::forward(d, params.data(), tokens.data(), S);
    params[i] = p0;
    g[i] = (lp - lm) / (2.0 * kFdStep);
  }
  return g;
}

struct GradStats {
  double max_norm_err = 0;   // max over tensors of ||got - ref|| / ||ref||
  std::string worst_tensor;
  double max_abs_err = 0;    // max over elements of |got - ref|
  double max_scaled_err = 0; // max over elements of |got - ref| / (atol rms(ref) + rtol |ref|)
};

// Compares gradients tensor by tensor (names from the float64 layout). `norm_tol` bounds
// each tensor's relative L2 error; `rtol`/`atol` the elements (atol times the tensor rms).
template <typename T>
GradStats compare_grads(const ModelConfig& c, const std::vector<T>& got, const Vec& ref, double norm_tol,
                        double atol, double rtol, const std::string& what) {
  GradStats st;
  EXPECT_EQ(got.size(), ref.size()) << what;
  if (got.size() != ref.size()) return st;
  for (const ref64::Tensor& t : ref64::layout_of(ref64::dims_of(c)).tensors) {
    double err2 = 0, ref2 = 0;
    for (i64 k = t.offset; k < t.offset + t.numel; ++k) {
      const double e = double(got[k]) - ref[k];
      err2 += e * e;
      ref2 += ref[k] * ref[k];
    }
    const double rms = std::sqrt(ref2 / double(t.numel));
    const double norm_err = std::sqrt(err2 / ref2);
    EXPECT_GT(ref2, 0.0) << what << " " << t.name << ": the reference gradient is zero";
    EXPECT_LT(norm_err, norm_tol) << what << " " << t.name << ": relative L2 error";
    if (!(norm_err <= st.max_norm_err)) {
      st.max_norm_err = norm_err;
      st.worst_tensor = t.name;
    }
    int bad = 0;
    for (i64 k = t.offset; k < t.offset + t.numel; ++k) {
      const double e = std::fabs(double(got[k]) - ref[k]);
      const double bound = atol * rms + rtol * std::fabs(ref[k]);
      st.max_abs_err = std::max(st.max_abs_err, e);
      st.max_scaled_err = std::max(st.max_scaled_err, e / bound);
      if (!(e <= bound) && bad++ < 3)
        ADD_FAILURE() << what << " " << t.name << "[" << (k - t.offset) << "]: got " << got[k]
                      << ", want " << ref[k] << " (tensor rms " << rms << ")";
    }
    EXPECT_EQ(bad, 0) << what << " " << t.name << ": " << bad << " of " << t.numel
                      << " elements out of tolerance";
  }
  return st;
}

void print_grad_line(const char* check, const std::string& what, const GradStats& st) {
  std::printf("[%s] %s: max tensor rel L2 %.3e (%s), max |err| %.3e, max err/bound %.3f\n", check,
              what.c_str(), st.max_norm_err, st.worst_tensor.c_str(), st.max_abs_err,
              st.max_scaled_err);
}

double rel_err(double got, double ref) { return std::fabs(got - ref) / std::fabs(ref); }

struct Case {
  const char* name;
  int V, H, L, Z;
  i64 S;
  std::uint64_t seed;
};

constexpr Case kTiny{"tiny V=23 H=16 L=2 Z=4 S=13", 23, 16, 2, 4, 13, 11};
constexpr Case kSmall{"small V=61 H=32 L=3 Z=2 S=70", 61, 32, 3, 2, 70, 12};

// ---- layout -----------------------------------------------------------------------------

TEST(ModelReference, LayoutMatchesParameterSpecs) {
  for (const Case& k : {kTiny, kSmall}) {
    const ModelConfig c = make_config(k.V, k.H, k.L, k.Z);
    const ref64::Layout lay = ref64::layout_of(ref64::dims_of(c));
    const std::vector<TensorSpec> specs = parameter_specs(c);
    ASSERT_EQ(lay.tensors.size(), specs.size()) << k.name;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      EXPECT_EQ(lay.tensors[i].name, specs[i].name) << k.name;
      EXPECT_EQ(lay.tensors[i].shape, specs[i].shape) << k.name << " " << specs[i].name;
    }
    EXPECT_EQ(lay.total, c.num_params()) << k.name;
  }
}

// ---- 1. loss ------------------------------------------------------------------------------

TEST(ModelReference, LossMatchesFloat64) {
  for (const Case& k : {kTiny, kSmall}) {
    const ModelConfig c = make_config(k.V, k.H, k.L, k.Z);
    const std::vector<float> params = make_params(c, k.seed);
    const Tokens tokens = make_tokens(k.S, k.V, std::uint32_t(k.seed) + 100u);
    const EngineRun e = run_engine(c, params, tokens, {k.S}, {0.0});
    const Vec p64 = to_double(params);
    const double ref = ref64::forward(ref64::dims_of(c), p64.data(), tokens.data(), k.S);
    const double err = rel_err(e.loss, ref);
    std::printf("[check 1] loss %s: engine %.9f float64 %.9f rel err %.3e\n", k.name, e.loss, ref, err);
    EXPECT_LT(err, kLossRtol) << k.name;
  }
}

// ---- 2. gradients ---------------------------------------------------------------------------

TEST(ModelReference, TinyGradsMatchFiniteDifferences) {
  const Case& k = kTiny;
  const ModelConfig c = make_config(k.V, k.H, k.L, k.Z);
  const std::vector<float> params = make_params(c, k.seed);
  const Tokens tokens = make_tokens(k.S, k.V, std::uint32_t(k.seed) + 200u);
  const Vec p64 = to_double(params);

  const Vec fd = finite_differences(c, p64, tokens);
  const EngineRun e = run_engine(c, params, tokens, {k.S}, {0.0});
  print_grad_line("check 2", std::string("engine vs float64 FD, ") + k.name + ", " +
                                 std::to_string(fd.size()) + " params",
                  compare_grads(c, e.grads, fd, kGradNormTol, kGradAtol, kGradRtol, "engine vs FD"));

  // The float64 analytic backward, used below for the larger model, against the same FD.
  const RefRun r = run_ref(c, p64, tokens);
  print_grad_line("check 2", std::string("float64 backward vs float64 FD, ") + k.name,
                  compare_grads(c, r.grads, fd, kRefNormTol, 1e-6, 1e-6, "float64 backward vs FD"));
}

TEST(ModelReference, SmallGradsMatchFloat64Backward) {
  const Case& k = kSmall;
  const ModelConfig c = make_config(k.V, k.H, k.L, k.Z);
  const std::vector<float> params = make_params(c, k.seed);
  const Tokens tokens = make_tokens(k.S, k.V, std::uint32_t(k.seed) + 300u);
  const Vec p64 = to_double(params);

  const RefRun r = run_ref(c, p64, tokens);
  // Spot-check the float64 backward on this shape too: central differences of a few
  // elements of every tensor.
  {
    const ref64::Dims d = ref64::dims_of(c);
    std::mt19937 rng(301);
    Vec p = p64;
    double max_rel = 0;
    for (const ref64::Tensor& t : ref64::layout_of(d).tensors) {
      std::uniform_int_distribution<i64> pick(t.offset, t.offset + t.numel - 1);
      for (int n = 0; n < 4; ++n) {
        const i64 i = pick(rng);
        const double p0 = p[i];
        p[i] = p0 + kFdStep;
        const double lp = ref64::forward(d, p.data(), tokens.data(), k.S);
        p[i] = p0 - kFdStep;
        const double lm = ref64::forward(d, p.data(), tokens.data(), k.S);
        p[i] = p0;
        const double fd = (lp - lm) / (2.0 * kFdStep);
        const double err = std::fabs(fd - r.grads[i]);
        EXPECT_LE(err, 1e-8 + 1e-5 * std::fabs(fd)) << t.name << "[" << (i - t.offset) << "]";
        max_rel = std::max(max_rel, err / (1e-8 + std::fabs(fd)));
      }
    }
    std::printf("[check 2] float64 backward vs float64 FD spot checks, %s: max err/(1e-8+|fd|) %.3e\n",
                k.name, max_rel);
  }

  const EngineRun e = run_engine(c, params, tokens, {k.S}, {0.0});
  print_grad_line("check 2", std::string("engine vs float64 backward, ") + k.name,
                  compare_grads(c, e.grads, r.grads, kGradNormTol, kGradAtol, kGradRtol,
                                "engine vs float64 backward"));
}

// ---- 3. subsequences at global positions ----------------------------------------------------

void check_split(const Case& k, const std::vector<i64>& lengths, const std::vector<double>& alpha,
                 std::uint32_t token_seed) {
  const ModelConfig c = make_config(k.V, k.H, k.L, k.Z);
  const std::vector<float> params = make_params(c, k.seed);
  const Tokens tokens = make_tokens(k.S, k.V, token_seed);
  const Vec p64 = to_double(params);
  std::string split;
  for (i64 l : lengths) split += (split.empty() ? "" : ",") + std::to_string(l);
  const std::string what = std::string(k.name) + " lengths {" + split + "}";

  const EngineRun whole = run_engine(c, params, tokens, {k.S}, {0.0});
  const EngineRun parts = run_engine(c, params, tokens, lengths, alpha);
  const RefRun r = run_ref(c, p64, tokens);

  const double err_whole = rel_err(parts.loss, whole.loss), err_ref = rel_err(parts.loss, r.loss);
  EXPECT_LT(err_whole, kSplitNormTol) << what;
  EXPECT_LT(err_ref, kLossRtol) << what;

  // The check can tell: the same model with RoPE positions restarting at every subsequence
  // has a clearly different loss.
  std::vector<i64> local;
  for (i64 l : lengths)
    for (i64 t = 0; t < l; ++t) local.push_back(t);
  const double wrong = ref64::forward(ref64::dims_of(c), p64.data(), tokens.data(), k.S, nullptr, local);
  EXPECT_GT(rel_err(wrong, r.loss), 100 * kLossRtol) << what << ": local positions are not detectable";
  EXPECT_GT(rel_err(parts.loss, wrong), 10 * kLossRtol) << what << ": engine matches local positions";

  std::printf("[check 3] loss %s: rel err vs N=1 %.3e, vs float64 %.3e (local positions would give %.3e)\n",
              what.c_str(), err_whole, err_ref, rel_err(wrong, r.loss));
  const Vec whole64 = to_double(whole.grads);
  print_grad_line("check 3", "grads vs N=1, " + what,
                  compare_grads(c, parts.grads, whole64, kSplitNormTol, kGradAtol, kGradRtol, what + " vs N=1"));
  print_grad_line("check 3", "grads vs float64, " + what,
                  compare_grads(c, parts.grads, r.grads, kGradNormTol, kGradAtol, kGradRtol,
                                what + " vs float64"));
}

// ---- bidirectional attention, masked-token objective ---------------------------------------

// The engine's bidirectional model trained on masked tokens (mask_tokens, the trainer's
// recipe) against the float64 model with every key visible: the loss, and every gradient
// against finite differences of the float64 loss over the masked positions. The causal
// float64 loss on the same inputs differs by far more than the tolerance, so an engine that
// still masked the future would fail.
TEST(ModelReference, BidirectionalMaskedTokensMatchFloat64) {
  const Case& k = kTiny;
  ModelConfig c = make_config(k.V, k.H, k.L, k.Z);
  c.causal = false;
  const std::vector<float> params = make_params(c, k.seed);
  Tokens tokens = make_tokens(k.S, k.V, std::uint32_t(k.seed) + 400u);
  const std::vector<std::int32_t> targets = mask_tokens(tokens.data(), k.S, k.V, 5);
  const Vec p64 = to_double(params);
  const ref64::Dims d = ref64::dims_of(c);

  Runtime rt(c, RuntimeOptions{});
  std::copy(params.begin(), params.end(), rt.params());
  StepControl control;
  control.targets = targets.data();
  const StepResult r = rt.step(sched::build_single(c.layers, {k.S}, {0.0}), tokens.data(), control);
  const std::vector<float> grads(rt.grads(), rt.grads() + rt.num_params());

  ref64::Cache cache;
  const double ref = ref64::forward(d, p64.data(), tokens.data(), k.S, &cache, {}, targets.data());
  ref64::Dims causal = d;
  causal.causal = true;
  const double ref_causal = ref64::forward(causal, p64.data(), tokens.data(), k.S, nullptr, {}, targets.data());
  std::printf("[bidirectional] loss: engine %.9f float64 %.9f (causal float64 %.9f), rel err %.3e\n", r.loss, ref,
              ref_causal, rel_err(r.loss, ref));
  EXPECT_LT(rel_err(r.loss, ref), kLossRtol);
  EXPECT_GT(rel_err(ref_causal, ref), 100 * kLossRtol) << "the causal and bidirectional losses should differ";
  EXPECT_EQ(r.predicted, std::count_if(targets.begin(), targets.end(), [](std::int32_t t) { return t >= 0; }));

  Vec fd(p64.size()), q = p64;
  for (std::size_t i = 0; i < q.size(); ++i) {
    const double p0 = q[i];
    q[i] = p0 + kFdStep;
    const double lp = ref64::forward(d, q.data(), tokens.data(), k.S, nullptr, {}, targets.data());
    q[i] = p0 - kFdStep;
    const double lm = ref64::forward(d, q.data(), tokens.data(), k.S, nullptr, {}, targets.data());
    q[i] = p0;
    fd[i] = (lp - lm) / (2.0 * kFdStep);
  }
  print_grad_line("bidirectional", "engine vs float64 FD",
                  compare_grads(c, grads, fd, kGradNormTol, kGradAtol, kGradRtol, "bidirectional engine vs FD"));
  Vec g64(p64.size());
  ref64::backward(d, p64.data(), tokens.data(), k.S, cache, g64.data(), {}, targets.data());
  print_grad_line("bidirectional", "float64 backward vs float64 FD",
                  compare_grads(c, g64, fd, kRefNormTol, 1e-6, 1e-6, "bidirectional float64 backward vs FD"));
}

TEST(ModelReference, SubsequencesUseGlobalPositions) {
  check_split(kTiny, {5, 1, 7}, {0.0, 0.0, 0.0}, 400u);
}

TEST(ModelReference, SubsequencesWithOffloadUseGlobalPositions) {
  check_split(kSmall, {23, 1, 30, 16}, {0.5, 1.0, 0.25, 0.0}, 500u);
}

}  // namespace
}  // namespace sppo
