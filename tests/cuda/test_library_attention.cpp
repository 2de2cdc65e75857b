// The CUDA backend's attention through a fused attention library (backends/cuda/
// library_attention.h) against the CPU backend's attention kernels, on the same fresh random
// bf16 inputs: a subsequence after earlier blocks, blocks that its queries see in part or not
// at all, grouped-query heads, scratch too small for one library call (key parts and query
// chunks), and graphs per exact length against graphs per length class. On a GPU the library
// is cuDNN's; in the CPU emulation (tests/cuda/emulate) it is a naive float64 stand-in with
// cuDNN's documented semantics (emulate/sdpa_reference.cpp), so that the pieces, merges,
// scratch and accumulation run in CI.
//
// Tolerances: the library computes from bf16 inputs in fp32, rounds P to bf16 before P V
// (cuDNN) and its outputs to bf16 once; the forward merges pieces in bf16. Both are bounded
// by the relative L2 error of a whole tensor (1e-2) and by each element's error against the
// tensor's largest magnitude (4e-2): a wrong mask, block or row is an O(1) error.
#include <gtest/gtest.h>

#include "backend/attention_pieces.h"
#include "backends/cpu/attention.h"
#include "backends/cuda/attention.h"
#include "backends/cuda/library_attention.h"
#include "cuda/cuda_test.h"

namespace sppo {
namespace {

using namespace sppo::testing;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Relative L2 error and every element's error against the largest |ref|.
void expect_near_tensor(const Vec& got, const Vec& ref, const std::string& what, double rel_l2 = 1e-2,
                        double rel_max = 4e-2) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double num = 0, den = 0, worst = 0;
  const double top = std::max(max_abs(ref), 1e-30);
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i])) {
      ASSERT_EQ(got[i], ref[i]) << what << "[" << i << "]: a row that sees no key";
      continue;
    }
    const double e = std::fabs(double(got[i]) - ref[i]);
    ASSERT_FALSE(std::isnan(e)) << what << "[" << i << "] is NaN";
    num += e * e;
    den += double(ref[i]) * ref[i];
    worst = std::max(worst, e / top);
  }
  const double rel = std::sqrt(num / std::max(den, 1e-30));
  EXPECT_LE(rel, rel_l2) << what << ": relative L2 error";
  EXPECT_LE(worst, rel_max) << what << ": largest element error over the largest |ref|";
  std::printf("  %-36s rel L2 %.2e, worst %.2e of max|ref|\n", what.c_str(), rel, worst);
}

struct Block {
  int rows;
  i64 pos0;
};

struct Case {
  int Tq = 0, Z = 0, Zkv = 0, A = 0;
  i64 q_pos0 = 0;
  std::vector<Block> blocks;
};

class LibraryAttentionTest : public Cuda {
 protected:
  std::unique_ptr<cuda::LibraryAttention> open(bool length_classes) {
    try {
      return std::make_unique<cuda::LibraryAttention>(cuda::open_cudnn_sdpa(), DType::BF16, length_classes);
    } catch (const Error& e) {
      return nullptr;
    }
  }

