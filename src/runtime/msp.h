// Multiplexed sequence partitioning (MSP, Note [MSP pieces] in schedule/builders.cpp): a
// stage's owner lends its weights to helper ranks, which run pieces of its subsequences
// through its layers. This part holds the weights a helper borrows and sends and receives
// MSP's messages.
//
// Contract: every MSP message is a set of arrays sent one after another with the op's tag,
// which MPI keeps in order between two ranks:
//  - Weights: the owner's parameters (all it owns: under tensor parallelism its shard, to
//    the helper group's member of the same index) to a helper, which holds them from that
//    Recv until its last F/B on those layers before the next lease of them, or until it
//    sends their gradients (weights_for hands them to F and B);
//  - KV: a helper's K, V of its piece, per layer, to the owner, which holds them in the
//    K/V store for its own later subsequences' attention;
//  - KVGrad: the owner's dK/dV sums of such a piece back to the helper, received into its
//    accumulators of the piece before its backward of it;
//  - WeightGrads: a helper's gradients of the borrowed layers (allocated zeroed at its
//    first backward on them, or at the first forward through the LM head) and, after the
//    last stage, its loss sum and per-position losses, added to the owner's (+=). The
//    helper waits for the gradients to leave before it computes on (send_now), so they
//    are freed where the memory rules free them.
// At the end of a step nothing is borrowed (check_empty).
#pragma once

#include <cstddef>
#include <map>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"
#include "core/config.h"
#include "model/gpt.h"
#include "runtime/grad_reduce.h"
#include "runtime/kv_store.h"
#include "runtime/memory.h"
#include "runtime/stage_messages.h"
#include "runtime/step_io.h"
#include "schedule/ir.h"

namespace sppo {

// The weights an F/B op runs with, their gradients (accumulate +=) and the GEMMs' copy.
struct StageWeights {
  const ParamView* w;
  ParamView* g;
  const MatrixView* m;
};

// This rank's own parameters: what an owner lends, and what its helpers' gradients add to.
struct OwnWeights {
  const Buffer& params;  // [count] fp32, flat (parameter_specs order)
  Buffer& grads;         // [count] fp32, accumulate (+=)
  i64 count;
  StageWeights views;    // of the owned layers
};

class MspExchange {
 public:
  // `ops`: this rank's. `tp`: its tensor-parallel shard, which an owner lends and a helper
  // borrows (member t of the owner's group to member t of the helper's). `loss_sum`: the
  // step's loss sum on the device (one double).
  MspExchange(comm::Comm* comm, Backend& be, MemoryTier& device, const ModelConfig& c, const TpShard& tp,
              const sched::Schedule& sc, const std::vector<sched::Op>& ops, std::pair<int, int> layers,
              OwnWeights own, KvStore& kv, StageMessages& messages, GradReduce& grads, const Buffer& loss_sum,
              StepResult& result);

  // The weights F/B op `op` runs with: this rank's own, or another stage's lent to it.
  StageWeights weights_for(const sched::Op& op);
  // Send op `op` of an MSP payload.
  void send(const sched::Op& op);
  // Recv op `op`, the `index`-th: the seconds spent waiting for it.
  double receive(const sched::Op& op, std::size_t index);
  // After op `index`: the lease of borrowed weights that ends there is released.
  void end_lease(std::size_t index);
  // Nothing borrowed left (ASSERT).
  void check_empty() const;

 private:
  // Another stage's weights lent to this rank, by layer range, and their gradients.
  struct Borrowed {
    Buffer w, g;
    ParamView wv, gv;
    MatrixView mv;
    i64 count = 0;
  };

  comm::Comm* comm_;
  Backend& be_;
  MemoryTier& device_;
  const ModelConfig& config_;
  TpShard tp_;
  DType act_;
  const sched::Schedule& sched_;
  int lb_, le_;
  OwnWeights own_;
  KvStore& kv_;
  StageMessages& messages_;
  GradReduce& reduce_;
  const Buffer& loss_sum_;
  StepResult& result_;
  std::map<std::pair<int, int>, Borrowed> borrowed_;
  std::map<std::size_t, std::pair<int, int>> lease_ends_;  // op index -> lease released after it
  double helper_loss_ = 0;                                  // loss sum sent with the weight gradients
};

}  // namespace sppo
