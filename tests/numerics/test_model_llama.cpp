// The Llama-family block (RMSNorm, SwiGLU, grouped-query attention, scaled RoPE, untied
// head, the optional q/k/v bias; Qwen3's query/key norms and a head size that is not H / Z)
// against the float64 reference of model_reference64_llama.h, and every one-process mode of
// it (subsequences, offload, recomputed tensors, MLP tiles, K/V on the host or recomputed)
// against the whole-sequence engine run (docs/design.md 3).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/layout.h"
#include "model_reference64.h"
#include "model_reference64_llama.h"
#include "schedule/builders.h"
#include "train/setup.h"
#include "train/trainer.h"
#include "support/subseqs.h"

namespace sppo {
namespace {

using testing::alphas;
using testing::equal_lengths;

using Tokens = std::vector<std::int32_t>;

ModelConfig llama_config(int G, bool bias, RopeScaling::Type type, i64 S, bool tied = false) {
  ModelConfig c = preset("llama-tiny");
  c.vocab = 37;
  c.hidden = 32;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = G;
  c.ffn_size = 40;
  c.qkv_bias = bias;
  c.rope_theta = 500.0f;  // short wavelengths, so that a few dozen positions turn every pair
  c.max_positions = 16;
  c.rope_scaling.type = type;
  if (type != RopeScaling::Type::None) c.rope_scaling.factor = 4.0;
  if (type == RopeScaling::Type::Llama3) c.rope_scaling.original_max_positions = 16;
  c.rope_seq_len = S;
  c.tie_embeddings = tied;
  c.validate();
  return c;
}

// Qwen3's block (Note [Query/key norms], Note [Head size]) on llama_config's shape: heads of
// head_dim (12: queries 48 wide on H 32; 6: 24 wide, narrower than H), with or without
// the norms.
ModelConfig qwen3_config(int G, RopeScaling::Type type, i64 S, bool tied, int head_dim = 12, bool qk_norm = true) {
  ModelConfig c = llama_config(G, false, type, S, tied);
  c.head_dim = head_dim;
  c.qk_norm = qk_norm;
  c.validate();
  return c;
}

Tokens random_tokens(i64 S, int V, unsigned seed) {
  std::mt19937 rng(seed);
  Tokens t(std::size_t(S + 1));
  for (auto& x : t) x = std::int32_t(rng() % unsigned(V));
  return t;
}

// init_params and noise on every element, so that no norm gain is 1 and no bias 0.
std::vector<float> random_params(const ModelConfig& c, std::uint64_t seed) {
  std::vector<float> p(std::size_t(c.num_params()));
  init_params(c, p.data(), seed);
  std::mt19937 rng(unsigned(seed) * 31u + 7u);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  float* w = p.data();
  for (const TensorSpec& spec : parameter_specs(c)) {
    const float sd = spec.shape.size() == 2 ? 1.0f / std::sqrt(float(spec.shape[1])) : 0.2f;
    for (i64 k = 0; k < spec.numel(); ++k) w[k] += sd * normal(rng);
    w += spec.numel();
  }
  return p;
}

struct StepRun {
  double loss = 0;
  std::vector<double> grads;
};

struct Mode {
  std::vector<i64> lengths;
  std::vector<double> alpha;
  SavedSet recompute = 0;
  i64 mlp_tile_rows = 0;
  std::vector<KvPlace> kv_place = {};  // empty: every layer's K/V on the device
};

StepRun run_engine(const ModelConfig& c, const std::vector<float>& params, const Tokens& tokens, const Mode& m) {
  RuntimeOptions o;
  o.head_chunk = 7;  // several chunks per subsequence, and a partial last one
  Runtime rt(c, o);
  std::copy(params.begin(), params.end(), rt.params());
  sched::Schedule s = sched::build_single(c.layers, m.lengths, m.alpha);
  s.place.recompute = m.recompute;
  s.place.mlp_tile_rows = m.mlp_tile_rows;
  s.place.kv = m.kv_place;
  const StepResult r = rt.step(s, tokens.data());
  return {r.loss, std::vector<double>(rt.grads(), rt.grads() + rt.num_params())};
}

StepRun run_ref(const ModelConfig& c, const std::vector<float>& params, const Tokens& tokens) {
  const ref64llama::Dims d = ref64llama::dims_of(c);
  const std::vector<double> p(params.begin(), params.end());
  const i64 S = i64(tokens.size()) - 1;
  ref64llama::Cache cache;
  StepRun r;
  r.loss = ref64llama::forward(d, p.data(), tokens.data(), S, &cache);
  r.grads.assign(p.size(), 0.0);
  ref64llama::backward(d, p.data(), tokens.data(), S, cache, r.grads.data());
  return r;
}

// Per tensor: relative L2 error below norm_tol, and every element within atol x the
// tensor's rms + rtol x itself. Returns the worst relative L2 error.
double expect_grads_match(const ModelConfig& c, const StepRun& got, const StepRun& ref, double norm_tol, double atol,
                          double rtol, const std::string& what) {
  EXPECT_LT(std::fabs(got.loss - ref.loss) / std::fabs(ref.loss), 1e-5) << what << ": loss " << got.loss << " vs "
                                                                        << ref.loss;
  EXPECT_EQ(got.grads.size(), ref.grads.size()) << what;
  if (got.grads.size() != ref.grads.size()) return 1;
  double worst = 0;
  i64 off = 0;
  for (const TensorSpec& t : parameter_specs(c)) {
    double err2 = 0, ref2 = 0;
    for (i64 k = off; k < off + t.numel(); ++k) {
      err2 += (got.grads[k] - ref.grads[k]) * (got.grads[k] - ref.grads[k]);
      ref2 += ref.grads[k] * ref.grads[k];
    }
    EXPECT_GT(ref2, 0.0) << what << " " << t.name << ": the reference gradient is zero";
    const double rel = std::sqrt(err2 / std::max(ref2, 1e-300)), rms = std::sqrt(ref2 / double(t.numel()));
    EXPECT_LT(rel, norm_tol) << what << " " << t.name;
    worst = std::max(worst, rel);
    int bad = 0;
    for (i64 k = off; k < off + t.numel(); ++k)
      if (!(std::fabs(got.grads[k] - ref.grads[k]) <= atol * rms + rtol * std::fabs(ref.grads[k])) && bad++ < 3)
        ADD_FAILURE() << what << " " << t.name << "[" << k - off << "]: " << got.grads[k] << " vs " << ref.grads[k];
    off += t.numel();
  }
  return worst;
}


constexpr i64 kS = 45;

TEST(Llama, WholeSequenceMatchesFloat64) {
  using Type = RopeScaling::Type;
  struct Case {
    int G;
    bool bias;
    Type type;
    bool tied = false;
  };
  for (const Case k : {Case{2, false, Type::None}, Case{1, false, Type::Linear}, Case{4, true, Type::Dynamic},
                       Case{2, true, Type::Yarn}, Case{2, false, Type::Llama3}, Case{2, true, Type::None, true},
                       Case{1, false, Type::Llama3, true}}) {
    const ModelConfig c = llama_config(k.G, k.bias, k.type, kS, k.tied);
    const std::string what = std::string("G=") + std::to_string(k.G) + (k.bias ? " qkv bias " : " ") +
                             rope_scaling_name(k.type) + (k.tied ? " tied" : "");
    const std::vector<float> params = random_params(c, 3 + unsigned(k.G));
    const Tokens tokens = random_tokens(kS, c.vocab, 17);
    const StepRun ref = run_ref(c, params, tokens);
    const StepRun got = run_engine(c, params, tokens, {{kS}, {0.0}});
    const double e = expect_grads_match(c, got, ref, 1e-4, 1e-4, 1e-3, what);
    std::printf("[llama vs float64] %s: loss %.8f vs %.8f, worst tensor rel L2 %.2e\n", what.c_str(), got.loss,
                ref.loss, e);
  }
}

// Subsequences N 1, 3, 8, offloaded or not, with recomputed tensors and MLP tiles: the
// whole-sequence run's loss and gradients to fp32 rounding.
TEST(Llama, EveryOneProcessModeMatchesTheWholeSequence) {
  const ModelConfig c = llama_config(2, true, RopeScaling::Type::Yarn, kS);
  const std::vector<float> params = random_params(c, 5);
  const Tokens tokens = random_tokens(kS, c.vocab, 23);
  const StepRun whole = run_engine(c, params, tokens, {{kS}, {0.0}});
  const auto& levels = recompute_levels();
  for (int N : {1, 3, 8})
    for (double a : {0.0, 0.6})
      for (SavedSet rc : {SavedSet(0), levels[2], levels.back()})
        for (i64 tiles : {i64(0), i64(4)}) {
          const std::string what = "N=" + std::to_string(N) + " alpha=" + std::to_string(a) + " recompute " +
                                   recompute_tensors_text(rc) + " tiles " + std::to_string(tiles);
          const StepRun got = run_engine(c, params, tokens, {equal_lengths(kS, N), alphas(N, a), rc, tiles});
          expect_grads_match(c, got, whole, 1e-5, 1e-5, 1e-4, what);
        }
}

// Tied embeddings (Llama 3.2, Qwen2.5's small ones): the head's gradient lands in the
// embedding's, and every one-process mode gives the whole-sequence run's.
TEST(Llama, TiedEmbeddingsInEveryOneProcessMode) {
  const ModelConfig c = llama_config(2, true, RopeScaling::Type::None, kS, true);
  const std::vector<float> params = random_params(c, 9);
  const Tokens tokens = random_tokens(kS, c.vocab, 29);
  const StepRun whole = run_engine(c, params, tokens, {{kS}, {0.0}});
  expect_grads_match(c, whole, run_ref(c, params, tokens), 1e-4, 1e-4, 1e-3, "tied, whole");
  const auto& levels = recompute_levels();
  for (int N : {3, 8})
    for (double a : {0.0, 0.6}) {
      const std::string what = "tied, N=" + std::to_string(N) + " alpha=" + std::to_string(a);
      expect_grads_match(c, run_engine(c, params, tokens, {equal_lengths(kS, N), alphas(N, a), levels.back(), 0}),
                         whole, 1e-5, 1e-5, 1e-4, what);
    }
}

// Qwen3 (query/key norms before RoPE, heads of 12 on H 32: q and attn_out 48 wide) under
// every RoPE scaling, G 1, 2 and 4, tied and untied; heads narrower than H / Z; and a head
// size of its own without the norms (Llama's and Mistral's head_dim).
TEST(Qwen3, WholeSequenceMatchesFloat64) {
  using Type = RopeScaling::Type;
  struct Case {
    int G;
    Type type;
    bool tied;
    int head_dim = 12;
    bool qk_norm = true;
  };
  double worst = 0;
  for (const Case k : {Case{2, Type::None, true}, Case{1, Type::Linear, false}, Case{4, Type::Dynamic, true},
                       Case{2, Type::Yarn, false}, Case{2, Type::Llama3, true}, Case{2, Type::None, false, 6},
                       Case{1, Type::Yarn, true, 6}, Case{2, Type::Llama3, false, 12, false}}) {
    const ModelConfig c = qwen3_config(k.G, k.type, kS, k.tied, k.head_dim, k.qk_norm);
    const std::string what = std::string(k.qk_norm ? "qwen3" : "llama") + " A=" + std::to_string(k.head_dim) +
                             " G=" + std::to_string(k.G) + " " + rope_scaling_name(k.type) + (k.tied ? " tied" : "");
    const std::vector<float> params = random_params(c, 13 + unsigned(k.G));
    const Tokens tokens = random_tokens(kS, c.vocab, 19);
    const StepRun ref = run_ref(c, params, tokens);
    const StepRun got = run_engine(c, params, tokens, {{kS}, {0.0}});
    const double e = expect_grads_match(c, got, ref, 1e-4, 1e-4, 1e-3, what);
    worst = std::max(worst, e);
    std::printf("[qwen3 vs float64] %s: loss %.8f vs %.8f (rel %.2e), worst tensor rel L2 %.2e\n", what.c_str(),
                got.loss, ref.loss, std::fabs(got.loss - ref.loss) / ref.loss, e);
  }
  std::printf("[qwen3 vs float64] worst tensor rel L2 over every case %.2e\n", worst);
}

// Every one-process mode of Qwen3's block against its whole-sequence run: subsequences N 1,
// 3, 8, offloaded or not, with every recompute level (q's group makes q, the keys before
// their norm and both norms' statistics again), MLP tiles; the K/V on the host or
// recomputed from the layer input (the key norm inside the recompute, and each later
// subsequence's part of dK through the norm's backward: Note [dK/dV into the layer
// input]), alone and with the recomputed groups, uneven lengths.
TEST(Qwen3, EveryOneProcessModeMatchesTheWholeSequence) {
  const ModelConfig c = qwen3_config(2, RopeScaling::Type::Yarn, kS, true);
  const std::vector<float> params = random_params(c, 5);
  const Tokens tokens = random_tokens(kS, c.vocab, 23);
  const StepRun whole = run_engine(c, params, tokens, {{kS}, {0.0}});
  const auto& levels = recompute_levels();
  double worst = 0;
  for (int N : {1, 3, 8})
    for (double a : {0.0, 0.6})
      for (SavedSet rc : {SavedSet(0), levels[2], levels[3], levels.back()})
        for (i64 tiles : {i64(0), i64(4)}) {
          const std::string what = "N=" + std::to_string(N) + " alpha=" + std::to_string(a) + " recompute " +
                                   recompute_tensors_text(rc) + " tiles " + std::to_string(tiles);
          const StepRun got = run_engine(c, params, tokens, {equal_lengths(kS, N), alphas(N, a), rc, tiles});
          worst = std::max(worst, expect_grads_match(c, got, whole, 1e-5, 1e-5, 1e-4, what));
        }
  const std::vector<std::pair<std::string, std::vector<KvPlace>>> places = {
      {"host", std::vector<KvPlace>(std::size_t(c.layers), KvPlace::Host)},
      {"recompute", std::vector<KvPlace>(std::size_t(c.layers), KvPlace::Recompute)},
      {"recompute, host", {KvPlace::Recompute, KvPlace::Host}}};
  for (const auto& [name, kv] : places) {
    for (int N : {1, 3, 8})
      for (double a : {0.0, 0.6})
        for (SavedSet rc : {SavedSet(0), levels[2], levels[3], levels.back()}) {
          const std::string what = "K/V " + name + " N=" + std::to_string(N) + " alpha=" + std::to_string(a) +
                                   " recompute " + recompute_tensors_text(rc);
          const StepRun got = run_engine(c, params, tokens, {equal_lengths(kS, N), alphas(N, a), rc, 0, kv});
          worst = std::max(worst, expect_grads_match(c, got, whole, 1e-5, 1e-5, 1e-4, what));
        }
    const StepRun got = run_engine(c, params, tokens, {{5, 1, 22, 17}, {0.5, 1.0, 0.3, 0.0}, levels[3], 4, kv});
    worst = std::max(worst, expect_grads_match(c, got, whole, 1e-5, 1e-5, 1e-4, "K/V " + name + " uneven, tiles of 4"));
  }
  std::printf("[qwen3 modes vs whole sequence] worst tensor rel L2 %.2e\n", worst);
}

// The engine's bytes: GQA's K/V and dK/dV are G / Z of multi-head attention's.
TEST(Llama, GroupedKvShrinksTheCache) {
  const ModelConfig gqa = llama_config(1, false, RopeScaling::Type::None, kS);
  ModelConfig mha = gqa;
  mha.kv_heads = mha.heads;
  EXPECT_EQ(skeletal_bytes_per_token(mha, ActPrecision::BF16), 4 * skeletal_bytes_per_token(gqa, ActPrecision::BF16));
  const ModelConfig l8 = preset("llama-3-8b");
  EXPECT_EQ(skeletal_bytes_per_token(l8, ActPrecision::BF16), 2 * 8 * 128 * 2);  // k, v: 8 heads of 128, bf16
  EXPECT_EQ(l8.num_params(), 8030261248);  // Meta-Llama-3-8B's parameter count
}

// K/V on the host and K/V recomputed from the layer input (Schedule::kv_place; the
// streams of runtime/kv_stream.h with grouped-query K/V, G A wide, and dq dense): N 1, 3,
// 8, offloaded or not, with recomputed tensors (the attention too: its forward streams
// the earlier blocks again inside the backward), every layer or one of each; the whole-sequence run's loss
// and gradients to fp32 rounding. With and without the q/k/v bias (a Recompute layer's
// K/V weight gradients then have no bias to add to), and with earlier blocks longer than a
// chunk (kv_chunk_rows), so that the window streams several chunks, some of two blocks.
TEST(Llama, HostAndRecomputedKvMatchTheWholeSequence) {
  const auto& levels = recompute_levels();
  struct Config {
    int G;
    bool bias;
    RopeScaling::Type type;
  };
  for (const Config k : {Config{2, true, RopeScaling::Type::Yarn}, Config{1, false, RopeScaling::Type::Llama3}}) {
    const ModelConfig c = llama_config(k.G, k.bias, k.type, kS);
    const std::string config = "G=" + std::to_string(k.G) + (k.bias ? " qkv bias" : "");
    const std::vector<float> params = random_params(c, 7 + unsigned(k.G));
    const Tokens tokens = random_tokens(kS, c.vocab, 29);
    const StepRun whole = run_engine(c, params, tokens, {{kS}, {0.0}});
    const std::vector<std::pair<std::string, std::vector<KvPlace>>> places = {
        {"host", std::vector<KvPlace>(std::size_t(c.layers), KvPlace::Host)},
        {"recompute", std::vector<KvPlace>(std::size_t(c.layers), KvPlace::Recompute)},
        {"recompute, host", {KvPlace::Recompute, KvPlace::Host}}};
    for (const auto& [name, kv] : places)
      for (int N : {1, 3, 8})
        for (double a : {0.0, 0.6})
          for (SavedSet rc : {SavedSet(0), levels[2], levels[3], levels.back()}) {
            const std::string what = config + " K/V " + name + " N=" + std::to_string(N) + " alpha=" +
                                     std::to_string(a) + " recompute " + recompute_tensors_text(rc);
            const StepRun got = run_engine(c, params, tokens, {equal_lengths(kS, N), alphas(N, a), rc, 0, kv});
            expect_grads_match(c, got, whole, 1e-5, 1e-5, 1e-4, what);
          }
    // MLP tiles and uneven lengths with the streams.
    for (const auto& [name, kv] : places) {
      const StepRun got = run_engine(c, params, tokens, {{5, 1, 22, 17}, {0.5, 1.0, 0.3, 0.0}, levels[2], 4, kv});
      expect_grads_match(c, got, whole, 1e-5, 1e-5, 1e-4, config + " K/V " + name + " uneven, tiles of 4");
    }
  }
  // Several chunks: subsequence 1 (50 rows) streams 2400 earlier rows in chunks of 1024
  // (kKvChunkMinRows), subsequence 2 (150 rows) 2450, its third chunk of two blocks.
  const i64 S = 2600;
  const ModelConfig c = llama_config(2, false, RopeScaling::Type::None, S);
  const std::vector<float> params = random_params(c, 11);
  const Tokens tokens = random_tokens(S, c.vocab, 31);
  const StepRun whole = run_engine(c, params, tokens, {{S}, {0.0}});
  for (KvPlace kv : {KvPlace::Host, KvPlace::Recompute}) {
    const StepRun got = run_engine(c, params, tokens,
                                   {{2400, 50, 150}, {1.0, 0.5, 0.0}, 0, 0, std::vector<KvPlace>(2, kv)});
    expect_grads_match(c, got, whole, 1e-5, 1e-5, 1e-4, std::string("chunks, K/V ") + to_string(kv));
  }
}

// The device arena's measured peak and the host tier's equal the simulator's prediction
// (schedule/memory.cpp: the window's K, V and dK, dV are G A wide, its forward's partial
// output Z A; a Recompute layer's x, LayerNorm-1 output and sums H, and with key norms its
// keys before the norm and their statistics) on llama-tiny (G 2 of Z 4) and qwen3-tiny
// (its saved q_pre, k_pre and the norms' statistics too).
TEST(Llama, StreamedKvPeakEqualsTheSimulatorsPrediction) {
  struct Case {
    i64 S;
    const char* subseqs;
    const char* offload;
    const char* kv_cache;
    const char* partition = "length";
    const char* recompute = "none";
  };
  const Case cases[] = {
      {512, "4", "none", "host"},        {512, "4", "0.5", "host"},
      {512, "4", "none", "host", "length", "ln1,ln2,fc_pre"},
      {1536, "6", "0.5", "host"},        {1536, "5", "none", "host", "flops"},
      {512, "4", "none", "recompute"},   {512, "4", "0.5", "recompute"},
      {512, "4", "none", "recompute", "length", "ln1,q,x_mid,ln2,fc_pre"},
      {1536, "6", "0.5", "recompute"},   {1536, "5", "none", "recompute", "flops"},
  };
  for (const char* model : {"llama-tiny", "qwen3-tiny"})
  for (const Case& k : cases) {
    StepOptions o;
    o.model = preset(model);
    o.model_name = o.model_preset = model;
    o.seq_len = k.S;
    o.subseqs = k.subseqs;
    o.offload = k.offload;
    o.place.kv = parse_kv_cache(k.kv_cache);
    o.partition = k.partition;
    o.place.recompute = parse_recompute_option(k.recompute);
    StepSetup s = make_setup(o);
    ASSERT_FALSE(s.schedule.place.kv.empty());
    ASSERT_GT(s.predicted_peak_bytes, 0);
    init_owned(*s.runtime, 1234);
    std::vector<std::int32_t> tokens(std::size_t(k.S + 1));
    s.data->next(tokens.data(), k.S + 1);
    s.runtime->device().reset_peak();
    const StepResult r = s.runtime->step(s.schedule, tokens.data());
    const std::string what = std::string(model) + " S " + std::to_string(k.S) + " N " + k.subseqs + " offload " +
                             k.offload + " kv-cache " + k.kv_cache + " partition " + k.partition + " recompute " +
                             k.recompute;
    EXPECT_EQ(s.runtime->device().stats().peak, s.predicted_peak_bytes) << what;
    EXPECT_EQ(r.device.peak, s.predicted_peak_bytes) << what;
    EXPECT_EQ(r.host.peak, s.predicted_host_bytes) << what;
    std::printf("[llama streamed K/V peak] %s: %lld measured, %lld predicted; host %lld, %lld\n", what.c_str(),
                static_cast<long long>(r.device.peak), static_cast<long long>(s.predicted_peak_bytes),
                static_cast<long long>(r.host.peak), static_cast<long long>(s.predicted_host_bytes));
  }
}

}  // namespace
}  // namespace sppo

