#include "comm/launcher.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/check.h"

namespace sppo::comm {

namespace {

// A launcher's count or index: a non-negative integer, else -1 (absent or malformed).
int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return -1;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  return *end == '\0' && x >= 0 && x <= 1'000'000 ? int(x) : -1;
}

// Slurm's tasks per node, run-length coded: "2(x3),1" is 2, 2, 2, 1. Empty where malformed.
std::vector<int> tasks_per_node(const std::string& text) {
  std::vector<int> out;
  std::size_t i = 0;
  while (i < text.size()) {
    std::size_t used = 0;
    int count = 0, repeat = 1;
    try {
      count = std::stoi(text.substr(i), &used);
    } catch (const std::exception&) {
      return {};
    }
    i += used;
    if (text.compare(i, 2, "(x") == 0) {
      try {
        repeat = std::stoi(text.substr(i + 2), &used);
      } catch (const std::exception&) {
        return {};
      }
      i += 2 + used;
      if (i >= text.size() || text[i] != ')') return {};
      ++i;
    }
    if (count < 0 || repeat < 1 || repeat > 1'000'000) return {};
    out.insert(out.end(), std::size_t(repeat), count);
    if (i < text.size() && text[i++] != ',') return {};
  }
  return out;
}

}  // namespace

int srun_tasks() { return std::max(0, env_int("SLURM_STEP_NUM_TASKS")); }

int launcher_local_rank() {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"})
    if (const int r = env_int(v); r >= 0) return r;
  return srun_tasks() > 0 ? env_int("SLURM_LOCALID") : -1;
}

int launcher_local_size() {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"})
    if (const int n = env_int(v); n > 0) return n;
  if (srun_tasks() == 0) return 0;
  const char* text = std::getenv("SLURM_STEP_TASKS_PER_NODE");
  const std::vector<int> nodes = tasks_per_node(text ? text : "");
  if (nodes.empty()) return 0;
  const int node = env_int("SLURM_NODEID");
  // Without this node's index, the most on any node: what every per-machine check must allow.
  if (node >= 0 && node < int(nodes.size())) return nodes[std::size_t(node)];
  return *std::max_element(nodes.begin(), nodes.end());
}

void check_launch() {
  const int tasks = srun_tasks();
  SPPO_CHECK(tasks <= 1 || launched_by_mpi(), "comm")
      << "srun started " << tasks << " tasks without an MPI plugin (no PMIX_RANK or PMI_RANK in the "
      << "environment), so each would train alone as rank 0 of 1; start them with srun --mpi=pmix (srun "
         "--mpi=list shows this cluster's plugins; MpiDefault=pmix in slurm.conf makes it the default), or "
         "with mpirun";
}

}  // namespace sppo::comm
