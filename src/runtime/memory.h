// Memory tiers with exact byte accounting (docs/design.md 4, docs/design.md, Conventions 4).
//
// Contract: every byte the runtime holds for a step lives in a Buffer allocated from a
// MemoryTier. The device tier has a hard budget: an allocation that would exceed it throws
// sppo::Error naming the bytes asked, the bytes in use and the budget. Accounting counts
// the bytes asked for (what the layout tables and the planner count), current and peak,
// and is thread-safe: copy streams free device memory when an offload completes.
// On the CPU backend both tiers are host memory; the device tier is the budgeted arena
// that stands for a GPU's memory. On CUDA the device tier's bytes are the GPU's.
#pragma once

#include <cstddef>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/dims.h"
#include "backend/backend.h"
#include "core/layout.h"

namespace sppo {

// The bytes of `count` fp32 values.
inline std::size_t fp32_bytes(i64 count) { return std::size_t(count) * sizeof(float); }

class MemoryTier;

// Owning handle of one allocation; move-only, frees on destruction.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { reset(); }

  void reset();
  float* f32() const { return static_cast<float*>(data_); }
  void* data() const { return data_; }
  i64 bytes() const { return bytes_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  friend class MemoryTier;
  MemoryTier* tier_ = nullptr;
  void* data_ = nullptr;
  i64 bytes_ = 0;
};

struct MemoryStats {
  i64 current = 0;
  i64 peak = 0;
};

class MemoryTier {
 public:
  // budget 0 means unlimited. The bytes come from the backend's device or host memory
  // (backend/backend.h); without one, from the heap.
  MemoryTier(Tier tier, i64 budget, Backend* backend = nullptr);
  MemoryTier(const MemoryTier&) = delete;
  MemoryTier& operator=(const MemoryTier&) = delete;
  ~MemoryTier();

  // `what` names the tensor in the over-budget error.
  Buffer alloc(i64 bytes, const std::string& what);
  Buffer alloc_zeroed(i64 bytes, const std::string& what);

  MemoryStats stats() const;
  void reset_peak();

  // Bytes that copies in flight will release (an offload frees its device bytes when its
  // copy completes). An allocation that would exceed the budget first waits for those
  // releases, as a GPU allocator synchronises with its streams before giving up; only
  // when none is pending does it fail. The copy calls settle() after freeing.
  void expect_release(i64 bytes);
  void settle(i64 bytes);
  // Seconds allocations spent waiting for releases since the last reset_peak().
  double release_wait_s() const;

  // Called (on the allocating thread, without the tier's lock) when an allocation would
  // exceed the budget: it may wait for something that frees device bytes (a message being
  // sent) and returns whether it did. Null: none.
  void set_reclaimer(std::function<bool()> reclaim) { reclaim_ = std::move(reclaim); }

  // Records (clock(), bytes in use) at every allocation and release until stopped, for
  // the memory row of a trace. clock null stops recording.
  void record_timeline(double (*clock)());
  std::vector<std::pair<double, i64>> take_timeline();
  i64 budget() const { return budget_; }
  Tier tier() const { return tier_; }

 private:
  friend class Buffer;
  void release(void* p, i64 bytes);
  void* raw_alloc(std::size_t bytes);
  void raw_free(void* p);

  Tier tier_;
  i64 budget_;
  Backend* backend_;
  mutable std::mutex mu_;
  std::condition_variable released_;
  MemoryStats stats_;
  i64 pending_release_ = 0;
  double (*clock_)() = nullptr;
  std::vector<std::pair<double, i64>> timeline_;
  double release_wait_s_ = 0;
  std::function<bool()> reclaim_;
};

}  // namespace sppo
