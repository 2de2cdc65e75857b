// The learning-rate schedules (Note [Learning-rate schedules] in train/lr_schedule.h): each
// shape against its formula written out here, at the steps where it turns, and the
// schedules a run cannot follow refused with what works.
#include <gtest/gtest.h>

#include <cmath>

#include "support/expect_error.h"
#include "train/lr_schedule.h"

namespace sppo {
namespace {

LrSchedule schedule(LrShape shape, double min_lr = -1, int decay_steps = 0) {
  LrSchedule s;
  s.shape = shape;
  s.peak = 0.004;
  s.warmup = 10;
  s.min_lr = min_lr;
  s.decay_steps = decay_steps;
  return s;
}

TEST(LrSchedule, EveryShapeWarmsUpLinearly) {
  for (LrShape shape : {LrShape::Cosine, LrShape::Linear, LrShape::Constant, LrShape::Wsd}) {
    const LrSchedule s = schedule(shape);
    for (int k = 0; k < 10; ++k) EXPECT_DOUBLE_EQ(s.at(k, 100), 0.004 * (k + 1) / 10.0) << to_string(shape);
    EXPECT_DOUBLE_EQ(s.at(10, 100), 0.004) << to_string(shape);  // the peak, where the warm-up ends
  }
}

TEST(LrSchedule, CosineAndLinearDecayToTheFloorAtTheLastStep) {
  const LrSchedule cosine = schedule(LrShape::Cosine), linear = schedule(LrShape::Linear, 0.001);
  EXPECT_DOUBLE_EQ(cosine.floor(), 0.0004);  // a tenth of the peak by default
  for (int k = 10; k <= 120; k += 7) {
    const double progress = std::min(1.0, (k - 10) / 90.0);
    EXPECT_NEAR(cosine.at(k, 100), 0.0004 + 0.0036 * 0.5 * (1 + std::cos(M_PI * progress)), 1e-15) << k;
    EXPECT_NEAR(linear.at(k, 100), 0.004 - 0.003 * progress, 1e-15) << k;
  }
  EXPECT_NEAR(cosine.at(55, 100), (0.004 + 0.0004) / 2, 1e-15);  // halfway down at the middle
  EXPECT_DOUBLE_EQ(cosine.at(100, 100), 0.0004);
  EXPECT_DOUBLE_EQ(linear.at(150, 100), 0.001);  // past the planned steps: the floor
}

TEST(LrSchedule, ConstantHoldsThePeak) {
  const LrSchedule s = schedule(LrShape::Constant, 0.001);
  for (int k : {10, 50, 99, 500}) EXPECT_DOUBLE_EQ(s.at(k, 100), 0.004);
  EXPECT_EQ(s.describe(100), "constant");
}

TEST(LrSchedule, WsdIsStableThenDecaysOverItsLastSteps) {
  const LrSchedule s = schedule(LrShape::Wsd, 0.0, 20);  // decay over steps 80 .. 100
  for (int k : {10, 40, 79, 80}) EXPECT_DOUBLE_EQ(s.at(k, 100), 0.004) << k;
  EXPECT_NEAR(s.at(90, 100), 0.002, 1e-15);
  EXPECT_NEAR(s.at(95, 100), 0.001, 1e-15);
  EXPECT_DOUBLE_EQ(s.at(100, 100), 0.0);
  EXPECT_DOUBLE_EQ(s.at(130, 100), 0.0);
  // By default the decay is a tenth of the steps: 20 of 200, from step 180.
  const LrSchedule d = schedule(LrShape::Wsd);
  EXPECT_EQ(d.decay(200), 20);
  EXPECT_DOUBLE_EQ(d.at(180, 200), 0.004);
  EXPECT_NEAR(d.at(190, 200), (0.004 + 0.0004) / 2, 1e-15);
  EXPECT_EQ(d.describe(200), "stable, then linear decay to 0.0004 over the last 20 steps (wsd)");
}

TEST(LrSchedule, RefusesWhatARunCannotFollow) {
  EXPECT_ERROR_WITH(parse_lr_shape("step"), "'step'", "cosine", "linear", "constant", "wsd");
  EXPECT_EQ(parse_lr_shape("wsd"), LrShape::Wsd);
  EXPECT_ERROR_WITH(check_lr_schedule(schedule(LrShape::Cosine, 0.01), 100), "--min-lr 0.01", "--lr 0.004");
  EXPECT_ERROR_WITH(check_lr_schedule(schedule(LrShape::Cosine, -1, 5), 100), "--decay-steps", "wsd");
  EXPECT_ERROR_WITH(check_lr_schedule(schedule(LrShape::Wsd, -1, 95), 100), "--decay-steps 90 or less");
  check_lr_schedule(schedule(LrShape::Wsd, -1, 90), 100);
  check_lr_schedule(schedule(LrShape::Linear, 0.004), 100);
}

}  // namespace
}  // namespace sppo
