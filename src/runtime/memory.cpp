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

MemoryTier::MemoryTier(Tier tier, i64 budget, Backend* backend) : tier_(tier), budget_(budget), backend_(backend) {
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
  // Written as a difference so that no byte count can overflow: current <= budget always.
  // Called with mu_ held.
  auto fits = [&] { return budget_ == 0 || bytes <= budget_ - stats_.current; };
  while (reclaim_) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (fits()) break;
    }
    if (!reclaim_()) break;
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!fits() && pending_release_ > 0) {
      const auto t0 = std::chrono::steady_clock::now();
      released_.wait(lock, [&] { return fits() || pending_release_ == 0; });
      release_wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    SPPO_CHECK_FITS(bytes <= kMaxAllocBytes - stats_.current, "memory")
        << what << " asks " << bytes << " B with " << stats_.current
        << " B in use, more than this process can address; use a shorter --seq-len or a smaller model";
    SPPO_CHECK_FITS(fits(), "memory")
        << (tier_ == Tier::Device ? "device" : "host") << " memory budget exceeded: "
        << what << " asks " << format_bytes(double(bytes)) << " (" << bytes << " B) with "
        << format_bytes(double(stats_.current)) << " in use of a budget of "
        << format_bytes(double(budget_))
        << (tier_ == Tier::Device ? "; use more subsequences (--subseqs), offload more (--offload full), or a larger "
                                    "--device-memory"
                                  : "; offload less (a lower --offload ratio, with more --device-memory), or a larger "
                                    "--host-memory");
    stats_.current += bytes;
    if (stats_.current > stats_.peak) stats_.peak = stats_.current;
    if (clock_) timeline_.emplace_back(clock_(), stats_.current);
  }
  void* p = raw_alloc(std::size_t(bytes));
  if (!p) {
    release(nullptr, bytes);
    SPPO_CHECK_FITS(false, "memory") << "out of " << (tier_ == Tier::Device ? "device" : "host") << " memory allocating "
                                     << format_bytes(double(bytes)) << " for " << what;
  }
  Buffer b;
  b.tier_ = this;
  b.data_ = p;
  b.bytes_ = bytes;
  return b;
}

Buffer MemoryTier::alloc_zeroed(i64 bytes, const std::string& what) {
  Buffer b = alloc(bytes, what);
  if (backend_ && tier_ == Tier::Device) backend_->fill_zero(b.data(), std::size_t(bytes));
  else std::memset(b.data(), 0, std::size_t(bytes));
  return b;
}

void* MemoryTier::raw_alloc(std::size_t bytes) {
  if (backend_) return tier_ == Tier::Device ? backend_->device_alloc(bytes) : backend_->host_alloc(bytes);
  const std::size_t rounded = (bytes + kAlignBytes - 1) / kAlignBytes * kAlignBytes;
  return std::aligned_alloc(kAlignBytes, rounded == 0 ? kAlignBytes : rounded);
}

void MemoryTier::raw_free(void* p) {
  if (!p) return;
  if (!backend_) std::free(p);
  else if (tier_ == Tier::Device) backend_->device_free(p);
  else backend_->host_free(p);
}

void MemoryTier::release(void* p, i64 bytes) {
  raw_free(p);
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
