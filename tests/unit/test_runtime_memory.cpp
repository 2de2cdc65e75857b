// Memory tiers (runtime/memory.h): exact accounting {current, peak}, the budget error, and
// allocations that wait for releases still in flight under a tight budget. Each test runs
// on a tier whose bytes come from the heap and on one whose bytes come from the CPU
// backend (as the runtime makes them): the accounting must not depend on where they live.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>

#include "backend/backend.h"
#include "runtime/memory.h"
#include "support/expect_error.h"

namespace sppo {
namespace {

using namespace std::chrono_literals;

// The parameter names where a tier's bytes come from: "heap" (no backend) or a backend.
class MemoryTierTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() != "heap") be_ = make_backend(GetParam());
  }
  Backend* backend() { return be_.get(); }

 private:
  std::unique_ptr<Backend> be_;
};

TEST_P(MemoryTierTest, CountsCurrentAndPeak) {
  MemoryTier tier(Tier::Device, 0, backend());
  EXPECT_EQ(tier.stats().current, 0);
  {
    Buffer a = tier.alloc(1000, "a");
    Buffer b = tier.alloc(24, "b");
    EXPECT_EQ(tier.stats().current, 1024);
    EXPECT_EQ(tier.stats().peak, 1024);
    a.reset();
    EXPECT_FALSE(a);
    EXPECT_EQ(tier.stats().current, 24);
    EXPECT_EQ(tier.stats().peak, 1024);
    Buffer c = tier.alloc(500, "c");
    EXPECT_EQ(tier.stats().current, 524);
    EXPECT_EQ(tier.stats().peak, 1024) << "the peak is a high-water mark";
    tier.reset_peak();
    EXPECT_EQ(tier.stats().peak, 524) << "reset_peak starts from what is in use";
  }
  EXPECT_EQ(tier.stats().current, 0) << "buffers free their bytes when they go";
}

TEST_P(MemoryTierTest, BuffersMoveWithoutDoubleFreeing) {
  MemoryTier tier(Tier::Host, 0, backend());
  Buffer a = tier.alloc(64, "a");
  float* p = a.f32();
  Buffer b = std::move(a);
  EXPECT_FALSE(a);
  EXPECT_EQ(b.f32(), p);
  EXPECT_EQ(b.bytes(), 64);
  Buffer c = tier.alloc(32, "c");
  c = std::move(b);  // frees c's 32 bytes, takes b's 64
  EXPECT_EQ(tier.stats().current, 64);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(c.data()) % 64, 0u) << "aligned to a cache line";
}

TEST_P(MemoryTierTest, ZeroedAndEmptyAllocations) {
  MemoryTier tier(Tier::Device, 0, backend());
  Buffer z = tier.alloc_zeroed(4096, "z");
  for (int k = 0; k < 1024; ++k) ASSERT_EQ(z.f32()[k], 0.0f);
  Buffer e = tier.alloc(0, "empty");
  EXPECT_TRUE(e) << "a zero-byte buffer still has an address";
  EXPECT_EQ(tier.stats().current, 4096);
}

TEST_P(MemoryTierTest, OverBudgetNamesTheBytesAskedInUseAndTheBudget) {
  MemoryTier tier(Tier::Device, 1000, backend());
  Buffer a = tier.alloc(600, "first");
  EXPECT_ERROR_WITH(tier.alloc(401, "blocks.3 subseq 2 q"), "[memory]", "device memory budget exceeded",
                    "blocks.3 subseq 2 q asks 401 B (401 B)", "with 600 B in use", "budget of 1000 B",
                    "--subseqs", "--device-memory");
  EXPECT_EQ(tier.stats().current, 600) << "a refused allocation holds nothing";
  Buffer b = tier.alloc(400, "exactly the rest");
  EXPECT_EQ(tier.stats().current, 1000);
  EXPECT_EQ(tier.stats().peak, 1000);
}

TEST_P(MemoryTierTest, HugeRequestsDoNotOverflowTheAccounting) {
  MemoryTier budgeted(Tier::Device, 1 << 20, backend());
  Buffer a = budgeted.alloc(1000, "a");
  const i64 huge = std::numeric_limits<i64>::max() - 10;
  EXPECT_ERROR_WITH(budgeted.alloc(huge, "huge"), "huge asks");
  MemoryTier unlimited(Tier::Host, 0, backend());
  Buffer b = unlimited.alloc(1000, "b");
  EXPECT_ERROR_WITH(unlimited.alloc(huge, "huge"), "huge asks", "more than this process can address");
  EXPECT_EQ(unlimited.stats().current, 1000);
}

TEST_P(MemoryTierTest, AllocationWaitsForAnInFlightRelease) {
  MemoryTier tier(Tier::Device, 1000, backend());
  Buffer held = tier.alloc(800, "offloading");
  // A copy stream has taken these bytes to the host and will free them when it completes.
  tier.expect_release(800);
  std::thread copy([&] {
    std::this_thread::sleep_for(50ms);
    held.reset();
    tier.settle(800);
  });
  const auto t0 = std::chrono::steady_clock::now();
  Buffer next = tier.alloc(500, "next subsequence");
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  copy.join();
  EXPECT_TRUE(next);
  EXPECT_GE(waited, 0.03);
  EXPECT_GE(tier.release_wait_s(), 0.03);
  EXPECT_EQ(tier.stats().current, 500);
  EXPECT_EQ(tier.stats().peak, 800) << "the wait kept the tier within its budget";
}

TEST_P(MemoryTierTest, WaitingEndsInAnErrorWhenTheReleaseIsNotEnough) {
  MemoryTier tier(Tier::Device, 1000, backend());
  Buffer stays = tier.alloc(700, "K/V cache");
  Buffer going = tier.alloc(200, "offloading");
  tier.expect_release(200);
  std::thread copy([&] {
    std::this_thread::sleep_for(30ms);
    going.reset();
    tier.settle(200);
  });
  EXPECT_ERROR_WITH(tier.alloc(500, "too big"), "too big asks", "700 B in use", "budget of 1000 B");
  copy.join();
  EXPECT_EQ(tier.stats().current, 700);
}

TEST_P(MemoryTierTest, NothingPendingFailsAtOnce) {
  MemoryTier tier(Tier::Device, 1000, backend());
  Buffer a = tier.alloc(800, "a");
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_ERROR_WITH(tier.alloc(500, "b"), "b asks");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 0.5);
  EXPECT_EQ(tier.release_wait_s(), 0.0);
}

double fake_clock() {
  static double t = 0;
  return t += 1.0;
}

TEST_P(MemoryTierTest, TimelineRecordsEveryChange) {
  MemoryTier tier(Tier::Device, 0, backend());
  Buffer before = tier.alloc(10, "before");
  tier.record_timeline(fake_clock);
  {
    Buffer a = tier.alloc(100, "a");
    Buffer b = tier.alloc(50, "b");
  }
  const auto t = tier.take_timeline();
  tier.record_timeline(nullptr);
  Buffer after = tier.alloc(1, "after");
  EXPECT_TRUE(tier.take_timeline().empty()) << "stopped";
  ASSERT_EQ(t.size(), 5u);  // start, two allocations, two releases
  const i64 bytes[] = {10, 110, 160, 110, 10};
  for (std::size_t k = 0; k < t.size(); ++k) {
    EXPECT_EQ(t[k].second, bytes[k]) << k;
    if (k > 0) {
      EXPECT_GT(t[k].first, t[k - 1].first);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sources, MemoryTierTest, ::testing::Values("heap", "cpu"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace sppo
