#include "bench/bench_cores.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "backends/cpu/blas_setup.h"
#include "core/check.h"
#include "core/timing.h"
#include "io/fileutil.h"

extern char** environ;

namespace sppo {

namespace {

// What each child's environment says about OpenMP's waiting: `set`, after removing every
// variable that decides it (so that a user's own setting does not leak into the rows).
struct Setting {
  const char* key;
  const char* name;
  std::vector<std::string> set;
};

std::vector<Setting> settings() {
  return {{"libgomp_default", "libgomp's default", {std::string("GOMP_SPINCOUNT=") + cpu::kLibgompSpinCount}},
          {"passive", "OMP_WAIT_POLICY=passive", {"OMP_WAIT_POLICY=passive"}},
          {"sppo_default", "sppo's default", {}}};
}

// The neighbours: none, a second busy sppo, `sppo bench memory`.
enum class Neighbour { None, Sppo, BenchMemory };
constexpr Neighbour kNeighbours[] = {Neighbour::None, Neighbour::Sppo, Neighbour::BenchMemory};
const char* key_of(Neighbour n) {
  switch (n) {
    case Neighbour::None: return "alone";
    case Neighbour::Sppo: return "beside_sppo";
    case Neighbour::BenchMemory: return "beside_bench_memory";
  }
  return "";
}

// A busy neighbour's first second is its start-up; the step is measured after it (for a
// second sppo: once it has finished a step).
constexpr auto kNeighbourStart = std::chrono::seconds(1);
constexpr auto kNeighbourFirstStepLimit = std::chrono::seconds(120);

std::vector<std::string> child_environment(const Setting& s) {
  static const char* const kDecides[] = {"OMP_WAIT_POLICY=", "GOMP_SPINCOUNT=", "SPPO_OMP_WAIT_CHOSEN="};
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string v = *e;
    if (std::none_of(std::begin(kDecides), std::end(kDecides), [&](const char* p) { return v.rfind(p, 0) == 0; }))
      env.push_back(v);
  }
  env.insert(env.end(), s.set.begin(), s.set.end());
  return env;
}

// Starts `args` with `env`, its output to /dev/null.
pid_t spawn(const std::vector<std::string>& args, const std::vector<std::string>& env) {
  std::vector<char*> argv, envp;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_addopen(&files, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&files, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, args[0].c_str(), &files, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&files);
  SPPO_CHECK(rc == 0, "bench") << "cannot start " << args[0] << ": " << std::strerror(rc);
  return pid;
}

int wait_for(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return status;
}

// A neighbour started for one measurement, stopped when it ends.
class Neighbouring {
 public:
  Neighbouring(Neighbour n, const std::string& self, const BenchCoresOptions& o, const std::vector<std::string>& env,
               const io::TempDir& dir) {
    if (n == Neighbour::None) return;
    const std::string metrics = dir.file("neighbour.jsonl");
    std::filesystem::remove(metrics);
    if (n == Neighbour::Sppo)
      pid_ = spawn({self, "train", "--model", o.model, "--seq-len", o.seq_len, "--steps", "1000000000", "--quiet",
                    "--metrics", metrics},
                   env);
    else
      pid_ = spawn({self, "bench", "memory"}, env);
    std::this_thread::sleep_for(kNeighbourStart);
    if (n == Neighbour::Sppo) wait_for_first_step(metrics);
  }
  ~Neighbouring() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    wait_for(pid_);
  }
  Neighbouring(const Neighbouring&) = delete;
  Neighbouring& operator=(const Neighbouring&) = delete;

 private:
  void wait_for_first_step(const std::string& metrics) {
    const auto until = std::chrono::steady_clock::now() + kNeighbourFirstStepLimit;
    while (std::chrono::steady_clock::now() < until) {
      std::ifstream f(metrics);
      std::string line;
      if (std::getline(f, line) && !line.empty()) return;
      int status = 0;
      SPPO_CHECK(::waitpid(pid_, &status, WNOHANG) == 0, "bench") << "the neighbouring sppo train stopped at start";
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    SPPO_CHECK(false, "bench") << "the neighbouring sppo train did no step in "
                               << kNeighbourFirstStepLimit.count() << " s";
  }
  pid_t pid_ = 0;
};

// One measured run: the child's median step time (its metrics' summary line).
double measure_step(const std::string& self, const BenchCoresOptions& o, const std::vector<std::string>& env,
                    const io::TempDir& dir) {
  const std::string metrics = dir.file("step.jsonl");
  std::filesystem::remove(metrics);
  const int status = wait_for(spawn({self, "train", "--model", o.model, "--seq-len", o.seq_len, "--steps",
                                     std::to_string(o.steps), "--quiet", "--metrics", metrics},
                                    env));
  SPPO_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "bench")
      << "sppo train --model " << o.model << " --seq-len " << o.seq_len << " failed (status " << status
      << "); run it alone to see why";
  std::ifstream f(metrics);
  std::string line, last;
  while (std::getline(f, line))
    if (!line.empty()) last = line;
  const nlohmann::json summary = nlohmann::json::parse(last, nullptr, false);
  SPPO_CHECK(summary.is_object() && summary.contains("measured_step_time_s"), "bench")
      << "no summary in " << metrics;
  return summary["measured_step_time_s"].get<double>();
}

