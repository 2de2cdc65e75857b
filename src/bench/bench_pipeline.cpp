#include "bench/bench_pipeline.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "core/check.h"
#include "core/timing.h"
#include "planner/profile.h"
#include "train/parallel.h"
#include "train/profile_machine.h"
#include "train/setup.h"

namespace sppo {

namespace {

constexpr int kRanks = 2;
constexpr int kBubbleSubseqs[] = {2, 4, 8, 16};

struct Row {
  double measured_s = 0, simulated_s = 0;
  double measured_bubble = 0, simulated_bubble = 0;
  std::vector<i64> measured_peak, predicted_peak;
  std::vector<double> compute_s;  // per rank (median), less waits for ring attention's messages
  i64 offloaded = 0;
};

// Timed steps of one layout: the step time is the slowest rank's, the bubble the mean
// over ranks of idle over busy compute time.
// `alone`: every rank runs the layout as a one-process job of its own, all at once (the
// baseline that shares the machine as the ranks do).
Row run(const StepOptions& so, int reps, comm::Comm& world, bool alone = false) {
  StepSetup s;
  on_every_rank(world, [&] { s = make_setup(so, alone ? nullptr : &world); });
  if (!alone) prepare_groups(world, s.schedule, s.config);
  init_owned(*s.runtime, so.seed);
  const i64 S = so.seq_len;
  std::vector<std::int32_t> tokens(std::size_t(S + 1));
  s.data->next(tokens.data(), S + 1);
  StepControl control;
  std::vector<std::int32_t> targets;
  if (!s.config.causal) {
    targets = mask_tokens(tokens.data(), S, s.config.vocab, so.seed);
    control.targets = targets.data();
  }
  Row row;
  row.simulated_s = s.predicted_step_s;
  row.simulated_bubble = s.predicted_bubble;
  row.predicted_peak = s.predicted_peak_per_rank;
  if (alone) row.predicted_peak.assign(std::size_t(world.size()), s.predicted_peak_bytes);
  row.measured_peak.assign(std::size_t(world.size()), 0);
  row.compute_s.assign(std::size_t(world.size()), 0);
  std::vector<double> times, bubbles;
  std::vector<std::vector<double>> computes(std::size_t(world.size()));
  for (int r = 0; r < reps + 1; ++r) {
    const StepResult res = s.runtime->step(s.schedule, tokens.data(), control);
    std::vector<double> v(std::size_t(world.size()) * 4, 0.0);
    double* mine = v.data() + std::size_t(world.rank()) * 4;
    mine[0] = res.step_s, mine[1] = res.compute_s - res.ring_wait_s, mine[2] = double(res.device.peak), mine[3] = double(res.offloaded_bytes);
    comm::allreduce_sum(world, v, comm::world_group(world), "the benchmark's step figures");
    if (r == 0) continue;  // warm-up
    double step = 0, bubble = 0;
    for (int k = 0; k < world.size(); ++k) {
      const double* x = v.data() + std::size_t(k) * 4;
      step = std::max(step, x[0]);
      bubble += x[1] > 0 ? (x[0] - x[1]) / x[1] / world.size() : 0;
      row.measured_peak[std::size_t(k)] = std::max(row.measured_peak[std::size_t(k)], i64(x[2]));
      row.offloaded = std::max(row.offloaded, i64(x[3]));
      computes[std::size_t(k)].push_back(x[1]);
    }
    times.push_back(step);
    bubbles.push_back(bubble);
  }
  row.measured_s = median(times);
  row.measured_bubble = median(bubbles);
  for (std::size_t k = 0; k < computes.size(); ++k) row.compute_s[k] = median(computes[k]);
  return row;
}

nlohmann::json row_json(const Row& r) {
  return {{"measured_step_time_s", r.measured_s},
          {"simulated_step_time_s", r.simulated_s},
          {"simulated_over_measured", r.measured_s > 0 ? r.simulated_s / r.measured_s : 0},
          {"measured_bubble", r.measured_bubble},
          {"simulated_bubble", r.simulated_bubble},
          {"measured_peak_device_bytes_per_rank", r.measured_peak},
          {"predicted_peak_device_bytes_per_rank", r.predicted_peak},
          {"offloaded_bytes", r.offloaded}};
}

// What both benchmarks start from: two ranks of one thread, the model and S, the built-in
// task, and the profile every prediction uses. Without `hardware`, both ranks measure it at
// once, one thread each, as they will compute at once; rank 0's is used, through a file
// each rank writes and the destructor removes.
struct BenchBase {
  StepOptions options;
  std::string profile_name;
  std::string own_profile;  // the measured profile's file, removed at the end

