// Model configuration and presets. Pure data: the planner, the simulator and the runtime
// all read it, so it lives in core and includes nothing of kernels or backends.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/dims.h"

namespace sppo {

// Limits ModelConfig::validate() enforces: far beyond any real model, they keep parameter
// counts and byte counts inside 64 bits.
inline constexpr int kMaxHidden = 1 << 20;
inline constexpr int kMaxLayers = 1 << 16;
inline constexpr int kMaxFfnMult = 64;
inline constexpr int kMaxHeadDim = 1024;  // A given directly (head_dim)
inline constexpr double kMaxParams = 1e15;

// The block a model is built from (docs/design.md 2 for GPT). Llama-family blocks (Llama 2/3,
// Mistral, Qwen2, Qwen3) use RMSNorm, a SwiGLU MLP of their own intermediate size F,
// grouped-query attention (G key/value heads shared by groups of Z / G query heads), no
// biases but optionally the q/k/v projection's (Qwen2), and an LM head of its own. Their
// head size A may be given apart from H / Z (Qwen3: 16 heads of 128 on H 1024), and their
// queries and keys may pass an RMSNorm of each head's A values before RoPE (Qwen3).
enum class Family { Gpt, Llama };

// RoPE frequency scaling as Hugging Face's config.json names it ("rope_scaling"); the
// frequencies themselves: core/rope.h.
struct RopeScaling {
  enum class Type { None, Linear, Dynamic, Yarn, Llama3 };
  Type type = Type::None;
  double factor = 1.0;
  i64 original_max_positions = 0;                  // llama3: the context it was trained at
  double low_freq_factor = 1.0, high_freq_factor = 4.0;  // llama3
  double beta_fast = 32.0, beta_slow = 1.0;         // yarn
  double attention_factor = 0.0;                    // yarn: scale of cos and sin; 0: 0.1 ln(factor) + 1
};
const char* rope_scaling_name(RopeScaling::Type t);  // "none", "linear", "dynamic", "yarn", "llama3"

// Note [Head size]
// ~~~~~~~~~~~~~~~~
// GPT's heads split the hidden size: A = H / Z. A Llama-family model may give A itself
// (head_dim), so that its attention is Z A wide where the residual stream is H: Qwen3-0.6B
// runs 16 heads of 128 on H 1024, Qwen3-32B 64 of 128 on 5120. Everything of the
// attention is then Z A (or G A) wide: the q rows of the projection [Z A, H] and its k and v
// rows [G A, H], q and attn_out [T, Z A], the LSE [Z, T], the output projection [H, Z A],
// the ring's travelling queries and their partial outputs; everything of the residual
// stream, the norms and the MLP stays H. q_width() names the first, hidden the second; a
// tensor-parallel member's share of the first is TpShard::local_hidden (its heads x A).
struct ModelConfig {
  int vocab = 0;              // V
  int hidden = 0;             // H
  int layers = 0;             // L
  int heads = 0;              // Z
  int ffn_mult = 4;           // F = ffn_mult * H (GPT)
  float rope_theta = 10000.0f;
  float ln_eps = 1e-5f;       // LayerNorm's eps, or RMSNorm's
  bool causal = true;         // false: bidirectional attention (every query sees every key)
  Family family = Family::Gpt;
  int kv_heads = 0;           // G: key/value heads (grouped-query attention); 0: Z
  int ffn_size = 0;           // F given directly (a Llama's intermediate_size); 0: ffn_mult * H
  bool qkv_bias = true;       // the q/k/v projection has a bias (GPT: every linear has one)
  i64 max_positions = 0;      // max_position_embeddings: "dynamic" and "yarn" scaling's reference length
  RopeScaling rope_scaling;
  i64 rope_seq_len = 0;       // "dynamic" scaling: the sequence length trained at (set by the run)
  // A Llama-family model whose LM head is its embedding (Hugging Face's tie_word_embeddings:
  // Llama 3.2 1B/3B, Qwen2.5 up to 3B, Qwen3 up to 4B). GPT's always is.
  bool tie_embeddings = false;
  // A given directly (Hugging Face's head_dim; a Llama-family model's); 0: H / Z. The
  // queries and the attention output are then Z A wide, whatever H is (Note [Head size]).
  int head_dim = 0;
  // Qwen3's q_norm and k_norm: an RMSNorm over each query and key head's A values (weights
  // [A] shared by the heads), after the projection and before RoPE (Note [Query/key norms]
  // in model/gpt.h).
  bool qk_norm = false;

