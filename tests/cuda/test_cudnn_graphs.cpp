// cuDNN's verdict on the attention graphs the CUDA backend builds (backends/cuda/
// sdpa_cudnn.cpp), decided on the host for an H100/H200 (SM 90) without a GPU: every shape
// the runtime's calls make validates (forward and backward, both masks, grouped-query and
// multi-head, q and dq at H or 3H, graphs per length class with a padding mask and per exact
// length), and what cuDNN cannot take is refused with its reason. The graphs' builds and
// results need the GPU: test_library_attention.
#include <gtest/gtest.h>

#include "backends/cuda/sdpa.h"

namespace sppo {
namespace {

constexpr int kHopper = 90;

bool built_with_cudnn() { return cuda::cudnn_sdpa_built(); }

cuda::SdpaGraphKey key(bool backward, int Z, int Zkv, int A, i64 ldq, int rows, int keys, PieceMask mask,
                       bool padded) {
  cuda::SdpaGraphKey k;
  k.backward = backward;
  k.Z = Z, k.Zkv = Zkv, k.A = A;
  k.ldq = ldq, k.ldk = k.ldv = i64(Zkv) * A;
  k.ld_dout = backward ? i64(Z) * A : 0;
  k.rows = rows, k.keys = keys;
  k.mask = mask;
  k.padded = padded;
  k.act = DType::BF16;
  return k;
}

TEST(CudnnGraphs, EveryShapeTheRuntimeCallsValidatesOnHopper) {
  if (!built_with_cudnn()) GTEST_SKIP() << "built without cuDNN (SPPO_CUDNN off)";
  struct Heads {
    int Z, Zkv, A;
  };
  // Llama-3-8B's heads (32 over 8 of 128), GPT's (32 of 128), small models' (8 of 64).
  for (const Heads h : {Heads{32, 8, 128}, Heads{32, 32, 128}, Heads{8, 8, 64}})
    for (const bool backward : {false, true})
      for (const i64 ldq : {i64(h.Z) * h.A, 3 * i64(h.Z) * h.A})
        for (const PieceMask mask : {PieceMask::None, PieceMask::BottomRight})
          for (const bool padded : {true, false})
            // A subsequence's own block; its queries after a long prefix; a short chunk.
            for (const auto& [rows, keys] : {std::pair{4096, 4096}, std::pair{16384, 131072}, std::pair{1152, 1024}}) {
              if (mask == PieceMask::BottomRight && rows > keys) continue;  // the pieces never ask
              const auto k = key(backward, h.Z, h.Zkv, h.A, ldq, rows, keys, mask, padded);
              EXPECT_EQ(cuda::validate_cudnn_sdpa(k, kHopper), "") << cuda::describe(k);
            }
}

TEST(CudnnGraphs, WhatCudnnCannotTakeIsRefusedWithItsReason) {
  if (!built_with_cudnn()) GTEST_SKIP() << "built without cuDNN (SPPO_CUDNN off)";
  // The bottom-right mask over more rows than keys (attention_pieces never makes one).
  EXPECT_NE(cuda::validate_cudnn_sdpa(key(false, 8, 8, 64, 512, 2048, 1024, PieceMask::BottomRight, false), kHopper),
            "");
  // Head sizes: a multiple of 8, and at most 256 for the backward on Hopper, 128 on Ampere.
  EXPECT_NE(cuda::validate_cudnn_sdpa(key(false, 8, 8, 100, 800, 1024, 1024, PieceMask::None, false), kHopper), "");
  EXPECT_NE(cuda::validate_cudnn_sdpa(key(true, 2, 2, 512, 1024, 1024, 1024, PieceMask::None, false), kHopper), "");
  const auto a256 = key(true, 8, 8, 256, 2048, 1024, 1024, PieceMask::None, false);
  EXPECT_EQ(cuda::validate_cudnn_sdpa(a256, kHopper), "");
  EXPECT_NE(cuda::validate_cudnn_sdpa(a256, 80), "");
  // Query heads that key/value heads do not divide.
  EXPECT_NE(cuda::validate_cudnn_sdpa(key(false, 6, 4, 64, 384, 1024, 1024, PieceMask::None, false), kHopper), "");
}

}  // namespace
}  // namespace sppo
