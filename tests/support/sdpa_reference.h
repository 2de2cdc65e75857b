// Test helper: a fused attention library's call (cuDNN's SDPA on one sequence) computed
// naively in float64, with the semantics its documentation gives: Q [rows] of Z heads
// against K, V [keys] of Zkv heads (query head z reads key/value head z / (Z / Zkv)),
// scores scaled by `scale`, mask None or BottomRight (row i sees keys [0, keys - rows + i]);
// the forward gives O and Stats = the natural log-sum-exp of each row's scaled scores; the
// backward, from O, dO and Stats, OVERWRITES dQ, dK, dV (dK, dV summed over the query heads
// of a group), with rowsum(dO * O) as the softmax's backward term. Elements are read and
// written through callables, so that fp32 and bf16 storage share one reference.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "backend/attention_pieces.h"

namespace sppo::testing {

struct SdpaRefShape {
  int rows = 0, keys = 0, Z = 0, Zkv = 0, A = 0;
  PieceMask mask = PieceMask::None;
  double scale = 1;
  bool sees(int i, int j) const { return mask == PieceMask::None || j <= keys - rows + i; }
};

// get(tensor, row, head, col) -> double; put(tensor, row, head, col, value); tensors: 'q',
// 'k', 'v', 'o', 'd' (dO); stats(row, head) -> double; put_stats(row, head, value).
template <typename Get, typename Put, typename PutStats>
void sdpa_reference_forward(const SdpaRefShape& s, Get get, Put put, PutStats put_stats) {
  const int group = s.Z / s.Zkv;
  std::vector<double> p(static_cast<std::size_t>(s.keys));
  for (int z = 0; z < s.Z; ++z) {
    const int g = z / group;
    for (int i = 0; i < s.rows; ++i) {
      double mx = -std::numeric_limits<double>::infinity();
      for (int j = 0; j < s.keys; ++j) {
        if (!s.sees(i, j)) continue;
        double dot = 0;
        for (int a = 0; a < s.A; ++a) dot += get('q', i, z, a) * get('k', j, g, a);
        p[std::size_t(j)] = dot * s.scale;
        mx = std::max(mx, p[std::size_t(j)]);
      }
      double sum = 0;
      for (int j = 0; j < s.keys; ++j)
        if (s.sees(i, j)) sum += std::exp(p[std::size_t(j)] - mx);
      for (int a = 0; a < s.A; ++a) {
        double o = 0;
        for (int j = 0; j < s.keys; ++j)
          if (s.sees(i, j)) o += std::exp(p[std::size_t(j)] - mx) / sum * get('v', j, g, a);
        put('o', i, z, a, o);
      }
      put_stats(i, z, mx + std::log(sum));
    }
  }
}

template <typename Get, typename Stats, typename Put>
void sdpa_reference_backward(const SdpaRefShape& s, Get get, Stats stats, Put put) {
  const int group = s.Z / s.Zkv;
  std::vector<double> dq(std::size_t(s.rows) * s.Z * s.A, 0.0), dk(std::size_t(s.keys) * s.Zkv * s.A, 0.0),
      dv(std::size_t(s.keys) * s.Zkv * s.A, 0.0);
  for (int z = 0; z < s.Z; ++z) {
    const int g = z / group;
    for (int i = 0; i < s.rows; ++i) {
      double delta = 0;
      for (int a = 0; a < s.A; ++a) delta += get('d', i, z, a) * get('o', i, z, a);
      for (int j = 0; j < s.keys; ++j) {
        if (!s.sees(i, j)) continue;
        double dot = 0, dp = 0;
        for (int a = 0; a < s.A; ++a) {
          dot += get('q', i, z, a) * get('k', j, g, a);
          dp += get('d', i, z, a) * get('v', j, g, a);
        }
        const double pr = std::exp(dot * s.scale - stats(i, z));
        const double ds = pr * (dp - delta) * s.scale;
        for (int a = 0; a < s.A; ++a) {
          dq[(std::size_t(i) * s.Z + z) * s.A + a] += ds * get('k', j, g, a);
          dk[(std::size_t(j) * s.Zkv + g) * s.A + a] += ds * get('q', i, z, a);
          dv[(std::size_t(j) * s.Zkv + g) * s.A + a] += pr * get('d', i, z, a);
        }
      }
    }
  }
  for (int i = 0; i < s.rows; ++i)
    for (int z = 0; z < s.Z; ++z)
      for (int a = 0; a < s.A; ++a) put('q', i, z, a, dq[(std::size_t(i) * s.Z + z) * s.A + a]);
  for (int j = 0; j < s.keys; ++j)
    for (int g = 0; g < s.Zkv; ++g)
      for (int a = 0; a < s.A; ++a) {
        put('k', j, g, a, dk[(std::size_t(j) * s.Zkv + g) * s.A + a]);
        put('v', j, g, a, dv[(std::size_t(j) * s.Zkv + g) * s.A + a]);
      }
}

}  // namespace sppo::testing
