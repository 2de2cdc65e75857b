// Options -> step setup: partitions, alpha and N chosen through the planner, and budgets
// checked before any work.
#include <gtest/gtest.h>

#include <numeric>

#include "core/check.h"
#include "train/profile_machine.h"
#include "train/setup.h"

namespace sppo {
namespace {

StepOptions options(i64 S) {
  StepOptions o;
  o.model = preset("small");
  o.model_name = "small";
  o.seq_len = S;
  return o;
}

TEST(Setup, AutoSubseqsIsTheFewestThatFitTheBudget) {
  StepOptions o = options(16384);
  o.subseqs = "auto";
  o.offload = "adaptive";
  o.partition = "flops";
  o.device_memory = 128 << 20;
  o.place.kv = KvPlace::Device;
  o.place.recompute = parse_recompute_option("none");
  o.place.backward = BackwardOrder::Subseq;
  StepSetup s = make_setup(o);
  EXPECT_GT(s.lengths.size(), 1u);
  EXPECT_LE(s.predicted_peak_bytes, o.device_memory);
  EXPECT_EQ(std::accumulate(s.lengths.begin(), s.lengths.end(), i64(0)), o.seq_len);
  // One subsequence fewer does not fit.
  StepOptions fewer = o;
  fewer.subseqs = std::to_string(s.lengths.size() - 1);
  EXPECT_THROW(make_setup(fewer), Error);
  // With --kv-cache auto it fits, with some K/V on the host.
  fewer.place.kv = kAuto;
  const StepSetup host = make_setup(fewer);
  EXPECT_FALSE(host.schedule.place.kv.empty());
  EXPECT_LE(host.predicted_peak_bytes, o.device_memory);
  // With --backward-order auto it fits too, the K/V on the device, holding one layer's
  // dK/dV sums at a time (Note [Layer-major backward]).
  fewer.place.kv = KvPlace::Device;
  fewer.place.backward = kAuto;
  const StepSetup layer = make_setup(fewer);
  EXPECT_EQ(layer.schedule.place.backward, BackwardOrder::Layer);
  EXPECT_TRUE(layer.schedule.place.kv.empty());
  EXPECT_LE(layer.predicted_peak_bytes, o.device_memory);
}

TEST(Setup, FlopsPartitionMakesLaterSubsequencesShorter) {
  StepOptions o = options(8192);
  o.subseqs = "4";
  o.partition = "flops";
  const StepSetup s = make_setup(o);
  ASSERT_EQ(s.lengths.size(), 4u);
  for (std::size_t i = 1; i < 4; ++i) EXPECT_LT(s.lengths[i], s.lengths[i - 1]);
  for (std::size_t i = 0; i + 1 < 4; ++i) EXPECT_EQ(s.lengths[i] % 128, 0) << "boundaries on the kernel's tile";
}

TEST(Setup, AdaptiveOffloadWithoutPressureOffloadsNothing) {
  StepOptions o = options(4096);
  o.subseqs = "4";
  o.offload = "adaptive";
  o.hardware = "";  // measured here
  const StepSetup s = make_setup(o);
  for (double a : s.alpha) EXPECT_EQ(a, 0.0);
}

TEST(Setup, AdaptiveOffloadUnderPressureFitsAndKeepsTheLastSubsequence) {
  StepOptions o = options(8192);
  o.subseqs = "8";
  o.offload = "none";
  const i64 unbudgeted = make_setup(o).predicted_peak_bytes;
  o.offload = "adaptive";
  o.device_memory = unbudgeted * 3 / 4;
  const StepSetup s = make_setup(o);
  EXPECT_LE(s.predicted_peak_bytes, o.device_memory);
  EXPECT_GT(*std::max_element(s.alpha.begin(), s.alpha.end()), 0.0);
  EXPECT_EQ(s.alpha.back(), 0.0);
}

}  // namespace
}  // namespace sppo
