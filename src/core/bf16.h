// bfloat16 on the host, rounded as the engine rounds it everywhere: to nearest even, as
// torch's float -> bfloat16 and the CUDA kernels' __float2bfloat16_rn; a NaN stays a quiet
// NaN. Used where bf16 is read or written outside the kernels: Hugging Face weights
// (io/hf.cpp) and MPI's bf16 sum (comm/mpi/mpi_comm.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace sppo {

inline float bf16_to_float(std::uint16_t h) {
  const std::uint32_t bits = std::uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline std::uint16_t float_to_bf16(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return std::uint16_t((bits >> 16) | 0x40);
  bits += 0x7fff + ((bits >> 16) & 1);
  return std::uint16_t(bits >> 16);
}

}  // namespace sppo
