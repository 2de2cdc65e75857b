// `sppo eval`: a model's loss on held-out sequences, by position, through SPPO's forward
// alone (train/eval.h), at lengths its training could not hold in the same memory.
#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "cli/config_file.h"
#include "cli/step_options.h"
#include "core/check.h"
#include "train/eval.h"

namespace sppo::cli {

void add_eval_command(CLI::App& app, Commands& out) {
  struct Eval {
    EvalOptions options;
    StepFlags flags;
    std::string config;
  };
  auto e = std::make_shared<Eval>();
  CLI::App* cmd = app.add_subcommand(
      "eval", "Evaluate a model's loss on held-out sequences, by position, running the forward alone");
  add_config_option(cmd, e->config);
  add_step_options(cmd, e->flags, e->options.step);
  // What trains but has nothing to do in a forward: an evaluation offloads nothing,
  // recomputes nothing and keeps no gradients or optimizer state.
  for (const char* name : {"--objective", "--offload", "--recompute", "--recompute-tensors", "--backward-order",
                           "--weights", "--residual-grads", "--rebuild-inputs", "--msp", "--msp-reach", "--zero",
                           "--batch", "--plan", "--pack", "--mlp-tile-rows"})
    if (CLI::Option* opt = cmd->get_option_no_throw(name)) cmd->remove_option(opt);
  cmd->add_option("--out", e->options.out, "Directory for eval.json and loss_by_position.svg");
  cmd->add_option("--seqs", e->options.seqs,
                  "Sequences to evaluate (default: every whole sequence of --data; the built-in task: 1)");
  out.push_back({cmd, [e, cmd](const Invocation&) {
                   apply_config_file(cmd, e->config);
                   e->options.step.forward_only = true;
                   resolve_step_options(e->flags, e->options.step);
                   return run_eval(e->options);
                 }});
}

}  // namespace sppo::cli
