// `sppo bench eval` in miniature: the longest lengths train and eval fit under small budgets,
// and the one evaluation it runs per K/V placement, at eval's longest or at the measuring cap,
// whichever is shorter, its measured peaks the predicted ones.
#include <gtest/gtest.h>

#include <algorithm>

#include "bench/bench_eval.h"

namespace sppo {
namespace {

TEST(BenchEval, MeasuresAtTheLongestOrTheCapAndPeaksArePredicted) {
  BenchEvalOptions o;
  o.budget = i64{16} << 20;
  o.host_budget = i64{32} << 20;
  o.cap = i64{64} << 10;
  o.measure_cap = i64{8} << 10;
  const nlohmann::json j = bench_eval(o);
  ASSERT_EQ(j["rows"].size(), 2u) << j.dump();
  bool capped = false, longest = false;
  for (const auto& r : j["rows"]) {
    const i64 train = r["train_max_seq_len"], eval = r["eval_max_seq_len"], at = r["eval_measured_seq_len"];
    SCOPED_TRACE(r.dump());
    // The forward alone keeps less than a training step: it reaches further under both budgets.
    EXPECT_GT(train, 0);
    EXPECT_GT(eval, train);
    EXPECT_LT(eval, o.cap);  // the budgets bind, not the search's cap
    EXPECT_EQ(at, std::min(eval, o.measure_cap));
    (at == eval ? longest : capped) = true;
    EXPECT_DOUBLE_EQ(r["eval_measured_ratio"].get<double>(), double(at) / double(train));
    EXPECT_EQ(r["eval_measured_peak_device_bytes"], r["eval_predicted_peak_device_bytes"]);
    EXPECT_EQ(r["eval_measured_peak_host_bytes"], r["eval_predicted_peak_host_bytes"]);
    EXPECT_LE(r["eval_measured_peak_device_bytes"].get<i64>(), o.budget);
    EXPECT_LE(r["eval_measured_peak_host_bytes"].get<i64>(), o.host_budget);
  }
  // These budgets put the device row's longest under the cap and the host row's over it.
  EXPECT_TRUE(longest);
  EXPECT_TRUE(capped);
}

}  // namespace
}  // namespace sppo
