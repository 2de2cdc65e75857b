#include "model/gpt.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "core/check.h"
#include "backends/cpu/attention.h"
#include "backends/cpu/ops.h"

namespace sppo {

ParamView param_view(const ModelConfig& c, float* base) { return param_view(c, base, 0, c.layers); }

ParamView param_view(const ModelConfig& c, float* base, int begin, int end) {
  ParamView v;
  float* p = base;
  auto take = [&](i64 n) {
    float* r = p;
    p += n;
    return r;
  };
  const i64 H = c.hidden, F = c.ffn();
  if (begin == 0 || end == c.layers) v.embed = take(i64(c.vocab) * H);
  v.blocks.resize(c.layers);
  for (int l = begin; l < end; ++l) {
    BlockParams& b = v.blocks[l];
    b.ln1_w = take(H);
    b.ln1_b = take(H);
    b.qkv_w = take(3 * H * H);
    b.qkv_b = take(3 * H);
    b.out_w = take(H * H);
    b.out_b = take(H);
    b.ln2_w = take(H);
    b.ln2_b = take(H);
    b.fc_w = take(F * H);
    b.fc_b = take(F);
    b.proj_w = take(H * F);
    b.proj_b = take(H);
  }
  if (end == c.layers) {
    v.lnf_w = take(H);
    v.lnf_b = take(H);
  }
  SPPO_ASSERT(p - base == total_bytes(parameter_specs(c, begin, end)) / i64(sizeof(float)));
  return v;
}

BlockSaved block_saved_from(const std::vector<float*>& t) {
  SPPO_ASSERT(t.size() == 14);
  return {t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], t[10], t[11], t[12], t[13]};
}

BlockWorkspace block_workspace_from(const std::vector<float*>& t, cpu::Scratch* scratch) {
  SPPO_ASSERT(t.size() == 4);
  return {t[0], t[1], t[2], t[3], scratch};
}

HeadWorkspace head_workspace_from(const std::vector<float*>& t, int chunk, cpu::Scratch* scratch) {
  SPPO_ASSERT(t.size() == 5);
  return {t[0], t[1], t[2], t[3], t[4], chunk, scratch};
}

KernelScratch block_kernel_scratch(const ModelConfig& c, int threads) {
  KernelScratch s = cpu::attention_forward_scratch(c.head_size(), threads);
  s = cpu::max(s, cpu::attention_backward_scratch(c.heads, c.head_size(), threads));
  s = cpu::max(s, cpu::layernorm_backward_scratch(c.hidden));
  return cpu::max(s, cpu::linear_backward_scratch(std::max(3 * c.hidden, c.ffn())));
}

KernelScratch head_kernel_scratch(const ModelConfig& c, int chunk) {
  return cpu::max(cpu::layernorm_backward_scratch(c.hidden), cpu::xent_scratch(chunk));
}

namespace {

// The workspace's scratch, emptied for the next kernel (null when there is none).
cpu::Scratch* fresh(cpu::Scratch* s) {
  if (s) s->reset();
  return s;
}

void add_inplace(float* y, const float* x, i64 n) {
#pragma omp parallel for simd schedule(static)
  for (i64 i = 0; i < n; ++i) y[i] += x[i];
}

// Copies columns [col, col + width) of a [T, ld] buffer into a dense [T, width] one.
void copy_cols(float* dst, const float* src, int T, int width, int ld_src, int col) {
#pragma omp parallel for schedule(static)
  for (int t = 0; t < T; ++t)
    std::memcpy(dst + i64(t) * width, src + i64(t) * ld_src + col, sizeof(float) * width);
}

void put_cols(float* dst, const float* src, int T, int width, int ld_dst, int col) {
#pragma omp parallel for schedule(static)
  for (int t = 0; t < T; ++t)
    std::memcpy(dst + i64(t) * ld_dst + col, src + i64(t) * width, sizeof(float) * width);
}

cpu::AttnDims attn_dims(const ModelConfig& c, const Subseq& q) {
  cpu::AttnDims d;
  d.Tq = q.T;
  d.Z = c.heads;
  d.A = c.head_size();
  d.q_pos0 = q.offset;
  d.ldq = d.ldk = d.ldv = d.ldo = c.hidden;
  return d;
}

// The KV blocks a subsequence's queries attend to, in position order: the earlier
// subsequences' blocks, then its own keys k_self/v_self (gradients dk_self/dv_self).
std::vector<cpu::KVBlock> kv_blocks(const KVBlocks& past, const float* k_self, const float* v_self,
                                    float* dk_self, float* dv_self, const Subseq& q) {
  std::vector<cpu::KVBlock> blocks;
  blocks.reserve(past.k.size() + 1);
  for (size_t j = 0; j < past.k.size(); ++j)
    blocks.push_back({past.k[j], past.v[j], j < past.dk.size() ? past.dk[j] : nullptr,
                      j < past.dv.size() ? past.dv[j] : nullptr, int(past.lengths[j]),
                      past.offsets[j]});
  blocks.push_back({k_self, v_self, dk_self, dv_self, q.T, q.offset});
  return blocks;
}

}  // namespace

