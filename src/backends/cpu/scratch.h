// Scratch memory for kernel calls, carved by the caller from its budgeted device tier, so
// that the budget covers kernel workspaces too (a kernel called without one allocates its
// own). Each kernel that needs scratch states how much as a KernelScratch (core/layout.h):
// bytes = fixed + per token x T, an upper bound of what it takes for T rows, so that the
// runtime and the simulator size the same buffer to the byte.
//
// Taking is thread-safe: the OpenMP threads of a kernel take their buffers at the start of
// its parallel region. The owner resets it between kernel calls. Taking more than the size
// is a bug in a size function and aborts.
#pragma once

#include <atomic>
#include <cstddef>

#include "core/layout.h"

namespace sppo::cpu {

class Scratch {
 public:
  Scratch(void* base, std::size_t bytes) : base_(static_cast<char*>(base)), bytes_(bytes) {}
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  // n elements, 64-byte aligned, uninitialised.
  float* floats(std::size_t n) { return static_cast<float*>(take(n * sizeof(float))); }
  double* doubles(std::size_t n) { return static_cast<double*>(take(n * sizeof(double))); }
  void reset() { used_ = 0; }
  std::size_t size() const { return bytes_; }

  // What taking n bytes costs, alignment included (the size functions sum these).
  static constexpr std::size_t cost(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
  static constexpr std::size_t kAlign = 64;

 private:
  void* take(std::size_t n);

  char* base_;
  std::size_t bytes_;
  std::atomic<std::size_t> used_{0};
};

// The larger of two scratch bounds (for kernels that run one after another on one buffer).
KernelScratch max(const KernelScratch& a, const KernelScratch& b);

}  // namespace sppo::cpu
