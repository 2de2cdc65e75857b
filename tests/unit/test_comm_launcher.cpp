// What a launcher's environment says (comm/launcher.h, Note [Launchers]): the local rank that
// picks a GPU and the ranks sharing a machine, under mpirun, mpiexec and srun, and where a
// Slurm job's variables must be ignored; and the refusal of an srun of several tasks without
// an MPI plugin. tests/slurm/srun_vs_mpirun.sh runs real srun and mpirun ranks.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <string>

#include "comm/launcher.h"
#include "support/expect_error.h"

namespace sppo::comm {
namespace {

// Each test starts from an environment without any launcher's variables and gets the
// process's own back after.
class Launcher : public ::testing::Test {
 protected:
  static constexpr const char* kNames[] = {
      "OMPI_COMM_WORLD_SIZE",    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALRANKID",
      "MPI_LOCALNRANKS",         "PMIX_RANK",                  "PMI_RANK",                   "SLURM_STEP_NUM_TASKS",
      "SLURM_LOCALID",           "SLURM_NODEID",               "SLURM_STEP_TASKS_PER_NODE",  "SLURM_PROCID",
      "SLURM_NTASKS",            "SLURM_TASKS_PER_NODE"};

  void SetUp() override {
    for (const char* n : kNames) {
      if (const char* v = std::getenv(n)) saved_[n] = v;
      unsetenv(n);
    }
  }
  void TearDown() override {
    for (const char* n : kNames) unsetenv(n);
    for (const auto& [n, v] : saved_) setenv(n.c_str(), v.c_str(), 1);
  }
  static void set(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const auto& [n, v] : vars) setenv(n, v, 1);
  }

 private:
  std::map<std::string, std::string> saved_;
};

TEST_F(Launcher, NoLauncherSaysNothing) {
  EXPECT_EQ(launcher_local_rank(), -1);
  EXPECT_EQ(launcher_local_size(), 0);
  EXPECT_EQ(srun_tasks(), 0);
  EXPECT_NO_THROW(check_launch());
}

TEST_F(Launcher, MpirunsVariables) {
  set({{"OMPI_COMM_WORLD_SIZE", "8"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "3"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_EQ(launcher_local_rank(), 3);
  EXPECT_EQ(launcher_local_size(), 4);
}

TEST_F(Launcher, SrunsLocalIdPicksTheLocalRank) {
  set({{"PMIX_RANK", "5"}, {"SLURM_PROCID", "5"}, {"SLURM_STEP_NUM_TASKS", "8"}, {"SLURM_LOCALID", "1"},
       {"SLURM_NODEID", "1"}, {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"}});
  EXPECT_EQ(srun_tasks(), 8);
  EXPECT_EQ(launcher_local_rank(), 1);
  EXPECT_EQ(launcher_local_size(), 4);
}

TEST_F(Launcher, SrunsUnevenNodesGiveThisNodesTasks) {
  set({{"SLURM_STEP_NUM_TASKS", "7"}, {"SLURM_LOCALID", "0"}, {"SLURM_STEP_TASKS_PER_NODE", "3,2(x2)"}});
  for (const auto& [node, tasks] : std::map<std::string, int>{{"0", 3}, {"1", 2}, {"2", 2}}) {
    setenv("SLURM_NODEID", node.c_str(), 1);
    EXPECT_EQ(launcher_local_size(), tasks) << "node " << node;
  }
  // Without this node's index (or with one past the list): the most on any node.
  unsetenv("SLURM_NODEID");
  EXPECT_EQ(launcher_local_size(), 3);
  setenv("SLURM_NODEID", "3", 1);
  EXPECT_EQ(launcher_local_size(), 3);
}

TEST_F(Launcher, MalformedTasksPerNodeSaysNothing) {
  set({{"SLURM_STEP_NUM_TASKS", "2"}, {"SLURM_NODEID", "0"}});
  for (const char* text : {"", "x", "2(x", "2(x0)", "2,,1", "2(x2", "-1", "2;1"}) {
    setenv("SLURM_STEP_TASKS_PER_NODE", text, 1);
    EXPECT_EQ(launcher_local_size(), 0) << "'" << text << "'";
  }
}

// A batch script's environment holds SLURM_LOCALID=0 (and no step's variables): a process it
// starts directly, or that an mpirun or mpiexec inside it starts, is not an srun task.
TEST_F(Launcher, SlurmJobVariablesOutsideAStepAreIgnored) {
  set({{"SLURM_LOCALID", "0"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "16"}, {"SLURM_TASKS_PER_NODE", "8(x2)"}});
  EXPECT_EQ(launcher_local_rank(), -1);
  EXPECT_EQ(launcher_local_size(), 0);
  EXPECT_NO_THROW(check_launch());
}

// mpirun and mpiexec start their daemons on other nodes with srun, one task per node, so a
// rank there sees that step's SLURM_LOCALID=0: the MPI launcher's own variables win.
TEST_F(Launcher, MpiLaunchersWinOverTheSrunThatStartedTheirDaemons) {
  set({{"SLURM_STEP_NUM_TASKS", "2"}, {"SLURM_LOCALID", "0"}, {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"},
       {"SLURM_NODEID", "1"}});
  set({{"OMPI_COMM_WORLD_SIZE", "16"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "6"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "8"}});
  EXPECT_EQ(launcher_local_rank(), 6);
  EXPECT_EQ(launcher_local_size(), 8);
  for (const char* n : {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"})
    unsetenv(n);
  set({{"PMI_RANK", "9"}, {"MPI_LOCALRANKID", "5"}, {"MPI_LOCALNRANKS", "8"}});
  EXPECT_EQ(launcher_local_rank(), 5);
  EXPECT_EQ(launcher_local_size(), 8);
}

TEST_F(Launcher, SrunOfSeveralTasksWithoutAnMpiPluginIsRefused) {
  set({{"SLURM_STEP_NUM_TASKS", "2"}, {"SLURM_PROCID", "1"}, {"SLURM_LOCALID", "1"}});
  EXPECT_ERROR_WITH(check_launch(), "[comm] srun started 2 tasks without an MPI plugin", "srun --mpi=pmix");
  setenv("PMIX_RANK", "1", 1);  // srun --mpi=pmix
  EXPECT_NO_THROW(check_launch());
  unsetenv("PMIX_RANK");
  setenv("SLURM_STEP_NUM_TASKS", "1", 1);  // one task runs alone, as it should
  EXPECT_NO_THROW(check_launch());
}

}  // namespace
}  // namespace sppo::comm
