// Faults on purpose, for the tests that prove a failing rank ends the whole job instead of
// hanging it. Read once from the environment variable SPPO_FAULT; unset means none:
//   SPPO_FAULT=die:R:K    rank R kills itself (SIGKILL) as it starts step K (1-based)
//   SPPO_FAULT=drop:R:K   rank R drops its K-th message send (1-based) of the run
//   SPPO_FAULT=nan:R:K    rank R's gradient is not finite in step K
// Nothing else in the engine reads it.
#pragma once

namespace sppo {

struct FaultPlan {
  enum class Kind { None, Die, Drop, Nan };
  Kind kind = Kind::None;
  int rank = -1;
  int count = 0;  // the step (Die, Nan) or the send (Drop)
};

const FaultPlan& fault_plan();

}  // namespace sppo
