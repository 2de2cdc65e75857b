// A CPU emulation of the CUDA execution model, enough to run this project's kernels unchanged on
// a machine without a GPU (tests/cuda/emulate/run.sh). Every block runs alone; its threads are
// fibers (ucontext) switched only at barriers, so one OS thread runs everything in a fixed order.
//   __syncthreads()      waits for every live thread of the block
//   warp collectives     (__shfl_xor_sync, __syncwarp, and the mma / ldmatrix of ptx_emu.cuh)
//                        wait for every live thread of the warp, then see each other's values
// A barrier that can never complete (threads waiting on different barriers) aborts with a
// message: that is the divergent-barrier bug a GPU would hang or misbehave on.
// Shared memory: `extern __shared__` buffers are emu::g_smem (run.sh rewrites the declaration);
// static `__shared__` arrays become function statics, shared by the block's threads.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda_bf16.h"
#include "cuda_runtime_api.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static

namespace emu {

enum class State { Runnable, WaitBlock, WaitWarp, Done };

struct Fiber {
  ucontext_t ctx;
  State state = State::Runnable;
  uint3 tid;
};

// The fibers' stacks, kept from launch to launch: allocated and zeroed afresh for each
// launch (512 KiB a thread), they made most of the tests' time system time, in page faults.
inline constexpr std::size_t kStackBytes = 512 * 1024;
inline std::vector<std::unique_ptr<char[]>> g_stacks;

inline constexpr std::size_t kSmemBytes = 256 * 1024;
alignas(16) inline unsigned char g_smem[kSmemBytes];
inline uint3 g_tid, g_bid;
inline dim3 g_block, g_grid;
inline std::vector<Fiber>* g_fibers = nullptr;
inline int g_cur = -1;
inline ucontext_t g_sched;

inline void yield_to_scheduler() {
  Fiber& f = (*g_fibers)[g_cur];
  swapcontext(&f.ctx, &g_sched);
}

inline void block_barrier() {
  (*g_fibers)[g_cur].state = State::WaitBlock;
  yield_to_scheduler();
}

inline void warp_barrier() {
  (*g_fibers)[g_cur].state = State::WaitWarp;
  yield_to_scheduler();
}

inline int lane_id() { return static_cast<int>(g_tid.x % 32); }
inline int warp_id() { return static_cast<int>(g_tid.x / 32); }

// Per-warp exchange slots: each lane writes its value, all lanes read any of them.
struct alignas(16) Slot {
  unsigned char bytes[256];
};
inline std::vector<Slot> g_slots;  // [threads]

// cp.async emulated asynchronously: copies are captured when issued and land in shared memory
// only when a cp.async.wait_group retires their group, so a read before the wait sees stale data.
struct PendingCopy {
  void* dst;
  unsigned char data[16];
};
struct AsyncCopies {
  std::vector<PendingCopy> open;
  std::vector<std::vector<PendingCopy>> groups;
};
inline std::vector<AsyncCopies> g_async;  // [threads]

// Publishes `mine`, waits for the warp, and returns a pointer to lane 0's slot; slot of lane l
// is at index l. Valid until the caller's next warp_barrier().
template <typename T>
const Slot* warp_gather(const T& mine) {
  static_assert(sizeof(T) <= sizeof(Slot), "slot too small");
  std::memcpy(g_slots[g_tid.x].bytes, &mine, sizeof(T));
  warp_barrier();
  return &g_slots[static_cast<std::size_t>(warp_id()) * 32];
}

template <typename T>
T slot_value(const Slot* s, int lane) {
  T v;
  std::memcpy(&v, s[lane].bytes, sizeof(T));
  return v;
}

template <typename F, typename... Args>
struct Entry {
  F* kernel;
  std::tuple<Args...> args;
};

template <typename E>
void fiber_main(unsigned lo, unsigned hi) {
  const auto* e = reinterpret_cast<const E*>((std::uintptr_t(hi) << 32) | lo);
  std::apply(e->kernel, e->args);
  (*g_fibers)[g_cur].state = State::Done;
  swapcontext(&(*g_fibers)[g_cur].ctx, &g_sched);
}

// Runs kernel<<<grid, block, smem>>>(args...) to completion, block after block (those
// g_run_block takes, when set). A grid or block past CUDA's limits (2^31 - 1 blocks along x,
// 65535 along y and z, 1024 threads) runs nothing and sets g_launch_error, as CUDA refuses it.
template <typename... P, typename... Args>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t,
            Args&&... args) {
  const unsigned long long block_threads = 1ull * block.x * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 2147483647u || grid.y > 65535u ||
      grid.z > 65535u || block_threads == 0 || block_threads > 1024 || block.z > 64) {
    g_launch_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (smem > kSmemBytes) {
    std::fprintf(stderr, "emu: %zu bytes of dynamic shared memory asked, %zu emulated\n", smem,
                 kSmemBytes);
    std::abort();
  }
  using E = Entry<void(P...), std::decay_t<P>...>;
  const E entry{kernel, std::tuple<std::decay_t<P>...>(std::forward<Args>(args)...)};
  const unsigned threads = block.x * block.y * block.z;
  g_block = block;
  g_grid = grid;
  g_slots.assign(threads + 32, Slot{});
  std::vector<Fiber> fibers(threads);
  while (g_stacks.size() < threads) g_stacks.push_back(std::make_unique<char[]>(kStackBytes));
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        g_bid = uint3{bx, by, bz};
        if (g_run_block && !g_run_block(grid, block, g_bid)) continue;
        std::memset(g_smem, 0xA5, smem);  // stale data, never zeros
        g_fibers = &fibers;
        g_async.assign(threads, AsyncCopies{});
        for (unsigned t = 0; t < threads; ++t) {
          Fiber& f = fibers[t];
          f.state = State::Runnable;
          f.tid = uint3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = g_stacks[t].get();
          f.ctx.uc_stack.ss_size = kStackBytes;
          f.ctx.uc_link = nullptr;
          const auto ptr = reinterpret_cast<std::uintptr_t>(&entry);
          makecontext(&f.ctx, reinterpret_cast<void (*)()>(&fiber_main<E>), 2,
                      static_cast<unsigned>(ptr & 0xffffffffu), static_cast<unsigned>(ptr >> 32));
        }
        for (;;) {
          bool ran = false;
          for (unsigned t = 0; t < threads; ++t) {
            if (fibers[t].state != State::Runnable) continue;
            ran = true;
            g_cur = static_cast<int>(t);
            g_tid = fibers[t].tid;
            swapcontext(&g_sched, &fibers[t].ctx);
          }
          if (ran) continue;
          // Nothing runnable: release a complete barrier, or stop.
          bool all_done = true, released = false;
          unsigned live = 0, at_block = 0;
          for (const Fiber& f : fibers) {
            if (f.state != State::Done) all_done = false, ++live;
            if (f.state == State::WaitBlock) ++at_block;
          }
          if (all_done) break;
          if (at_block == live) {
            for (Fiber& f : fibers)
              if (f.state == State::WaitBlock) f.state = State::Runnable;
            released = true;
          }
          for (unsigned w = 0; w * 32 < threads && !released; ++w) {
            unsigned wlive = 0, at_warp = 0;
            for (unsigned t = w * 32; t < std::min(threads, w * 32 + 32); ++t) {
              if (fibers[t].state != State::Done) ++wlive;
              if (fibers[t].state == State::WaitWarp) ++at_warp;
            }
            if (wlive > 0 && at_warp == wlive) {
              for (unsigned t = w * 32; t < std::min(threads, w * 32 + 32); ++t)
                fibers[t].state = State::Runnable;
              released = true;
            }
          }
          if (!released) {
            std::fprintf(
                stderr, "emu: deadlock in block (%u, %u, %u): threads wait on different barriers\n",
                bx, by, bz);
            std::abort();
          }
        }
        g_fibers = nullptr;
      }
}

}  // namespace emu

#define threadIdx (::emu::g_tid)
#define blockIdx (::emu::g_bid)
#define blockDim (::emu::g_block)
#define gridDim (::emu::g_grid)

inline void __syncthreads() { ::emu::block_barrier(); }
inline void __syncwarp(unsigned = 0xffffffffu) { ::emu::warp_barrier(); }
[[noreturn]] inline void __trap() {
  std::fprintf(stderr, "emu: __trap() in block %u thread %u\n", blockIdx.x, threadIdx.x);
  std::abort();
}

template <typename T>
T __shfl_xor_sync(unsigned, T value, int lane_mask) {
  const emu::Slot* s = emu::warp_gather(value);
  const T v = emu::slot_value<T>(s, emu::lane_id() ^ lane_mask);
  emu::warp_barrier();
  return v;
}

template <typename T>
T min(T a, T b) {
  return b < a ? b : a;
}
template <typename T>
T max(T a, T b) {
  return a < b ? b : a;
}
