// The runtime: executes a schedule (schedule/ir.h) with real tensors on the CPU backend.
//
// Memory follows the rules the simulator models (sim/): parameters, gradients and AdamW
// moments are resident in the device tier; F(i) allocates, per layer, the block's saved
// tensors (block_saved_specs) and its workspace (freed after the layer), then the head's
// workspace and head_grad; O(i) moves a fraction of subsequence i's offloadable tensors to
// the host tier and frees their device bytes when each copy completes; P(i) allocates them
// again and copies back; B(i) allocates each layer's dK/dV accumulators the first time the
// backward touches the layer and frees K_i, V_i, dK_i, dV_i and the unit of (l, i) when
// layer l of subsequence i is done.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "model/gpt.h"
#include "runtime/memory.h"
#include "schedule/ir.h"

namespace sppo {

struct RuntimeOptions {
  i64 device_budget = 0;    // bytes; 0 = unlimited
  bool recompute = false;   // baseline: keep only block inputs, recompute the rest in backward
  int head_chunk = 1024;    // rows of logits computed at once
  bool record_memory = false;  // keep the device tier's timeline in StepResult::memory
};

// One span of the step's timeline: the op that ran, on which lane, when.
enum class Lane { Compute, CopyOut, CopyIn };
struct TraceSpan {
  std::string name;   // "F3", "O2", "wait P1", ...
  sched::OpKind kind;
  Lane lane;
  double start_s = 0;  // since the step started
  double dur_s = 0;
};

struct StepResult {
  double loss = 0;                // mean cross-entropy over the S predicted tokens
  std::vector<float> losses;      // [S] per-position losses
  MemoryStats device;             // device tier over the step (peak = high-water mark)
  i64 offloaded_bytes = 0;        // bytes copied to the host tier during the step
  double exposed_copy_s = 0;      // compute time spent waiting on copies
  double step_s = 0;              // wall time of the step
  std::vector<TraceSpan> trace;
  std::vector<std::pair<double, i64>> memory;  // (s since step start, device bytes in use)
};

class Runtime {
 public:
  Runtime(const ModelConfig& c, const RuntimeOptions& o);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // Keep the device tier's timeline of the next steps (for traces).
  void record_memory(bool on) { opts_.record_memory = on; }

  const ModelConfig& config() const { return config_; }
  i64 num_params() const { return config_.num_params(); }
  float* params() { return params_.f32(); }
  float* grads() { return grads_.f32(); }
  float* adam_m() { return adam_m_.f32(); }
  float* adam_v() { return adam_v_.f32(); }
  MemoryTier& device() { return *device_; }
  MemoryTier& host() { return *host_; }

  // One forward/backward over S + 1 tokens (inputs tokens[0..S), targets tokens[1..S]),
  // in the order the schedule says. Gradients are zeroed first and hold the gradient of
  // the mean loss afterwards.
  StepResult step(const sched::Schedule& s, const std::int32_t* tokens);

 private:
  struct StepState;
  void forward(StepState& st, int i);
  void backward(StepState& st, int i);
  void offload(StepState& st, int i, double fraction);
  void prefetch(StepState& st, int i);

  ModelConfig config_;
  RuntimeOptions opts_;
  std::unique_ptr<MemoryTier> device_, host_;
  Buffer params_, grads_, adam_m_, adam_v_;
  ParamView weights_, dweights_;
};


}  // namespace sppo
