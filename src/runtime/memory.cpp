#include "runtime/memory.h"

#include <chrono>
#include <cstdlib>
#include <limits>
#include <malloc.h>
#include <cstring>

#include "core/check.h"
#include "core/config.h"

namespace sppo {

namespace {
constexpr std::size_t kAlignBytes = 64;  // one cache line; AVX-512 loads stay aligned
// Bytes in use never exceed this, so the rounding below and the sums of stats cannot
// overflow (2^62: far beyond any host's memory).
constexpr i64 kMaxAllocBytes = i64{1} << 62;
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    reset();
    tier_ = o.tier_;
    data_ = o.data_;
    bytes_ = o.bytes_;
    o.tier_ = nullptr;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void Buffer::reset() {
  if (data_) tier_->release(data_, bytes_);
  tier_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

MemoryTier::MemoryTier(Tier tier, i64 budget) : tier_(tier), budget_(budget) {
  // Every step allocates and frees the same tensors. Left to glibc's defaults, each large
  // buffer is a fresh mmap whose pages fault in again on first touch every step (and an
  // offload's host copy pays them inside the copy). Keeping freed memory in the heap lets
  // the next step reuse it, already mapped.
  static const bool configured = [] {
    mallopt(M_MMAP_THRESHOLD, 1 << 30);
    mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
    return true;
  }();
  (void)configured;
}

MemoryTier::~MemoryTier() { SPPO_ASSERT_MSG(stats_.current == 0, "memory tier destroyed with " << stats_.current << " bytes still allocated"); }

Buffer MemoryTier::alloc(i64 bytes, const std::string& what) {
  SPPO_ASSERT(bytes >= 0);
  {
    std::unique_lock<std::mutex> lock(mu_);
    // Written as a difference so that no byte count can overflow: current <= budget always.
    auto fits = [&] { return budget_ == 0 || bytes <= budget_ - stats_.current; };
    if (!fits() && pending_release_ > 0) {
      const auto t0 = std::chrono::steady_clock::now();
      released_.wait(lock, [&] { return fits() || pending_release_ == 0; });
      release_wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    SPPO_CHECK(bytes <= kMaxAllocBytes - stats_.current, "memory")
        << what << " asks " << bytes << " B with " << stats_.current
        << " B in use, more than this process can address; use a shorter --seq-len or a smaller model";
    SPPO_CHECK(fits(), "memory")
        << (tier_ == Tier::Device ? "device" : "host") << " memory budget exceeded: "
        << what << " asks " << format_bytes(double(bytes)) << " (" << bytes << " B) with "
        << format_bytes(double(stats_.current)) << " in use of a budget of "
        << format_bytes(double(budget_))
        << "; use more subsequences (--subseqs), offload more (--offload full), or a larger "
           "--device-memory";
    stats_.current += bytes;
    if (stats_.current > stats_.peak) stats_.peak = stats_.current;
    if (clock_) timeline_.emplace_back(clock_(), stats_.current);
  }
  const std::size_t rounded = (std::size_t(bytes) + kAlignBytes - 1) / kAlignBytes * kAlignBytes;
  void* p = std::aligned_alloc(kAlignBytes, rounded == 0 ? kAlignBytes : rounded);
  if (!p) {
    release(nullptr, bytes);
    SPPO_CHECK(false, "memory") << "out of host memory allocating " << format_bytes(double(bytes))
                                << " for " << what;
  }
  Buffer b;
  b.tier_ = this;
  b.data_ = p;
  b.bytes_ = bytes;
  return b;
}

Buffer MemoryTier::alloc_zeroed(i64 bytes, const std::string& what) {
  Buffer b = alloc(bytes, what);
  std::memset(b.data(), 0, std::size_t(bytes));
  return b;
}

void MemoryTier::release(void* p, i64 bytes) {
  std::free(p);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.current -= bytes;
    SPPO_ASSERT(stats_.current >= 0);
    if (clock_) timeline_.emplace_back(clock_(), stats_.current);
  }
  released_.notify_all();
}

void MemoryTier::record_timeline(double (*clock)()) {
  std::lock_guard<std::mutex> lock(mu_);
  clock_ = clock;
  timeline_.clear();
  if (clock_) timeline_.emplace_back(clock_(), stats_.current);
}

std::vector<std::pair<double, i64>> MemoryTier::take_timeline() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::move(timeline_);
}

MemoryStats MemoryTier::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void MemoryTier::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak = stats_.current;
  release_wait_s_ = 0;
}

void MemoryTier::expect_release(i64 bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_release_ += bytes;
}

void MemoryTier::settle(i64 bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_release_ -= bytes;
    SPPO_ASSERT(pending_release_ >= 0);
  }
  released_.notify_all();
}

double MemoryTier::release_wait_s() const {
  std::lock_guard<std::mutex> lock(mu_);
  return release_wait_s_;
}

}  // namespace sppo
