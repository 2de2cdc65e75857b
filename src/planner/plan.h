// A plan: everything needed to build and run one training step's schedule, and what the
// simulator predicts for it. Read and written as JSON a user can edit (docs/design.md 5).
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/dims.h"
#include "core/layout.h"

namespace sppo::plan {

struct Prediction {
  double step_time_s = 0;
  double tokens_per_gpu_per_s = 0;
  double bubble_ratio = 0;
  i64 peak_device_bytes = 0;
  double exposed_copy_s = 0;
  i64 peak_host_bytes = 0;        // host-resident bytes per device at most
  double host_update_s = 0;       // of step_time_s: the optimizer's update on the host (0: none)
};

struct Plan {
  std::string system = "sppo";    // sppo | megatron | deepspeed
  std::string model_name;         // preset name, or "custom"
  ModelConfig model;
  std::string hardware;           // profile name or path
  i64 seq_len = 0;                // S per replica
  int gpus = 1;
  int gpus_per_node = 1;
  int sp = 1, pp = 1, dp = 1, tp = 1;  // tp: tensor parallel (megatron; sppo: train --tp); sp: of the kind sp_kind() names
  int subseqs = 1;                // N (megatron: 1; deepspeed: FPDT chunks)
  std::vector<i64> lengths;
  std::vector<double> alpha;
  bool msp = false;
  int msp_reach = 0;  // groups a split task runs on (Note [MSP reach] in schedule/msp.h): 0 every idle one
  int zero = 0;                   // 1: AdamW state sharded over each stage's all-reduce group (ZeRO-1)
  // Where the fp32 master weights and AdamW m, v of each rank's shard live, and where the
  // update runs: "device", or "host" (train --optimizer-state host).
  std::string optimizer_state = "device";
  // Where the layers' weights and gradients live: "device", or "host" (train --weights
  // host; with the optimizer state there: Note [Weights on the host] in schedule/weights.h).
  std::string weights = "device";
  std::string ring_layout = "zigzag";  // how SP ranks split a subsequence: zigzag | contiguous
  std::vector<int> stage_layers;  // layers per pipeline stage
  std::string offload = "adaptive";  // none | full | paper | adaptive
  std::string alpha_rule;         // how alpha was chosen
  i64 budget = 0;                 // device bytes the plan must fit
  // Layers whose K/V cache lives on the host, and layers that keep no K/V but recompute
  // them from the layer input (sched::Schedule::kv_place; JSON "kv_host_layers",
  // "kv_recompute_layers", their indices). The device then holds a window of at most
  // kv_window_tokens() earlier tokens a layer (JSON "kv_window_tokens").
  std::vector<int> kv_host_layers;
  std::vector<int> kv_recompute_layers;
  i64 kv_window_tokens() const;
  // The saved tensors every layer's backward recomputes (Note [Recomputed tensors] in
  // core/layout.h; JSON "recompute_tensors", their groups: "ln1,ln2,fc_pre", or "none").
  SavedSet recompute = 0;
  // The backward's order (sched::BackwardOrder; JSON "backward_order": "subseq", the
  // paper's, or "layer", one layer's dK/dV sums at a time, in one pipeline stage).
  std::string backward_order = "subseq";
  // Layers whose input the forward does not keep (Note [Rebuilt layer inputs] in
  // schedule/builders.cpp; JSON "rebuilt_inputs", their indices): train --rebuild-inputs.
  std::vector<int> rebuilt_inputs;
  // Rows of every layer's MLP tiles (Note [MLP tiles] in core/layout.h; JSON
  // "mlp_tile_rows"); 0: none.
  i64 mlp_tile_rows = 0;
  // The kernels' scratch a rank draws from its device memory (Backend::block_scratch and
  // head_scratch for the profile's backend: a CPU profile's at its threads; none on GPUs),
  // counted in the peaks as train counts it. JSON "kernel_scratch": {"block": [fixed
  // bytes, bytes a token], "head": [...]}; absent: none.
  KernelScratch block_scratch, head_scratch;
  Prediction predicted;
  std::vector<std::string> notes;
};

// Devices a plan may name; more would be a corrupted file, and simulating it would build a
// schedule per device.
inline constexpr int kMaxPlanDevices = 1 << 20;

// What a plan's `sp` is (the plan JSON's "sp_kind"): "ring" for SPPO and Megatron-LM,
// context parallelism with ring attention (SPPO's runs as `train --cp`, weights replicated
// over the ring); "ulysses" for DeepSpeed, all-to-all between sequence and head splits.
// Tensor parallelism with sequence-parallel regions (Megatron-LM's; the SPPO paper's SP) is
// `tp`, for Megatron-LM and for SPPO (runs as `train --tp`).
std::string sp_kind(const Plan& p);
nlohmann::json to_json(const Plan& p);
// Throws sppo::Error naming the missing or inconsistent field.
Plan plan_from_json(const nlohmann::json& j);

}  // namespace sppo::plan
