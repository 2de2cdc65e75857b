// Copy streams (runtime/copy_stream.h): tasks run in submission order on one worker, events
// complete when their task has run and record when, synchronize() waits for all, and the
// submitting thread is never held up by a copy.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>
#include <vector>

#include "runtime/copy_stream.h"

namespace sppo {
namespace {

using namespace std::chrono_literals;

double clock_s() {
  static const auto origin = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - origin).count();
}

TEST(CopyStream, RunsTasksInSubmissionOrder) {
  std::vector<int> ran;
  {
    CopyStream s(clock_s);
    for (int k = 0; k < 200; ++k) s.submit([&ran, k] { ran.push_back(k); });
    s.synchronize();
    ASSERT_EQ(ran.size(), 200u);
  }
  for (int k = 0; k < 200; ++k) EXPECT_EQ(ran[std::size_t(k)], k);
}

TEST(CopyStream, EventsCompleteAfterTheirTaskAndRecordWhen) {
  CopyStream s(clock_s);
  std::promise<void> go;
  std::shared_future<void> gate = go.get_future().share();
  const double t_submit = clock_s();
  auto first = s.submit([gate] { gate.wait(); std::this_thread::sleep_for(10ms); });
  auto second = s.submit([] { std::this_thread::sleep_for(5ms); });
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(first->done()) << "the task is held at its gate";
  EXPECT_FALSE(second->done()) << "a later task waits for the earlier one";
  go.set_value();
  const double waited = second->wait();
  EXPECT_GT(waited, 0.0);
  EXPECT_TRUE(first->done());
  EXPECT_TRUE(second->done());
  EXPECT_GE(first->start_s(), t_submit);
  EXPECT_GE(first->end_s() - first->start_s(), 0.009);
  EXPECT_GE(second->start_s(), first->end_s()) << "one worker: no overlap between tasks";
  EXPECT_GE(second->end_s() - second->start_s(), 0.004);
  EXPECT_LT(first->wait(), 0.01) << "waiting on a finished event returns at once";
}

TEST(CopyStream, SynchronizeWaitsForEveryTask) {
  CopyStream s(clock_s);
  std::atomic<int> done{0};
  for (int k = 0; k < 5; ++k) s.submit([&] { std::this_thread::sleep_for(2ms); ++done; });
  s.synchronize();
  EXPECT_EQ(done.load(), 5);
  s.synchronize();  // idle: returns at once
}

TEST(CopyStream, SubmittingDoesNotWaitForTheCopy) {
  CopyStream s(clock_s);
  const auto t0 = std::chrono::steady_clock::now();
  auto ev = s.submit([] { std::this_thread::sleep_for(100ms); });
  const double submit_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(submit_s, 0.05) << "the caller computes while the copy runs";
  EXPECT_FALSE(ev->done());
  ev->wait();
  EXPECT_TRUE(ev->done());
}

TEST(CopyStream, DestructionRunsWhatWasQueued) {
  std::atomic<int> ran{0};
  {
    CopyStream s(clock_s);
    for (int k = 0; k < 10; ++k) s.submit([&] { std::this_thread::sleep_for(1ms); ++ran; });
  }
  EXPECT_EQ(ran.load(), 10);
}

TEST(CopyStream, TwoStreamsRunConcurrently) {
  // Offloads and prefetches use one stream each, like two copy engines.
  CopyStream out(clock_s), in(clock_s);
  auto a = out.submit([] { std::this_thread::sleep_for(50ms); });
  auto b = in.submit([] { std::this_thread::sleep_for(50ms); });
  a->wait();
  b->wait();
  EXPECT_LT(std::max(a->start_s(), b->start_s()), std::min(a->end_s(), b->end_s())) << "the two spans overlap";
}

}  // namespace
}  // namespace sppo
