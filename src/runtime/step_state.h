// One step of a Runtime (runtime/executor.h) from its set-up to its result: the schedule
// checked against the runtime's options, and the parts the step's ops work on.
//
// Contract: check_schedule throws (CHECK) for a schedule this runtime cannot run, before
// anything is built. StepState's constructor reads the rank's op list into the parts
//   act       saved tensors, their offload and prefetch    (runtime/activation_store.h)
//   kv        K/V blocks, their dK/dV sums, attention      (runtime/kv_store.h)
//   messages  hidden states between stages, sends          (runtime/stage_messages.h)
//   grads     the gradient buckets' reduction              (runtime/grad_reduce.h)
//   msp       borrowed weights and MSP's messages          (runtime/msp.h)
//   weights   the layers' weights and gradients on the host (runtime/host_weights.h)
// and allocates nothing from the memory tiers. load_inputs puts the step's token ids, targets and loss sum on
// the device (the memory rules' step_input_bytes, schedule/memory.h); start opens the
// step's accounting and clock; finish waits for every message and copy, checks that
// every part is empty, and completes the result.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "core/config.h"
#include "core/layout.h"
#include "runtime/activation_store.h"
#include "runtime/grad_reduce.h"
#include "runtime/host_weights.h"
#include "runtime/kv_store.h"
#include "runtime/memory.h"
#include "runtime/msp.h"
#include "runtime/stage_messages.h"
#include "runtime/step_io.h"
#include "runtime/tensor_parallel.h"
#include "schedule/ir.h"

namespace sppo {

// What a step works with that outlives it: its Runtime's model, options, backend, memory
// tiers and parameters.
struct StepContext {
  const ModelConfig& config;
  const RuntimeOptions& opts;
  Backend& be;
  MemoryTier& device;
  MemoryTier& host;
  ActPrecision precision;                   // of the activations
  std::pair<int, int> layers;               // the rank's own [begin, end)
  const std::vector<TensorSpec>& specs;     // their parameters, flat in this order
  const std::vector<ParamBucket>& buckets;
  const std::vector<ShardSpan>& shard;
  OwnWeights own;
  const HostLayers* host_layers;  // the layers' weights on the host (--weights host); null: on the device
  int& sent_messages;  // hidden-state sends so far, over the runtime's life (runtime/fault.h)
};

// Throws for a schedule that this runtime cannot run (one of another job, or a layout its
// options exclude).
void check_schedule(const sched::Schedule& sc, const StepContext& ctx);

struct StepState {
  // `sc` passed check_schedule.
  StepState(const StepContext& c, const sched::Schedule& sc, const StepControl& ctl, StepResult& res);
  ~StepState();
  StepState(const StepState&) = delete;
  StepState& operator=(const StepState&) = delete;

  // The step's token ids (and a masked-token model's targets) and its loss sum, on the
  // device.
  void load_inputs(const std::int32_t* tokens);
  // Peaks are measured, and the timeline taken, from here.
  void start();
  // After the last op.
  void finish();

  const StepContext ctx;
  const sched::Schedule& sched;
  const std::vector<sched::Op>& ops;  // this rank's
  const StepControl control;
  StepResult& result;
  const i64 S;                            // tokens of the sequence
  i64 predicted = 0;                      // positions of this sequence whose token is predicted
  i64 loss_tokens = 0;                    // what the loss divides by (StepControl::loss_tokens)
  const std::int32_t* targets = nullptr;  // on the device: [S] target of every position
  Buffer ids;                             // [S + 1] token ids, or [2S] ids and targets, on the device
  Buffer loss_sum;                        // one double on the device, accumulate (+=)
  std::unique_ptr<TpGroup> tp;            // the tensor-parallel group (tp > 1)
  ActivationStore act;
  KvStore kv;
  StageMessages messages;
  GradReduce grads;
  MspExchange msp;
  HostWeights weights;  // the layers' weights and gradients with --weights host
  i64 sent_at_start = 0;  // the communicator's bytes_sent() when the step started
};

}  // namespace sppo
