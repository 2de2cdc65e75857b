// `sppo eval`: a model's loss on held-out sequences, by position, through SPPO's forward
// alone (train/eval.h), at lengths its training could not hold in the same memory.
#include <CLI/CLI.hpp>
#include <memory>
#include <utility>
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
  // The shared options as an evaluation reads them.
  const std::pair<const char*, const char*> reworded[] = {
      {"--init", "The weights to evaluate (required): an sppo checkpoint (train --save, sppo import) or a Hugging Face "
                 "model directory; its model is used unless --model is given"},
      {"--data", "The held-out data, read in windows of --seq-len + 1 tokens: empty for the built-in repeat task, a "
                 "text file (bytes), raw tokens (.u16/.u32), or a Megatron .bin/.idx prefix"},
      {"--labels", "The targets of --data, one per token as Hugging Face writes labels (the label of token i+1 is "
                   "what position i predicts), -100 where nothing is scored; gives the accuracy too"},
      {"--subseqs", "Subsequences N per sequence, or 'auto' (the fewest whose forward fits --device-memory, else "
                    "about 8K tokens each)"},
      {"--kv-cache", "Where finished subsequences' K/V live: device, host (streamed back to each later "
                     "subsequence's attention, a chunk at a time), or auto (the device unless that does not fit the "
                     "budgets, then the host on the fewest layers that fit)"},
      {"--host-memory", "Host memory budget for the K/V on the host, e.g. 2GiB (default: unlimited)"},
      {"--dp", "Data-parallel replicas, each evaluating its share of the sequences"}};
  for (const auto& [name, text] : reworded) cmd->get_option(name)->description(text);
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
