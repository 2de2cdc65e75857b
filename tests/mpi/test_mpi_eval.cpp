// Evaluation over ranks (sppo eval, train --eval-data): the forward-only step under every
// layout train has (pipeline stages, a ring, tensor and Ulysses members, replicas, K/V on
// the host) gives one process's loss, per-position losses and accuracy, and each layout's
// measured device peak is its predicted one.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "support/mpi_run.h"

namespace sppo {
namespace {

using testing::mpirun;
using testing::read_json;
using testing::read_jsonl;
using testing::run_command;
using testing::sppo_binary;

// Relative difference the layouts' sums in another order leave (fp32 forward, fp64 sums).
constexpr double kTolerance = 1e-6;

class Eval : public testing::CommandTest {
 protected:
  Eval() : CommandTest("sppo-mpi-eval") {}
  void SetUp() override {
    CommandTest::SetUp();
    // A model trained a few steps (so its losses are not those of a uniform guess), and
    // held-out tokens of its vocabulary.
    const auto r = run_command(sppo() + " train --model llama-tiny --layers 4 --seq-len 128 --steps 4 --threads 1 "
                                        "--quiet --save " + path("ck"));
    ASSERT_EQ(r.status, 0) << r.output;
    std::mt19937 gen(11);
    std::vector<std::uint32_t> tokens(3 * 256 + 1);
    for (auto& t : tokens) t = gen() % 64;
    std::ofstream(path("held.u32"), std::ios::binary)
        .write(reinterpret_cast<const char*>(tokens.data()), std::streamsize(tokens.size() * 4));
    // Labels: the next token, every seventh not scored.
    std::vector<std::int32_t> labels(tokens.begin(), tokens.end());
    for (std::size_t k = 0; k < labels.size(); k += 7) labels[k] = -100;
    std::ofstream(path("held.i32"), std::ios::binary)
        .write(reinterpret_cast<const char*>(labels.data()), std::streamsize(labels.size() * 4));
  }
  std::string eval_args(const std::string& out) const {
    return "eval --init " + path("ck") + " --data " + path("held.u32") + " --labels " + path("held.i32") +
           " --seq-len 256 --seqs 3 --subseqs 4 --threads 1 --out " + path(out);
  }
};

void expect_close(double a, double b, const std::string& what) {
  EXPECT_LT(std::fabs(a - b), kTolerance * (1 + std::fabs(b))) << what << ": " << a << " vs " << b;
}

TEST_F(Eval, EveryLayoutGivesOneProcesssLosses) {
  const auto one = run_command(sppo() + " " + eval_args("one"));
  ASSERT_EQ(one.status, 0) << one.output;
  const nlohmann::json want = read_json(path("one/eval.json"));
  const long tokens = want["tokens"].get<long>();
  ASSERT_GT(tokens, 3 * 256 * 5 / 7);
  ASSERT_LT(tokens, 3 * 256);
  const double accuracy = want["accuracy"].get<double>();
  struct Layout {
    int np;
    const char* flags;
  };
  const Layout layouts[] = {{2, "--pp 2"},     {2, "--cp 2"},      {2, "--tp 2"},
                            {2, "--ulysses 2"}, {2, "--dp 2"},     {2, "--pp 2 --kv-cache host"},
                            {4, "--pp 2 --cp 2"}};
  int k = 0;
  for (const Layout& l : layouts) {
    const std::string out = "l" + std::to_string(k++);
    const auto r = mpirun(l.np, eval_args(out) + " " + l.flags);
    ASSERT_EQ(r.status, 0) << l.flags << "\n" << r.output;
    const nlohmann::json got = read_json(path(out + "/eval.json"));
    expect_close(got["loss"].get<double>(), want["loss"].get<double>(), l.flags);
    EXPECT_EQ(got["tokens"], want["tokens"]) << l.flags;
    ASSERT_EQ(got["per_position"].size(), want["per_position"].size()) << l.flags;
    for (std::size_t b = 0; b < want["per_position"].size(); ++b)
      expect_close(got["per_position"][b]["loss"].get<double>(), want["per_position"][b]["loss"].get<double>(),
                   std::string(l.flags) + " bin " + std::to_string(b));
    // The most likely token of each position, whole or from its members' parts (--tp): the
    // same but where two logits tie within the layouts' rounding.
    EXPECT_NEAR(got["accuracy"].get<double>(), accuracy, 1.5 / double(tokens)) << l.flags;
    EXPECT_EQ(got["peak_device_bytes"], got["predicted_peak_device_bytes"]) << l.flags;
    EXPECT_EQ(got["peak_host_bytes"], got["predicted_peak_host_bytes"]) << l.flags;
  }
}

TEST_F(Eval, HeldOutLossDuringTrainingEqualsOneProcesss) {
  const std::string run = " train --model llama-tiny --layers 4 --seq-len 256 --subseqs 2 --steps 4 --threads 1 "
                          "--quiet --eval-data " + path("held.u32") + " --eval-every 2 --eval-seqs 2 --metrics ";
  const auto one = run_command(sppo() + run + path("one.jsonl"));
  ASSERT_EQ(one.status, 0) << one.output;
  const auto two = mpirun(2, run + path("pp.jsonl") + " --pp 2");
  ASSERT_EQ(two.status, 0) << two.output;
  std::vector<double> a, b;
  for (const auto& m : read_jsonl(path("one.jsonl")))
    if (m.contains("eval_loss")) a.push_back(m["eval_loss"].get<double>());
  for (const auto& m : read_jsonl(path("pp.jsonl")))
    if (m.contains("eval_loss")) b.push_back(m["eval_loss"].get<double>());
  ASSERT_EQ(a.size(), 2u) << "steps 2 and 4";
  ASSERT_EQ(b.size(), a.size());
  for (std::size_t k = 0; k < a.size(); ++k) expect_close(b[k], a[k], "held-out loss " + std::to_string(k));
  EXPECT_NE(a[1], a[0]) << "the weights changed between the two";
}

// Under ZeRO-3 the held-out forward gathers each layer from the shards as the training step
// does (Note [ZeRO-3 gathers] in schedule/weights.h: the forward-only step keeps its F ops'
// gathers, over the layer group, where no gradient is reduced): its loss is ZeRO-1's.
TEST_F(Eval, HeldOutLossUnderZeroThreeIsZeroOnes) {
  const std::string run = " train --model llama-tiny --layers 4 --seq-len 256 --subseqs 2 --steps 2 --threads 1 "
                          "--quiet --dp 2 --eval-data " + path("held.u32") + " --eval-every 1 --eval-seqs 2 --metrics ";
  std::vector<std::vector<double>> held;
  for (const char* stage : {"1", "3"}) {
    const std::string file = path(std::string("zero") + stage + ".jsonl");
    const auto r = mpirun(2, run + file + " --zero " + stage);
    ASSERT_EQ(r.status, 0) << r.output;
    held.emplace_back();
    for (const auto& m : read_jsonl(file)) held.back().push_back(m.value("eval_loss", -1.0));
  }
  ASSERT_EQ(held[0].size(), 3u) << "two steps and the summary";
  for (std::size_t k = 0; k < 2; ++k) expect_close(held[1][k], held[0][k], "held-out loss " + std::to_string(k));
}

// The held-out data's targets are its own: labels where --eval-labels gives them, beside a
// run trained on next tokens, and next tokens beside a run trained on labels; the held-out
// loss at the last step is what sppo eval gives the checkpoint saved there.
TEST_F(Eval, HeldOutTargetsAreTheHeldOutDatas) {
  const std::string base = " train --model llama-tiny --layers 4 --seq-len 256 --steps 2 --threads 1 --quiet "
                           "--eval-data " + path("held.u32") + " --eval-seqs 3";
  const auto a = run_command(sppo() + base + " --eval-labels " + path("held.i32") + " --metrics " +
                             path("a.jsonl") + " --save " + path("a"));
  ASSERT_EQ(a.status, 0) << a.output;
  const auto b = run_command(sppo() + base + " --data " + path("held.u32") + " --labels " + path("held.i32") +
                             " --metrics " + path("b.jsonl"));
  ASSERT_EQ(b.status, 0) << b.output;
  const nlohmann::json la = read_jsonl(path("a.jsonl")).at(1), lb = read_jsonl(path("b.jsonl")).at(1);
  ASSERT_TRUE(la.contains("eval_accuracy")) << la.dump();
  ASSERT_TRUE(lb.contains("eval_loss") && !lb.contains("eval_accuracy")) << lb.dump();
  const auto e = run_command(sppo() + " eval --init " + path("a") + " --data " + path("held.u32") + " --labels " +
                             path("held.i32") + " --seq-len 256 --seqs 3 --threads 1 --out " + path("ea"));
  ASSERT_EQ(e.status, 0) << e.output;
  const nlohmann::json ea = read_json(path("ea/eval.json"));
  expect_close(la["eval_loss"].get<double>(), ea["loss"].get<double>(), "held-out loss against sppo eval");
  EXPECT_EQ(la["eval_accuracy"].get<double>(), ea["accuracy"].get<double>());
}

}  // namespace
}  // namespace sppo
