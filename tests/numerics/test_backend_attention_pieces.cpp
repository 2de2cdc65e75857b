// Note [Attention pieces] (backend/attention_pieces.h) against the attention it stands for:
// every (query, key) pair a call's positions make visible lies in exactly one piece, under
// that piece's mask; and the attention computed piece by piece with a fused library's
// semantics (tests/support/sdpa_reference.h, float64), merged by log-sum-exp, and its
// backward run piece by piece from the final output's delta and log-sum-exp (the CUDA
// backend's way: Note [The library's backward from delta] in
// backends/cuda/library_attention.cpp) equal a naive float64 attention over the
// positions, on fresh random inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "backend/attention_pieces.h"
#include "support/sdpa_reference.h"

namespace sppo {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Call {
  int Tq = 0, Z = 0, Zkv = 0, A = 0;
  i64 q_pos0 = 0;
  std::vector<KeySpan> blocks;
};

// Query t sees key s of block b.
bool visible(const Call& c, int t, int b, int s) { return c.blocks[std::size_t(b)].pos0 + s <= c.q_pos0 + t; }

Call random_call(std::mt19937& rng) {
  std::uniform_int_distribution<int> n(1, 12), blocks(1, 4), shift(-14, 14);
  Call c;
  c.Tq = n(rng);
  c.q_pos0 = 40;
  const int nb = blocks(rng);
  for (int b = 0; b < nb; ++b) {
    // Blocks before, around, over and after the queries, of any length.
    c.blocks.push_back({n(rng), c.q_pos0 + shift(rng)});
  }
  return c;
}

TEST(AttentionPieces, EveryVisiblePairIsInExactlyOnePieceUnderItsMask) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 3000; ++trial) {
    const Call c = random_call(rng);
    const std::vector<AttnPiece> pieces = attention_pieces(c.Tq, c.q_pos0, c.blocks);
    std::vector<std::vector<std::vector<int>>> hits(std::size_t(c.Tq));
    for (auto& row : hits) {
      row.resize(c.blocks.size());
      for (std::size_t b = 0; b < c.blocks.size(); ++b) row[b].assign(std::size_t(c.blocks[b].rows), 0);
    }
    for (const AttnPiece& p : pieces) {
      ASSERT_GT(p.rows, 0);
      ASSERT_GT(p.keys, 0);
      ASSERT_LE(p.keys, c.blocks[std::size_t(p.block)].rows);
      ASSERT_GE(p.q0, 0);
      ASSERT_LE(p.q0 + p.rows, c.Tq);
      if (p.mask == PieceMask::BottomRight) {
        ASSERT_GE(p.keys, p.rows) << "the library refuses rows > keys";
      }
      const testing::SdpaRefShape s{p.rows, p.keys, 1, 1, 1, p.mask, 1};
      for (int i = 0; i < p.rows; ++i) {
        int seen = 0;
        for (int j = 0; j < p.keys; ++j)
          if (s.sees(i, j)) {
            ++hits[std::size_t(p.q0 + i)][std::size_t(p.block)][std::size_t(j)];
            ++seen;
          }
        ASSERT_GT(seen, 0) << "a piece's row sees no key: the library's softmax of it is undefined";
      }
    }
    for (int t = 0; t < c.Tq; ++t)
      for (std::size_t b = 0; b < c.blocks.size(); ++b)
        for (int s = 0; s < c.blocks[b].rows; ++s)
          ASSERT_EQ(hits[std::size_t(t)][b][std::size_t(s)], visible(c, t, int(b), s) ? 1 : 0)
              << "trial " << trial << " query " << t << " block " << b << " key " << s;
  }
}

TEST(AttentionPieces, ASubsequencesOwnBlockAndItsPastAreOnePieceEach) {
  // The SPPO pattern: two earlier blocks, then the queries' own block.
  const auto p = attention_pieces(64, 128, {{64, 0}, {64, 64}, {64, 128}});
  ASSERT_EQ(p.size(), 3u);
  EXPECT_EQ(p[0].mask, PieceMask::None);
  EXPECT_EQ(p[1].mask, PieceMask::None);
  EXPECT_EQ(p[2].mask, PieceMask::BottomRight);
  EXPECT_EQ(p[2].rows, 64);
  EXPECT_EQ(p[2].keys, 64);
  // The prefix and the queries in one buffer: one bottom-right piece (queries last).
  const auto one = attention_pieces(16, 112, {{128, 0}});
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].mask, PieceMask::BottomRight);
  EXPECT_EQ(one[0].keys, 128);
}

// Inputs of a call: q [Tq, Z A], per block k, v [Tk, Zkv A], dout [Tq, Z A].
struct Tensors {
  std::vector<double> q, dout;
  std::vector<std::vector<double>> k, v;
};

