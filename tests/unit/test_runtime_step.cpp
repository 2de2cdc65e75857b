// The runtime on real steps (Runtime::step): offload copies run while compute does, and the
// device arena's measured peak equals the simulator's prediction for the same schedule.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "io/fileutil.h"
#include "runtime/executor.h"
#include "train/parallel.h"
#include "train/profile_machine.h"
#include "train/setup.h"

namespace sppo {
namespace {

// Adaptive choices need a profile's rates; a fixed one saves measuring this machine (the
// peaks compared below do not depend on rates).
const std::string& nominal_profile_path() {
  static io::TempDir dir("sppo-runtime-step");
  static const std::string path = [] {
    const std::string p = dir.file("nominal.json");
    plan::save_profile(nominal_cpu_profile(), p);
    return p;
  }();
  return path;
}

StepOptions step_options(const std::string& model, i64 S, const std::string& subseqs, const std::string& offload,
                         i64 budget = 0) {
  StepOptions o;
  o.model = preset(model);
  o.model_name = model;
  o.seq_len = S;
  o.subseqs = subseqs;
  o.offload = offload;
  o.device_memory = budget;
  o.hardware = nominal_profile_path();
  return o;
}

// One step of `s` from the seed's weights and the first sequence of its data.
StepResult run_step(StepSetup& s, i64 S) {
  init_owned(*s.runtime, 1234);
  std::vector<std::int32_t> tokens(std::size_t(S + 1));
  s.data->next(tokens.data(), S + 1);
  return s.runtime->step(s.schedule, tokens.data());
}

bool overlap(const TraceSpan& a, const TraceSpan& b) {
  return std::max(a.start_s, b.start_s) < std::min(a.start_s + a.dur_s, b.start_s + b.dur_s);
}

// How many of a step's offload copies ran while a forward or backward pass computed.
int overlapped_copies(const StepResult& r) {
  std::vector<TraceSpan> copies, compute;
  for (const TraceSpan& t : r.trace) {
    if (t.lane == Lane::CopyOut) copies.push_back(t);
    if (t.lane == Lane::Compute && (t.kind == sched::OpKind::Forward || t.kind == sched::OpKind::Backward))
      compute.push_back(t);
  }
  EXPECT_EQ(copies.size(), 3u) << "one offload per subsequence but the last";
  int overlapped = 0;
  for (const TraceSpan& c : copies) {
    EXPECT_GT(c.dur_s, 0.0) << c.name;
    for (const TraceSpan& f : compute)
      if (overlap(c, f)) {
        ++overlapped;
        break;
      }
  }
  return overlapped;
}

TEST(RuntimeStep, OffloadCopiesOverlapCompute) {
  const i64 S = 2048;
  StepSetup s = make_setup(step_options("small", S, "4", "full"));
  // A copy made on the compute thread never overlaps a pass. An asynchronous one can miss
  // in one step when ctest keeps both cores busy (the copy thread runs its millisecond
  // while the compute thread waits for a core), so the step gets a few tries.
  int overlapped = 0;
  for (int attempt = 0; attempt < 5 && overlapped == 0; ++attempt) {
    const StepResult r = run_step(s, S);
    EXPECT_GT(r.offloaded_bytes, 0);
    overlapped = overlapped_copies(r);
  }
  EXPECT_GE(overlapped, 1) << "no offload ran while a subsequence computed, in 5 steps";
}

struct PeakCase {
  const char* model;
  i64 S;
  const char* subseqs;
  const char* offload;
  double budget_fraction;  // of the unbudgeted, unoffloaded peak; 0: no budget
};

TEST(RuntimeStep, MeasuredPeakEqualsTheSimulatorsPrediction) {
  const PeakCase cases[] = {
      {"tiny", 256, "1", "none", 0},          {"tiny", 1024, "4", "none", 0},
      {"tiny", 1024, "4", "0.5", 0},          {"tiny", 1024, "4", "full", 0},
      {"tiny", 1000, "3", "0.3", 0},          {"small", 1024, "8", "full", 0},
      {"small", 1024, "8", "adaptive", 0.75}, {"small", 1024, "auto", "adaptive", 0.5},
      {"medium", 512, "2", "full", 0},
  };
  for (const PeakCase& c : cases) {
    i64 budget = 0;
    if (c.budget_fraction > 0) {
      const StepSetup whole = make_setup(step_options(c.model, c.S, "1", "none"));
      budget = i64(double(whole.predicted_peak_bytes) * c.budget_fraction);
    }
    StepSetup s = make_setup(step_options(c.model, c.S, c.subseqs, c.offload, budget));
    ASSERT_GT(s.predicted_peak_bytes, 0);
    s.runtime->device().reset_peak();
    const StepResult r = run_step(s, c.S);
    const std::string what = std::string(c.model) + " S " + std::to_string(c.S) + " N " + c.subseqs + " (" +
                             std::to_string(s.lengths.size()) + ") offload " + c.offload + " budget " +
                             std::to_string(budget);
    EXPECT_EQ(s.runtime->device().stats().peak, s.predicted_peak_bytes) << what;
    EXPECT_EQ(r.device.peak, s.predicted_peak_bytes) << what;
    if (budget > 0) {
      EXPECT_LE(r.device.peak, budget) << what;
      EXPECT_GT(r.offloaded_bytes, 0) << what << ": the budget should have demanded offloading";
    }
  }
}

}  // namespace
}  // namespace sppo