nlohmann::json spread(const std::vector<double>& runs) {
  return {{"median_s", median(runs)},
          {"min_s", *std::min_element(runs.begin(), runs.end())},
          {"max_s", *std::max_element(runs.begin(), runs.end())},
          {"runs_s", runs}};
}

// The median over repetitions of a[r] / b[r]: each ratio from one repetition, measured
// within seconds, so that a neighbour outside the benchmark that comes and goes between
// repetitions moves no ratio.
double median_ratio(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> r;
  for (std::size_t k = 0; k < a.size(); ++k) r.push_back(a[k] / b[k]);
  return median(r);
}

// The machine's load average over 1, 5 and 15 minutes: other programs' work beside the
// benchmark's own (each measurement runs at most two programs).
nlohmann::json load_average() {
  double load[3] = {0, 0, 0};
  if (::getloadavg(load, 3) != 3) return nullptr;
  return {load[0], load[1], load[2]};
}

}  // namespace

nlohmann::json bench_cores(const BenchCoresOptions& o) {
  SPPO_CHECK(o.steps >= 2, "bench") << "--steps must be at least 2: the first step is not timed (got " << o.steps << ")";
  SPPO_CHECK(o.reps >= 1, "bench") << "--reps must be at least 1 (got " << o.reps << ")";
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::vector<Setting> all = settings();
  io::TempDir dir("sppo-bench-cores");
  const nlohmann::json load_at_start = load_average();
  // runs[setting][neighbour]: one step time per repetition.
  std::vector<std::vector<std::vector<double>>> runs(all.size(), std::vector<std::vector<double>>(3));
  const auto started = std::chrono::steady_clock::now();
  for (int rep = 0; rep < o.reps; ++rep)
    for (const Neighbour n : kNeighbours)
      for (std::size_t s = 0; s < all.size(); ++s) {
        const std::vector<std::string> env = child_environment(all[s]);
        const Neighbouring beside(n, self, o, env, dir);
        runs[s][std::size_t(n)].push_back(measure_step(self, o, env, dir));
      }
  nlohmann::json rows = nlohmann::json::array();
  for (std::size_t s = 0; s < all.size(); ++s) {
    std::string environment;
    for (const auto& v : all[s].set) environment += (environment.empty() ? "" : " ") + v;
    nlohmann::json row = {{"setting", all[s].key}, {"name", all[s].name}, {"environment", environment}};
    if (s == 2) row["chooses"] = std::string("GOMP_SPINCOUNT=") + cpu::kSppoSpinCount;
    for (const Neighbour n : kNeighbours) row[key_of(n)] = spread(runs[s][std::size_t(n)]);
    row["beside_sppo_over_alone"] = median_ratio(runs[s][1], runs[s][0]);
    row["beside_bench_memory_over_alone"] = median_ratio(runs[s][2], runs[s][0]);
    row["alone_over_libgomp_default_alone"] = median_ratio(runs[s][0], runs[0][0]);
    rows.push_back(std::move(row));
  }
  return {{"model", o.model},
          {"seq_len", o.seq_len},
          {"steps", o.steps},
          {"reps", o.reps},
          {"cores", std::thread::hardware_concurrency()},
          {"load_average_at_start", load_at_start},
          {"load_average_at_end", load_average()},
          {"seconds", std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count()},
          {"settings", rows}};
}

void print_bench_cores(const nlohmann::json& j) {
  std::printf("one step of %s at %s tokens on %d cores, alone and beside a busy neighbour given the same setting; "
              "median of %d runs of %d steps",
              j["model"].get<std::string>().c_str(), j["seq_len"].get<std::string>().c_str(), j["cores"].get<int>(),
              j["reps"].get<int>(), j["steps"].get<int>());
  if (j["load_average_at_start"].is_array() && j["load_average_at_end"].is_array())
    std::printf(" (load average %.2f at the start, %.2f at the end)", j["load_average_at_start"][0].get<double>(),
                j["load_average_at_end"][0].get<double>());
  std::printf("\n| OpenMP wait | alone s | beside a busy sppo s | / alone | beside bench memory s | / alone | "
              "alone / libgomp's default alone |\n|---|---|---|---|---|---|---|\n");
  for (const auto& r : j["settings"]) {
    std::string name = r["name"].get<std::string>();
    if (!r["environment"].get<std::string>().empty() && name != r["environment"].get<std::string>())
      name += " (" + r["environment"].get<std::string>() + ")";
    if (r.contains("chooses")) name += " (" + r["chooses"].get<std::string>() + ")";
    std::printf("| %s | %.3f | %.3f | %.2fx | %.3f | %.2fx | %.2fx |\n", name.c_str(), r["alone"]["median_s"].get<double>(),
                r["beside_sppo"]["median_s"].get<double>(), r["beside_sppo_over_alone"].get<double>(),
                r["beside_bench_memory"]["median_s"].get<double>(), r["beside_bench_memory_over_alone"].get<double>(),
                r["alone_over_libgomp_default_alone"].get<double>());
  }
}

}  // namespace sppo
