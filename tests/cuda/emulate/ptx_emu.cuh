// The emulated replacement of src/backends/cuda/ptx.cuh (tests/cuda/emulate): the same functions,
// with the semantics of the PTX ISA (Note [mma fragments] in attention_tc.cu), on emu.h's warps.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "backends/cuda/common.cuh"

namespace sppo::cuda {
namespace emu_ptx {

inline void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "emu: %s (block %u thread %u)\n", what, blockIdx.x, threadIdx.x);
    std::abort();
  }
}
inline bool in_smem(const void* p, std::size_t n) {
  const auto* c = static_cast<const unsigned char*>(p);
  return c >= ::emu::g_smem && c + n <= ::emu::g_smem + ::emu::kSmemBytes;
}
inline float bf16_lo(std::uint32_t w) {
  return __bfloat162float(__nv_bfloat16{static_cast<std::uint16_t>(w & 0xffffu)});
}
inline float bf16_hi(std::uint32_t w) {
  return __bfloat162float(__nv_bfloat16{static_cast<std::uint16_t>(w >> 16)});
}

}  // namespace emu_ptx

inline void cp_async16(void* dst, const void* src, bool valid) {
  emu_ptx::require(reinterpret_cast<std::uintptr_t>(dst) % 16 == 0 && emu_ptx::in_smem(dst, 16),
                   "cp.async: destination not 16-byte aligned shared memory");
  ::emu::PendingCopy c{dst, {}};
  if (valid) {
    emu_ptx::require(reinterpret_cast<std::uintptr_t>(src) % 16 == 0,
                     "cp.async: source not 16-byte aligned");
    std::memcpy(c.data, src, 16);
  }
  ::emu::g_async[threadIdx.x].open.push_back(c);
}
inline void cp_async_commit() {
  auto& a = ::emu::g_async[threadIdx.x];
  a.groups.push_back(std::move(a.open));
  a.open.clear();
}
template <int N>
inline void cp_async_wait() {
  auto& a = ::emu::g_async[threadIdx.x];
  while (a.groups.size() > static_cast<std::size_t>(N)) {
    for (const auto& c : a.groups.front()) std::memcpy(c.dst, c.data, 16);
    a.groups.erase(a.groups.begin());
  }
}

// D = A B + C for the warp's m16n8k16 fragments, from the fragment layout of the PTX ISA.
inline void mma_16816(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                      std::uint32_t b1) {
  struct Frag {
    std::uint32_t a[4], b[2];
    float c[4];
  };
  const Frag mine{{a[0], a[1], a[2], a[3]}, {b0, b1}, {c[0], c[1], c[2], c[3]}};
  const ::emu::Slot* s = ::emu::warp_gather(mine);
  float A[16][16], B[16][8], C[16][8];
  for (int l = 0; l < 32; ++l) {
    const Frag f = ::emu::slot_value<Frag>(s, l);
    const int g = l >> 2, q = l & 3;
    A[g][2 * q] = emu_ptx::bf16_lo(f.a[0]);
    A[g][2 * q + 1] = emu_ptx::bf16_hi(f.a[0]);
    A[g + 8][2 * q] = emu_ptx::bf16_lo(f.a[1]);
    A[g + 8][2 * q + 1] = emu_ptx::bf16_hi(f.a[1]);
    A[g][2 * q + 8] = emu_ptx::bf16_lo(f.a[2]);
    A[g][2 * q + 9] = emu_ptx::bf16_hi(f.a[2]);
    A[g + 8][2 * q + 8] = emu_ptx::bf16_lo(f.a[3]);
    A[g + 8][2 * q + 9] = emu_ptx::bf16_hi(f.a[3]);
    B[2 * q][g] = emu_ptx::bf16_lo(f.b[0]);
    B[2 * q + 1][g] = emu_ptx::bf16_hi(f.b[0]);
    B[2 * q + 8][g] = emu_ptx::bf16_lo(f.b[1]);
    B[2 * q + 9][g] = emu_ptx::bf16_hi(f.b[1]);
    C[g][2 * q] = f.c[0];
    C[g][2 * q + 1] = f.c[1];
    C[g + 8][2 * q] = f.c[2];
    C[g + 8][2 * q + 1] = f.c[3];
  }
  const int l = ::emu::lane_id(), g = l >> 2, q = l & 3;
  for (int e = 0; e < 4; ++e) {
    const int r = g + (e >> 1) * 8, col = 2 * q + (e & 1);
    double acc = C[r][col];
    for (int k = 0; k < 16; ++k) acc += static_cast<double>(A[r][k]) * B[k][col];
    c[e] = static_cast<float>(acc);
  }
  ::emu::warp_barrier();
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: lanes 8i .. 8i+7 give the row addresses of matrix
// i; lane l receives (M_i[g][2q], M_i[g][2q + 1]), g = l / 4, q = l % 4.
inline void ldsm_x4(std::uint32_t (&r)[4], const bf16* p) {
  emu_ptx::require(reinterpret_cast<std::uintptr_t>(p) % 16 == 0 && emu_ptx::in_smem(p, 16),
                   "ldmatrix: row address not 16-byte aligned shared memory");
  const ::emu::Slot* s = ::emu::warp_gather(p);
  const int l = ::emu::lane_id(), g = l >> 2, q = l & 3;
  for (int i = 0; i < 4; ++i) {
    const bf16* row = ::emu::slot_value<const bf16*>(s, 8 * i + g);
    r[i] = std::uint32_t{row[2 * q].x} | std::uint32_t{row[2 * q + 1].x} << 16;
  }
  ::emu::warp_barrier();
}

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: lanes 8i .. 8i+7 give the row addresses of
// matrix i; lane l receives (M_i[2q][g], M_i[2q + 1][g]), g = l / 4, q = l % 4.
inline void ldsm_x4_trans(std::uint32_t (&r)[4], const bf16* p) {
  emu_ptx::require(reinterpret_cast<std::uintptr_t>(p) % 16 == 0 && emu_ptx::in_smem(p, 16),
                   "ldmatrix: row address not 16-byte aligned shared memory");
  const ::emu::Slot* s = ::emu::warp_gather(p);
  const int l = ::emu::lane_id(), g = l >> 2, q = l & 3;
  for (int i = 0; i < 4; ++i) {
    const bf16* row0 = ::emu::slot_value<const bf16*>(s, 8 * i + 2 * q);
    const bf16* row1 = ::emu::slot_value<const bf16*>(s, 8 * i + 2 * q + 1);
    r[i] = std::uint32_t{row0[g].x} | std::uint32_t{row1[g].x} << 16;
  }
  ::emu::warp_barrier();
}

inline std::uint32_t pack_bf16(float lo, float hi) {
  return std::uint32_t{__float2bfloat16_rn(lo).x} | std::uint32_t{__float2bfloat16_rn(hi).x} << 16;
}

}  // namespace sppo::cuda
