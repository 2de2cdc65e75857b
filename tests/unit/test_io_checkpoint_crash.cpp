// Crash consistency of checkpoints (Note [Checkpoint crash windows]): a process killed with
// SIGKILL at any point of a save leaves a checkpoint that loads, whole and from one save
// (weights, optimizer state and state.json agree), and the next save cleans up after it.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "io/checkpoint.h"
#include "io/fileutil.h"

namespace sppo::io {
namespace {

namespace fs = std::filesystem;

// A checkpoint whose every number says which save wrote it: weights hold `step`, the
// optimizer state `step + 0.5`, and state.json the same step.
struct Saved {
  std::vector<float> embed = std::vector<float>(4096), bias = std::vector<float>(64);
  std::vector<float> embed_m = std::vector<float>(4096), bias_m = std::vector<float>(64);

  std::vector<CheckpointTensor> weights() { return {{"embed", {64, 64}, embed.data()}, {"bias", {64}, bias.data()}}; }
  std::vector<CheckpointTensor> optimizer() {
    return {{"embed.m", {64, 64}, embed_m.data()}, {"bias.m", {64}, bias_m.data()}};
  }
  void fill(int step) {
    for (auto* v : {&embed, &bias}) std::fill(v->begin(), v->end(), float(step));
    for (auto* v : {&embed_m, &bias_m}) std::fill(v->begin(), v->end(), float(step) + 0.5f);
  }
  static nlohmann::json state(int step) {
    return {{"step", step},
            {"config", {{"vocab", 64}, {"hidden", 64}, {"layers", 1}, {"heads", 2}}},
            {"data_position", {{"kind", "repeat"}, {"sequence", step}}}};
  }
  void save(const std::string& dir, int step) {
    fill(step);
    save_checkpoint(dir, weights(), optimizer(), state(step));
  }
  // Loads `dir`; fails the test unless every tensor agrees with state.json's step.
  int load(const std::string& dir, std::string* from = nullptr) {
    fill(-1);
    const nlohmann::json s = load_checkpoint(dir, weights(), optimizer(), from);
    const int step = s.at("step").get<int>();
    for (auto* v : {&embed, &bias})
      for (float x : *v) EXPECT_EQ(x, float(step)) << "weights of another save than state.json's";
    for (auto* v : {&embed_m, &bias_m})
      for (float x : *v) EXPECT_EQ(x, float(step) + 0.5f) << "optimizer state of another save";
    return step;
  }
};

// Entries in `parent` other than the checkpoint `name` itself.
std::vector<std::string> leftovers(const std::string& parent, const std::string& name) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(parent))
    if (e.path().filename() != name) out.push_back(e.path().filename().string());
  return out;
}

// Runs `child` in a forked process and returns its wait status. The child never returns
// into the test framework.
template <typename F>
int in_child(F&& child, pid_t* pid_out = nullptr, std::chrono::microseconds kill_after = {}) {
  const pid_t pid = fork();
  if (pid == 0) {
    child();
    _exit(0);
  }
  if (pid_out != nullptr) *pid_out = pid;
  if (kill_after.count() > 0) {
    std::this_thread::sleep_for(kill_after);
    kill(pid, SIGKILL);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

int g_kill_at = -1;
void kill_at_step(int step, const char*) {
  if (step == g_kill_at) raise(SIGKILL);
}

TEST(CheckpointCrash, KilledAtEveryStepOfASaveLeavesOneThatLoads) {
  TempDir tmp("sppo-crash");
  const std::string dir = tmp.file("ckpt");
  Saved s;
  s.save(dir, 1);
  int steps_killed = 0;
  for (int k = 0;; ++k) {
    g_kill_at = k;
    pid_t child = 0;
    const int status = in_child(
        [&] {
          set_save_step_hook(kill_at_step);
          s.save(dir, 2);
        },
        &child);
    if (WIFEXITED(status)) {
      ASSERT_EQ(WEXITSTATUS(status), 0);
      EXPECT_EQ(s.load(dir), 2) << "an uninterrupted save";
      break;
    }
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "step " << k;
    ++steps_killed;
    std::string from;
    const int loaded = s.load(dir, &from);
    // Until the rename that publishes it (step 7), the new save is invisible.
    EXPECT_EQ(loaded, k < 7 ? 1 : 2) << "killed at step " << k;
    if (k == 6) {
      EXPECT_EQ(from, dir + ".old-" + std::to_string(child)) << "falls back to the moved-aside one";
    } else {
      EXPECT_EQ(from, dir) << "killed at step " << k;
    }
    // The next save succeeds and leaves nothing behind; the one after it starts over.
    s.save(dir, 3);
    EXPECT_EQ(s.load(dir), 3);
    EXPECT_TRUE(leftovers(tmp.path(), "ckpt").empty()) << "killed at step " << k << ": " << leftovers(tmp.path(), "ckpt")[0];
    s.save(dir, 1);
  }
  EXPECT_EQ(steps_killed, 11) << "save_checkpoint's steps 0..10";
}

TEST(CheckpointCrash, KilledAtRandomTimesWhileSavingInALoop) {
  TempDir tmp("sppo-crash");
  const std::string dir = tmp.file("run/ckpt");
  Saved s;
  s.save(dir, 0);
  // How long one save takes here, to spread the kills over whole saves.
  const auto t0 = std::chrono::steady_clock::now();
  for (int k = 1; k <= 5; ++k) s.save(dir, k);
  const auto per_save = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0) / 5;
  std::mt19937 rng(2024);
  std::uniform_int_distribution<long> delay(1, std::max<long>(2, 4 * per_save.count()));
  int last = s.load(dir), kills = 0, partial = 0, fallbacks = 0;
  for (int round = 0; round < 60; ++round) {
    const int start = last + 1;
    const int status = in_child(
        [&] {
          for (int step = start;; ++step) s.save(dir, step);
        },
        nullptr, std::chrono::microseconds(delay(rng)));
    kills += WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
    partial += !leftovers(tmp.file("run"), "ckpt").empty();
    std::string from;
    const int loaded = s.load(dir, &from);
    fallbacks += from != dir;
    EXPECT_GE(loaded, last) << "round " << round << ": a kill lost a checkpoint that had been published";
    last = loaded;
  }
  EXPECT_EQ(kills, 60);
  // Most kills land inside a save (the children do nothing else); report where.
  std::printf("60 kills: %d left a partial save beside the checkpoint, %d between the two renames\n", partial,
              fallbacks);
  EXPECT_GT(partial, 0);
  EXPECT_GT(last, 5) << "the children saved something";
  s.save(dir, last + 1);
  EXPECT_TRUE(leftovers(tmp.file("run"), "ckpt").empty());
}

}  // namespace
}  // namespace sppo::io
