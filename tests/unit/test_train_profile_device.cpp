// The profile measured through the backend interface (what `sppo profile --backend cuda`
// runs on a GPU), here on the CPU backend: every field a planner divides by is measured,
// positive and finite, and the attention after a prefix is recorded beside.
#include <gtest/gtest.h>

#include <cmath>

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

}  // namespace
}  // namespace sppo
