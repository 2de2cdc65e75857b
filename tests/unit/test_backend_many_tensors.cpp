// A step's calls over many tensors at once (backend/backend.h): adamw_spans equals adamw on
// each span and leaves the weights between spans alone; sum_squares_spans equals sum_squares of each range, in order. On the CPU backend these
// run the defaults a GPU backend replaces with fused kernels (tests/cuda checks those
// against the per-tensor kernels).
#include <gtest/gtest.h>

#include <random>
#include <utility>
#include <vector>

#include "backend/backend.h"

namespace sppo {
namespace {

std::vector<float> randn(std::size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) {
    do x = d(rng);
    while (x == 0.0f);
  }
  return v;
}

TEST(ManyTensors, AdamwSpansEqualsAdamwOnEachSpan) {
  const auto be = make_backend("cpu");
  std::mt19937 rng(7);
  // Spans with a gap of untouched weights before each, the moments packed at other offsets.
  std::vector<AdamwSpan> spans;
  long long at = 0, state = 0;
  for (long long n : {1LL, 37LL, 500LL, 8LL, 2049LL}) {
    spans.push_back({at + 5, n, state, spans.size() % 2 ? 0.1f : 0.0f});
    at += n + 5;
    state += n;
  }
  const auto p0 = randn(std::size_t(at), rng), g = randn(std::size_t(at), rng);
  const auto m0 = randn(std::size_t(state), rng, 0.1f);
  auto v0 = randn(std::size_t(state), rng, 0.01f);
  for (float& x : v0) x = x * x;
  // fp32 on the CPU: no working copy (the bf16 one is the CUDA test's).
  auto p = p0, m = m0, v = v0;
  for (const AdamwSpan& s : spans)
    be->adamw(p.data() + s.offset, m.data() + s.state_offset, v.data() + s.state_offset, g.data() + s.offset, s.count,
              1e-3f, 0.9f, 0.95f, 1e-8f, s.weight_decay, 4, nullptr);
  auto p2 = p0, m2 = m0, v2 = v0;
  be->adamw_spans(p2.data(), m2.data(), v2.data(), g.data(), spans, 1e-3f, 0.9f, 0.95f, 1e-8f, 4, nullptr);
  EXPECT_EQ(p2, p);
  EXPECT_EQ(m2, m);
  EXPECT_EQ(v2, v);
  // Something moved, and the gaps did not.
  EXPECT_NE(p2, p0);
  for (const AdamwSpan& s : spans)
    for (long long i = s.offset - 5; i < s.offset; ++i) EXPECT_EQ(p2[std::size_t(i)], p0[std::size_t(i)]) << i;
}

TEST(ManyTensors, SumSquaresSpansEqualsEachRange) {
  const auto be = make_backend("cpu");
  std::mt19937 rng(11);
  const auto g = randn(100000, rng);
  const std::vector<std::pair<i64, i64>> ranges{{0, 1}, {3, 70000}, {70003, 29997}, {10, 0}};
  const std::vector<double> sums = be->sum_squares_spans(g.data(), ranges);
  ASSERT_EQ(sums.size(), ranges.size());
  for (std::size_t k = 0; k < ranges.size(); ++k) {
    EXPECT_EQ(sums[k], be->sum_squares(g.data() + ranges[k].first, ranges[k].second)) << k;
    double ref = 0;  // float64, as a check of the kernel itself
    for (i64 i = ranges[k].first; i < ranges[k].first + ranges[k].second; ++i) ref += double(g[std::size_t(i)]) * g[std::size_t(i)];
    EXPECT_NEAR(sums[k], ref, 1e-9 * (1 + ref)) << k;
  }
  EXPECT_TRUE(be->sum_squares_spans(g.data(), {}).empty());
}

}  // namespace
}  // namespace sppo
