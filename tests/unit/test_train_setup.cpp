// Options -> step setup: partitions, alpha and N chosen through the planner, and budgets
// checked before any work.
#include <gtest/gtest.h>

#include <functional>
#include <numeric>

#include "core/check.h"
#include "train/profile_machine.h"
#include "train/setup.h"

namespace sppo {
namespace {

std::string testing_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

StepOptions options(i64 S) {
  StepOptions o;
  o.model = preset("small");
  o.model_name = "small";
  o.seq_len = S;
  return o;
}

// --device-memory: bytes, a share of the device, or the backend's capacity. On a GPU of 80
// GiB whose tier holds 77.5 GiB (CUDA's Backend::device_capacity: the memory free at start
// less the context's reserve) a run with no --device-memory budgets that capacity, so that
// --subseqs auto and adaptive offload size themselves to the GPU; on the CPU (capacity 0) it
// has no budget, as before.
TEST(Setup, DeviceBudgetDefaultsToTheGpusCapacity) {
  const i64 GiB = i64(1) << 30, gpu = 80 * GiB, tier = 77 * GiB + GiB / 2;
  const DeviceBudget none = resolve_device_budget(0, 0, gpu, tier);
  EXPECT_EQ(none.bytes, tier);
  EXPECT_NE(none.from.find("80.00 GiB"), std::string::npos) << none.from;
  EXPECT_NE(none.from.find("less 2.00 GiB for the CUDA context and libraries"), std::string::npos) << none.from;
  EXPECT_EQ(resolve_device_budget(0, 0.9, gpu, tier).bytes, 72 * GiB);
  EXPECT_EQ(resolve_device_budget(40 * GiB, 0, gpu, tier).bytes, 40 * GiB);
  const std::string over = testing_error([&] { resolve_device_budget(0, 0.99, gpu, tier); });
  EXPECT_NE(over.find("more than the device tier can hold"), std::string::npos) << over;
  EXPECT_NE(over.find("or 96%"), std::string::npos) << over;
  EXPECT_FALSE(testing_error([&] { resolve_device_budget(90 * GiB, 0, gpu, tier); }).empty());
  // The CPU: no budget unless given; a share of the machine's memory when asked.
  EXPECT_EQ(resolve_device_budget(0, 0, 24 * GiB, 0).bytes, 0);
  EXPECT_EQ(resolve_device_budget(0, 0.5, 24 * GiB, 0).bytes, 12 * GiB);
  EXPECT_EQ(resolve_device_budget(96 << 20, 0, 24 * GiB, 0).bytes, 96 << 20);
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
