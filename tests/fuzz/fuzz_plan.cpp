// Plan JSON (`sppo simulate PLAN.json`, `train --plan`) and hardware profile JSON
// (`--hardware FILE`). A plan that parses must survive a round trip through to_json, and a
// small one is simulated as `sppo simulate` would.
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "planner/plan.h"
#include "planner/profile.h"
#include "sim/solver.h"

using namespace sppo;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const nlohmann::json j = nlohmann::json::parse(data, data + size, nullptr, false);
  if (j.is_discarded()) return 0;
  try {
    (void)plan::profile_from_json(j, "fuzz");
  } catch (const Error&) {
  }
  try {
    const plan::Plan p = plan::plan_from_json(j);
    const plan::Plan q = plan::plan_from_json(plan::to_json(p));
    if (plan::to_json(q) != plan::to_json(p)) __builtin_trap();
    // Bounded, so that an input cannot ask for hours of simulation.
    if (p.gpus <= 16 && p.lengths.size() <= 32 && p.model.layers <= 16 && p.model.hidden <= 4096 &&
        p.model.vocab <= 65536 && p.model.ffn_mult <= 16)
      (void)sim::simulate_plan(p, plan::load_profile("a100-80gb"));
  } catch (const Error&) {
  }
  return 0;
}
