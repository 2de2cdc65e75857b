// A failing rank ends the whole job within 30 s with a message naming the rank and what it
// was doing, never a hang: a rank that dies, a message that never arrives (the watchdog),
// and ranks started with different options. Faults are injected with SPPO_FAULT
// (runtime/fault.h).
#include <gtest/gtest.h>

#include "support/mpi_run.h"

namespace sppo {
namespace {

using testing::mpirun;

constexpr double kLimitS = 30;
const std::string kRun = "train --model tiny --layers 4 --seed 3 --threads 1 --quiet --steps 4 --pp 2 --subseqs 3";

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(Faults, RankThatDies) {
  const auto r = mpirun(2, kRun + " --seq-len 96", "SPPO_FAULT=die:1:2");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_LT(r.seconds, kLimitS);
  EXPECT_TRUE(has(r.output, "rank 1")) << r.output;                    // the launcher names the dead rank
  EXPECT_TRUE(has(r.output, "rank 0: ended by the launcher while at op")) << r.output;  // the survivor, its op
}

TEST(Faults, MessageThatNeverArrives) {
  // The default watchdog, so that the bound holds for what users get.
  const auto r = mpirun(2, kRun + " --seq-len 96", "SPPO_FAULT=drop:0:2");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_LT(r.seconds, kLimitS);
  EXPECT_TRUE(has(r.output, "rank 1 waited")) << r.output;
  EXPECT_TRUE(has(r.output, "'recv hidden s1")) << r.output;  // the op that waited
}

TEST(Faults, RanksWithDifferentOptions) {
  const auto r = testing::run_command("mpirun --oversubscribe --bind-to none -np 1 " + testing::sppo_binary() + " " +
                                      kRun + " --seq-len 64 : -np 1 " + testing::sppo_binary() + " " + kRun +
                                      " --seq-len 128");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_LT(r.seconds, kLimitS);
  EXPECT_TRUE(has(r.output, "different options")) << r.output;
  EXPECT_TRUE(has(r.output, "rank 1 has --seq-len \"128\"")) << r.output;
}

}  // namespace
}  // namespace sppo
