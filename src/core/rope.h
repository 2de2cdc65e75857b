// RoPE's frequencies (docs/design.md 2): head dims j and j + A/2 of every head rotate together by
// the angle pos * inv_freq[j], j < A/2 (the rotate-half layout of GPT-NeoX and Hugging Face's
// Llama). Without scaling inv_freq[j] = theta^(-2j/A); the scalings of HF's config.json
// ("rope_scaling") change the frequencies and, for yarn, scale cos and sin by a factor:
//   linear   inv_freq / factor
//   dynamic  theta' = theta (factor S / M - factor + 1)^(A / (A - 2)) once the length
//            trained at S exceeds M = max_position_embeddings (below it: unscaled)
//   yarn     each frequency blended between inv_freq / factor and inv_freq by a ramp over
//            dims whose wavelength fits M between beta_fast and beta_slow turns;
//            cos and sin scaled by attention_factor (0.1 ln(factor) + 1 unless given)
//   llama3   wavelengths longer than original / low_freq_factor divided by factor, shorter
//            than original / high_freq_factor kept, the ones between smoothly interpolated
// (transformers' modeling_rope_utils as of 4.46, computed here in float64.) The table is
// pure data: kernels on every backend take it by value.
#pragma once

#include "core/config.h"
#include "core/dims.h"

namespace sppo {

inline constexpr int kMaxRopeHalf = 256;  // head sizes up to 512

struct RopeTable {
  int half = 0;                   // A / 2
  double scale = 1.0;             // cos and sin are multiplied by it (yarn's attention factor)
  double inv_freq[kMaxRopeHalf];  // radians per position of dims j and j + half
};

// The table of model c's heads (head size A = c.head_size()); "dynamic" scaling reads
// c.rope_seq_len (0: unscaled).
RopeTable rope_table(const ModelConfig& c);
// Plain RoPE of head size A at base theta.
RopeTable rope_table(int A, double theta);

}  // namespace sppo
