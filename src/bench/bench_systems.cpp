#include "bench/bench_systems.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "bench/longest.h"
#include "core/check.h"
#include "core/timing.h"
#include "io/fileutil.h"
#include "planner/profile.h"
#include "sim/solver.h"
#include "train/parallel.h"
#include "train/profile_machine.h"
#include "train/setup.h"

namespace sppo {

namespace {

const plan::System kSystems[] = {plan::System::Sppo, plan::System::Megatron, plan::System::Deepspeed};

struct Profile {
  plan::HardwareProfile hw;
  std::string path;  // the file plans and train read
};

// The ranks' profile: `hardware`, or measured now on every rank at once (one thread each, as
// they will compute), rank 0's; one node of the four ranks.
Profile ranks_profile(const BenchSystemsOptions& o, comm::Comm& world, const std::string& root) {
  Profile p;
  if (o.hardware.empty()) {
    const plan::HardwareProfile mine = measure_cpu_profile(true);
    const auto all = comm::allgather_strings(world, plan::to_json(mine).dump(), "rank 0's profile");
    p.hw = plan::profile_from_json(nlohmann::json::parse(all[0]), "rank 0's profile");
  } else {
    p.hw = plan::load_profile(o.hardware);
  }
  p.hw.threads = 1;
  p.hw.devices_per_node = kBenchSystemsRanks;
  p.path = root + "/profile.json";
  if (world.rank() == 0) plan::save_profile(p.hw, p.path);
  comm::barrier(world, "the profile's file");
  return p;
}

sim::PlanRequest request(const BenchSystemsOptions& o, const Profile& prof, plan::System system, i64 S) {
  sim::PlanRequest r;
  r.model_name = o.model;
  r.model = preset(o.model);
  r.seq_len = S;
  r.gpus = r.gpus_per_node = kBenchSystemsRanks;
  r.hardware = prof.path;
  r.hw = prof.hw;
  r.system = system;
  r.budget = o.budget;
  // The CPU kernels' scratch at one thread, from the device tier, as train counts it.
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  r.block_scratch = cpu->block_scratch(r.model);
  r.head_scratch = cpu->head_scratch(r.model, RuntimeOptions{}.head_chunk);
  return r;
}

// The system's plan at S, or why none fits.
sim::PlanOutcome plan_at(const BenchSystemsOptions& o, const Profile& prof, plan::System system, i64 S) {
  try {
    return sim::solve_plan(request(o, prof, system, S));
  } catch (const Error& e) {  // a length past what the search reaches
    sim::PlanOutcome out;
    out.error = e.what();
    return out;
  }
}

// The longest multiple of kLengthStep up to the cap that the system fits (0: none).
i64 longest(const BenchSystemsOptions& o, const Profile& prof, plan::System system) {
  return longest_fitting(kLengthStep, o.cap, [&](i64 S) { return plan_at(o, prof, system, S).ok; });
}

// A plan run on the ranks: train --plan's setup, one warm-up step and `reps` timed ones;
// the step is the slowest rank's (median over the timed steps), each rank's peak its
// highest.
struct Measured {
  double step_s = 0, simulated_s = 0;
  std::vector<i64> peak, predicted_peak;
};

Measured run_plan(const BenchSystemsOptions& o, const Profile& prof, const plan::Plan& p, comm::Comm& world,
                  const std::string& file) {
  if (world.rank() == 0) {
    std::ofstream out(file);
    out << plan::to_json(p).dump(2);
  }
  comm::barrier(world, "the plan's file");
  StepOptions so;
  so.model = p.model;
  so.model_name = o.model;
  so.seq_len = p.seq_len;
  so.plan_path = file;
  so.hardware = prof.path;
  so.threads = 1;
  so.data = "repeat";
  so.device_memory = o.budget;
  // What train's options take from a plan when not given (cli/step_options.cpp); the
  // placements left auto are the plan's in the setup.
  so.par.zero = p.par.zero;
  so.mlp_tile_rows = p.place.mlp_tile_rows;
  StepSetup s;
  on_every_rank(world, [&] { s = make_setup(so, &world); });
  prepare_groups(world, s.schedule, s.config);
  init_owned(*s.runtime, so.seed);
  std::vector<std::int32_t> tokens(std::size_t(p.seq_len + 1));
  s.data->next(tokens.data(), p.seq_len + 1);
  Measured m;
  m.simulated_s = s.predicted_step_s;
  m.predicted_peak = s.predicted_peak_per_rank;
  m.peak.assign(std::size_t(world.size()), 0);
  std::vector<double> steps;
  for (int r = 0; r < o.reps + 1; ++r) {
    const StepResult res = s.runtime->step(s.schedule, tokens.data());
    std::vector<double> v(std::size_t(world.size()) * 2, 0.0);
    v[std::size_t(world.rank()) * 2] = res.step_s;
    v[std::size_t(world.rank()) * 2 + 1] = double(res.device.peak);
    comm::allreduce_sum(world, v, comm::world_group(world), "the benchmark's step figures");
    double slowest = 0;
    for (int k = 0; k < world.size(); ++k) {
      slowest = std::max(slowest, v[std::size_t(k) * 2]);
      m.peak[std::size_t(k)] = std::max(m.peak[std::size_t(k)], i64(v[std::size_t(k) * 2 + 1]));
    }
    if (r > 0) steps.push_back(slowest);  // the first is the warm-up
  }
  m.step_s = median(steps);
  return m;
}

}  // namespace

nlohmann::json bench_systems(const BenchSystemsOptions& o, comm::Comm& world) {
  SPPO_CHECK(world.size() == kBenchSystemsRanks, "bench")
      << "bench systems runs on " << kBenchSystemsRanks << " ranks, not " << world.size()
      << "; start it without mpirun (it starts its own ranks) or with mpirun -np " << kBenchSystemsRanks;
  SPPO_CHECK(o.reps >= 1, "options") << "--reps must be at least 1 (got " << o.reps << ")";
  SPPO_CHECK(o.budget > 0 && o.cap >= kLengthStep && o.measure_cap >= kLengthStep, "options")
      << "bench systems needs a device budget and caps of at least " << kLengthStep << " tokens";
  omp_set_num_threads(1);
  const auto started = std::chrono::steady_clock::now();
  io::TempDir dir("sppo-bench-systems");
  // Every rank plans the same (the solver is deterministic); rank 0's directory is the one
  // all read, so its path goes to every rank.
  const std::string root = comm::allgather_strings(world, dir.path(), "rank 0's folder")[0];
  const Profile prof = ranks_profile(o, world, root);
  nlohmann::json systems = nlohmann::json::object();
  i64 common = o.measure_cap / kLengthStep * kLengthStep;
  for (plan::System sys : kSystems) {
    const i64 L = longest(o, prof, sys);
    systems[to_string(sys)] = {{"max_seq_len", L}, {"max_at_cap", L == o.cap / kLengthStep * kLengthStep}};
    common = std::min(common, L);
  }
  for (plan::System sys : kSystems) {
    nlohmann::json& j = systems[to_string(sys)];
    j["measured_step_s"] = nullptr;
    if (common == 0) continue;
    const sim::PlanOutcome p = plan_at(o, prof, sys, common);
    SPPO_CHECK(p.ok, "bench") << to_string(sys) << " fitted " << j["max_seq_len"] << " tokens but not " << common
                              << ": " << p.error;
    j["layout"] = plan::layout_text(p.plan);
    j["sequences_a_step"] = p.plan.par.dp;
    // Tokens a rank a second: a plan with replicas runs dp sequences a step.
    const auto per_rank = [&](double step_s) { return double(common) * p.plan.par.dp / kBenchSystemsRanks / step_s; };
    j["simulated_step_s"] = p.plan.predicted.step_time_s;
    j["simulated_tokens_per_rank_s"] = per_rank(p.plan.predicted.step_time_s);
    j["predicted_peak_device_bytes"] = p.plan.predicted.peak_device_bytes;
    const Measured m = run_plan(o, prof, p.plan, world, root + "/" + to_string(sys) + ".json");
    j["measured_step_s"] = m.step_s;
    j["simulated_step_s"] = m.simulated_s;
    j["measured_tokens_per_rank_s"] = per_rank(m.step_s);
    j["simulated_tokens_per_rank_s"] = per_rank(m.simulated_s);
    j["measured_over_simulated"] = m.simulated_s > 0 ? m.step_s / m.simulated_s : 0.0;
    j["measured_peak_device_bytes_per_rank"] = m.peak;
    j["predicted_peak_device_bytes_per_rank"] = m.predicted_peak;
  }
  return {{"ranks", kBenchSystemsRanks},
          {"threads_per_rank", 1},
          {"model", o.model},
          {"device_budget_bytes", o.budget},
          {"cap", o.cap / kLengthStep * kLengthStep},
          {"measure_cap", o.measure_cap / kLengthStep * kLengthStep},
          {"reps", o.reps},
          {"profile", o.hardware.empty() ? prof.hw.name + " (measured now, one thread a rank)" : o.hardware},
          {"common_seq_len", common},
          {"systems", systems},
          {"wall_s", seconds_since(started)}};
}

void print_bench_systems(const nlohmann::json& j) {
  std::printf("bench systems: %s on %d CPU ranks of one thread, a device budget of %s a rank; lengths in steps of "
              "%lld up to %lld; profile %s\n",
              j["model"].get<std::string>().c_str(), j["ranks"].get<int>(),
              format_bytes(j["device_budget_bytes"].get<double>()).c_str(), (long long)kLengthStep,
              j["cap"].get<long long>(), j["profile"].get<std::string>().c_str());
  std::printf("common length %lld tokens (the longest all three fit, at most %lld)\n",
              j["common_seq_len"].get<long long>(), j["measure_cap"].get<long long>());
  std::printf("%-10s %9s  %-44s %10s %11s %9s %14s\n", "system", "longest", "layout at the common length",
              "measured s", "simulated s", "meas/sim", "tokens/rank/s");
  for (plan::System sys : kSystems) {
    const nlohmann::json& s = j["systems"][to_string(sys)];
    const std::string longest = std::to_string(s["max_seq_len"].get<long long>()) + (s["max_at_cap"] ? "+" : "");
    char measured[32] = "not run", ratio[32] = "-", simulated[32] = "-", tput[48] = "-";
    if (!s["measured_step_s"].is_null()) {
      std::snprintf(measured, sizeof measured, "%.4f", s["measured_step_s"].get<double>());
      std::snprintf(ratio, sizeof ratio, "%.3f", s["measured_over_simulated"].get<double>());
      std::snprintf(tput, sizeof tput, "%.1f", s["measured_tokens_per_rank_s"].get<double>());
    } else if (s.contains("simulated_tokens_per_rank_s")) {
      std::snprintf(tput, sizeof tput, "%.1f (sim.)", s["simulated_tokens_per_rank_s"].get<double>());
    }
    if (s.contains("simulated_step_s")) std::snprintf(simulated, sizeof simulated, "%.4f", s["simulated_step_s"].get<double>());
    std::printf("%-10s %9s  %-44s %10s %11s %9s %14s\n", to_string(sys), longest.c_str(),
                s.value("layout", std::string("-")).substr(0, 44).c_str(), measured, simulated, ratio, tput);
  }
  std::printf("(+: at the cap; a step runs as many sequences as the layout's dp; %.0f s)\n",
              j["wall_s"].get<double>());
}

std::string svg_bench_systems(const nlohmann::json& j) {
  // Two panels of bars, one a system: the longest sequence, and at the common length the
  // tokens a rank a second measured (solid) and simulated (outlined).
  const int W = 640, H = 300, left = 70, top = 40, panel = 250, bar_h = 160;
  const char* colour[] = {"#1f77b4", "#d62728", "#2ca02c"};
  std::ostringstream s;
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  s << "<text x=\"10\" y=\"20\" font-size=\"14\">" << j["model"].get<std::string>() << " on "
    << j["ranks"].get<int>() << " CPU ranks, " << format_bytes(j["device_budget_bytes"].get<double>())
    << " a rank</text>\n";
  double most_len = 1, most_s = 1e-9;
  for (plan::System sys : kSystems) {
    const nlohmann::json& x = j["systems"][to_string(sys)];
    most_len = std::max(most_len, x["max_seq_len"].get<double>());
    if (!x["measured_step_s"].is_null()) most_s = std::max(most_s, x["measured_tokens_per_rank_s"].get<double>());
    if (x.contains("simulated_tokens_per_rank_s"))
      most_s = std::max(most_s, x["simulated_tokens_per_rank_s"].get<double>());
  }
  const int base = top + bar_h + 20;
  for (int p = 0; p < 2; ++p) {
    const int x0 = left + p * panel;
    s << "<text x=\"" << x0 << "\" y=\"" << top << "\">"
      << (p == 0 ? "longest sequence (tokens)"
                 : "tokens a rank a second at " + std::to_string(j["common_seq_len"].get<long long>()))
      << "</text>\n";
    s << "<line x1=\"" << x0 - 5 << "\" y1=\"" << base << "\" x2=\"" << x0 + panel - 40 << "\" y2=\"" << base
      << "\" stroke=\"black\"/>\n";
    int k = 0;
    for (plan::System sys : kSystems) {
      const nlohmann::json& x = j["systems"][to_string(sys)];
      const int bx = x0 + k * 65;
      auto bar = [&](double v, double most, int dx, bool solid, const std::string& label) {
        const int h = int(bar_h * v / most);
        s << "<rect x=\"" << bx + dx << "\" y=\"" << base - h << "\" width=\"26\" height=\"" << h << "\" fill=\""
          << (solid ? colour[k] : "none") << "\" stroke=\"" << colour[k] << "\"/>\n";
        s << "<text x=\"" << bx + dx << "\" y=\"" << base - h - 4 << "\" font-size=\"10\">" << label << "</text>\n";
      };
      char label[32];
      if (p == 0) {
        std::snprintf(label, sizeof label, "%lldK", x["max_seq_len"].get<long long>() / 1024);
        bar(x["max_seq_len"].get<double>(), most_len, 0, true, label);
      } else {
        if (!x["measured_step_s"].is_null()) {
          std::snprintf(label, sizeof label, "%.0f", x["measured_tokens_per_rank_s"].get<double>());
          bar(x["measured_tokens_per_rank_s"].get<double>(), most_s, 0, true, label);
        }
        if (x.contains("simulated_tokens_per_rank_s")) {
          std::snprintf(label, sizeof label, "%.0f", x["simulated_tokens_per_rank_s"].get<double>());
          bar(x["simulated_tokens_per_rank_s"].get<double>(), most_s, 28, false, label);
        }
      }
      s << "<text x=\"" << bx << "\" y=\"" << base + 16 << "\">" << to_string(sys) << "</text>\n";
      ++k;
    }
  }
  s << "<text x=\"10\" y=\"" << H - 10
    << "\" font-size=\"10\">solid: measured on the ranks; outlined: simulated"
    << "</text>\n</svg>\n";
  return s.str();
}

}  // namespace sppo
