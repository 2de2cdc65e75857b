// `sppo plan --explain`: device (and host) memory of a plan term by term, each with the
// formula behind it, for SPPO and the two baselines side by side.
//  - sppo: the simulator's own accounting at the peak of the fullest rank (schedule/memory.h
//    RankMemory: the rules the runtime's arena matches to the byte), so the terms sum to the
//    predicted peak exactly;
//  - megatron, deepspeed: the published accounting of each system (Note [Baseline memory]
//    in baselines.cpp), at the moment of its peak.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/dims.h"
#include "planner/plan.h"
#include "planner/profile.h"

namespace sppo::sim {

// The rows every system's table has, in this order (a system without a term shows "-").
enum class Row {
  Weights,
  Gradients,
  Optimizer,
  KVCache,
  KVGradAccum,
  Units,          // activation units: device bytes, and the offloaded part in the host column
  Checkpoints,    // checkpointed layer inputs (full recomputation)
  Recompute,      // the recomputed layer's saved activations
  Hidden,         // whole-sequence hidden states and their gradients between layers and stages
  LayerWorkspace, // one layer's scratch while it runs
  AttentionWorkspace,
  Logits,         // logits and loss
  CommBuffers,    // ring / all-to-all / all-gather / pipeline message buffers
  Borrowed,       // MSP: another stage's weights and gradients on a helper
  StepInputs,     // the step's token ids and loss sum
  kCount
};
const char* to_string(Row r);

struct MemoryLine {
  Row row = Row::Weights;
  i64 device = 0;
  i64 host = 0;
  std::string formula;
};

// Where an SPPO plan puts one kind of saved tensor of a layer, and why.
struct TensorPlacement {
  std::string tensors;     // names in the activation table (core/layout.h), or "dK/dV sums"
  i64 bytes_per_token = 0; // per token and layer, this rank's shards
  std::string placement;   // "device", "device, offloaded at alpha", "host", "recomputed", ...
  std::string why;
};

struct MemoryExplain {
  std::string system;
  std::string layout;              // e.g. "sp 8 pp 4 dp 1 N 32"
  std::string where;               // the device and the moment of the peak
  i64 budget = 0;                  // what the plan must fit (device memory less the reserve)
  i64 device_memory = 0;
  i64 reserve = 0;                 // the profile's framework and allocator reserve
  std::vector<MemoryLine> lines;   // one per Row
  std::vector<std::string> notes;  // symbols and sources
  std::vector<TensorPlacement> placements;  // sppo only: every saved tensor of a layer, placed

  i64 device_total() const;
  i64 host_total() const;
};

MemoryExplain explain_memory(const plan::Plan& p, const plan::HardwareProfile& hw);
std::string explain_text(const MemoryExplain& m);
nlohmann::json to_json(const MemoryExplain& m);

}  // namespace sppo::sim
