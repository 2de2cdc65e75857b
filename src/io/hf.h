// Hugging Face checkpoints in and out (Llama-family models): `sppo import`, `train --init
// HF_DIR` and `sppo export --format hf`.
//
// A Hugging Face model directory holds config.json (with "architectures") and its weights
// in model.safetensors, or in shards model-0000k-of-0000n.safetensors listed by
// model.safetensors.index.json ("weight_map": tensor -> file). Names and layouts map to
// sppo's (core/layout.h parameter_specs):
//   model.embed_tokens.weight                       embed.weight
//   model.layers.{l}.input_layernorm.weight         blocks.{l}.ln1.weight
//   model.layers.{l}.self_attn.{q,k,v}_proj.weight  blocks.{l}.attn.qkv.weight, rows q | k | v
//   model.layers.{l}.self_attn.{q,k,v}_proj.bias    blocks.{l}.attn.qkv.bias (Qwen2)
//   model.layers.{l}.self_attn.{q,k}_norm.weight    blocks.{l}.attn.{q,k}_norm.weight (Qwen3)
//   model.layers.{l}.self_attn.o_proj.weight        blocks.{l}.attn.out.weight
//   model.layers.{l}.post_attention_layernorm.weight  blocks.{l}.ln2.weight
//   model.layers.{l}.mlp.{gate,up}_proj.weight      blocks.{l}.mlp.fc.weight, rows gate | up
//   model.layers.{l}.mlp.down_proj.weight           blocks.{l}.mlp.proj.weight
//   model.norm.weight                               ln_f.weight
//   lm_head.weight                                  lm_head.weight
// HF's rotary layout (each head's dims j and j + A/2 rotate together) is sppo's, so q and k
// rows need no permutation. config.json's head_dim is A (Note [Head size] in
// core/config.h; Qwen3's default 128). Whatever sppo cannot represent (another
// architecture, sliding windows, biases beyond q/k/v, partial rotary) is refused, naming
// the config field or tensor.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/config.h"

namespace sppo::io {

// Whether `path` is a directory whose config.json names "architectures".
bool is_hf_dir(const std::string& path);

// The model of an HF config.json (`file` names it in errors). Throws sppo::Error naming
// the field sppo cannot represent.
ModelConfig hf_model_config(const nlohmann::json& config, const std::string& file);
// Reads DIR/config.json.
ModelConfig hf_read_config(const std::string& dir);

// Reads every weight of the model in DIR into `params` (parameter_specs(c) order, fp32;
// F32, BF16 and F16 tensors are converted). Every tensor is checked (present, its shape,
// no unknown tensor, every shard listed present) before `params` changes.
void hf_read_weights(const std::string& dir, const ModelConfig& c, float* params);

// HF's config.json for model c. `max_positions` (0: the model's) becomes
// max_position_embeddings where the RoPE scaling does not scale from it.
nlohmann::json hf_config_json(const ModelConfig& c, const std::string& torch_dtype, i64 max_positions);

// Writes DIR/config.json and the weights (parameter_specs(c) order in `params`) in `dtype`
// ("float32" or "bfloat16"): model.safetensors, or shards of at most `shard_bytes` with
// their index. DIR is created; files there of the same names are replaced.
void hf_write(const std::string& dir, const ModelConfig& c, const float* params, const std::string& dtype,
              i64 max_positions, i64 shard_bytes);

}  // namespace sppo::io