namespace sppo {
namespace {

// Packed documents (--pack): a sequence of documents, each ended by the separator, trains as
// the documents would one at a time: attention stops at each document's start, RoPE counts
// positions from it, and a document's last position predicts nothing. Against the float64
// reference run on each document alone, the losses and gradients weighted by the
// positions each predicts; for N 1, 3, 8 (subsequences cutting documents), offloaded and
// with recomputed tensors, and for a GPT block too.
TEST(Packed, DocumentsTrainAsSeparateSequences) {
  const ModelConfig llama = llama_config(2, true, RopeScaling::Type::Yarn, 0);
  ModelConfig gpt = preset("tiny");
  gpt.vocab = llama.vocab;
  for (const ModelConfig& c : {llama, gpt}) {
    const std::int32_t sep = c.vocab - 1;
    std::mt19937 rng(41);
    std::vector<Tokens> docs;
    Tokens tokens;
    for (int n : {9, 1, 17, 6, 12}) {  // a one-token document is its separator alone
      Tokens d;
      for (int t = 0; t + 1 < n; ++t) d.push_back(std::int32_t(rng() % unsigned(sep)));
      d.push_back(sep);
      docs.push_back(d);
      tokens.insert(tokens.end(), d.begin(), d.end());
    }
    const i64 S = i64(tokens.size()) - 1;  // the last separator is the last target
    const PackedDocs packed = pack_documents(tokens.data(), S, sep);
    ASSERT_EQ(packed.starts, (std::vector<i64>{0, 9, 10, 27, 33}));
    const std::vector<float> params = random_params(c, 9);
    // The reference: each document alone, at positions from 0.
    StepRun ref;
    ref.grads.assign(params.size(), 0.0);
    const std::vector<double> p64(params.begin(), params.end());
    i64 predicted = 0;
    std::vector<std::pair<double, std::vector<double>>> per_doc;
    for (std::size_t k = 0; k < docs.size(); ++k) {
      const i64 n = i64(docs[k].size());
      const i64 end = k + 1 < packed.starts.size() ? packed.starts[k + 1] : S;
      Tokens doc_tokens(tokens.begin() + packed.starts[k], tokens.begin() + end + 1);
      std::vector<std::int32_t> targets(packed.targets.begin() + packed.starts[k], packed.targets.begin() + end);
      const i64 rows = end - packed.starts[k];
      ASSERT_LE(rows, n);
      const i64 count = std::count_if(targets.begin(), targets.end(), [](std::int32_t t) { return t != kNoTarget; });
      predicted += count;
      if (count == 0) continue;  // the separator alone: nothing to predict
      std::vector<double> g(params.size(), 0.0);
      double loss = 0;
      if (c.llama()) {
        const ref64llama::Dims d = ref64llama::dims_of(c);
        ref64llama::Cache cache;
        loss = ref64llama::forward(d, p64.data(), doc_tokens.data(), rows, &cache, {}, targets.data());
        ref64llama::backward(d, p64.data(), doc_tokens.data(), rows, cache, g.data(), {}, targets.data());
      } else {
        const ref64::Dims d = ref64::dims_of(c);
        ref64::Cache cache;
        loss = ref64::forward(d, p64.data(), doc_tokens.data(), rows, &cache, {}, targets.data());
        ref64::backward(d, p64.data(), doc_tokens.data(), rows, cache, g.data(), {}, targets.data());
      }
      for (double& x : g) x *= double(count);
      per_doc.push_back({loss * double(count), g});
    }
    for (const auto& [loss, g] : per_doc) {
      ref.loss += loss / double(predicted);
      for (std::size_t k = 0; k < g.size(); ++k) ref.grads[k] += g[k] / double(predicted);
    }
    // One packed step of schedule s (N subsequences, alpha a) against the reference.
    auto check = [&](sched::Schedule s, const std::string& what, bool whole_block_recompute = false) {
      RuntimeOptions o;
      o.head_chunk = 7;
      o.recompute = whole_block_recompute;
      Runtime rt(c, o);
      std::copy(params.begin(), params.end(), rt.params());
      s.packed = true;
      StepControl control;
      control.targets = packed.targets.data();
      control.docs = &packed.starts;
      const StepResult r = rt.step(s, tokens.data(), control);
      const StepRun got{r.loss, std::vector<double>(rt.grads(), rt.grads() + rt.num_params())};
      expect_grads_match(c, got, ref, 1e-4, 1e-4, 1e-3, std::string(c.llama() ? "llama" : "gpt") + " packed " + what);
    };
    auto named = [](int N, double a) { return "N=" + std::to_string(N) + " alpha=" + std::to_string(a); };
    const auto& levels = recompute_levels();
    for (int N : {1, 3, 8})
      for (double a : {0.0, 0.6})
        for (SavedSet rc : {SavedSet(0), levels.back()}) {
          sched::Schedule s = sched::build_single(c.layers, equal_lengths(S, N), alphas(N, a));
          s.place.recompute = rc;
          check(s, named(N, a) + " recompute " + recompute_tensors_text(rc));
        }
    // K/V on the host or recomputed (runtime/kv_stream.h): only a subsequence's first span
    // meets the streamed chunks, cut at its document's start (recomputed keys get their
    // RoPE positions from it).
    for (const KvPlace place : {KvPlace::Host, KvPlace::Recompute})
      for (int N : {3, 8})
        for (double a : {0.0, 0.6}) {
          sched::Schedule s = sched::build_single(c.layers, equal_lengths(S, N), alphas(N, a));
          s.place.kv.assign(std::size_t(c.layers), place);
          check(s, named(N, a) + (place == KvPlace::Host ? " K/V on the host" : " K/V recomputed"));
        }
    // The whole-block recompute baseline (--recompute): backward reruns each block's forward.
    check(sched::build_single(c.layers, {S}, {0.0}), "--recompute", true);
  }
}

}  // namespace
}  // namespace sppo

