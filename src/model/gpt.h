// The GPT model of DESIGN.md 2, as forward and backward functions of ONE block (or the
// head) on ONE subsequence of T tokens at global offset o. The model owns no memory: the
// runtime allocates every buffer named below from the layout tables (core/layout.h) and
// decides where each lives (device, host, offloaded). Dimension letters: core/dims.h.
//
// Accumulation rule: parameter gradients ACCUMULATE (+=) across subsequences; the
// residual-stream gradient `d` is updated IN PLACE (on entry the gradient w.r.t. the
// block's output, on exit w.r.t. its input).
#pragma once

#include <cstdint>
#include <vector>

#include "core/config.h"
#include "core/layout.h"
#include "backends/cpu/scratch.h"

namespace sppo {

// Views into one flat fp32 buffer laid out by parameter_specs(); used for the weights and,
// with the same offsets, for their gradients and the AdamW moments.
struct BlockParams {
  float* ln1_w; float* ln1_b;    // [H], [H]
  float* qkv_w; float* qkv_b;    // [3H, H], [3H]
  float* out_w; float* out_b;    // [H, H], [H]
  float* ln2_w; float* ln2_b;    // [H], [H]
  float* fc_w; float* fc_b;      // [F, H], [F]
  float* proj_w; float* proj_b;  // [H, F], [H]
};

struct ParamView {
  float* embed = nullptr;        // [V, H], also the LM head
  std::vector<BlockParams> blocks;
  float* lnf_w = nullptr;        // [H]
  float* lnf_b = nullptr;        // [H]
};

// Carves views from `base`, which holds total_bytes(parameter_specs(c)) bytes.
ParamView param_view(const ModelConfig& c, float* base);
// The views of a stage that owns layers [begin, end): `base` holds
// parameter_specs(c, begin, end); blocks outside the range and the embedding or final
// LayerNorm the stage does not own stay null.
ParamView param_view(const ModelConfig& c, float* base, int begin, int end);

// What one block saves for backward on one subsequence (block_saved_specs order).
struct BlockSaved {
  float* x;         // [T, H] block input
  float* ln1_mean;  // [T]
  float* ln1_rstd;  // [T]
  float* ln1_out;   // [T, H]
  float* q;         // [T, H] after RoPE
  float* k;         // [T, H] after RoPE (KV cache block of this subsequence)
  float* v;         // [T, H]
  float* attn_out;  // [T, H]
  float* lse;       // [Z, T]
  float* x_mid;     // [T, H]
  float* ln2_mean;  // [T]
  float* ln2_rstd;  // [T]
  float* ln2_out;   // [T, H]
  float* fc_pre;    // [T, F]
};

// Builds a BlockSaved from pointers in block_saved_specs order.
BlockSaved block_saved_from(const std::vector<float*>& ptrs);

struct BlockWorkspace {
  float* qkv;      // [T, 3H]
  float* mlp_act;  // [T, F]
  float* d_tmp;    // [T, H]
  float* delta;    // [Z, T]
  cpu::Scratch* scratch = nullptr;  // the kernels' scratch (block_kernel_scratch); null: their own
};
BlockWorkspace block_workspace_from(const std::vector<float*>& ptrs, cpu::Scratch* scratch = nullptr);

// The kernel scratch one block's forward or backward takes on T tokens with `threads`
// OpenMP threads (one buffer, reused by its kernels in turn), and the head's.
KernelScratch block_kernel_scratch(const ModelConfig& c, int threads);
KernelScratch head_kernel_scratch(const ModelConfig& c, int chunk);

// Keys and values of the earlier subsequences j < i of this layer, and (in backward) their
// gradient accumulators. kv[j] covers positions offsets[j] .. offsets[j] + lengths[j] - 1.
struct KVBlocks {
  std::vector<const float*> k, v;  // [l_j, H]
  std::vector<float*> dk, dv;      // [l_j, H], accumulate (+=); backward only
  std::vector<i64> offsets, lengths;
};

struct Subseq {
  i64 offset = 0;  // o
  int T = 0;       // tokens in this subsequence
};

// x_out[T, H] = block(s.x). Fills every tensor of `s` (x must already hold the input).
// `past` holds the KV blocks of j < i; this subsequence's own k/v are s.k, s.v.
void block_forward(float* x_out, BlockSaved& s, const BlockParams& p, const BlockWorkspace& w,
                   const KVBlocks& past, const ModelConfig& c, const Subseq& q);

// d[T, H]: in the gradient w.r.t. the block output, out w.r.t. its input. dk_self/dv_self
// [T, H] are this subsequence's dK/dV accumulators: on entry they hold the contributions of
// later subsequences (or zeros); on exit they are complete. past.dk/dv accumulate.
void block_backward(float* d, BlockParams& grads, float* dk_self, float* dv_self,
                    const BlockSaved& s, const BlockParams& p, const BlockWorkspace& w,
                    const KVBlocks& past, const ModelConfig& c, const Subseq& q);

// Head forward and backward at once (the loss gradient is known in forward):
// given x[T, H] (last block output) and targets[T], adds this subsequence's summed loss to
// the return value, and writes head_grad[T, H] = d loss_mean / d x where loss_mean divides
// by `total_tokens` (S). dembed/dlnf accumulate. Workspace from head_workspace_specs;
// afterwards w.losses[T] holds each position's loss.
struct HeadWorkspace {
  float* ln_f_out;   // [T, H]
  float* ln_f_mean;  // [T]
  float* ln_f_rstd;  // [T]
  float* logits;     // [chunk, V]
  float* losses;     // [T]
  int chunk;
  cpu::Scratch* scratch = nullptr;  // head_kernel_scratch; null: the kernels' own
};
HeadWorkspace head_workspace_from(const std::vector<float*>& ptrs, int chunk, cpu::Scratch* scratch = nullptr);
double head_forward_backward(float* head_grad, const float* x,
                             const std::int32_t* targets, const ParamView& p, ParamView& g,
                             const HeadWorkspace& w, const ModelConfig& c, int T,
                             i64 total_tokens);

}  // namespace sppo