Tensors random_tensors(const Call& c, std::mt19937& rng) {
  std::normal_distribution<double> d(0.0, 1.0);
  auto fill = [&](std::size_t n) {
    std::vector<double> x(n);
    for (auto& e : x) e = d(rng);
    return x;
  };
  Tensors t;
  t.q = fill(std::size_t(c.Tq) * c.Z * c.A);
  t.dout = fill(std::size_t(c.Tq) * c.Z * c.A);
  for (const KeySpan& b : c.blocks) {
    t.k.push_back(fill(std::size_t(b.rows) * c.Zkv * c.A));
    t.v.push_back(fill(std::size_t(b.rows) * c.Zkv * c.A));
  }
  return t;
}

struct Result {
  std::vector<double> out, lse, dq;
  std::vector<std::vector<double>> dk, dv;
};

double scale_of(const Call& c) { return 1.0 / std::sqrt(double(c.A)); }

// The attention over the positions, naively.
Result naive(const Call& c, const Tensors& x) {
  const int group = c.Z / c.Zkv;
  const double sc = scale_of(c);
  Result r;
  r.out.assign(x.q.size(), 0.0);
  r.lse.assign(std::size_t(c.Z) * c.Tq, -kInf);
  r.dq.assign(x.q.size(), 0.0);
  for (const auto& k : x.k) {
    r.dk.emplace_back(k.size(), 0.0);
    r.dv.emplace_back(k.size(), 0.0);
  }
  auto at = [&](int row, int head, int width) { return (std::size_t(row) * width + head) * c.A; };
  for (int z = 0; z < c.Z; ++z) {
    const int g = z / group;
    for (int t = 0; t < c.Tq; ++t) {
      std::vector<std::pair<std::pair<int, int>, double>> s;  // ((block, key), score)
      double mx = -kInf;
      for (std::size_t b = 0; b < c.blocks.size(); ++b)
        for (int j = 0; j < c.blocks[b].rows; ++j) {
          if (!visible(c, t, int(b), j)) continue;
          double dot = 0;
          for (int a = 0; a < c.A; ++a) dot += x.q[at(t, z, c.Z) + a] * x.k[b][at(j, g, c.Zkv) + a];
          s.push_back({{int(b), j}, dot * sc});
          mx = std::max(mx, dot * sc);
        }
      if (s.empty()) continue;
      double sum = 0;
      for (const auto& e : s) sum += std::exp(e.second - mx);
      const double lse = mx + std::log(sum);
      r.lse[std::size_t(z) * c.Tq + t] = lse;
      for (const auto& e : s)
        for (int a = 0; a < c.A; ++a)
          r.out[at(t, z, c.Z) + a] += std::exp(e.second - lse) * x.v[std::size_t(e.first.first)][at(e.first.second, g, c.Zkv) + a];
      double delta = 0;
      for (int a = 0; a < c.A; ++a) delta += x.dout[at(t, z, c.Z) + a] * r.out[at(t, z, c.Z) + a];
      for (const auto& e : s) {
        const auto& [b, j] = e.first;
        const double p = std::exp(e.second - lse);
        double dp = 0;
        for (int a = 0; a < c.A; ++a) dp += x.dout[at(t, z, c.Z) + a] * x.v[std::size_t(b)][at(j, g, c.Zkv) + a];
        const double ds = p * (dp - delta) * sc;
        for (int a = 0; a < c.A; ++a) {
          r.dq[at(t, z, c.Z) + a] += ds * x.k[std::size_t(b)][at(j, g, c.Zkv) + a];
          r.dk[std::size_t(b)][at(j, g, c.Zkv) + a] += ds * x.q[at(t, z, c.Z) + a];
          r.dv[std::size_t(b)][at(j, g, c.Zkv) + a] += p * x.dout[at(t, z, c.Z) + a];
        }
      }
    }
  }
  return r;
}

