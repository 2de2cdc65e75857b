// Test helper for the collectives of comm/comm.h: buffers of random elements of each type
// (never zero), their elements as bits, and the sums a transport may produce. A sum of more
// than two floating-point operands depends on the order the transport combines them in, so
// the reference is every order: for three members, which pair is added first. Integers wrap
// (u8 modulo 256); bf16 adds each pair in fp32 and rounds to nearest even.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "comm/comm.h"

namespace sppo::testing {

inline std::uint16_t to_bf16(float f) {  // round to nearest even (operands here are finite)
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return std::uint16_t(u >> 16);
}

inline float from_bf16(std::uint16_t b) {
  const std::uint32_t u = std::uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// `n` elements of one type, as bytes.
class Elements {
 public:
  Elements(comm::Type type, i64 n) : type_(type), bytes_(std::size_t(n * comm::type_bytes(type)) + 1) {}
  comm::Type type() const { return type_; }
  i64 size() const { return i64(bytes_.size() - 1) / comm::type_bytes(type_); }
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  // Element i's bits (zero-extended), and back.
  std::uint64_t at(i64 i) const {
    std::uint64_t v = 0;
    std::memcpy(&v, bytes_.data() + i * comm::type_bytes(type_), std::size_t(comm::type_bytes(type_)));
    return v;
  }
  void set(i64 i, std::uint64_t v) {
    std::memcpy(bytes_.data() + i * comm::type_bytes(type_), &v, std::size_t(comm::type_bytes(type_)));
  }
  bool operator==(const Elements& o) const { return type_ == o.type_ && bytes_ == o.bytes_; }

 private:
  comm::Type type_;
  std::vector<std::uint8_t> bytes_;  // one byte more: data() of no elements is still a pointer
};

inline std::uint64_t random_element(comm::Type t, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uint64_t v = 0;
  switch (t) {
    case comm::Type::F32: {
      float f;
      do f = float(normal(rng));
      while (f == 0.0f);
      std::memcpy(&v, &f, 4);
      return v;
    }
    case comm::Type::F64: {
      double d;
      do d = normal(rng);
      while (d == 0.0);
      std::memcpy(&v, &d, 8);
      return v;
    }
    case comm::Type::BF16: {
      std::uint16_t b;
      do b = to_bf16(float(normal(rng)));
      while (from_bf16(b) == 0.0f);
      return b;
    }
    case comm::Type::I32: {
      std::uniform_int_distribution<std::int32_t> d(-1000, 999);
      std::int32_t x = d(rng);
      if (x >= 0) ++x;  // never zero
      std::memcpy(&v, &x, 4);
      return v;
    }
    case comm::Type::U8:
      return std::uniform_int_distribution<std::uint64_t>(1, 255)(rng);
  }
  return v;
}

inline Elements random_elements(comm::Type t, i64 n, std::mt19937_64& rng) {
  Elements e(t, n);
  for (i64 i = 0; i < n; ++i) e.set(i, random_element(t, rng));
  return e;
}

// a + b in type t, as bits.
inline std::uint64_t add(comm::Type t, std::uint64_t a, std::uint64_t b) {
  std::uint64_t v = 0;
  switch (t) {
    case comm::Type::F32: {
      float x, y;
      std::memcpy(&x, &a, 4);
      std::memcpy(&y, &b, 4);
      const float s = x + y;
      std::memcpy(&v, &s, 4);
      return v;
    }
    case comm::Type::F64: {
      double x, y;
      std::memcpy(&x, &a, 8);
      std::memcpy(&y, &b, 8);
      const double s = x + y;
      std::memcpy(&v, &s, 8);
      return v;
    }
    case comm::Type::BF16:
      return to_bf16(from_bf16(std::uint16_t(a)) + from_bf16(std::uint16_t(b)));
    case comm::Type::I32:
      return (a + b) & 0xffffffffu;
    case comm::Type::U8:
      return (a + b) & 0xffu;
  }
  return v;
}

// Every sum of the operands (one per member, at most three) a transport may produce.
inline std::vector<std::uint64_t> possible_sums(comm::Type t, const std::vector<std::uint64_t>& x) {
  switch (x.size()) {
    case 1:
      return {x[0]};
    case 2:
      return {add(t, x[0], x[1])};
    case 3:
      return {add(t, add(t, x[0], x[1]), x[2]), add(t, add(t, x[0], x[2]), x[1]), add(t, add(t, x[1], x[2]), x[0])};
  }
  ADD_FAILURE() << "possible_sums of " << x.size() << " operands: the tests use groups of at most 3";
  return {};
}

// An element as a reader wants it in a failure's message.
inline std::string show(comm::Type t, std::uint64_t v) {
  std::ostringstream os;
  switch (t) {
    case comm::Type::F32: {
      float f;
      std::memcpy(&f, &v, 4);
      os << f;
      break;
    }
    case comm::Type::F64: {
      double d;
      std::memcpy(&d, &v, 8);
      os << d;
      break;
    }
    case comm::Type::BF16:
      os << from_bf16(std::uint16_t(v)) << " (bf16)";
      break;
    case comm::Type::I32:
      os << std::int32_t(std::uint32_t(v));
      break;
    case comm::Type::U8:
      os << v;
      break;
  }
  return os.str();
}

inline const std::vector<comm::Type>& every_type() {
  static const std::vector<comm::Type> types{comm::Type::F32, comm::Type::F64, comm::Type::BF16, comm::Type::I32,
                                             comm::Type::U8};
  return types;
}

}  // namespace sppo::testing
