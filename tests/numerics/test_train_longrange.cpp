// The built-in task shows long-range learning: the second half of each sequence repeats the
// first, so its loss can fall far below the first half's ln(alphabet) only if attention
// reaches back S/2 tokens. A small model learns it in CI-sized time.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/fileutil.h"
#include "train/trainer.h"

namespace sppo {
namespace {

TEST(LongRange, SecondHalfLossFallsFarBelowFirstHalf) {
  io::TempDir tmp("sppo-longrange");
  TrainOptions o;
  o.step.model = preset("tiny");
  o.step.model_name = "tiny";
  o.step.seq_len = 256;
  o.step.data = "repeat:32";
  o.step.subseqs = "2";  // the copy reaches back across the subsequence boundary
  o.steps = 450;
  o.lr = 5e-3f;
  o.quiet = true;
  o.metrics_path = tmp.path() + "/m.jsonl";
  ASSERT_EQ(run_train(o), 0);

  std::vector<nlohmann::json> rows;
  std::ifstream f(o.metrics_path);
  for (std::string l; std::getline(f, l);) {
    auto j = nlohmann::json::parse(l);
    if (!j.contains("summary")) rows.push_back(std::move(j));
  }
  ASSERT_EQ(rows.size(), 450u);
  double first = 0, second = 0;
  const int last = 30;
  for (int k = int(rows.size()) - last; k < int(rows.size()); ++k) {
    first += rows[std::size_t(k)]["loss_first_half"].get<double>() / last;
    second += rows[std::size_t(k)]["loss_second_half"].get<double>() / last;
  }
  std::printf("last %d steps: first-half loss %.3f (ln 32 = %.3f), second-half loss %.3f\n", last, first,
              std::log(32.0), second);
  EXPECT_GT(first, 0.8 * std::log(32.0)) << "the first half is random: its loss cannot fall far";
  EXPECT_LT(second, 0.3 * first) << "attention did not learn to reach back S/2 tokens";
}

}  // namespace
}  // namespace sppo
