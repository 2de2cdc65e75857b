// The one validator of schedules (docs/design.md, Conventions 2), run by every builder test:
//  - every B after its F (same layers, subsequence, piece), each exactly once;
//  - every offload after its forward, every prefetch after its offload, every wait after
//    its start, every backward of an offloaded subsequence after its prefetch wait;
//  - sends match receives in order, ring steps pair up and all-reduce groups agree,
//    checked by executing the matching (a schedule that would deadlock fails);
//  - with memory rules: device bytes in program order (an offload's bytes are counted
//    until its wait: an upper bound of the timed peak) never exceed the budget;
//  - every store is empty at the end: no host bytes left, no device activation bytes.
#pragma once

#include <string>
#include <vector>

#include "schedule/ir.h"
#include "schedule/memory.h"

namespace sppo::sched {

struct ValidateOptions {
  const MemoryRules* memory = nullptr;  // null: skip the memory checks
  i64 budget = 0;                       // device bytes per rank; 0: no limit
};

struct Validation {
  std::vector<std::string> errors;  // empty when valid
  std::vector<i64> peak_bytes;      // per rank, program-order peak (with memory rules)

  bool ok() const { return errors.empty(); }
  std::string message() const;      // errors joined by newlines
};

Validation validate(const Schedule& s, const ValidateOptions& options = {});

// Why `s` cannot rebuild the layer inputs it names (Note [Rebuilt layer inputs] in
// builders.cpp), with what would work; empty when it can (or rebuilds none). validate
// reports it too; the runtime and the option parsing call it alone.
std::string rebuilt_inputs_error(const Schedule& s);

}  // namespace sppo::sched
