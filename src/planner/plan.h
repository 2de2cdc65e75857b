// A plan: everything needed to build and run one training step's schedule, and what the
// simulator predicts for it. Read and written as JSON a user can edit (docs/design.md 5).
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/dims.h"
#include "core/layout.h"
#include "core/step_shape.h"

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

// The systems a plan can be of: SPPO's own, and the paper's two baselines (sim/baselines.h).
enum class System : char { Sppo, Megatron, Deepspeed };
const char* to_string(System s);                  // "sppo" | "megatron" | "deepspeed"
System parse_system(const std::string& text);     // throws sppo::Error naming the choices

// How a plan's alpha was searched (--offload): none; full (every subsequence's unit but the
// last's); the paper's rule (alpha_i A_i = BW_d2h x balanced compute); adaptive (the least
// step time under the budget).
enum class OffloadMode : char { None, Full, Paper, Adaptive };
OffloadMode parse_offload(const std::string& text);  // none | full | paper | adaptive
const char* to_string(OffloadMode m);

// A plan is the shape of its step (core/step_shape.h: the layout, the stages' layer split,
// the placements, the activations' precision and the kernels' scratch), which
// sched::build_step turns into its schedule, with the sequence's partition, alpha and what
// the simulator predicts.
struct Plan : StepShape {
  System system = System::Sppo;
  std::string model_name;         // preset name, or "custom"
  ModelConfig model;
  std::string hardware;           // profile name or path
  i64 seq_len = 0;                // S per replica
  int gpus = 1;
  int gpus_per_node = 1;
  int subseqs = 1;                // N (megatron: 1; deepspeed: FPDT chunks)
  std::vector<i64> lengths;
  std::vector<double> alpha;
  OffloadMode offload = OffloadMode::Adaptive;
  std::string alpha_rule;         // how alpha was chosen
  i64 budget = 0;                 // device bytes the plan must fit
  // The device holds a window of at most kv_window_tokens() earlier tokens a layer whose
  // K/V stream (JSON "kv_window_tokens").
  i64 kv_window_tokens() const;
  Prediction predicted;
  std::vector<std::string> notes;

  const StepShape& shape() const { return *this; }
};

// Devices a plan may name; more would be a corrupted file, and simulating it would build a
// schedule per device.
inline constexpr int kMaxPlanDevices = kMaxRanks;

// The plan JSON (docs/planning.md). The layout is "tp", "ulysses", "cp", "pp", "dp" and
// "zero", each kind of sequence parallelism by its own name; the placements are
// "kv_host_layers", "kv_recompute_layers", "recompute_tensors", "mlp_tile_rows",
// "backward_order", "residual_grads", "weights", "optimizer_state" and "rebuilt_inputs".
nlohmann::json to_json(const Plan& p);
// The plan's layout line as `sppo plan` prints it, e.g. "tp 2 cp 2 pp 4 dp 1 N 64 msp
// kv-host layer-major zero-1": the layout (layout_text of its parallelism, with N for the
// systems that cut subsequences), then each choice that is not the default.
std::string layout_text(const Plan& p);
// Throws sppo::Error naming the missing or inconsistent field. Plans written before the
// kinds of sequence parallelism had their names load too: their "sp" is "cp" ("ulysses"
// where their "sp_kind" says so).
Plan plan_from_json(const nlohmann::json& j);

}  // namespace sppo::plan