// The same, piece by piece through the library's semantics.
Result by_pieces(const Call& c, const Tensors& x) {
  const std::vector<AttnPiece> pieces = attention_pieces(c.Tq, c.q_pos0, c.blocks);
  auto at = [&](int row, int head, int width) { return (std::size_t(row) * width + head) * c.A; };
  Result r;
  r.out.assign(x.q.size(), 0.0);
  r.lse.assign(std::size_t(c.Z) * c.Tq, -kInf);
  // Forward: each piece on its own, merged into out/lse by log-sum-exp.
  for (const AttnPiece& p : pieces) {
    const testing::SdpaRefShape s{p.rows, p.keys, c.Z, c.Zkv, c.A, p.mask, scale_of(c)};
    std::vector<double> o(std::size_t(p.rows) * c.Z * c.A), st(std::size_t(c.Z) * p.rows);
    const auto& k = x.k[std::size_t(p.block)];
    const auto& v = x.v[std::size_t(p.block)];
    testing::sdpa_reference_forward(
        s,
        [&](char t, int i, int h, int a) {
          if (t == 'q') return x.q[at(p.q0 + i, h, c.Z) + a];
          return (t == 'k' ? k : v)[at(i, h, c.Zkv) + a];
        },
        [&](char, int i, int h, int a, double val) { o[at(i, h, c.Z) + a] = val; },
        [&](int i, int h, double val) { st[std::size_t(h) * p.rows + i] = val; });
    for (int z = 0; z < c.Z; ++z)
      for (int i = 0; i < p.rows; ++i) {
        double& l = r.lse[std::size_t(z) * c.Tq + p.q0 + i];
        const double m = st[std::size_t(z) * p.rows + i], nl = l == -kInf ? m : std::max(l, m) + std::log1p(std::exp(-std::abs(l - m)));
        for (int a = 0; a < c.A; ++a) {
          double& out = r.out[at(p.q0 + i, z, c.Z) + a];
          out = (l == -kInf ? 0.0 : out * std::exp(l - nl)) + o[at(i, z, c.Z) + a] * std::exp(m - nl);
        }
        l = nl;
      }
  }
  // Backward: per piece from a synthetic output whose rowsum with dout is delta.
  r.dq.assign(x.q.size(), 0.0);
  for (const auto& k : x.k) {
    r.dk.emplace_back(k.size(), 0.0);
    r.dv.emplace_back(k.size(), 0.0);
  }
  std::vector<double> synth(x.q.size(), 0.0);
  for (int t = 0; t < c.Tq; ++t)
    for (int z = 0; z < c.Z; ++z) {
      double delta = 0, norm = 0;
      for (int a = 0; a < c.A; ++a) {
        delta += x.dout[at(t, z, c.Z) + a] * r.out[at(t, z, c.Z) + a];
        norm += x.dout[at(t, z, c.Z) + a] * x.dout[at(t, z, c.Z) + a];
      }
      for (int a = 0; a < c.A; ++a) synth[at(t, z, c.Z) + a] = norm > 0 ? x.dout[at(t, z, c.Z) + a] * delta / norm : 0;
    }
  for (const AttnPiece& p : pieces) {
    const testing::SdpaRefShape s{p.rows, p.keys, c.Z, c.Zkv, c.A, p.mask, scale_of(c)};
    const std::size_t b = std::size_t(p.block);
    testing::sdpa_reference_backward(
        s,
        [&](char t, int i, int h, int a) {
          switch (t) {
            case 'q': return x.q[at(p.q0 + i, h, c.Z) + a];
            case 'o': return synth[at(p.q0 + i, h, c.Z) + a];
            case 'd': return x.dout[at(p.q0 + i, h, c.Z) + a];
            case 'k': return x.k[b][at(i, h, c.Zkv) + a];
            default: return x.v[b][at(i, h, c.Zkv) + a];
          }
        },
        [&](int i, int h) { return r.lse[std::size_t(h) * c.Tq + p.q0 + i]; },
        [&](char t, int i, int h, int a, double val) {
          if (t == 'q') r.dq[at(p.q0 + i, h, c.Z) + a] += val;
          else (t == 'k' ? r.dk[b] : r.dv[b])[at(i, h, c.Zkv) + a] += val;
        });
  }
  return r;
}

void expect_near(const std::vector<double>& got, const std::vector<double>& ref, const char* what, int trial) {
  ASSERT_EQ(got.size(), ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (ref[i] == -kInf) {
      ASSERT_EQ(got[i], -kInf) << what << " " << i << " trial " << trial;
      continue;
    }
    ASSERT_NEAR(got[i], ref[i], 1e-11 * (1 + std::abs(ref[i]))) << what << " " << i << " trial " << trial;
  }
}

TEST(AttentionPieces, PieceByPieceEqualsTheAttentionOverPositionsForwardAndBackward) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    Call c = random_call(rng);
    const int shapes[3][2] = {{2, 2}, {4, 2}, {3, 1}};  // Z, Zkv: heads, grouped, one shared
    c.Z = shapes[trial % 3][0];
    c.Zkv = shapes[trial % 3][1];
    c.A = 4;
    const Tensors x = random_tensors(c, rng);
    const Result want = naive(c, x), got = by_pieces(c, x);
    expect_near(got.out, want.out, "out", trial);
    expect_near(got.lse, want.lse, "lse", trial);
    expect_near(got.dq, want.dq, "dq", trial);
    for (std::size_t b = 0; b < c.blocks.size(); ++b) {
      expect_near(got.dk[b], want.dk[b], "dk", trial);
      expect_near(got.dv[b], want.dv[b], "dv", trial);
    }
  }
}

