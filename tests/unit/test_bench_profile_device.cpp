// The profile measured through the backend interface (what `sppo profile --backend cuda`
// runs on a GPU), here on the CPU backend: every field a planner divides by is measured,
// positive and finite, and the attention after a prefix is recorded beside.
#include <gtest/gtest.h>

#include <cmath>

#include "core/check.h"

#include "bench/bench_attention.h"
#include "train/profile_device.h"

namespace sppo {
namespace {

TEST(ProfileDevice, EveryRateIsMeasured) {
  const auto be = make_backend("cpu");
  nlohmann::json details;
  const plan::HardwareProfile p = measure_backend_profile(*be, true, &details);
  for (double x : {p.gemm_flops, p.attention_efficiency, p.elementwise_bw, p.d2h_bw, p.h2d_bw, p.duplex_factor,
                   p.layer_overhead})
    EXPECT_TRUE(std::isfinite(x) && x > 0) << x;
  EXPECT_EQ(p.gemm_flops_by_hidden.size(), 2u);
  EXPECT_EQ(p.attention_efficiency_by_head.size(), 3u);
  EXPECT_GT(p.device_memory, 0);
  EXPECT_EQ(p.precision, "f32");
  EXPECT_TRUE(details.contains("attention_after_prefix_flops_per_s")) << details.dump();
  // The profile is a valid one: it survives the JSON round trip the planner reads.
  EXPECT_NO_THROW(plan::profile_from_json(plan::to_json(p), "measured"));
}

// `sppo bench attention` names its shapes the way bench/gpu/collect.py reads them
// (whole_32k, prefix_16k_after_112k for the GPU's defaults).
TEST(BenchAttention, NamesEachShapeByItsLengths) {
  const auto be = make_backend("cpu");
  EXPECT_EQ(default_attention_shapes(*be).heads, 4);
  BenchAttentionOptions o;
  o.seq_len = 1024, o.queries = 512, o.prefix = 3072, o.heads = 2, o.head_dim = 32, o.reps = 1;
  const auto j = bench_attention(*be, o);
  for (const char* name : {"whole_1k", "prefix_512_after_3k", "prefix_512_after_3k_chunked"}) {
    ASSERT_TRUE(j.contains(name)) << j.dump();
    EXPECT_GT(j[name]["sppo_tflops"].get<double>(), 0);
  }
  EXPECT_EQ(j["prefix_512_after_3k"]["prefix"], 3072);
  EXPECT_EQ(j["prefix_512_after_3k_chunked"]["chunk"], kKvChunkMinRows);
  EXPECT_EQ(j["attention"], "own kernels");
  o.head_dim = 512;
  EXPECT_THROW(bench_attention(*be, o), Error);
}

}  // namespace
}  // namespace sppo