  // The call through the library and through the CPU kernels; `ws_bytes` 0: scratch from
  // the pool, else a workspace of that size.
  void compare(const Case& c, bool length_classes = true, std::size_t ws_bytes = 0) {
    auto lib = open(length_classes);
    if (!lib) GTEST_SKIP() << "this build has no fused attention library (SPPO_CUDNN off)";
    const int ldq = c.Z * c.A, ldk = c.Zkv * c.A;
    // Inputs rounded to bf16 first: both sides compute from the same values.
    const Vec q = rounded(randn(std::size_t(c.Tq) * ldq, rng_), DType::BF16);
    const Vec dout = rounded(randn(std::size_t(c.Tq) * ldq, rng_), DType::BF16);
    const Vec dq0 = rounded(randn(std::size_t(c.Tq) * ldq, rng_), DType::BF16);
    std::vector<Vec> k, v, dk0, dv0;
    for (const Block& b : c.blocks) {
      k.push_back(rounded(randn(std::size_t(b.rows) * ldk, rng_), DType::BF16));
      v.push_back(rounded(randn(std::size_t(b.rows) * ldk, rng_), DType::BF16));
      dk0.push_back(randn(std::size_t(b.rows) * ldk, rng_));
      dv0.push_back(randn(std::size_t(b.rows) * ldk, rng_));
    }

    // The CPU kernels, fp32.
    cpu::AttnDims cd;
    cd.Tq = c.Tq, cd.Z = c.Z, cd.A = c.A, cd.Zkv = c.Zkv, cd.q_pos0 = c.q_pos0;
    Vec out_ref(q.size()), lse_ref(std::size_t(c.Z) * c.Tq), delta(lse_ref.size()), dq_ref = dq0;
    std::vector<Vec> dk_ref = dk0, dv_ref = dv0;
    std::vector<cpu::KVBlock> cb;
    for (std::size_t b = 0; b < c.blocks.size(); ++b)
      cb.push_back({k[b].data(), v[b].data(), dk_ref[b].data(), dv_ref[b].data(), c.blocks[b].rows,
                    c.blocks[b].pos0});
    cpu::attention_forward_blocks(out_ref.data(), lse_ref.data(), q.data(), cb, cd);
    cpu::attention_backward_delta(delta.data(), dout.data(), out_ref.data(), cd);
    Vec dq_f32(q.size(), 0.0f);
    cpu::attention_backward_blocks(dq_f32.data(), dout.data(), q.data(), cb, lse_ref.data(), delta.data(), cd);
    for (std::size_t i = 0; i < dq_ref.size(); ++i) dq_ref[i] += dq_f32[i];

    // The library.
    Dev dq_d = upload(dq0, DType::BF16), q_d = upload(q, DType::BF16), dout_d = upload(dout, DType::BF16);
    Dev out_d(q.size() * 2), lse_d(lse_ref.size() * 4), delta_d = upload(delta, DType::F32);
    std::vector<Dev> k_d, v_d, dk_d, dv_d;
    std::vector<KVRef> refs;
    for (std::size_t b = 0; b < c.blocks.size(); ++b) {
      k_d.push_back(upload(k[b], DType::BF16));
      v_d.push_back(upload(v[b], DType::BF16));
      dk_d.push_back(upload(dk0[b], DType::F32));
      dv_d.push_back(upload(dv0[b], DType::F32));
      refs.push_back({k_d[b].get(), v_d[b].get(), dk_d[b].as<float>(), dv_d[b].as<float>(), c.blocks[b].rows,
                      c.blocks[b].pos0});
    }
    AttnShape d;
    d.Tq = c.Tq, d.Z = c.Z, d.A = c.A, d.Zkv = c.Zkv, d.q_pos0 = c.q_pos0;
    d.ldq = d.ldo = ldq, d.ldk = d.ldv = ldk;
    Dev ws_d(ws_bytes + 256);
    // A workspace off the 256-byte grid, as one carved from inside a larger buffer may be.
    const Workspace ws{ws_bytes ? static_cast<char*>(ws_d.get()) + 8 : nullptr, ws_bytes};
    ASSERT_TRUE(lib->forward(out_d.get(), lse_d.as<float>(), q_d.get(), refs, d, ws, stream_)) << lib->refused();
    // The backward from the CPU's delta and the library's own lse, as the runtime calls it.
    ASSERT_TRUE(lib->backward(dq_d.get(), dout_d.get(), q_d.get(), refs, lse_d.as<float>(), delta_d.as<float>(), d,
                              ws, stream_))
        << lib->refused();
    SPPO_CUDA_CHECK(cudaStreamSynchronize(stream_));

    expect_near_tensor(download(out_d, q.size(), DType::BF16), out_ref, "out");
    Vec lse = download(lse_d, lse_ref.size(), DType::F32);
    for (std::size_t i = 0; i < lse.size(); ++i) {
      if (std::isinf(lse_ref[i])) {
        EXPECT_EQ(lse[i], -kInf) << "lse[" << i << "] of a row that sees no key";
      } else {
        EXPECT_NEAR(lse[i], lse_ref[i], 2e-3 * (1 + std::fabs(lse_ref[i]))) << "lse[" << i << "]";
      }
    }
    // dq and the accumulators: what they held plus the call's gradient.
    expect_near_tensor(download(dq_d, q.size(), DType::BF16), dq_ref, "dq (+= onto random)");
    for (std::size_t b = 0; b < c.blocks.size(); ++b) {
      const std::size_t n = k[b].size();
      Vec got_k = download(dk_d[b], n, DType::F32), got_v = download(dv_d[b], n, DType::F32);
      Vec want_k = dk_ref[b], want_v = dv_ref[b];
      for (std::size_t i = 0; i < n; ++i) {  // the gradient alone, not drowned by the start
        got_k[i] -= dk0[b][i], want_k[i] -= dk0[b][i];
        got_v[i] -= dv0[b][i], want_v[i] -= dv0[b][i];
      }
      expect_near_tensor(got_k, want_k, "dk of block " + std::to_string(b));
      expect_near_tensor(got_v, want_v, "dv of block " + std::to_string(b));
    }
  }
};

