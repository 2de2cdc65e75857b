// Emulated bf16 (tests/cuda/emulate): the storage and the round-to-nearest-even conversions.
#pragma once

#include <cstdint>
#include <cstring>

#include "cuda_runtime_api.h"

struct __nv_bfloat16 {
  std::uint16_t x;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return __nv_bfloat16{static_cast<std::uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{static_cast<std::uint16_t>(u >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 b) {
  const std::uint32_t u = std::uint32_t{b.x} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return __nv_bfloat162{__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
inline float2 __bfloat1622float2(__nv_bfloat162 v) {
  return float2{__bfloat162float(v.x), __bfloat162float(v.y)};
}
