// The subcommands of `sppo`. Each file of cli/ registers its own on the app, with its
// options and what runs once the command line is parsed; main parses, runs the one given
// and turns errors into exit statuses.
#pragma once

#include <functional>
#include <vector>

namespace CLI {
class App;
}

namespace sppo::cli {

// How sppo was started: what a command needs beyond its options (a run resuming a
// checkpoint parses its command line again with the recorded options; a benchmark of
// several ranks starts itself again under mpirun).
struct Invocation {
  CLI::App& app;
  int argc;
  char** argv;
};

struct Command {
  CLI::App* app;                                // the subcommand; it runs when it was given
  std::function<int(const Invocation&)> run;    // returns the exit status
};
using Commands = std::vector<Command>;

void add_train_commands(CLI::App& app, Commands& out);    // train, grads (cmd_train.cpp)
void add_bench_commands(CLI::App& app, Commands& out);    // bench layer|attention|memory|offload|pipeline|sp|sim
void add_plan_commands(CLI::App& app, Commands& out);     // plan, simulate (cmd_plan.cpp)
void add_profile_command(CLI::App& app, Commands& out);   // profile
void add_model_commands(CLI::App& app, Commands& out);    // import, export (cmd_model.cpp)
void add_plot_command(CLI::App& app, Commands& out);      // plot
void add_eval_command(CLI::App& app, Commands& out);      // eval (cmd_eval.cpp)

}  // namespace sppo::cli
