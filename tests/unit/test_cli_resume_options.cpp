// What the README says of resuming, exactly: "`train --resume DIR` restores every option
// that changes the numbers and continues the run bit-identically to the end it was planned
// for; `--steps M` extends it, the steps past the original `--steps` training at the
// schedule's final learning rate; an option given again with a different value is
// refused." And a step whose loss or gradient is not finite is skipped; --max-bad-steps in
// a row stop the run, keeping the last good checkpoint.
#include <gtest/gtest.h>

#include "io/fileutil.h"
#include "support/mpi_run.h"

namespace sppo {
namespace {

using testing::read_json;
using testing::read_jsonl;
using testing::run_command;

using io::read_file;

class Resume : public testing::CommandTest {
 protected:
  Resume() : CommandTest("sppo-resume") {}
};

const std::string kRun = " train --model tiny --seq-len 64 --seed 5 --warmup 2 --steps 6 --quiet";

TEST_F(Resume, AloneRestoresTheRunBitIdentically) {
  ASSERT_EQ(run_command(sppo() + kRun + " --save " + path("straight")).status, 0);
  ASSERT_EQ(run_command(sppo() + kRun + " --stop-after 3 --save " + path("ck")).status, 0);
  const auto r = run_command(sppo() + " train --resume " + path("ck") + " --quiet --save " + path("resumed"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(read_json(path("resumed/state.json"))["step"].get<int>(), 6);
  EXPECT_EQ(read_file(path("resumed/model.safetensors")), read_file(path("straight/model.safetensors")));
  EXPECT_EQ(read_file(path("resumed/optimizer.safetensors")), read_file(path("straight/optimizer.safetensors")));
}

TEST_F(Resume, StepsExtendAtTheFinalLearningRate) {
  ASSERT_EQ(run_command(sppo() + kRun + " --lr 0.004 --save " + path("ck")).status, 0);
  const auto r = run_command(sppo() + " train --resume " + path("ck") + " --steps 8 --quiet --metrics " + path("m.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  const auto m = read_jsonl(path("m.jsonl"));
  ASSERT_EQ(m.size(), 3u);  // steps 7, 8 and the summary
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(m[k]["step"].get<int>(), 7 + k);
    EXPECT_FLOAT_EQ(m[k]["lr"].get<float>(), 0.004f * 0.1f);  // the cosine's floor: a tenth of --lr
  }
}

// Note [Learning-rate schedules]: the schedule's name and numbers are options the checkpoint
// records, so a resumed run continues it, step for step the rates of the run not stopped.
TEST_F(Resume, TheLearningRateScheduleContinues) {
  const std::string wsd = " train --model tiny --seq-len 64 --seed 5 --warmup 2 --steps 10 --quiet --lr 0.004 "
                          "--lr-schedule wsd --decay-steps 4 --min-lr 0.001";
  auto r = run_command(sppo() + wsd + " --metrics " + path("straight.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  ASSERT_EQ(run_command(sppo() + wsd + " --stop-after 5 --save " + path("ck")).status, 0);
  r = run_command(sppo() + " train --resume " + path("ck") + " --metrics " + path("resumed.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("stable, then linear decay to 0.001 over the last 4 steps (wsd)"), std::string::npos)
      << r.output;
  const auto straight = read_jsonl(path("straight.jsonl")), resumed = read_jsonl(path("resumed.jsonl"));
  ASSERT_EQ(straight.size(), 11u);  // ten steps and the summary
  ASSERT_EQ(resumed.size(), 6u);
  const float want[10] = {0.002f, 0.004f, 0.004f, 0.004f, 0.004f, 0.004f, 0.004f, 0.00325f, 0.0025f, 0.00175f};
  for (int k = 0; k < 10; ++k) EXPECT_FLOAT_EQ(straight[k]["lr"].get<float>(), want[k]) << "step " << k + 1;
  for (int k = 0; k < 5; ++k) EXPECT_EQ(resumed[k]["lr"], straight[k + 5]["lr"]) << "step " << k + 6;
}

// Note [Continuing a trained model]: --init takes a fine-tuning learning rate (2e-5), warm-up
// over 3% of the steps and no weight decay unless given, says so at start-up, and a resumed
// run keeps them.
TEST_F(Resume, InitTakesFineTuningDefaultsAndSaysWhere) {
  ASSERT_EQ(run_command(sppo() + kRun + " --save " + path("base")).status, 0);
  const std::string init = " train --init " + path("base") + " --seq-len 64 --steps 100";
  auto r = run_command(sppo() + init + " --stop-after 2 --save " + path("ft") + " --metrics " + path("m.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("lr 2e-05 (fine-tuning default for --init), warm-up 3 steps (3% of --steps, fine-tuning "
                          "default for --init), cosine decay to 2e-06, weight decay 0 (fine-tuning default for --init)"),
            std::string::npos)
      << r.output;
  const auto m = read_jsonl(path("m.jsonl"));
  EXPECT_FLOAT_EQ(m[0]["lr"].get<float>(), 2e-5f / 3);  // the first of 3 warm-up steps
  r = run_command(sppo() + " train --resume " + path("ft") + " --stop-after 3");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("lr 2e-05 (from the checkpoint)"), std::string::npos) << r.output;
  // Given: kept, and said so; a run from scratch keeps the from-scratch defaults.
  r = run_command(sppo() + init + " --lr 1e-4 --stop-after 1");
  EXPECT_NE(r.output.find("lr 0.0001 (--lr), warm-up 3 steps (3% of --steps"), std::string::npos) << r.output;
  r = run_command(sppo() + " train --model tiny --seq-len 64 --steps 1");
  EXPECT_NE(r.output.find("lr 0.005 (default), warm-up 20 steps (default)"), std::string::npos) << r.output;
}

TEST_F(Resume, AnOptionGivenAgainDifferentlyIsRefused) {
  ASSERT_EQ(run_command(sppo() + kRun + " --stop-after 2 --save " + path("ck")).status, 0);
  const std::string before = read_file(path("ck/model.safetensors"));
  for (const char* changed : {"--seq-len 128", "--model small", "--lr 0.1", "--seed 6", "--subseqs 2", "--batch 2",
                              "--lr-schedule wsd", "--min-lr 0.0001"}) {
    const auto r = run_command(sppo() + " train --resume " + path("ck") + " " + changed + " --save " + path("ck"));
    EXPECT_EQ(r.status, 2) << changed << "\n" << r.output;
    const std::string flag = std::string(changed).substr(0, std::string(changed).find(' '));
    EXPECT_NE(r.output.find("[checkpoint] " + flag), std::string::npos) << r.output;
  }
  EXPECT_EQ(read_file(path("ck/model.safetensors")), before) << "a refused resume must not touch the checkpoint";
  // The same values given again are fine.
  EXPECT_EQ(run_command(sppo() + " train --resume " + path("ck") + " --seq-len 64 --model tiny --quiet").status, 0);
}

TEST_F(Resume, NonFiniteStepsAreSkippedThenStopTheRun) {
  auto r = run_command("SPPO_FAULT=nan:0:3 " + sppo() + kRun + " --metrics " + path("a.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  const auto m = read_jsonl(path("a.jsonl"));
  ASSERT_EQ(m.size(), 7u);
  EXPECT_TRUE(m[2].value("skipped", false)) << m[2].dump();
  for (int k : {0, 1, 3, 4, 5}) EXPECT_TRUE(std::isfinite(m[std::size_t(k)]["loss"].get<double>()));
  r = run_command("SPPO_FAULT=nan:0:4 " + sppo() + kRun + " --max-bad-steps 1 --save-every 1 --save " + path("ck"));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("non-finite"), std::string::npos) << r.output;
  EXPECT_EQ(read_json(path("ck/state.json"))["step"].get<int>(), 3) << "the last good checkpoint stays";
}

}  // namespace
}  // namespace sppo
