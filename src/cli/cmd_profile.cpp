// `sppo profile`: this machine measured as a hardware profile, and `sppo plot`: a run's
// loss curve, or a passkey grid's accuracy heat map.
#include <CLI/CLI.hpp>
#include <omp.h>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

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

namespace {

// A passkey grid (scripts/passkey.py grid writes it) is one JSON object with a "cells"
// array. A metrics file is JSON Lines: it parses whole only when it has a single line,
// and no step record has "cells", so the two never pass for each other. Returns nullopt
// for anything that is not a grid (the loss-curve reader then reports what is wrong
// with it as a metrics file); throws naming the file and cell when a grid's cell is
// malformed.
std::optional<std::vector<io::GridCell>> read_passkey_grid(const std::string& path) {
  std::ifstream in(path);
  if (!in.good()) return std::nullopt;
  const auto doc = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!doc.is_object() || !doc.contains("cells")) return std::nullopt;
  const auto& cells = doc["cells"];
  SPPO_CHECK(cells.is_array() && !cells.empty(), "plot")
      << path << ": \"cells\" should be a non-empty array of {\"length\", \"depth\", \"accuracy\"}";
  std::vector<io::GridCell> grid;
  std::set<std::pair<std::int64_t, double>> seen;
  for (std::size_t k = 0; k < cells.size(); ++k) {
    const auto& c = cells[k];
    const auto where = [&] { return path + " cells[" + std::to_string(k) + "]"; };
    SPPO_CHECK(c.is_object(), "plot") << where() << " is not an object {\"length\", \"depth\", \"accuracy\"}";
    const auto length = c.find("length"), depth = c.find("depth"), accuracy = c.find("accuracy");
    SPPO_CHECK(length != c.end() && length->is_number_integer() && length->get<std::int64_t>() > 0, "plot")
        << where() << ": \"length\" should be a positive whole number of tokens";
    SPPO_CHECK(depth != c.end() && depth->is_number() && depth->get<double>() >= 0 && depth->get<double>() <= 1,
               "plot")
        << where() << ": \"depth\" should be a number in [0, 1] (0: the haystack's start, 1: its end)";
    // null: a cell the grid did not run (passkey.py stops at a length that does not fit).
    SPPO_CHECK(accuracy != c.end() && (accuracy->is_null() || (accuracy->is_number() && accuracy->get<double>() >= 0 &&
                                                                accuracy->get<double>() <= 1)),
               "plot")
        << where() << ": \"accuracy\" should be a number in [0, 1], or null for a cell not run";
    const io::GridCell cell{length->get<std::int64_t>(), depth->get<double>(),
                            accuracy->is_null() ? std::numeric_limits<double>::quiet_NaN() : accuracy->get<double>()};
    SPPO_CHECK(seen.emplace(cell.length, cell.depth).second, "plot")
        << where() << " repeats length " << cell.length << " at depth " << cell.depth;
    grid.push_back(cell);
  }
  return grid;
}

}  // namespace

void add_plot_command(CLI::App& app, Commands& out) {
  struct Plot {
    std::string metrics, out, title;
  };
  auto o = std::make_shared<Plot>();
  auto* cmd = app.add_subcommand("plot",
                                 "Draw a run's loss curve (whole sequence, near and far positions) from its --metrics "
                                 "file, or a passkey grid's accuracy by length and depth, as SVG");
  cmd->add_option("metrics", o->metrics,
                  "The run's metrics file (train --metrics FILE.jsonl), or a passkey grid's passkey.json "
                  "(scripts/passkey.py grid)")
      ->required();
  cmd->add_option("--out", o->out, "Where to write the SVG")->required();
  cmd->add_option("--title", o->title,
                  "Heading of the plot (default: the metrics file's name; for a passkey grid \"Passkey retrieval: "
                  "accuracy by length and depth\")");
  out.push_back({cmd, [o](const Invocation&) {
                   SPPO_CHECK(std::filesystem::path(o->out).extension() == ".svg", "plot")
                       << "--out " << o->out << " should name an .svg file; the input file is never overwritten";
                   if (const auto grid = read_passkey_grid(o->metrics)) {
                     const std::string title =
                         o->title.empty() ? "Passkey retrieval: accuracy by length and depth" : o->title;
                     io::write_file_atomic(o->out, io::svg_accuracy_grid(*grid, title));
                     double sum = 0;
                     int run = 0;
                     for (const io::GridCell& c : *grid) {
                       if (!std::isfinite(c.accuracy)) continue;
                       sum += c.accuracy;
                       ++run;
                     }
                     std::printf("wrote %s: passkey grid of %zu cells, %d of them run", o->out.c_str(), grid->size(),
                                 run);
                     if (run > 0) std::printf(", mean accuracy %.3f", sum / run);
                     std::printf("\n");
                     return 0;
                   }
                   const auto curve = io::read_loss_curve(o->metrics);
                   io::write_file_atomic(o->out, io::svg_loss_curve(curve, o->title.empty() ? o->metrics : o->title));
                   std::printf("wrote %s: %zu steps, loss %.4f -> %.4f\n", o->out.c_str(), curve.size(),
                               curve.front().loss, curve.back().loss);
                   return 0;
                 }});
}

}  // namespace sppo::cli
