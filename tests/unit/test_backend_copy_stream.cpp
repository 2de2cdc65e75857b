// The CPU backend's copy streams (Backend::make_copy_stream, backend/backend.h): copies run
// in submission order on one worker, each moves its bytes and then runs its `then`; events
// complete after both and record when they ran; synchronize() waits for all; the
// submitting thread is never held up by a copy; two streams run at once.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <thread>
#include <vector>

#include "backend/backend.h"

namespace sppo {
namespace {

using namespace std::chrono_literals;

double steady_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Host and device buffers of one backend, freed with it.
class CopyStreamTest : public ::testing::Test {
 protected:
  void SetUp() override { be = make_backend("cpu"); }
  void TearDown() override {
    for (void* p : device) be->device_free(p);
    for (void* p : host) be->host_free(p);
  }
  void* device_bytes(std::size_t n) { return device.emplace_back(be->device_alloc(n)); }
  void* host_bytes(std::size_t n) { return host.emplace_back(be->host_alloc(n)); }

  std::unique_ptr<Backend> be;
  std::vector<void*> device, host;
};

TEST_F(CopyStreamTest, CopiesTheBytesThenRunsThen) {
  // Large enough for the streaming-store path, with a tail that is not whole cache lines.
  const std::size_t n = (1 << 20) + 37;
  auto* src = static_cast<unsigned char*>(device_bytes(n));
  auto* dst = static_cast<unsigned char*>(host_bytes(n));
  for (std::size_t k = 0; k < n; ++k) src[k] = static_cast<unsigned char>(k * 7 + 3);
  std::memset(dst, 0, n);
  auto s = be->make_copy_stream();
  bool matched_in_then = false;
  auto ev = s->copy(dst, src, n, [&] { matched_in_then = std::memcmp(dst, src, n) == 0; });
  ev->wait();
  EXPECT_TRUE(matched_in_then) << "`then` runs after the copy has landed";
  EXPECT_EQ(std::memcmp(dst, src, n), 0);
}

TEST_F(CopyStreamTest, RunsCopiesInSubmissionOrder) {
  // Every copy writes the same destination, so only the last one's value stays; each
  // `then` records its index.
  auto* values = static_cast<int*>(host_bytes(200 * sizeof(int)));
  auto* slot = static_cast<int*>(device_bytes(sizeof(int)));
  std::vector<int> ran;
  {
    auto s = be->make_copy_stream();
    for (int k = 0; k < 200; ++k) {
      values[k] = k;
      s->copy(slot, &values[k], sizeof(int), [&ran, k] { ran.push_back(k); });
    }
    s->synchronize();
    ASSERT_EQ(ran.size(), 200u);
  }
  for (int k = 0; k < 200; ++k) EXPECT_EQ(ran[std::size_t(k)], k);
  EXPECT_EQ(*slot, 199);
}

TEST_F(CopyStreamTest, EventsCompleteAfterTheirCopyAndRecordWhen) {
  auto s = be->make_copy_stream();
  void* a = host_bytes(64);
  void* b = device_bytes(64);
  std::promise<void> go;
  std::shared_future<void> gate = go.get_future().share();
  const double t_submit = steady_s();
  auto first = s->copy(b, a, 64, [gate] { gate.wait(); std::this_thread::sleep_for(10ms); });
  auto second = s->copy(b, a, 64, [] { std::this_thread::sleep_for(5ms); });
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(first->done()) << "the copy's `then` is held at its gate";
  EXPECT_FALSE(second->done()) << "a later copy waits for the earlier one";
  go.set_value();
  const double waited = second->wait();
  EXPECT_GT(waited, 0.0);
  EXPECT_TRUE(first->done());
  EXPECT_TRUE(second->done());
  EXPECT_GE(first->start_s(), t_submit) << "times are on the steady clock";
  EXPECT_GE(first->end_s() - first->start_s(), 0.009);
  EXPECT_GE(second->start_s(), first->end_s()) << "one worker: no overlap between copies";
  EXPECT_GE(second->end_s() - second->start_s(), 0.004);
  EXPECT_LT(first->wait(), 0.01) << "waiting on a finished event returns at once";
}

TEST_F(CopyStreamTest, SynchronizeWaitsForEveryCopy) {
  auto s = be->make_copy_stream();
  void* a = host_bytes(64);
  void* b = device_bytes(64);
  std::atomic<int> done{0};
  for (int k = 0; k < 5; ++k) s->copy(b, a, 64, [&] { std::this_thread::sleep_for(2ms); ++done; });
  s->synchronize();
  EXPECT_EQ(done.load(), 5);
  s->synchronize();  // idle: returns at once
}

TEST_F(CopyStreamTest, SubmittingDoesNotWaitForTheCopy) {
  auto s = be->make_copy_stream();
  void* a = host_bytes(64);
  void* b = device_bytes(64);
  const double t0 = steady_s();
  auto ev = s->copy(b, a, 64, [] { std::this_thread::sleep_for(100ms); });
  EXPECT_LT(steady_s() - t0, 0.05) << "the caller computes while the copy runs";
  EXPECT_FALSE(ev->done());
  ev->wait();
  EXPECT_TRUE(ev->done());
}

TEST_F(CopyStreamTest, DestructionRunsWhatWasQueued) {
  void* a = host_bytes(64);
  void* b = device_bytes(64);
  std::atomic<int> ran{0};
  {
    auto s = be->make_copy_stream();
    for (int k = 0; k < 10; ++k) s->copy(b, a, 64, [&] { std::this_thread::sleep_for(1ms); ++ran; });
  }
  EXPECT_EQ(ran.load(), 10);
}

TEST_F(CopyStreamTest, TwoStreamsRunConcurrently) {
  // Offloads and prefetches use one stream each, like two copy engines.
  auto out = be->make_copy_stream();
  auto in = be->make_copy_stream();
  auto a = out->copy(host_bytes(64), device_bytes(64), 64, [] { std::this_thread::sleep_for(50ms); });
  auto b = in->copy(device_bytes(64), host_bytes(64), 64, [] { std::this_thread::sleep_for(50ms); });
  a->wait();
  b->wait();
  EXPECT_LT(std::max(a->start_s(), b->start_s()), std::min(a->end_s(), b->end_s())) << "the two spans overlap";
}

}  // namespace
}  // namespace sppo
