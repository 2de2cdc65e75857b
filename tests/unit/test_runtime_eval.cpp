// Forward-only steps (Note [Forward-only steps] in schedule/builders.cpp): an evaluation's
// loss and per-position losses are the training step's forward's, bit for bit, on every
// placement it runs; its measured device and host peaks equal the simulator's to the byte,
// below the training step's; and under a budget --subseqs auto finds the fewest
// subsequences that fit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "core/check.h"
#include "io/fileutil.h"
#include "runtime/executor.h"
#include "schedule/builders.h"
#include "schedule/validate.h"
#include "train/parallel.h"
#include "train/profile_machine.h"
#include "support/nominal_profile.h"
#include "train/setup.h"

namespace sppo {
namespace {

using testing::nominal_profile_path;

StepOptions options(const std::string& model, i64 S, const std::string& subseqs, const std::string& kv,
                    bool eval, i64 budget = 0) {
  StepOptions o;
  o.model = preset(model);
  o.model_name = model;
  o.seq_len = S;
  o.subseqs = subseqs;
  o.device_memory = budget;
  o.hardware = nominal_profile_path();
  o.place.kv = parse_kv_cache(kv);
  o.forward_only = eval;
  return o;
}

StepResult run(StepSetup& s, i64 S) {
  init_owned(*s.runtime, 77);
  std::vector<std::int32_t> tokens(std::size_t(S + 1));
  s.data->next(tokens.data(), S + 1);
  return s.runtime->step(s.schedule, tokens.data());
}

struct Case {
  const char* model;
  i64 S;
  const char* subseqs;
  const char* kv;
};

TEST(RuntimeEval, LossesAreTheTrainingForwardsAndPeaksThePredicted) {
  const Case cases[] = {{"tiny", 256, "1", "device"},  {"tiny", 1000, "3", "device"}, {"small", 1024, "4", "device"},
                        {"tiny", 1024, "4", "host"},   {"small", 1024, "8", "host"},  {"tiny", 4096, "8", "host"}};
  for (const Case& c : cases) {
    const std::string what = std::string(c.model) + " S " + std::to_string(c.S) + " N " + c.subseqs + " kv " + c.kv;
    StepSetup train = make_setup(options(c.model, c.S, c.subseqs, c.kv, false));
    StepSetup eval = make_setup(options(c.model, c.S, c.subseqs, c.kv, true));
    ASSERT_TRUE(eval.schedule.forward_only) << what;
    for (const auto& ops : eval.schedule.ops)
      for (const sched::Op& op : ops) EXPECT_EQ(op.kind, sched::OpKind::Forward) << what;
    const sched::Validation v = sched::validate(eval.schedule, {});
    EXPECT_TRUE(v.errors.empty()) << what << ": " << (v.errors.empty() ? "" : v.errors.front());
    const StepResult rt = run(train, c.S);
    const StepResult re = run(eval, c.S);
    EXPECT_EQ(re.loss, rt.loss) << what;
    ASSERT_EQ(re.losses.size(), rt.losses.size()) << what;
    for (std::size_t p = 0; p < re.losses.size(); ++p) ASSERT_EQ(re.losses[p], rt.losses[p]) << what << " at " << p;
    ASSERT_EQ(re.hits.size(), std::size_t(c.S)) << what;
    EXPECT_EQ(re.device.peak, eval.predicted_peak_bytes) << what;
    EXPECT_EQ(re.host.peak, eval.predicted_host_bytes) << what;
    EXPECT_LT(re.device.peak, rt.device.peak) << what << ": an evaluation holds less than training";
    EXPECT_EQ(eval.runtime->device().stats().current, i64(eval.runtime->num_params()) * 4)
        << what << ": after the step the weights alone";
  }
}

// With labels, a hit is a labelled position whose most likely token is its label: none
// where nothing is scored, and a hit's loss at most log V (its label has the largest
// probability). Without labels none is scored (the accuracy needs labels).
TEST(RuntimeEval, HitsAreScoredWhereThereAreLabels) {
  io::TempDir dir("sppo-runtime-eval-hits");
  const i64 S = 64;
  std::vector<std::uint32_t> tokens(std::size_t(S + 1));
  std::vector<std::int32_t> labels(tokens.size());
  for (std::size_t k = 0; k < tokens.size(); ++k) {
    tokens[k] = std::uint32_t((k * 7 + 3) % 64);
    labels[k] = k % 3 == 0 ? -100 : std::int32_t((k * 5) % 64);
  }
  std::ofstream(dir.file("d.u32"), std::ios::binary)
      .write(reinterpret_cast<const char*>(tokens.data()), std::streamsize(tokens.size() * 4));
  std::ofstream(dir.file("d.i32"), std::ios::binary)
      .write(reinterpret_cast<const char*>(labels.data()), std::streamsize(labels.size() * 4));
  StepOptions o = options("tiny", S, "2", "device", true);
  o.data = dir.file("d.u32");
  o.labels = dir.file("d.i32");
  StepSetup eval = make_setup(o);
  ASSERT_TRUE(eval.schedule.labeled);
  init_owned(*eval.runtime, 77);
  std::vector<std::int32_t> ids(tokens.begin(), tokens.end()), targets;
  for (i64 p = 0; p < S; ++p)
    targets.push_back(labels[std::size_t(p + 1)] == -100 ? kNoTarget : labels[std::size_t(p + 1)]);
  StepControl control;
  control.targets = targets.data();
  const StepResult r = eval.runtime->step(eval.schedule, ids.data(), control);
  ASSERT_EQ(r.hits.size(), std::size_t(S));
  for (i64 p = 0; p < S; ++p) {
    if (targets[std::size_t(p)] == kNoTarget) {
      EXPECT_EQ(r.hits[std::size_t(p)], 0) << p;
    }
    if (r.hits[std::size_t(p)]) {
      EXPECT_LE(r.losses[std::size_t(p)], std::log(double(eval.config.vocab)) + 1e-4) << p;
    }
  }
  StepSetup plain = make_setup(options("tiny", S, "2", "device", true));
  const StepResult q = run(plain, S);
  for (std::uint8_t h : q.hits) ASSERT_EQ(h, 0) << "nothing is scored without labels";
}

TEST(RuntimeEval, AutoFindsTheFewestSubsequencesThatFit) {
  const StepSetup whole = make_setup(options("small", 4096, "1", "device", true));
  const i64 budget = whole.predicted_peak_bytes * 7 / 10;
  StepSetup s = make_setup(options("small", 4096, "auto", "device", true, budget));
  const int N = int(s.lengths.size());
  ASSERT_GT(N, 1);
  EXPECT_LE(s.predicted_peak_bytes, budget);
  const StepSetup fewer = make_setup(options("small", 4096, std::to_string(N - 1), "device", true));
  EXPECT_GT(fewer.predicted_peak_bytes, budget) << "one fewer than auto's " << N << " does not fit";
  const StepResult r = run(s, 4096);
  EXPECT_EQ(r.device.peak, s.predicted_peak_bytes);
  EXPECT_LE(r.device.peak, budget);
}

}  // namespace
}  // namespace sppo
