// `sppo bench layer --breakdown`: the extra step's parts are the kernels' own times, each
// measured, and together no more than the step they were taken from.
#include <gtest/gtest.h>

#include "backend/backend.h"

#include "bench/bench.h"

namespace sppo {
namespace {

TEST(BenchLayer, BreakdownPartsAddUpToTheTimedStep) {
  const auto be = make_backend("cpu");
  const auto j = bench_layer(*be, 64, 2, 256, 1, true);
  ASSERT_TRUE(j.contains("breakdown")) << j.dump();
  const auto& b = j["breakdown"];
  double sum = 0;
  for (const char* part : {"attention_forward_s", "attention_backward_s", "gemm_s", "other_s"}) {
    EXPECT_GT(b[part].get<double>(), 0) << part << ": " << b.dump();
    sum += b[part].get<double>();
  }
  EXPECT_LE(sum, b["step_s"].get<double>()) << b.dump();
  EXPECT_NEAR(b["between_s"].get<double>(), b["step_s"].get<double>() - sum, 1e-9);
  EXPECT_GE(b["between_s"].get<double>(), 0) << b.dump();
  // What is neither attention nor a GEMM: the other kernels and the time between them.
  const double outside = j["outside_attention_gemm_fraction"].get<double>();
  EXPECT_NEAR(outside, (b["other_s"].get<double>() + b["between_s"].get<double>()) / b["step_s"].get<double>(), 1e-12);
  EXPECT_GT(outside, 0);
  EXPECT_LT(outside, 1);
}

TEST(BenchLayer, NoBreakdownUnlessAsked) {
  const auto be = make_backend("cpu");
  EXPECT_FALSE(bench_layer(*be, 64, 2, 256, 1).contains("breakdown"));
}

}  // namespace
}  // namespace sppo
