// Note [MLP tiles] (core/layout.h): one block's forward and backward with its MLP in row
// tiles equal the untiled block's to fp32 rounding (the output, the input gradient, every
// weight gradient and dK/dV), with fc_pre saved or made a tile at a time, on fresh random
// inputs: tiles that do not divide T, as long as T, longer than T, and of one row.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/gpt.h"

namespace sppo {
namespace {

struct BlockRun {
  std::vector<float> out, d, grads, dk, dv;
};

std::vector<float> normal(std::size_t n, float scale, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Forward, then backward of block 0 on x [T, H] at offset o with output gradient dy [T, H].
BlockRun run_block(const ModelConfig& c, std::vector<float> params, const std::vector<float>& x,
                   const std::vector<float>& dy, int T, i64 o, const MlpTiles& tiles) {
  const auto be = make_backend("cpu");
  const ParamView p = param_view(c, params.data());
  const MatrixView m = matrix_view(c, params.data(), DType::F32, 0, c.layers);
  std::vector<std::vector<float>> saved, ws;
  std::vector<void*> sp, wp;
  for (const auto& s : block_saved_specs(c, T, ActPrecision::F32)) saved.emplace_back(std::size_t(s.numel()), 0.0f);
  for (const auto& s : block_workspace_specs(c, T, ActPrecision::F32, TpShard{}, tiles))
    ws.emplace_back(std::size_t(s.numel()), 0.0f);
  for (auto& b : saved) sp.push_back(b.data());
  for (auto& b : ws) wp.push_back(b.data());
  if (tiles.on() && tiles.fc_pre_recomputed) sp[kSavedFcPre] = nullptr;
  saved[0] = x;
  sp[0] = saved[0].data();
  BlockSaved s = block_saved_from(sp);
  const BlockWorkspace w = block_workspace_from(wp, {}, tiles);
  BlockRun r;
  r.out.assign(x.size(), 0.0f);
  const Subseq q(o, T);
  block_forward(*be, r.out.data(), s, p.blocks[0], m.blocks[0], w, KVBlocks{}, c, q);
  r.grads.assign(params.size(), 0.0f);
  ParamView g = param_view(c, r.grads.data());
  r.d = dy;
  r.dk.assign(x.size(), 0.0f);
  r.dv.assign(x.size(), 0.0f);
  block_backward(*be, r.d.data(), g.blocks[0], r.dk.data(), r.dv.data(), s, p.blocks[0], m.blocks[0], w, KVBlocks{},
                 c, q);
  return r;
}

// |got - ref| <= atol + rtol |ref| element-wise, atol relative to the largest |ref|.
void expect_close(const std::vector<float>& got, const std::vector<float>& ref, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double largest = 0;
  for (float v : ref) largest = std::max(largest, double(std::fabs(v)));
  const double rtol = 1e-5, atol = 1e-6 * largest;
  std::size_t bad = 0, first = 0;
  for (std::size_t k = 0; k < ref.size(); ++k)
    if (std::fabs(double(got[k]) - double(ref[k])) > atol + rtol * std::fabs(double(ref[k])) && bad++ == 0) first = k;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << ref.size() << " elements differ, the first at " << first
                     << ": " << got[first] << " vs " << ref[first];
}

TEST(MlpTiles, BlockMatchesTheUntiledBlock) {
  ModelConfig c;
  c.vocab = 17;
  c.hidden = 32;
  c.heads = 4;
  c.layers = 1;
  std::mt19937 rng(2026);
  for (int T : {13, 40}) {
    std::vector<float> params = normal(std::size_t(c.num_params()), 0.1f, rng);
    const ParamView p = param_view(c, params.data());
    for (int k = 0; k < c.hidden; ++k) p.blocks[0].ln1_w[k] += 1.0f, p.blocks[0].ln2_w[k] += 1.0f;
    const auto x = normal(std::size_t(T) * c.hidden, 1.0f, rng);
    const auto dy = normal(std::size_t(T) * c.hidden, 1.0f, rng);
    const i64 o = 5;  // RoPE at positions past 0
    const BlockRun ref = run_block(c, params, x, dy, T, o, MlpTiles{});
    for (i64 R : {i64(1), i64(6), i64(T), i64(64)})
      for (bool fc_pre_recomputed : {false, true}) {
        const std::string what = "T " + std::to_string(T) + " tiles of " + std::to_string(R) +
                                 (fc_pre_recomputed ? " fc_pre a tile at a time" : " fc_pre saved");
        const BlockRun got = run_block(c, params, x, dy, T, o, MlpTiles{R, fc_pre_recomputed});
        expect_close(got.out, ref.out, what + ": output");
        expect_close(got.d, ref.d, what + ": input gradient");
        expect_close(got.grads, ref.grads, what + ": weight gradients");
        expect_close(got.dk, ref.dk, what + ": dK");
        expect_close(got.dv, ref.dv, what + ": dV");
      }
  }
}

// The workspace holds min(T, R) rows of the MLP activation, and of fc_pre when it is
// recomputed; the other buffers are the untiled ones.
TEST(MlpTiles, WorkspaceHoldsOneTile) {
  ModelConfig c;
  c.hidden = 32;
  c.heads = 4;
  const i64 T = 100, F = c.ffn();
  const i64 whole = total_bytes(block_workspace_specs(c, T, ActPrecision::BF16));
  EXPECT_EQ(total_bytes(block_workspace_specs(c, T, ActPrecision::BF16, TpShard{}, MlpTiles{})), whole);
  EXPECT_EQ(total_bytes(block_workspace_specs(c, T, ActPrecision::BF16, TpShard{}, MlpTiles{30, false})),
            whole - (T - 30) * F * 2);
  EXPECT_EQ(total_bytes(block_workspace_specs(c, T, ActPrecision::BF16, TpShard{}, MlpTiles{30, true})),
            whole - (T - 30) * F * 2 + 30 * F * 2);
  EXPECT_EQ(total_bytes(block_workspace_specs(c, T, ActPrecision::BF16, TpShard{}, MlpTiles{500, true})),
            whole + T * F * 2);
}

}  // namespace
}  // namespace sppo
