// `sppo plan` and `sppo simulate`: the planner and the simulator from the command line.
#pragma once

#include <optional>
#include <string>

namespace CLI {
class App;
}

namespace sppo::cli {

struct PlanOptions {
  std::string model = "gpt-7b";
  std::string seq_len = "1M";
  int gpus = 8;
  int gpus_per_node = 8;
  std::string hardware = "a100-80gb";
  std::string system = "sppo";      // sppo | megatron | deepspeed
  std::string offload = "adaptive"; // none | full | paper | adaptive
  std::string msp = "auto";         // auto | on | off
  std::string zero = "auto";        // auto | 0 | 1: ZeRO-1 over each stage's all-reduce group
  std::string ring_layout = "zigzag";  // zigzag | contiguous
  std::string kv_cache = "auto";    // device | host | recompute | auto (the others where nothing fits on the device)
  std::string backward_order = "auto";  // subseq | layer | auto (layer on one stage where nothing else fits)
  std::string rebuild_inputs = "auto";  // none | auto (every other layer's, where nothing else fits)
  std::string optimizer_state = "auto";  // device | host | auto (the host where nothing fits with the device)
  std::string weights = "auto";     // device | host | auto (the host where nothing fits with the state alone there)
  std::string recompute_tensors = "auto";  // a list of tensors or groups, none, or auto (the planner's choice)
  bool explain = false;             // also print device memory term by term
  std::string budget;               // bytes per device; empty: the profile's usable memory
  std::string host_budget;          // host bytes per device; empty: the profile's host_memory_bytes
  std::string out;                  // also write the plan JSON here
  bool json = false;
  bool table = false;               // the comparison table of issue 4 instead of one plan
};

struct SimulateOptions {
  std::string plan;      // PLAN.json
  std::string hardware;  // overrides the plan's profile
  std::string trace;     // Chrome trace JSON output
  std::string svg;       // SVG timeline output
  bool json = false;
};

// Exit status: 0 ok, 2 bad input, 3 nothing fits (prints {"error": "..."}).
int run_plan(const PlanOptions& o);
int run_plan_table(const PlanOptions& o);
int run_simulate(const SimulateOptions& o);


}  // namespace sppo::cli
