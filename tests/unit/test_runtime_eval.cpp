// Forward-only steps (Note [Forward-only steps] in schedule/builders.cpp): an evaluation's
// loss and per-position losses are the training step's forward's, bit for bit, on every
// placement it runs; its measured device and host peaks equal the simulator's to the byte,
// below the training step's; and under a budget --subseqs auto finds the fewest
// subsequences that fit.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/check.h"
#include "io/fileutil.h"
#include "runtime/executor.h"
#include "schedule/builders.h"
#include "schedule/validate.h"
#include "train/parallel.h"
#include "train/profile_machine.h"
#include "train/setup.h"

namespace sppo {
namespace {

const std::string& nominal_profile_path() {
  static io::TempDir dir("sppo-runtime-eval");
  static const std::string path = [] {
    const std::string p = dir.file("nominal.json");
    plan::save_profile(nominal_cpu_profile(), p);
    return p;
  }();
  return path;
}

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

// Hits are where the argmax of the logits is the target: a float64 check of one row set.
TEST(RuntimeEval, HitsAreTheLogitsArgmax) {
  StepSetup eval = make_setup(options("tiny", 64, "1", "device", true));
  const StepResult r = run(eval, 64);
  i64 hits = 0;
  for (std::uint8_t h : r.hits) hits += h;
  // An untrained model picks its targets about as often as chance: a handful at most.
  EXPECT_LT(hits, 16);
  // Trained on nothing, the per-position loss bounds each hit: a hit's loss is at most log V.
  for (std::size_t p = 0; p < r.hits.size(); ++p)
    if (r.hits[p]) {
      EXPECT_LE(r.losses[p], std::log(double(eval.config.vocab)) + 1e-4) << p;
    }
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