void block_forward(float* x_out, BlockSaved& s, const BlockParams& p, const BlockWorkspace& w,
                   const KVBlocks& past, const ModelConfig& c, const Subseq& q) {
  const int T = q.T, H = c.hidden, F = c.ffn();
  const i64 TH = i64(T) * H;
  // Attention half: x_mid = x + out(attn(rope(qkv(LN1(x)))))
  cpu::layernorm_forward(s.ln1_out, s.ln1_mean, s.ln1_rstd, s.x, p.ln1_w, p.ln1_b, T, H, c.ln_eps);
  cpu::linear_forward(w.qkv, s.ln1_out, p.qkv_w, p.qkv_b, T, H, 3 * H);
  cpu::rope_forward(w.qkv, T, c.heads, c.head_size(), q.offset, c.rope_theta, 3 * H);      // q
  cpu::rope_forward(w.qkv + H, T, c.heads, c.head_size(), q.offset, c.rope_theta, 3 * H);  // k
  copy_cols(s.q, w.qkv, T, H, 3 * H, 0);
  copy_cols(s.k, w.qkv, T, H, 3 * H, H);
  copy_cols(s.v, w.qkv, T, H, 3 * H, 2 * H);
  // Every earlier block and the diagonal one in one call: one online softmax, no merge.
  cpu::attention_forward_blocks(s.attn_out, s.lse, s.q, kv_blocks(past, s.k, s.v, nullptr, nullptr, q),
                                attn_dims(c, q), fresh(w.scratch));
  cpu::linear_forward(s.x_mid, s.attn_out, p.out_w, p.out_b, T, H, H);
  add_inplace(s.x_mid, s.x, TH);
  // MLP half: x_out = x_mid + proj(gelu(fc(LN2(x_mid))))
  cpu::layernorm_forward(s.ln2_out, s.ln2_mean, s.ln2_rstd, s.x_mid, p.ln2_w, p.ln2_b, T, H, c.ln_eps);
  cpu::linear_forward(s.fc_pre, s.ln2_out, p.fc_w, p.fc_b, T, H, F);
  cpu::gelu_forward(w.mlp_act, s.fc_pre, i64(T) * F);
  cpu::linear_forward(x_out, w.mlp_act, p.proj_w, p.proj_b, T, F, H);
  add_inplace(x_out, s.x_mid, TH);
}