TEST(AttentionPieces, BlocksJoinWhereTheyContinueEachOtherAndSplitBack) {
  AttnShape d;
  d.Tq = 8, d.Z = 4, d.A = 8, d.Zkv = 2;  // K/V rows of 16 elements
  std::vector<float> k(100 * 16), v(100 * 16), dk(100 * 16), dv(100 * 16);
  const std::size_t f = sizeof(float);
  const std::vector<KVRef> parts{{k.data(), v.data(), dk.data(), dv.data(), 30, 0},
                                 {k.data() + 30 * 16, v.data() + 30 * 16, dk.data() + 30 * 16, dv.data() + 30 * 16, 50, 30},
                                 {k.data() + 80 * 16, v.data() + 80 * 16, dk.data() + 80 * 16, dv.data() + 80 * 16, 20, 90}};
  const auto joined = join_adjacent_blocks(parts, d, f);
  ASSERT_EQ(joined.size(), 2u) << "the third block's positions do not continue the second's";
  EXPECT_EQ(joined[0].Tk, 80);
  EXPECT_EQ(joined[1].k_pos0, 90);
  // A block without gradients does not join one with them.
  std::vector<KVRef> mixed = parts;
  mixed[1].dk = mixed[1].dv = nullptr;
  EXPECT_EQ(join_adjacent_blocks(mixed, d, f).size(), 3u);
  const auto split = split_blocks(joined, 32, d, f);
  ASSERT_EQ(split.size(), 4u);  // 32 + 32 + 16, then 20
  EXPECT_EQ(split[1].k, k.data() + 32 * 16);
  EXPECT_EQ(split[1].dv, dv.data() + 32 * 16);
  EXPECT_EQ(split[2].Tk, 16);
  EXPECT_EQ(split[2].k_pos0, 64);
  EXPECT_EQ(split[3].k_pos0, 90);
}

TEST(AttentionPieces, LengthClassesAreFewAndAtMostAnEighthLong) {
  i64 last = 0;
  int classes = 0;
  for (i64 n = 1; n <= 1 << 20; ++n) {
    const i64 c = sdpa_length_class(n);
    ASSERT_GE(c, n);
    ASSERT_GE(c, last) << "classes grow with the length";
    if (n > 64) {
      ASSERT_LE(double(c), 1.125 * double(n)) << n;
    }
    if (c != last) ++classes;
    last = c;
  }
  // 64, then 8 a power of two from 128 to 1M: a step's many lengths reuse a few graphs.
  EXPECT_LE(classes, 1 + 8 * 14);
  EXPECT_EQ(sdpa_length_class(16384), 16384);
  EXPECT_EQ(sdpa_length_class(16385), 18432);
}

// Note [Library scratch]: what the block's scratch reserves covers what a library backward
// takes on up to kLibraryQueryRows query rows with key parts of up to kLibraryKeyRows (any
// number of pieces), with the library's workspace at its bound, at every length; and it does
// not grow with the block.
TEST(AttentionPieces, TheBlockScratchCoversALibraryCallOnItsRows) {
  struct Heads {
    int Z, Zkv, A;
  };
  for (const Heads h : {Heads{32, 8, 128}, Heads{32, 32, 128}, Heads{4, 2, 64}, Heads{12, 12, 64}}) {
    ModelConfig c;
    c.heads = h.Z, c.kv_heads = h.Zkv, c.hidden = h.Z * h.A;
    const KernelScratch reserve = library_attention_scratch(c, 2);
    EXPECT_EQ(reserve.bytes_per_token, 0);
    for (int rows = 1; rows <= kLibraryQueryRows; rows = rows < 200 ? rows + 1 : rows * 17 / 16 + 1) {
      const int Tq = std::min(rows, kLibraryQueryRows), cls = int(sdpa_length_class(Tq));
      const int keys = int(sdpa_length_class(std::min(rows * 3, kLibraryKeyRows)));
      const LibraryCallBytes b = library_call_bytes(true, Tq, cls, 2, h.Z, h.Zkv, h.A, 2);
      const std::size_t need = b.rows_side + b.per_key_row * std::size_t(keys) + 2 * 256 +
                               library_workspace_bound(cls, h.Z, h.A);
      ASSERT_LE(need, std::size_t(reserve.fixed_bytes)) << Tq << " rows, " << h.Z << "/" << h.Zkv << " heads of " << h.A;
    }
  }
  // gpt-7b's heads: under 1 GiB a rank, where 75 KB a token would take 2.3 GiB at 32K.
  ModelConfig gpt;
  gpt.heads = 32, gpt.hidden = 4096;
  EXPECT_LT(library_attention_scratch(gpt, 2).fixed_bytes, i64{1} << 30);
}

}  // namespace
}  // namespace sppo