  BenchBase(const char* command, const BenchPipelineOptions& o, comm::Comm& world) {
    SPPO_CHECK(world.size() == kRanks, "bench")
        << "bench " << command << " runs on " << kRanks << " ranks, not " << world.size()
        << "; start it without mpirun (it starts its own ranks) or with mpirun -np " << kRanks;
    SPPO_CHECK(o.reps >= 1, "options") << "--reps must be at least 1 (got " << o.reps << ")";
    omp_set_num_threads(1);
    options.model = preset(o.model);
    options.model_name = o.model;
    options.seq_len = parse_count(o.seq_len, "--seq-len");
    options.data = "repeat";
    options.threads = 1;
    options.hardware = profile_name = o.hardware;
    if (o.hardware.empty()) {
      const plan::HardwareProfile mine = measure_cpu_profile(true);
      const auto all = comm::allgather_strings(world, plan::to_json(mine).dump(), "rank 0's profile");
      const plan::HardwareProfile hw = plan::profile_from_json(nlohmann::json::parse(all[0]), "rank 0's profile");
      own_profile = (std::filesystem::temp_directory_path() /
                     ("sppo-bench-profile-" + std::to_string(getpid()) + ".json"))
                        .string();
      plan::save_profile(hw, own_profile);
      options.hardware = own_profile;
      profile_name = hw.name + " (" + hw.description + ", one thread a rank)";
    }
  }
  ~BenchBase() {
    if (!own_profile.empty()) std::filesystem::remove(own_profile);
  }
  BenchBase(const BenchBase&) = delete;
  BenchBase& operator=(const BenchBase&) = delete;
};

}  // namespace

nlohmann::json bench_pipeline(const BenchPipelineOptions& o, comm::Comm& world) {
  const BenchBase bench("pipeline", o, world);
  StepOptions base = bench.options;
  base.partition = "flops";
  const std::string& profile_name = bench.profile_name;
  auto layout = [&](int pp, int dp, int n, const std::string& offload, i64 budget) {
    StepOptions so = base;
    so.par.pp = pp;
    so.par.dp = dp;
    so.subseqs = std::to_string(n);
    so.offload = offload;
    so.device_memory = budget;
    return so;
  };

  nlohmann::json out = {{"ranks", kRanks},
                        {"threads_per_rank", 1},
                        {"model", o.model},
                        {"seq_len", base.seq_len},
                        {"reps", o.reps},
                        {"profile", profile_name}};
  nlohmann::json bubble = nlohmann::json::array();
  for (int n : kBubbleSubseqs) {
    nlohmann::json j = row_json(run(layout(2, 1, n, "none", 0), o.reps, world));
    j["subseqs"] = n;
    j["paper_bubble"] = 1.0 / n;  // (P - 1) / N with P = 2
    bubble.push_back(std::move(j));
  }
  out["bubble"] = std::move(bubble);

  nlohmann::json steps = nlohmann::json::array();
  auto add = [&](const std::string& name, const StepOptions& so) {
    nlohmann::json j = row_json(run(so, o.reps, world));
    j["layout"] = name;
    j["subseqs"] = std::stoi(so.subseqs);
    steps.push_back(std::move(j));
  };
  add("pp 2", layout(2, 1, 8, "none", 0));
  add("dp 2", layout(1, 2, 4, "none", 0));
  // A budget halfway between no offload's and full offload's predicted peaks, so that
  // adaptive has to offload.
  i64 none_peak = 0, full_peak = 0;
  on_every_rank(world, [&] {
    none_peak = make_setup(layout(2, 1, 8, "none", 0), &world).predicted_peak_bytes;
    full_peak = make_setup(layout(2, 1, 8, "full", 0), &world).predicted_peak_bytes;
  });
  const i64 budget = (none_peak + full_peak) / 2;
  add("pp 2, adaptive offload", layout(2, 1, 8, "adaptive", budget));
  steps.back()["device_memory_bytes"] = budget;
  out["step_time"] = std::move(steps);
  return out;
}

nlohmann::json bench_sp(const BenchPipelineOptions& o, comm::Comm& world) {
  const BenchBase bench("sp", o, world);
  StepOptions base = bench.options;
  base.subseqs = "1";
  base.offload = "none";
  const std::string& profile_name = bench.profile_name;
  const i64 S = base.seq_len;
  nlohmann::json out = {{"ranks", kRanks},
                        {"threads_per_rank", 1},
                        {"model", o.model},
                        {"seq_len", S},
                        {"reps", o.reps},
                        {"profile", profile_name},
                        {"kind", "ring (context parallel, one-pass with LSE merge), tensor parallel with "
                                 "sequence-parallel regions, and Ulysses"}};
  nlohmann::json rows = nlohmann::json::array(), tensor = nlohmann::json::array(), ulysses = nlohmann::json::array();
  auto add = [&](const std::string& name, i64 seq_len, int cp, const std::string& ring, bool alone,
                 bool bidirectional = false, int tp = 1, int U = 1) {
    StepOptions so = base;
    so.seq_len = seq_len;
    so.par.cp = cp;
    so.par.tp = tp;
    so.par.ulysses = U;
    parse_ring(ring, so.par);
    if (bidirectional) {
      so.model.causal = false;
      so.objective = "mlm";
    }
    const Row r = run(so, o.reps, world, alone);
    nlohmann::json j = row_json(r);
    j["layout"] = name;
    j["seq_len"] = seq_len;
    const i64 split = i64(cp) * tp * U;
    j["tokens_per_rank"] = seq_len / split;
    j["compute_s_per_rank"] = r.compute_s;
    const auto [lo, hi] = std::minmax_element(r.compute_s.begin(), r.compute_s.end());
    j["compute_imbalance"] = *lo > 0 ? *hi / *lo : 0.0;
    j["tokens_per_s_per_rank"] = r.measured_s > 0 ? double(seq_len / split) / r.measured_s : 0.0;
    (U > 1 ? ulysses : tp > 1 ? tensor : rows).push_back(std::move(j));
  };
  add("one rank (each rank alone)", S, 1, "zigzag", true);
  add("cp 2, contiguous", S, 2, "contiguous", false);
  add("cp 2, zigzag", S, 2, "zigzag", false);
  add("cp 2, zigzag, 2S (equal tokens per rank)", 2 * S, 2, "zigzag", false);
  add("bidirectional, cp 2, one-pass ring", S, 2, "flash,contiguous", false, true);
  add("bidirectional, cp 2, RSA (two-pass)", S, 2, "rsa,contiguous", false, true);
  // The SPPO paper's SP: tensor parallelism with sequence-parallel regions.
  add("tp 2", S, 1, "zigzag", false, false, 2);
  add("tp 2, 2S (equal tokens per rank)", 2 * S, 1, "zigzag", false, false, 2);
  // DeepSpeed-Ulysses: all-to-alls around each attention (runtime/ulysses.h).
  add("ulysses 2", S, 1, "zigzag", false, false, 1, 2);
  add("ulysses 2, 2S (equal tokens per rank)", 2 * S, 1, "zigzag", false, false, 1, 2);
  const double one = rows[0]["measured_step_time_s"].get<double>();
  out["speedup_cp2_zigzag_over_one"] = one / rows[2]["measured_step_time_s"].get<double>();
  out["speedup_cp2_contiguous_over_one"] = one / rows[1]["measured_step_time_s"].get<double>();
  out["zigzag_over_contiguous_step_time"] =
      rows[2]["measured_step_time_s"].get<double>() / rows[1]["measured_step_time_s"].get<double>();
  out["tokens_per_s_per_rank_2S_over_one"] =
      rows[3]["tokens_per_s_per_rank"].get<double>() / rows[0]["tokens_per_s_per_rank"].get<double>();
  out["rsa_over_one_pass_step_time"] =
      rows[5]["measured_step_time_s"].get<double>() / rows[4]["measured_step_time_s"].get<double>();
  out["rsa_over_one_pass_peak"] = double(rows[5]["measured_peak_device_bytes_per_rank"][0].get<i64>()) /
                                  double(rows[4]["measured_peak_device_bytes_per_rank"][0].get<i64>());
  const i64 one_peak = rows[0]["measured_peak_device_bytes_per_rank"][0].get<i64>();
  out["speedup_tp2_over_one"] = one / tensor[0]["measured_step_time_s"].get<double>();
  out["tokens_per_s_per_rank_tp2_2S_over_one"] =
      tensor[1]["tokens_per_s_per_rank"].get<double>() / rows[0]["tokens_per_s_per_rank"].get<double>();
  out["peak_tp2_over_one"] = double(tensor[0]["measured_peak_device_bytes_per_rank"][0].get<i64>()) / double(one_peak);
  out["peak_cp2_over_one"] = double(rows[2]["measured_peak_device_bytes_per_rank"][0].get<i64>()) / double(one_peak);
  out["speedup_ulysses2_over_one"] = one / ulysses[0]["measured_step_time_s"].get<double>();
  out["tokens_per_s_per_rank_ulysses2_2S_over_one"] =
      ulysses[1]["tokens_per_s_per_rank"].get<double>() / rows[0]["tokens_per_s_per_rank"].get<double>();
  out["peak_ulysses2_over_one"] =
      double(ulysses[0]["measured_peak_device_bytes_per_rank"][0].get<i64>()) / double(one_peak);
  out["ring"] = std::move(rows);
  out["tensor"] = std::move(tensor);
  out["ulysses"] = std::move(ulysses);
  // MSP on the sequence pipeline of 2 stages: the bubble-adjacent subsequences run split
  // over both ranks.
  nlohmann::json msp = nlohmann::json::array();
  for (int n : {2, 4, 8}) {
    nlohmann::json pair;
    for (const char* on : {"off", "on"}) {
      StepOptions so = base;
      so.par.pp = 2;
      so.subseqs = std::to_string(n);
      so.par.msp.on = std::string(on) == "on";
      nlohmann::json j = row_json(run(so, o.reps, world));
      j["layout"] = std::string("pp 2, N ") + std::to_string(n) + ", msp " + on;
      j["subseqs"] = n;
      j["msp"] = std::string(on) == "on";
      pair[on] = j;
      msp.push_back(std::move(j));
    }
    out["msp_step_time_on_over_off_n" + std::to_string(n)] =
        pair["on"]["measured_step_time_s"].get<double>() / pair["off"]["measured_step_time_s"].get<double>();
  }
  out["msp"] = std::move(msp);
  return out;
}

void print_bench_sp_msp(const nlohmann::json& j);

void print_bench_sp(const nlohmann::json& j) {
  std::printf("sequence parallelism on %d ranks, one thread each: %s, S %lld, profile %s\n%s\n", j["ranks"].get<int>(),
              j["model"].get<std::string>().c_str(), (long long)j["seq_len"].get<i64>(),
              j["profile"].get<std::string>().c_str(), j["kind"].get<std::string>().c_str());
  std::printf("\n| layout | S | tokens a rank | measured s | simulated s | compute max/min | tokens/s a rank | peak a "
              "rank (measured / predicted) |\n|---|---|---|---|---|---|---|---|\n");
  nlohmann::json all = j["ring"];
  for (const auto& r : j["tensor"]) all.push_back(r);
  for (const auto& r : j["ulysses"]) all.push_back(r);
  for (const auto& r : all)
    std::printf("| %s | %lld | %lld | %.3f | %.3f | %.2f | %.0f | %s / %s |\n", r["layout"].get<std::string>().c_str(),
                (long long)r["seq_len"].get<i64>(), (long long)r["tokens_per_rank"].get<i64>(),
                r["measured_step_time_s"].get<double>(), r["simulated_step_time_s"].get<double>(),
                r["compute_imbalance"].get<double>(), r["tokens_per_s_per_rank"].get<double>(),
                format_bytes(double(r["measured_peak_device_bytes_per_rank"][0].get<i64>())).c_str(),
                format_bytes(double(r["predicted_peak_device_bytes_per_rank"][0].get<i64>())).c_str());
  std::printf("\nspeedup over one rank at S: cp 2 zigzag %.2fx, cp 2 contiguous %.2fx; zigzag / contiguous step time "
              "%.3f; tokens/s a rank at 2S over one rank at S: %.3f\n",
              j["speedup_cp2_zigzag_over_one"].get<double>(), j["speedup_cp2_contiguous_over_one"].get<double>(),
              j["zigzag_over_contiguous_step_time"].get<double>(), j["tokens_per_s_per_rank_2S_over_one"].get<double>());
  std::printf("bidirectional, RSA over the one-pass ring: step time %.2fx, peak memory a rank %.2fx (the RSA row's "
              "prediction leaves out its score rows)\n",
              j["rsa_over_one_pass_step_time"].get<double>(), j["rsa_over_one_pass_peak"].get<double>());
  std::printf("tensor parallel (sequence-parallel regions): tp 2 over one rank at S %.2fx; tokens/s a rank at 2S over "
              "one rank at S %.3f; peak a rank over one rank's: tp 2 %.3f, cp 2 zigzag %.3f\n",
              j["speedup_tp2_over_one"].get<double>(), j["tokens_per_s_per_rank_tp2_2S_over_one"].get<double>(),
              j["peak_tp2_over_one"].get<double>(), j["peak_cp2_over_one"].get<double>());
  std::printf("ulysses: ulysses 2 over one rank at S %.2fx; tokens/s a rank at 2S over one rank at S %.3f; peak a "
              "rank over one rank's %.3f\n",
              j["speedup_ulysses2_over_one"].get<double>(), j["tokens_per_s_per_rank_ulysses2_2S_over_one"].get<double>(),
              j["peak_ulysses2_over_one"].get<double>());
  print_bench_sp_msp(j);
}

void print_bench_sp_msp(const nlohmann::json& j) {
  std::printf("\nMSP on a pipeline of 2 stages (idle over busy compute time)\n");
  std::printf("| layout | measured s | simulated s | bubble measured | bubble simulated | peak a rank (measured / "
              "predicted, fullest rank) |\n|---|---|---|---|---|---|\n");
  for (const auto& r : j["msp"]) {
    const auto& m = r["measured_peak_device_bytes_per_rank"];
    const auto& p = r["predicted_peak_device_bytes_per_rank"];
    std::printf("| %s | %.3f | %.3f | %.3f | %.3f | %s / %s |\n", r["layout"].get<std::string>().c_str(),
                r["measured_step_time_s"].get<double>(), r["simulated_step_time_s"].get<double>(),
                r["measured_bubble"].get<double>(), r["simulated_bubble"].get<double>(),
                format_bytes(double(std::max(m[0].get<i64>(), m[1].get<i64>()))).c_str(),
                format_bytes(double(std::max(p[0].get<i64>(), p[1].get<i64>()))).c_str());
  }
  std::printf("MSP step time on / off, measured: N 2 %.3f, N 4 %.3f, N 8 %.3f\n",
              j["msp_step_time_on_over_off_n2"].get<double>(), j["msp_step_time_on_over_off_n4"].get<double>(),
              j["msp_step_time_on_over_off_n8"].get<double>());
}

void print_bench_pipeline(const nlohmann::json& j) {
  std::printf("sequence pipeline on %d ranks, one thread each: %s, S %lld, profile %s\n", j["ranks"].get<int>(),
              j["model"].get<std::string>().c_str(), (long long)j["seq_len"].get<i64>(),
              j["profile"].get<std::string>().c_str());
  std::printf("\nbubble, pipeline of 2 stages (idle over busy compute time)\n");
  std::printf("| N | measured | simulated | (P-1)/N | step s measured | step s simulated |\n|---|---|---|---|---|---|\n");
  for (const auto& b : j["bubble"])
    std::printf("| %d | %.3f | %.3f | %.3f | %.3f | %.3f |\n", b["subseqs"].get<int>(), b["measured_bubble"].get<double>(),
                b["simulated_bubble"].get<double>(), b["paper_bubble"].get<double>(),
                b["measured_step_time_s"].get<double>(), b["simulated_step_time_s"].get<double>());
  std::printf("\nstep time, simulated vs measured\n");
  std::printf("| layout | N | measured s | simulated s | simulated / measured | offloaded |\n|---|---|---|---|---|---|\n");
  for (const auto& s : j["step_time"])
    std::printf("| %s | %d | %.3f | %.3f | %.3f | %s |\n", s["layout"].get<std::string>().c_str(), s["subseqs"].get<int>(),
                s["measured_step_time_s"].get<double>(), s["simulated_step_time_s"].get<double>(),
                s["simulated_over_measured"].get<double>(), format_bytes(double(s["offloaded_bytes"].get<i64>())).c_str());
}

void relaunch_under_mpirun(int ranks, int argc, char** argv) {
  if (getuid() == 0) {  // OpenMPI refuses root without consent; this is the user's own job
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 0);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 0);
  }
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::vector<std::string> args = {"mpirun", "--oversubscribe", "--bind-to",
                                   std::thread::hardware_concurrency() >= unsigned(ranks) ? "core" : "none",
                                   "-np", std::to_string(ranks), self};
  for (int k = 1; k < argc; ++k) args.push_back(argv[k]);
  std::vector<char*> c;
  for (auto& a : args) c.push_back(a.data());
  c.push_back(nullptr);
  std::fprintf(stderr, "starting %d ranks: mpirun -np %d %s ...\n", ranks, ranks, self.c_str());
  execvp("mpirun", c.data());
  SPPO_CHECK(false, "bench") << "cannot start mpirun (" << std::strerror(errno)
                             << "); install OpenMPI (openmpi-bin) or start the benchmark with mpirun -np " << ranks;
}

}  // namespace sppo