namespace sppo {
namespace {

// Labels (--labels): a position predicts the label of the token after it, which need not be
// that token, and none where the label is -100; the loss and the gradients are the mean over
// the counted positions of all the step's sequences (StepControl::loss_tokens), each
// sequence its share. Two sequences of a step, with a third of their positions uncounted,
// against the float64 reference with the same targets, in every one-process mode; for the
// tied Llama block and a GPT block.
TEST(Labels, TheLossAveragesOverTheStepsCountedPositions) {
  ModelConfig gpt = preset("tiny");
  gpt.vocab = 37;
  for (const ModelConfig& c : {llama_config(2, false, RopeScaling::Type::None, kS, true), gpt}) {
    std::mt19937 rng(53);
    std::vector<Tokens> tokens, targets;
    i64 counted = 0;
    for (unsigned k = 0; k < 2; ++k) {
      tokens.push_back(random_tokens(kS, c.vocab, 60 + k));
      Tokens t(static_cast<std::size_t>(kS));
      for (auto& x : t) x = rng() % 3 == 0 ? kNoTarget : std::int32_t(rng() % unsigned(c.vocab));
      counted += std::count_if(t.begin(), t.end(), [](std::int32_t x) { return x != kNoTarget; });
      targets.push_back(t);
    }
    const std::vector<float> params = random_params(c, 17);
    const std::vector<double> p64(params.begin(), params.end());
    StepRun ref;
    ref.grads.assign(params.size(), 0.0);
    for (std::size_t k = 0; k < 2; ++k) {
      const double n = double(std::count_if(targets[k].begin(), targets[k].end(), [](std::int32_t x) { return x != kNoTarget; }));
      std::vector<double> g(params.size(), 0.0);
      double loss = 0;
      if (c.llama()) {
        const ref64llama::Dims d = ref64llama::dims_of(c);
        ref64llama::Cache cache;
        loss = ref64llama::forward(d, p64.data(), tokens[k].data(), kS, &cache, {}, targets[k].data());
        ref64llama::backward(d, p64.data(), tokens[k].data(), kS, cache, g.data(), {}, targets[k].data());
      } else {
        const ref64::Dims d = ref64::dims_of(c);
        ref64::Cache cache;
        loss = ref64::forward(d, p64.data(), tokens[k].data(), kS, &cache, {}, targets[k].data());
        ref64::backward(d, p64.data(), tokens[k].data(), kS, cache, g.data(), {}, targets[k].data());
      }
      ref.loss += loss * n / double(counted);
      for (std::size_t e = 0; e < g.size(); ++e) ref.grads[e] += g[e] * n / double(counted);
    }
    auto check = [&](sched::Schedule s, const std::string& what) {
      RuntimeOptions o;
      o.head_chunk = 7;
      Runtime rt(c, o);
      std::copy(params.begin(), params.end(), rt.params());
      s.labeled = true;
      StepRun got;
      for (std::size_t k = 0; k < 2; ++k) {
        StepControl control;
        control.accumulate = k > 0;
        control.targets = targets[k].data();
        control.loss_tokens = counted;
        got.loss += rt.step(s, tokens[k].data(), control).loss;
      }
      got.grads.assign(rt.grads(), rt.grads() + rt.num_params());
      expect_grads_match(c, got, ref, 1e-4, 1e-4, 1e-3, std::string(c.llama() ? "llama" : "gpt") + " labels " + what);
    };
    for (int N : {1, 3, 8})
      for (double a : {0.0, 0.6})
        for (SavedSet rc : {SavedSet(0), recompute_levels().back()}) {
          sched::Schedule s = sched::build_single(c.layers, equal_lengths(kS, N), alphas(N, a));
          s.place.recompute = rc;
          check(s, "N=" + std::to_string(N) + " alpha=" + std::to_string(a) + " recompute " + recompute_tensors_text(rc));
        }
    for (const KvPlace place : {KvPlace::Host, KvPlace::Recompute}) {
      sched::Schedule s = sched::build_single(c.layers, equal_lengths(kS, 3), alphas(3, 0.6));
      s.place.kv.assign(std::size_t(c.layers), place);
      check(s, place == KvPlace::Host ? "K/V on the host" : "K/V recomputed");
    }
  }
}

// A schedule built for labels refuses a step without targets, and a plain one a step with
// them: the step's inputs on the device are laid out for one or the other.
TEST(Labels, TheScheduleSaysWhetherTargetsComeBesideTheIds) {
  const ModelConfig c = llama_config(2, false, RopeScaling::Type::None, kS);
  Runtime rt(c, RuntimeOptions{});
  const Tokens tokens = random_tokens(kS, c.vocab, 5);
  const Tokens targets(tokens.begin() + 1, tokens.end());
  sched::Schedule s = sched::build_single(c.layers, {kS}, {0.0});
  StepControl with;
  with.targets = targets.data();
  EXPECT_THROW(rt.step(s, tokens.data(), with), Error);
  const double plain = rt.step(s, tokens.data()).loss;
  s.labeled = true;
  EXPECT_THROW(rt.step(s, tokens.data()), Error);
  // The next tokens as labels: the very same step.
  EXPECT_EQ(rt.step(s, tokens.data(), with).loss, plain);
}

}  // namespace
}  // namespace sppo