  bool llama() const { return family == Family::Llama; }
  int head_size() const { return head_dim > 0 ? head_dim : hidden / heads; }  // A
  int kv_head_count() const { return kv_heads > 0 ? kv_heads : heads; }  // G
  int q_width() const { return heads * head_size(); }             // width of q and attn_out: Z A
  int kv_width() const { return kv_head_count() * head_size(); }  // width of k and v: G A
  int qkv_width() const { return q_width() + 2 * kv_width(); }    // the q/k/v projection's outputs
  int ffn() const { return ffn_size > 0 ? ffn_size : ffn_mult * hidden; }  // F
  bool gated() const { return llama(); }                          // SwiGLU: fc makes gate and up
  int fc_width() const { return gated() ? 2 * ffn() : ffn(); }    // outputs of the fc projection
  bool biases() const { return !llama(); }                        // every linear but q/k/v
  bool tied_embeddings() const { return !llama() || tie_embeddings; }  // the LM head is the embedding
  // Weights of a block's four projections (q/k/v [Z A + 2 G A, H], out [H, Z A], fc, proj):
  // a token's forward GEMMs take twice as many FLOPs.
  double layer_matmul_params() const {
    return double(hidden) * (double(qkv_width()) + q_width() + fc_width() + ffn());
  }
  i64 num_params() const;
  // Throws sppo::Error naming the option and what would work.
  void validate() const;
};

// Names of the built-in presets, in the order `--help` lists them.
std::vector<std::string> preset_names();
// Throws sppo::Error listing the presets when the name is unknown.
ModelConfig preset(const std::string& name);

// The `sppo grads` config.json fields: vocab, hidden, layers, heads, ffn_mult, rope_theta, ln_eps,
// and "attention": "bidirectional" for a bidirectional model (absent: causal); a Llama-family
// model adds "family": "llama", kv_heads, ffn_size, qkv_bias, max_positions, "tie_embeddings"
// where its head is its embedding, "head_dim" where A is not H / Z, "qk_norm" where its
// queries and keys have norms, and "rope_scaling" {"type", "factor", ...} (HF's field
// names).
nlohmann::json to_json(const ModelConfig& c);
// HF's "rope_scaling" object ("rope_type" or "type", "factor", ...); throws naming the field.
RopeScaling rope_scaling_from_json(const nlohmann::json& j);
ModelConfig model_config_from_json(const nlohmann::json& j);

// Parses "65536", "64K", "1M", "1.5K" (K = 1024, M = 1048576, G = 2^30; the result must be
// whole), and for bytes "512MiB", "2GiB", "1.5GB" (B, KiB/KB, MiB/MB, GiB/GB, TiB/TB;
// KB = 1000 B; fractions of a byte are dropped). Arithmetic is exact and checked: a value
// above the limit below is refused as too large, naming the limit. `what` names the option
// in errors.
i64 parse_count(const std::string& text, const char* what);
i64 parse_bytes(const std::string& text, const char* what);

// Largest count parse_count accepts: 2^40 (1024G). Sizes derived from a count (S * H * 8
// bytes, S * Z * 4, ...) stay far inside 64 bits.
inline constexpr i64 kMaxCount = i64{1} << 40;
// Largest size parse_bytes accepts: 2^60 bytes (1048576 TiB); sums of a few such sizes
// still fit 64 bits.
inline constexpr i64 kMaxBytes = i64{1} << 60;
std::string format_bytes(double bytes);  // "1.50 GiB"

}  // namespace sppo
