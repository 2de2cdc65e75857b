// `sppo profile`: this machine measured as a hardware profile, and `sppo plot`: a run's
// loss curve.
#include <CLI/CLI.hpp>
#include <omp.h>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/commands.h"
#include "core/check.h"
#include "io/fileutil.h"
#include "io/loss_plot.h"
#include "planner/profile.h"
#include "train/profile_device.h"
#include "train/profile_machine.h"
#include "train/setup.h"

namespace sppo::cli {

void add_profile_command(CLI::App& app, Commands& out) {
  struct Profile {
    std::string out = "profiles/cpu-local.json", backend = "cpu", precision;
    bool quick = false;
    int threads = 0;
  };
  auto o = std::make_shared<Profile>();
  auto* cmd = app.add_subcommand("profile", "Measure this machine (GEMM, attention, copies) as a hardware profile");
  cmd->add_option("--out", o->out, "Where to write the profile JSON")->capture_default_str();
  cmd->add_flag("--quick", o->quick, "Smaller shapes, about a second");
  cmd->add_option("--backend", o->backend, "cpu, cuda or auto: the device to measure")->capture_default_str();
  cmd->add_option("--precision", o->precision, "fp32 or bf16 (default: the backend's)");
  cmd->add_option("--threads", o->threads,
                  "CPU: compute threads of one device (0: all cores); measure with what each rank of "
                  "`mpirun -np R sppo train --threads T` runs, T")
      ->capture_default_str();
  out.push_back({cmd, [o](const Invocation&) {
                   io::check_output_file(o->out, "--out", true);  // before a minute of measuring
                   // The CPU is measured with its own kernels; other devices through the backend.
                   const auto be = make_backend(o->backend, o->precision);
                   SPPO_CHECK(o->threads >= 0, "options")
                       << "--threads " << o->threads << " is negative; use 0 (all cores) or a count";
                   SPPO_CHECK(o->threads == 0 || std::string(be->name()) == "cpu", "options")
                       << "--threads is for the cpu backend; the " << be->name() << " backend's device has its own";
                   if (o->threads > 0) omp_set_num_threads(o->threads);
                   nlohmann::json details;
                   const auto p = std::string(be->name()) == "cpu" ? measure_cpu_profile(o->quick)
                                                                   : measure_backend_profile(*be, o->quick, &details);
                   if (!details.empty()) std::fprintf(stderr, "also measured: %s\n", details.dump().c_str());
                   plan::save_profile(p, o->out);
                   std::printf("%s\n", plan::to_json(p).dump(2).c_str());
                   std::fprintf(stderr, "wrote %s; use it with --hardware %s\n", o->out.c_str(), o->out.c_str());
                   return 0;
                 }});
}

void add_plot_command(CLI::App& app, Commands& out) {
  struct Plot {
    std::string metrics, out, title;
  };
  auto o = std::make_shared<Plot>();
  auto* cmd = app.add_subcommand(
      "plot", "Draw a run's loss curve (whole sequence, near and far positions) from its --metrics file as SVG");
  cmd->add_option("metrics", o->metrics, "The run's metrics file (train --metrics FILE.jsonl)")->required();
  cmd->add_option("--out", o->out, "Where to write the SVG")->required();
  cmd->add_option("--title", o->title, "Heading of the plot (default: the metrics file's name)");
  out.push_back({cmd, [o](const Invocation&) {
                   SPPO_CHECK(std::filesystem::path(o->out).extension() == ".svg", "plot")
                       << "--out " << o->out << " should name an .svg file; the metrics file is never overwritten";
                   const auto curve = io::read_loss_curve(o->metrics);
                   io::write_file_atomic(o->out, io::svg_loss_curve(curve, o->title.empty() ? o->metrics : o->title));
                   std::printf("wrote %s: %zu steps, loss %.4f -> %.4f\n", o->out.c_str(), curve.size(),
                               curve.front().loss, curve.back().loss);
                   return 0;
                 }});
}

}  // namespace sppo::cli