// SPPO's pattern: a subsequence's queries after two earlier subsequences' blocks, then its
// own block (causal), with grouped-query heads.
TEST_F(LibraryAttentionTest, SubsequenceAfterEarlierBlocks) {
  compare({96, 4, 2, 64, 192, {{96, 0}, {96, 96}, {96, 192}}});
}

// Multi-head, a length off every class boundary, and the prefix and queries in one block
// (a bottom-right causal piece over the prefix).
TEST_F(LibraryAttentionTest, OneBlockWithThePrefixBeforeTheQueries) {
  compare({77, 2, 2, 64, 150, {{227, 0}}});
}

// Blocks the queries see in part (a ring piece's, a document cut), one they cannot see, and
// rows that see no key at all (out 0, lse -inf).
TEST_F(LibraryAttentionTest, PartlyVisibleBlocksAndRowsThatSeeNothing) {
  compare({80, 4, 1, 64, 1000, {{50, 1030}, {40, 1060}, {30, 1200}}});
  compare({64, 2, 2, 64, 500, {{100, 450}, {64, 520}}});
}

// A workspace too small for one call on the longest block: the keys go in parts (and the
// queries in chunks), with the same results.
TEST_F(LibraryAttentionTest, ScratchTooSmallCutsKeysAndQueries) {
  const Case c{128, 4, 2, 64, 512, {{512, 0}, {128, 512}}};
  const std::size_t ab = 2, za = std::size_t(c.Z) * c.A;
  // About what a backward on 64 query rows against 128-key parts needs, plus the library's own.
  const std::size_t small = 64 * za * (ab + 4) + 2 * 128 * za * ab + 128 * za * ab + 64 * 4 * c.Z + (4 << 20);
  compare(c, true, small);
}

// A head size the library does not take (20: not a multiple of 8): the call says so and
// leaves its outputs as they were, so that the backend can run its own kernels instead.
TEST_F(LibraryAttentionTest, ACallTheLibraryRefusesIsLeftUndone) {
  auto lib = open(true);
  if (!lib) GTEST_SKIP() << "this build has no fused attention library (SPPO_CUDNN off)";
  const int Tq = 16, Z = 2, A = 20;
  const Vec q = rounded(randn(std::size_t(Tq) * Z * A, rng_), DType::BF16);
  const Vec before = rounded(randn(q.size(), rng_), DType::BF16);
  Dev q_d = upload(q, DType::BF16), k_d = upload(q, DType::BF16), out_d = upload(before, DType::BF16);
  Dev lse_d = upload(Vec(std::size_t(Z) * Tq, 7.0f), DType::F32);
  AttnShape d;
  d.Tq = Tq, d.Z = Z, d.A = A, d.Zkv = Z;
  const std::vector<KVRef> refs{{k_d.get(), k_d.get(), nullptr, nullptr, Tq, 0}};
  EXPECT_FALSE(lib->forward(out_d.get(), lse_d.as<float>(), q_d.get(), refs, d, Workspace{}, stream_));
  EXPECT_NE(lib->refused().find("head"), std::string::npos) << lib->refused();
  SPPO_CUDA_CHECK(cudaStreamSynchronize(stream_));
  expect_equal(download(out_d, q.size(), DType::BF16), before, "out of a refused call");
  expect_equal(download(lse_d, std::size_t(Z) * Tq, DType::F32), Vec(std::size_t(Z) * Tq, 7.0f),
               "lse of a refused call");
}

TEST_F(LibraryAttentionTest, GraphsPerExactLengthAgree) {
  compare({72, 4, 2, 64, 144, {{72, 0}, {72, 72}, {72, 144}}}, false);
}

}  // namespace
}  // namespace sppo