void block_backward(float* d, BlockParams& g, float* dk_self, float* dv_self, const BlockSaved& s,
                    const BlockParams& p, const BlockWorkspace& w, const KVBlocks& past,
                    const ModelConfig& c, const Subseq& q) {
  const int T = q.T, H = c.hidden, F = c.ffn();
  // MLP half. d is the gradient w.r.t. x_out = x_mid + proj(gelu(fc_pre)).
  cpu::gelu_forward(w.mlp_act, s.fc_pre, i64(T) * F);  // recomputed: cheaper than saving it
  cpu::linear_backward(nullptr, g.proj_w, g.proj_b, d, w.mlp_act, p.proj_w, T, F, H, 0, 0, fresh(w.scratch));
  cpu::gemm(false, false, T, F, H, 1.0f, d, H, p.proj_w, F, 0.0f, w.mlp_act, F);  // d mlp_act
  cpu::gelu_backward(w.mlp_act, w.mlp_act, s.fc_pre, i64(T) * F);                // d fc_pre
  cpu::linear_backward(w.d_tmp, g.fc_w, g.fc_b, w.mlp_act, s.ln2_out, p.fc_w, T, H, F, 0, 0, fresh(w.scratch));
  cpu::layernorm_backward(d, g.ln2_w, g.ln2_b, w.d_tmp, s.x_mid, p.ln2_w, s.ln2_mean, s.ln2_rstd, T, H,
                          fresh(w.scratch));
  // Attention half. d is now the gradient w.r.t. x_mid = x + out(attn_out).
  cpu::linear_backward(w.d_tmp, g.out_w, g.out_b, d, s.attn_out, p.out_w, T, H, H, 0, 0, fresh(w.scratch));
  cpu::AttnDims self = attn_dims(c, q);
  cpu::attention_backward_delta(w.delta, w.d_tmp, s.attn_out, self);
  float* dqkv = w.qkv;  // [T, 3H]: dq accumulates in columns 0..H-1
  for (int t = 0; t < T; ++t) std::memset(dqkv + i64(t) * 3 * H, 0, sizeof(float) * H);
  cpu::AttnDims dq_self = self;
  dq_self.ldq = 3 * H;
  // Queries read from s.q (stride H); dq written with stride 3H: the kernel takes one ldq
  // for both, so run with q copied into the dq columns' layout.
  float* q3 = w.qkv + H;  // columns H..2H-1 are free until dk is written below
  put_cols(q3, s.q, T, H, 3 * H, 0);
  cpu::attention_backward_blocks(dqkv, w.d_tmp, q3, kv_blocks(past, s.k, s.v, dk_self, dv_self, q),
                                 s.lse, w.delta, dq_self, fresh(w.scratch));
  // dK/dV of this subsequence are complete: every later subsequence has contributed.
  put_cols(dqkv, dk_self, T, H, 3 * H, H);
  put_cols(dqkv, dv_self, T, H, 3 * H, 2 * H);
  cpu::rope_backward(dqkv, T, c.heads, c.head_size(), q.offset, c.rope_theta, 3 * H);
  cpu::rope_backward(dqkv + H, T, c.heads, c.head_size(), q.offset, c.rope_theta, 3 * H);
  cpu::linear_backward(w.d_tmp, g.qkv_w, g.qkv_b, dqkv, s.ln1_out, p.qkv_w, T, H, 3 * H, 0, 0, fresh(w.scratch));
  cpu::layernorm_backward(d, g.ln1_w, g.ln1_b, w.d_tmp, s.x, p.ln1_w, s.ln1_mean, s.ln1_rstd, T, H,
                          fresh(w.scratch));
}

double head_forward_backward(float* head_grad, const float* x, const std::int32_t* targets,
                             const ParamView& p, ParamView& g, const HeadWorkspace& w,
                             const ModelConfig& c, int T, i64 total_tokens) {
  const int H = c.hidden, V = c.vocab;
  cpu::layernorm_forward(w.ln_f_out, w.ln_f_mean, w.ln_f_rstd, x, p.lnf_w, p.lnf_b, T, H, c.ln_eps);
  const float scale = float(1.0 / double(total_tokens));
  double loss = 0;
  // Row chunks bound the logits to [chunk, V]. Once a chunk's rows of ln_f_out have fed
  // dembed they are dead, so the chunk's gradient d ln_f_out overwrites them in place.
  for (int t0 = 0; t0 < T; t0 += w.chunk) {
    const int rows = std::min(w.chunk, T - t0);
    float* h = w.ln_f_out + i64(t0) * H;
    cpu::gemm(false, true, rows, V, H, 1.0f, h, H, p.embed, H, 0.0f, w.logits, V);
    loss += cpu::xent_forward_backward(w.logits, w.losses + t0, targets + t0, rows, V, scale, fresh(w.scratch));
    cpu::gemm(true, false, V, H, rows, 1.0f, w.logits, V, h, H, 1.0f, g.embed, H);
    cpu::gemm(false, false, rows, H, V, 1.0f, w.logits, V, p.embed, H, 0.0f, h, H);
  }
  std::memset(head_grad, 0, sizeof(float) * i64(T) * H);
  cpu::layernorm_backward(head_grad, g.lnf_w, g.lnf_b, w.ln_f_out, x, p.lnf_w, w.ln_f_mean,
                          w.ln_f_rstd, T, H, fresh(w.scratch));
  return loss;
}

}  // namespace sppo
