// The full-recomputation baseline's peak device memory, predicted before training
// (schedule/memory.h recompute_peak_bytes), is the arena's high-water mark, and a budget
// below it is refused before any step with a message that fits the mode.
#include <gtest/gtest.h>

#include <vector>

#include "support/expect_error.h"
#include "train/setup.h"

namespace sppo {
namespace {

StepOptions recompute(const char* model, int layers, i64 S) {
  StepOptions o;
  o.model = preset(model);
  o.model.layers = layers;
  o.model_name = model;
  o.seq_len = S;
  o.recompute = true;
  return o;
}

TEST(Recompute, PredictedPeakIsTheArenas) {
  for (auto [model, layers, S] : {std::tuple{"tiny", 1, 100}, std::tuple{"tiny", 3, 257}, std::tuple{"small", 2, 512}}) {
    StepSetup s = make_setup(recompute(model, layers, S));
    init_params(s.config, s.runtime->params(), 1);
    std::vector<std::int32_t> tokens(std::size_t(S + 1));
    s.data->next(tokens.data(), S + 1);
    const StepResult r = s.runtime->step(s.schedule, tokens.data());
    EXPECT_EQ(r.device.peak, s.predicted_peak_bytes) << model << " L " << layers << " S " << S;
  }
}

TEST(Recompute, BudgetRefusedBeforeTraining) {
  StepOptions o = recompute("tiny", 2, 300);
  const i64 need = make_setup(o).predicted_peak_bytes;
  o.device_memory = need - 1;
  EXPECT_ERROR_WITH(make_setup(o), "[memory] --recompute needs", "--device-memory", "drop --recompute");
  o.device_memory = need;
  EXPECT_NO_THROW(make_setup(o));
}

}  // namespace
}  // namespace sppo
