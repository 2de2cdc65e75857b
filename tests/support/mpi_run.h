// Test helper: runs build/sppo under a real mpirun (ctest label mpi) and reads back what it
// wrote. As root (CI runs as root), OpenMPI needs its two consent variables.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/fileutil.h"
#include "support/grads.h"

namespace sppo::testing {

struct RunResult {
  int status = -1;       // exit status of mpirun (or of the shell)
  std::string output;    // stdout and stderr together
  double seconds = 0;
};

inline std::string sppo_binary() { return std::string(SPPO_BINARY_DIR) + "/sppo"; }

// A test whose commands write into a fresh temporary directory, removed after it.
class CommandTest : public ::testing::Test {
 protected:
  explicit CommandTest(const char* prefix) : prefix_(prefix) {}
  void SetUp() override { tmp_ = std::make_unique<io::TempDir>(prefix_); }
  std::string path(const std::string& name) const { return tmp_->path() + "/" + name; }
  std::string sppo() const { return sppo_binary(); }

 private:
  const char* prefix_;
  std::unique_ptr<io::TempDir> tmp_;
};

// Runs `command` with a shell, capturing its output.
inline RunResult run_command(const std::string& command) {
  if (getuid() == 0) {
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  }
  RunResult r;
  const auto t0 = std::chrono::steady_clock::now();
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  std::size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int raw = pclose(p);
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

// `np` ranks of `sppo <args>` (oversubscribed: tests run on two cores); env is prepended
// to the command (e.g. "SPPO_FAULT=die:1:2").
inline RunResult mpirun(int np, const std::string& args, const std::string& env = "") {
  return run_command(env + (env.empty() ? "" : " ") + "mpirun --oversubscribe --bind-to none -np " +
                     std::to_string(np) + " " + sppo_binary() + " " + args);
}

inline nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  return nlohmann::json::parse(f);
}

inline std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::ifstream f(path);
  std::vector<nlohmann::json> lines;
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

}  // namespace sppo::testing
