// Canonical text of small schedules against files in tests/golden/ (docs/design.md,
// Conventions 1). After a deliberate change, rewrite them with SPPO_UPDATE_GOLDEN=1 and
// review the diff by eye.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "core/config.h"
#include "schedule/builders.h"

namespace sppo::sched {
namespace {

void check_golden(const std::string& name, const Schedule& s) {
  const std::string path = std::string(SPPO_SOURCE_DIR) + "/tests/golden/" + name + ".txt";
  const std::string text = to_string(s);
  if (std::getenv("SPPO_UPDATE_GOLDEN")) {
    std::ofstream(path) << text;
    GTEST_SKIP() << "wrote " << path;
  }
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << "missing golden file " << path << " (run with SPPO_UPDATE_GOLDEN=1)";
  std::stringstream want;
  want << in.rdbuf();
  EXPECT_EQ(text, want.str()) << "schedule text differs from " << path;
}

TEST(Golden, Single) { check_golden("single_n4", build_single(2, {4, 3, 2, 1}, {0.5, 1.0, 0.25, 0.0})); }

TEST(Golden, Pipeline) {
  PipelineSpec spec;
  spec.layers = 4;
  spec.par.pp = 2;
  spec.lengths = {6, 5, 4};
  spec.alpha = {0.5, 0.5, 0.0};
  check_golden("pipeline_p2_n3", build_pipeline(spec));
}

TEST(Golden, RingAndDataParallel) {
  PipelineSpec spec;
  spec.layers = 2;
  spec.par.pp = 1;
  spec.par.cp = 2;
  spec.par.ring_layout = RingLayout::Contiguous;
  spec.par.dp = 2;
  spec.lengths = {8, 6};
  check_golden("ring_sp2_dp2_n2", build_pipeline(spec));
}

TEST(Golden, ZigzagRingInAPipeline) {
  PipelineSpec spec;
  spec.layers = 2;
  spec.par.pp = 2;
  spec.par.cp = 2;
  spec.lengths = {12, 8};
  spec.par.ring_layout = RingLayout::Zigzag;
  check_golden("ring_zigzag_sp2_p2_n2", build_pipeline(spec));
}

// ZeRO-3 over two replicas in the layer-major backward: each layer's gather before the F or
// B that starts it (Note [ZeRO-3 gathers] in schedule/weights.h), the reduce-scatter at
// the end.
TEST(Golden, ZeroThreeLayerMajor) {
  ModelConfig c = preset("tiny");
  c.layers = 2;
  StepShape shape;
  shape.par.dp = 2;
  shape.par.zero = ZeroStage::Weights;
  shape.place.backward = BackwardOrder::Layer;
  check_golden("zero3_dp2_n2_layer", build_step(c, {6, 4}, {0.5, 0.0}, shape));
}

TEST(Golden, Msp) {
  PipelineSpec spec;
  spec.layers = 3;
  spec.par.pp = 3;
  spec.par.msp.on = true;
  spec.lengths = {9, 8, 7, 6};
  check_golden("msp_p3_n4", build_pipeline(spec));
}

}  // namespace
}  // namespace sppo::sched
