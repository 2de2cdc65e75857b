// Every subsequence, offload and recompute mode must reproduce the whole-sequence reference
// (one process, N = 1, no offload): the loss and every parameter gradient, to fp32 rounding
// (docs/design.md 3). Also a 20-step training run must give the same loss curve.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "core/layout.h"
#include "schedule/builders.h"
#include "train/setup.h"
#include "train/trainer.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "io/fileutil.h"
#include "support/subseqs.h"

namespace sppo {
namespace {

using testing::alphas;
using testing::equal_lengths;

ModelConfig small_config() {
  ModelConfig c;
  c.vocab = 41;
  c.hidden = 32;
  c.layers = 3;
  c.heads = 4;
  return c;
}

struct Grads {
  double loss = 0;
  std::vector<float> g;
  i64 peak = 0;
  i64 offloaded = 0;
};

std::vector<std::int32_t> random_tokens(i64 S, int V, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::int32_t> t(std::size_t(S + 1));
  for (auto& x : t) x = std::int32_t(rng() % unsigned(V));
  return t;
}

Grads run(const ModelConfig& c, const std::vector<i64>& lengths, const std::vector<double>& alpha,
          const std::vector<std::int32_t>& tokens, bool recompute = false, std::vector<KvPlace> kv = {},
          SavedSet recompute_tensors = 0, i64 mlp_tile_rows = 0, bool layer_major = false,
          bool residual_host = false, std::vector<bool> rebuilt = {}) {
  RuntimeOptions o;
  o.recompute = recompute;
  o.head_chunk = 7;  // several chunks per subsequence, and a partial last one
  Runtime rt(c, o);
  init_params(c, rt.params(), 99);
  // Perturb every parameter so LayerNorm gains and biases are not trivially 1 or 0.
  std::mt19937 rng(5);
  std::normal_distribution<float> n(0.0f, 0.05f);
  for (i64 k = 0; k < c.num_params(); ++k) rt.params()[k] += n(rng);
  sched::Schedule sc = sched::build_single(c.layers, lengths, alpha);
  if (layer_major) sc = sched::to_layer_major(std::move(sc));
  sc.place.residual_grads = residual_host ? Tier::Host : Tier::Device;
  sc.place.kv = std::move(kv);
  sc.place.recompute = recompute_tensors;
  sc.place.mlp_tile_rows = mlp_tile_rows;
  sc.place.inputs_rebuilt = std::move(rebuilt);
  StepResult r = rt.step(sc, tokens.data());
  Grads out;
  out.loss = r.loss;
  out.g.assign(rt.grads(), rt.grads() + c.num_params());
  out.peak = r.device.peak;
  out.offloaded = r.offloaded_bytes;
  return out;
}

// Per-tensor relative L2 error of b against the reference a; the worst tensor's.
double worst_rel_error(const ModelConfig& c, const Grads& ref, const Grads& got, std::string* which) {
  double worst = 0;
  i64 off = 0;
  for (const auto& spec : parameter_specs(c)) {
    double num = 0, den = 0;
    for (i64 k = off; k < off + spec.numel(); ++k) {
      const double d = double(got.g[k]) - double(ref.g[k]);
      num += d * d;
      den += double(ref.g[k]) * double(ref.g[k]);
    }
    const double e = std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
    if (e > worst) {
      worst = e;
      *which = spec.name;
    }
    off += spec.numel();
  }
  return worst;
}


void expect_matches(const ModelConfig& c, const Grads& ref, const Grads& got, const std::string& what) {
  std::string which;
  const double e = worst_rel_error(c, ref, got, &which);
  EXPECT_LT(std::fabs(got.loss - ref.loss) / std::fabs(ref.loss), 1e-5) << what << ": loss " << got.loss << " vs " << ref.loss;
  EXPECT_LT(e, 1e-5) << what << ": worst gradient " << which << " relative L2 error " << e;
}

TEST(Subsequences, MatchTheWholeSequenceReference) {
  const ModelConfig c = small_config();
  const i64 S = 61;
  const auto tokens = random_tokens(S, c.vocab, 1);
  const Grads ref = run(c, {S}, {0.0}, tokens);
  ASSERT_TRUE(std::isfinite(ref.loss));
  for (int N : {2, 3, 7, 16})
    for (double a : {0.0, 0.5, 1.0})
      expect_matches(c, ref, run(c, equal_lengths(S, N), alphas(N, a), tokens),
                     "N=" + std::to_string(N) + " alpha=" + std::to_string(a));
}

TEST(Subsequences, UnevenLengthsIncludingLengthOne) {
  const ModelConfig c = small_config();
  const i64 S = 40;
  const auto tokens = random_tokens(S, c.vocab, 2);
  const Grads ref = run(c, {S}, {0.0}, tokens);
  const std::vector<std::vector<i64>> cases = {{1, 39}, {39, 1}, {17, 1, 22}, {1, 1, 1, 37}, {5, 9, 1, 13, 12}};
  for (const auto& l : cases) {
    const int N = int(l.size());
    for (double a : {0.0, 0.5, 1.0}) expect_matches(c, ref, run(c, l, alphas(N, a), tokens), "uneven N=" + std::to_string(N));
  }
}

TEST(Subsequences, PerSubsequenceAlpha) {
  const ModelConfig c = small_config();
  const i64 S = 50;
  const auto tokens = random_tokens(S, c.vocab, 3);
  const Grads ref = run(c, {S}, {0.0}, tokens);
  const Grads got = run(c, {10, 12, 8, 20}, {1.0, 0.3, 0.75, 0.0}, tokens);
  expect_matches(c, ref, got, "mixed alpha");
  EXPECT_GT(got.offloaded, 0);
}

// K/V and their dK/dV sums on the host (Schedule::kv_place), on every layer or some, with
// and without offload, even and uneven lengths: the same loss and gradients.
TEST(Subsequences, HostKvCacheMatches) {
  const ModelConfig c = small_config();
  const i64 S = 61;
  const auto tokens = random_tokens(S, c.vocab, 7);
  const Grads ref = run(c, {S}, {0.0}, tokens);
  const std::vector<KvPlace> all(std::size_t(c.layers), KvPlace::Host), some = {KvPlace::Device, KvPlace::Host, KvPlace::Device};
  for (int N : {1, 3, 8})
    for (double a : {0.0, 1.0}) {
      const std::string what = "N=" + std::to_string(N) + " alpha=" + std::to_string(a);
      expect_matches(c, ref, run(c, equal_lengths(S, N), alphas(N, a), tokens, false, all), "host K/V " + what);
      expect_matches(c, ref, run(c, equal_lengths(S, N), alphas(N, a), tokens, false, some), "layer 1's K/V " + what);
    }
  expect_matches(c, ref, run(c, {5, 1, 30, 25}, {0.5, 1.0, 0.3, 0.0}, tokens, false, all), "host K/V uneven");
  // Earlier blocks longer than a chunk (kv_chunk_rows of the later, shorter subsequences):
  // subsequence 1 streams 2400 rows in three chunks (a K/V slot used twice, each of the
  // three sums slots once), subsequence 2 2500, its last chunk of two blocks.
  const auto long_tokens = random_tokens(3200, c.vocab, 8);
  const Grads long_ref = run(c, {3200}, {0.0}, long_tokens);
  expect_matches(c, long_ref, run(c, {2400, 100, 700}, {1.0, 0.5, 0.0}, long_tokens, false, all), "host K/V chunks");
}

// K/V recomputed from each layer's input (KvPlace::Recompute, Note [dK/dV into the layer
// input]): no K/V kept, their gradients summed into the LayerNorm-1 output's on the host.
// Every layer or some, with and without offload (an offloaded x streams back from the
// host), chunks that pack several blocks and blocks longer than a chunk.
TEST(Subsequences, RecomputedKvMatches) {
  const ModelConfig c = small_config();
  const i64 S = 61;
  const auto tokens = random_tokens(S, c.vocab, 9);
  const Grads ref = run(c, {S}, {0.0}, tokens);
  const std::vector<KvPlace> all(std::size_t(c.layers), KvPlace::Recompute),
      mixed = {KvPlace::Recompute, KvPlace::Host, KvPlace::Device};
  for (int N : {1, 3, 8})
    for (double a : {0.0, 1.0}) {
      const std::string what = "N=" + std::to_string(N) + " alpha=" + std::to_string(a);
      expect_matches(c, ref, run(c, equal_lengths(S, N), alphas(N, a), tokens, false, all), "recomputed K/V " + what);
      expect_matches(c, ref, run(c, equal_lengths(S, N), alphas(N, a), tokens, false, mixed), "mixed K/V " + what);
    }
  expect_matches(c, ref, run(c, {5, 1, 30, 25}, {0.5, 1.0, 0.3, 0.0}, tokens, false, all), "recomputed K/V uneven");
  const auto long_tokens = random_tokens(3200, c.vocab, 10);
  const Grads long_ref = run(c, {3200}, {0.0}, long_tokens);
  expect_matches(c, long_ref, run(c, {2400, 100, 700}, {1.0, 0.5, 0.0}, long_tokens, false, all),
                 "recomputed K/V chunks");
}

// Saved tensors recomputed in backward (Schedule::recompute, Note [Recomputed tensors]):
// each group alone, the planner's levels, and every group, with K/V on the device, on the
// host or recomputed, for N 1, 3, 8 with and without offload.
TEST(Subsequences, RecomputedTensorsMatch) {
  const ModelConfig c = small_config();
  const i64 S = 61;
  const auto tokens = random_tokens(S, c.vocab, 11);
  const Grads ref = run(c, {S}, {0.0}, tokens);
  std::vector<SavedSet> sets;
  for (const RecomputeGroup& g : recompute_groups()) sets.push_back(g.tensors);
  for (std::size_t k = 1; k < recompute_levels().size(); ++k) sets.push_back(recompute_levels()[k]);
  for (SavedSet set : sets)
    for (int N : {1, 3, 8})
      for (double a : {0.0, 1.0}) {
        const std::string what = recompute_tensors_text(set) + " N=" + std::to_string(N) + " alpha=" + std::to_string(a);
        const Grads got = run(c, equal_lengths(S, N), alphas(N, a), tokens, false, {}, set);
        expect_matches(c, ref, got, "recompute " + what);
      }
  // Streamed K/V, with the attention kept and recomputed (its forward streams the earlier
  // blocks again inside the backward).
  for (KvPlace kv : {KvPlace::Host, KvPlace::Recompute})
    for (SavedSet set : {recompute_levels()[3], recompute_groups()[2].tensors, recompute_levels().back()})
      for (int N : {1, 3, 8})
        expect_matches(c, ref,
                       run(c, equal_lengths(S, N), alphas(N, 0.5), tokens, false,
                           std::vector<KvPlace>(std::size_t(c.layers), kv), set),
                       std::string("recompute ") + recompute_tensors_text(set) + " with " + to_string(kv) +
                           " K/V, N=" + std::to_string(N));
}

// The layer-major backward (Note [Layer-major backward] in schedule/builders.cpp): the
// layers from the last, each over the subsequences in reverse, with every K/V placement,
// offload (a layer's part prefetched at a time), recomputed tensors and the loss in
// backward, even and uneven lengths, the residual gradients waiting on the device or on the
// host (Note [Residual gradients on the host]): the reference's loss and gradients. With
// the K/V on the device, one layer's dK/dV sums at a time lower the peak.
TEST(Subsequences, LayerMajorBackwardMatches) {
  const ModelConfig c = small_config();
  const i64 S = 61;
  const auto tokens = random_tokens(S, c.vocab, 13);
  const Grads ref = run(c, {S}, {0.0}, tokens);
  const std::vector<std::vector<KvPlace>> kvs = {{},
                                                 std::vector<KvPlace>(std::size_t(c.layers), KvPlace::Host),
                                                 std::vector<KvPlace>(std::size_t(c.layers), KvPlace::Recompute),
                                                 {KvPlace::Recompute, KvPlace::Host, KvPlace::Device}};
  const SavedSet all = recompute_levels().back();
  for (const auto& kv : kvs)
    for (SavedSet set : {SavedSet{0}, recompute_levels()[3], all})
      for (int N : {1, 3, 8})
        for (double a : {0.0, 0.5, 1.0}) {
          const std::string what = std::string("layer-major, K/V ") + (kv.empty() ? "device" : to_string(kv[1])) +
                                   ", recompute " + recompute_tensors_text(set) + ", N=" + std::to_string(N) +
                                   " alpha=" + std::to_string(a);
          expect_matches(c, ref, run(c, equal_lengths(S, N), alphas(N, a), tokens, false, kv, set, 0, true), what);
          if (a == 0.5)
            expect_matches(c, ref, run(c, equal_lengths(S, N), alphas(N, a), tokens, false, kv, set, 0, true, true),
                           what + ", residual gradients on the host");
        }
  expect_matches(c, ref, run(c, {5, 1, 30, 25}, {0.5, 1.0, 0.3, 0.0}, tokens, false, {}, 0, 0, true),
                 "layer-major uneven");
  expect_matches(c, ref, run(c, {5, 1, 30, 25}, {0.5, 1.0, 0.3, 0.0}, tokens, false, {}, 0, 0, true, true),
                 "layer-major uneven, residual gradients on the host");
  expect_matches(c, ref, run(c, equal_lengths(S, 3), alphas(3, 0.5), tokens, false, {}, 0, 7, true),
                 "layer-major with MLP tiles");
  const Grads subseq = run(c, equal_lengths(S, 8), alphas(8, 0.0), tokens);
  const Grads layer = run(c, equal_lengths(S, 8), alphas(8, 0.0), tokens, false, {}, 0, 0, true);
  EXPECT_LT(layer.peak, subseq.peak) << "one layer's dK/dV sums at a time should lower the peak";
}

// Rebuilt layer inputs (Note [Rebuilt layer inputs] in schedule/builders.cpp): a layer whose
// input the forward drops gets it again from the layer below's forward inside each of its
// B ops. The same kernels on the same inputs: the loss and every gradient equal those of
// the same schedule keeping every input, bit for bit, and so the whole sequence's, with
// the layer below's K/V on the device or recomputed, the rebuilt layer's on the device or
// the host, recomputed tensors, offload (the layer below's input copied back from the
// host), the residual gradients on the host, MLP tiles and uneven lengths.
TEST(Subsequences, RebuiltLayerInputsMatch) {
  const ModelConfig c = small_config();
  const i64 S = 61;
  const auto tokens = random_tokens(S, c.vocab, 19);
  const Grads ref = run(c, {S}, {0.0}, tokens);
  const SavedSet all = recompute_levels().back();
  struct Case {
    std::vector<bool> rebuilt;
    std::vector<KvPlace> kv;
    const char* what;
  };
  const std::vector<Case> cases = {
      {{false, true, false}, {}, "layer 1, K/V on the device"},
      {{false, true, false}, {KvPlace::Recompute, KvPlace::Host, KvPlace::Recompute}, "layer 1, K/V recomputed below"},
      {{false, false, true}, {KvPlace::Device, KvPlace::Recompute, KvPlace::Host}, "layer 2, K/V recomputed below"},
  };
  for (const Case& k : cases)
    for (SavedSet set : {SavedSet{0}, all})
      for (int N : {1, 3, 8})
        for (double a : {0.0, 0.5, 1.0}) {
          const std::string what = std::string(k.what) + ", recompute " + recompute_tensors_text(set) +
                                   ", N=" + std::to_string(N) + " alpha=" + std::to_string(a);
          const Grads kept = run(c, equal_lengths(S, N), alphas(N, a), tokens, false, k.kv, set, 0, true);
          const Grads got = run(c, equal_lengths(S, N), alphas(N, a), tokens, false, k.kv, set, 0, true,
                                a == 0.5, k.rebuilt);
          EXPECT_EQ(got.loss, kept.loss) << what;
          EXPECT_TRUE(got.g == kept.g) << what << ": the gradients differ from those keeping every input";
          expect_matches(c, ref, got, what);
        }
  const Case& below = cases[1];
  expect_matches(c, ref, run(c, {5, 1, 30, 25}, {0.5, 1.0, 0.3, 0.0}, tokens, false, below.kv, all, 0, true, false,
                             below.rebuilt),
                 "rebuilt inputs, uneven");
  expect_matches(c, ref, run(c, equal_lengths(S, 3), alphas(3, 0.5), tokens, false, {}, all, 7, true, false,
                             cases[0].rebuilt),
                 "rebuilt inputs with MLP tiles");
}

// One step of `sc` with the layers' weights on the device or the host (Note [Weights on the
// host] in schedule/weights.h), from run()'s weights, over packed documents when `docs`.
Grads run_weights(const ModelConfig& c, sched::Schedule sc, const std::vector<std::int32_t>& tokens, bool host,
                  const PackedDocs* docs = nullptr) {
  RuntimeOptions o;
  o.head_chunk = 7;
  o.optimizer_host = host;  // the layers' master weights on the host are the optimizer's
  o.weights_host = host;
  Runtime rt(c, o);
  init_params(c, rt.params(), 99);
  std::mt19937 rng(5);
  std::normal_distribution<float> n(0.0f, 0.05f);
  for (i64 k = 0; k < c.num_params(); ++k) rt.params()[k] += n(rng);
  rt.refresh_weights();  // the embedding, final norm and head to the device
  sc.place.weights = host ? Tier::Host : Tier::Device;
  StepControl control;
  if (docs) {
    sc.packed = true;
    control.targets = docs->targets.data();
    control.docs = &docs->starts;
  }
  const StepResult r = rt.step(sc, tokens.data(), control);
  Grads out;
  out.loss = r.loss;
  out.g.assign(rt.grads(), rt.grads() + c.num_params());
  out.peak = r.device.peak;
  return out;
}

// --weights host: each layer's weights come from the host for the F and B ops that run it
// and its gradient goes there after its last backward. The same kernels run on the same
// values in the same order, so the loss and every gradient equal those of the weights on
// the device to the bit, for N 1, 3 and 8, in both backward orders, with offload, with K/V
// on the host or recomputed, and over packed documents; and the device holds less.
TEST(Subsequences, WeightsOnTheHostMatchTheDevice) {
  const ModelConfig c = small_config();
  const i64 S = 61;
  const auto tokens = random_tokens(S, c.vocab, 17);
  const PackedDocs docs = pack_documents(tokens.data(), S, tokens[20]);
  ASSERT_GT(docs.starts.size(), 1u);
  const Grads ref = run(c, {S}, {0.0}, tokens);
  const std::vector<std::vector<KvPlace>> kvs = {{},
                                                 std::vector<KvPlace>(std::size_t(c.layers), KvPlace::Host),
                                                 std::vector<KvPlace>(std::size_t(c.layers), KvPlace::Recompute)};
  for (bool layer_major : {false, true})
    for (const auto& kv : kvs)
      for (int N : {1, 3, 8})
        for (double a : {0.0, 0.5})
          for (bool packed : {false, true}) {
            sched::Schedule sc = sched::build_single(c.layers, equal_lengths(S, N), alphas(N, a));
            if (layer_major) sc = sched::to_layer_major(std::move(sc));
            sc.place.kv = kv;
            // Rebuilt layer inputs bring the layer below's weights with the layer's.
            if (layer_major && kv.empty()) sc.place.inputs_rebuilt = {false, true, false};
            const std::string what = std::string(layer_major ? "layer" : "subseq") + " order" +
                                     (sc.place.any_input_rebuilt() ? ", layer 1's input rebuilt" : "") + ", K/V " +
                                     (kv.empty() ? "device" : to_string(kv[0])) + ", N=" + std::to_string(N) +
                                     " alpha=" + std::to_string(a) + (packed ? ", packed" : "");
            const Grads device = run_weights(c, sc, tokens, false, packed ? &docs : nullptr);
            const Grads host = run_weights(c, sc, tokens, true, packed ? &docs : nullptr);
            EXPECT_EQ(host.loss, device.loss) << what;
            EXPECT_TRUE(host.g == device.g) << what << ": the gradients differ from the weights on the device's";
            expect_matches(c, device, host, what);
            if (!packed) expect_matches(c, ref, host, what + " against the whole sequence");
            EXPECT_LT(host.peak, device.peak) << what;
          }
}

// MLP tiles (Note [MLP tiles] in core/layout.h): a tile of one row, tiles that do not
// divide the subsequences, and tiles longer than them, with fc_pre kept or recomputed (a
// tile at a time), for N 1, 3, 8 with and without offload, and with K/V on the host.
TEST(Subsequences, MlpTilesMatch) {
  const ModelConfig c = small_config();
  const i64 S = 61;
  const auto tokens = random_tokens(S, c.vocab, 13);
  const Grads ref = run(c, {S}, {0.0}, tokens);
  for (i64 R : {1, 5, 64})
    for (SavedSet set : {SavedSet(0), recompute_groups()[5].tensors, recompute_levels().back()})
      for (int N : {1, 3, 8})
        for (double a : {0.0, 1.0}) {
          const std::string what = "tiles of " + std::to_string(R) + " recompute " + recompute_tensors_text(set) +
                                   " N=" + std::to_string(N) + " alpha=" + std::to_string(a);
          expect_matches(c, ref, run(c, equal_lengths(S, N), alphas(N, a), tokens, false, {}, set, R), what);
        }
  expect_matches(c, ref,
                 run(c, equal_lengths(S, 3), alphas(3, 0.5), tokens, false,
                     std::vector<KvPlace>(std::size_t(c.layers), KvPlace::Host),
                     recompute_groups()[5].tensors, 4),
                 "tiles of 4 with host K/V");
}

// Tiles lower the peak: the MLP activation, and a recomputed fc_pre, are never whole.
TEST(Subsequences, MlpTilesLowerThePeak) {
  ModelConfig c = small_config();
  c.hidden = 64;
  const i64 S = 256;
  const auto tokens = random_tokens(S, c.vocab, 14);
  const SavedSet fc_pre = recompute_groups()[5].tensors;
  EXPECT_LT(run(c, {S}, {0.0}, tokens, false, {}, 0, 32).peak, run(c, {S}, {0.0}, tokens).peak);
  EXPECT_LT(run(c, {S}, {0.0}, tokens, false, {}, fc_pre, 32).peak, run(c, {S}, {0.0}, tokens, false, {}, fc_pre).peak);
}

// Recomputing lowers the peak: the saved tensors it drops are no longer held between a
// layer's forward and its backward.
TEST(Subsequences, RecomputingLowersThePeak) {
  ModelConfig c = small_config();
  c.hidden = 64;
  const i64 S = 256;
  const auto tokens = random_tokens(S, c.vocab, 12);
  const Grads keep = run(c, equal_lengths(S, 4), alphas(4, 0.0), tokens);
  const Grads mlp = run(c, equal_lengths(S, 4), alphas(4, 0.0), tokens, false, {}, recompute_levels()[2]);
  const Grads kv = run(c, equal_lengths(S, 4), alphas(4, 0.0), tokens, false,
                       std::vector<KvPlace>(std::size_t(c.layers), KvPlace::Recompute));
  EXPECT_LT(mlp.peak, keep.peak);
  EXPECT_LT(kv.peak, keep.peak);
}

TEST(Subsequences, RecomputeBaselineMatches) {
  const ModelConfig c = small_config();
  const i64 S = 45;
  const auto tokens = random_tokens(S, c.vocab, 4);
  const Grads ref = run(c, {S}, {0.0}, tokens);
  const Grads rc = run(c, {S}, {0.0}, tokens, true);
  expect_matches(c, ref, rc, "recompute");
  EXPECT_LT(rc.peak, ref.peak) << "recompute should hold less than the reference";
}

TEST(Subsequences, OffloadLowersPeakDeviceMemory) {
  ModelConfig c = small_config();
  c.hidden = 64;
  const i64 S = 256;
  const auto tokens = random_tokens(S, c.vocab, 6);
  const Grads none = run(c, equal_lengths(S, 8), alphas(8, 0.0), tokens);
  const Grads full = run(c, equal_lengths(S, 8), alphas(8, 1.0), tokens);
  EXPECT_LT(full.peak, none.peak);
  EXPECT_EQ(none.offloaded, 0);
  EXPECT_GT(full.offloaded, 0);
}

std::vector<double> loss_curve(const std::string& subseqs, const std::string& partition,
                               const std::string& offload, bool recompute, const std::string& dir) {
  TrainOptions o;
  o.step.model = small_config();
  o.step.model_name = "custom";
  o.step.seq_len = 120;
  o.step.data = "repeat:16";
  o.step.subseqs = subseqs;
  o.step.partition = partition;
  o.step.offload = offload;
  o.step.recompute = recompute;
  o.steps = 20;
  o.warmup = 3;
  o.quiet = true;
  o.metrics_path = dir + "/" + subseqs + partition + offload + (recompute ? "rc" : "") + ".jsonl";
  EXPECT_EQ(run_train(o), 0);
  std::vector<double> losses;
  std::ifstream f(o.metrics_path);
  for (std::string l; std::getline(f, l);) {
    const auto j = nlohmann::json::parse(l);
    if (!j.contains("summary")) losses.push_back(j["loss"].get<double>());
  }
  return losses;
}

TEST(Subsequences, TwentyStepLossCurveMatchesTheReference) {
  io::TempDir tmp("sppo-curves");
  const auto ref = loss_curve("1", "length", "none", false, tmp.path());
  ASSERT_EQ(ref.size(), 20u);
  EXPECT_LT(ref.back(), ref.front()) << "the run should learn something in 20 steps";
  const std::vector<std::vector<double>> others = {
      loss_curve("3", "flops", "0.5", false, tmp.path()),
      loss_curve("7", "length", "full", false, tmp.path()),
      loss_curve("16", "flops", "adaptive", false, tmp.path()),
      loss_curve("1", "length", "none", true, tmp.path()),
  };
  for (const auto& c : others) {
    ASSERT_EQ(c.size(), ref.size());
    for (std::size_t k = 0; k < ref.size(); ++k)
      EXPECT_LT(std::fabs(c[k] - ref[k]) / std::fabs(ref[k]), 1e-5) << "step " << k + 1;
  }
}

}  // namespace
}  // namespace sppo
