// sppo: the command line. Each subcommand (cli/cmd_*.cpp) registers its options and what it
// runs; main parses, runs the one given, and turns a bad option or input into one
// "[component] message" line and exit status 2 (3: the run does not fit).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <new>

#include "backends/cpu/blas_setup.h"
#include "cli/commands.h"
#include "comm/comm.h"
#include "core/check.h"

int main(int argc, char** argv) {
  using namespace sppo;
  // First: OpenBLAS and libgomp read their settings only when they load.
  cpu::select_library_settings(argv);
  CLI::App app{"sppo: long-sequence transformer training with sequence pipeline parallel offloading", "sppo"};
  app.require_subcommand(1);
  cli::Commands commands;
  cli::add_train_commands(app, commands);
  cli::add_eval_command(app, commands);
  cli::add_bench_commands(app, commands);
  cli::add_plan_commands(app, commands);
  cli::add_profile_command(app, commands);
  cli::add_plot_command(app, commands);
  cli::add_model_commands(app, commands);
  try {
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return app.exit(e) == 0 ? 0 : 2;
    }
    const cli::Invocation invocation{app, argc, argv};
    for (const cli::Command& c : commands)
      if (c.app->parsed()) return c.run(invocation);
    return 0;
  } catch (const Error& e) {
    // Errors that reach here are the same on every rank (train and grads agree on them
    // first), so one rank reports them. 3: the run does not fit; 2: bad input.
    if (!comm::launched_by_mpi() || comm::world().rank() == 0) std::fprintf(stderr, "sppo: %s\n", e.what());
    return dynamic_cast<const DoesNotFit*>(&e) ? 3 : 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "sppo: [memory] this machine ran out of memory; shorten --seq-len or use a smaller model\n");
    return 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sppo: %s\n", e.what());
    return 2;
  }
}
