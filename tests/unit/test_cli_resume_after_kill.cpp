// A training run killed with SIGKILL while it checkpoints every step leaves a checkpoint
// that `sppo train --resume` continues from.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/check.h"
#include "io/checkpoint.h"
#include "io/fileutil.h"

namespace {

using namespace std::chrono_literals;

pid_t spawn(const std::vector<std::string>& args) {
  const pid_t pid = fork();
  if (pid == 0) {
    const int null = open("/dev/null", O_WRONLY);
    dup2(null, STDOUT_FILENO);
    dup2(null, STDERR_FILENO);
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

int wait_status(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

// The step of the checkpoint at `dir`, or -1 while there is none or it is being replaced
// (a reader racing the writer's renames may find it mid-publication).
int saved_step(const std::string& dir) {
  try {
    return sppo::io::checkpoint_exists(dir) ? sppo::io::read_checkpoint_state(dir).at("step").get<int>() : -1;
  } catch (const sppo::Error&) {
    return -1;
  }
}

TEST(CliResumeAfterKill, ContinuesFromTheLastGoodCheckpoint) {
  sppo::io::TempDir tmp("sppo-kill");
  const std::string sppo = std::string(SPPO_BINARY_DIR) + "/sppo", ckpt = tmp.file("ckpt");
  const std::vector<std::string> model = {sppo, "train", "--model", "tiny", "--seq-len", "32", "--quiet"};
  std::mt19937 rng(7);
  int step = 0;
  for (int round = 0; round < 3; ++round) {
    std::vector<std::string> args = model;
    for (const char* a : {"--steps", "1000000", "--save-every", "1", "--save"}) args.push_back(a);
    args.push_back(ckpt);
    if (round > 0) args.insert(args.end(), {"--resume", ckpt});
    const pid_t pid = spawn(args);
    // Kill it a random moment after it has saved again (it saves after every step).
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    while (std::chrono::steady_clock::now() < deadline && saved_step(ckpt) <= step) std::this_thread::sleep_for(5ms);
    std::this_thread::sleep_for(std::chrono::microseconds(std::uniform_int_distribution<int>(0, 50000)(rng)));
    kill(pid, SIGKILL);
    const int status = wait_status(pid);
    ASSERT_TRUE(WIFSIGNALED(status)) << "round " << round << ": the run ended by itself (status " << status << ")";
    const int saved = sppo::io::read_checkpoint_state(ckpt).at("step").get<int>();
    EXPECT_GT(saved, step) << "round " << round;
    step = saved;
  }
  // Finish two more steps from the last checkpoint.
  std::vector<std::string> args = model;
  args.insert(args.end(), {"--resume", ckpt, "--steps", std::to_string(step + 2), "--save", ckpt});
  const int status = wait_status(spawn(args));
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "resume failed with status " << status;
  EXPECT_EQ(sppo::io::read_checkpoint_state(ckpt).at("step").get<int>(), step + 2);
}

}  // namespace
