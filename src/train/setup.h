// Turning options into a ready step: model config, data, runtime, partition, alpha and the
// schedule. Shared by `sppo train`, `sppo grads` and the benchmarks, so every mode that
// trains can also be exported and measured. Everything is validated here, before any work.
#pragma once

#include <functional>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "io/data.h"
#include "planner/plan.h"
#include "planner/profile.h"
#include "runtime/executor.h"
#include "schedule/ir.h"
#include "train/options.h"
#include "train/parallel.h"

namespace sppo {

// The device tier's budget (--device-memory): `bytes` given, else a share `fraction` of the
// device's memory, else the backend's capacity (Backend::device_capacity: CUDA's GPU less
// kDeviceReserveBytes; 0 on the CPU: no budget). A budget over the capacity is refused,
// naming the largest that fits. `from` says where it came from, as the run's header states
// it.
struct DeviceBudget {
  i64 bytes = 0;  // 0: none
  std::string from;
};
DeviceBudget resolve_device_budget(i64 bytes, double fraction, i64 device_memory, i64 capacity);

struct StepSetup {
  ModelConfig config;
  std::unique_ptr<io::TokenSource> data;
  std::unique_ptr<io::TokenSource> labels;  // --labels, read in step with `data`; null without
  std::unique_ptr<Backend> backend;   // before the runtime: it outlives it
  DeviceBudget device_budget;   // the device tier's budget (--device-memory, or the backend's)
  AttentionServed attention;    // what runs attention (Backend::prepare_attention)
  // Several ranks on a backend whose device memory the host cannot read (or --comm mpi): the
  // communicator for device memory (NCCL, or MPI staged through host memory); null: the world
  // serves. Before the runtime: it outlives it.
  std::unique_ptr<comm::Comm> device_comm;
  std::string comm_name;        // what carries the ranks' messages ("" alone)
  // The communicator for the runtime's and the trainer's messages.
  comm::Comm& comm(comm::Comm& world) { return device_comm ? *device_comm : world; }
  std::unique_ptr<Runtime> runtime;
  std::vector<i64> lengths;     // l_i
  std::vector<double> alpha;    // alpha_i
  sched::Schedule schedule;     // every rank's ops; this process runs layout.rank's
  ParallelLayout layout;
  i64 predicted_peak_bytes = 0; // the simulator's prediction for this schedule, max over
                                // ranks (0: none, as for --recompute, which it does not model)
  std::vector<i64> predicted_peak_per_rank;
  std::vector<i64> predicted_host_per_rank;   // bytes held on the host, each rank's most
  std::vector<i64> predicted_sent_per_rank;  // point-to-point bytes each rank sends in a step
  std::vector<i64> predicted_collective_per_rank;  // its weight collectives' buffers (sched::collective_bytes)
  double predicted_step_s = 0;  // on `profile`
  double predicted_bubble = 0;  // idle over busy compute time, mean over ranks
  i64 predicted_host_bytes = 0; // offloaded bytes held in host memory at once (fullest rank)
  i64 host_budget = 0;          // the host tier's budget (--host-memory; a dry run's profile's); 0: none
  std::optional<plan::Plan> plan;  // --plan's
  plan::HardwareProfile profile;  // this machine's (measured or loaded), else nominal
  bool profile_measured = false;  // profile prices time (not only memory)
  bool repeat_task = false;     // the built-in task: report both halves' losses
  std::uint64_t seed = 0;       // --seed (masked-token training draws its masks from it)
  std::int64_t doc_sep = -1;    // --pack: the token that ends each document
  // --pack: the simulator's step time for a step whose documents begin at these positions
  // (Schedule::doc_starts); empty when nothing prices time (no measured profile).
  std::function<double(const std::vector<i64>&)> simulate_packed;
};

// Packed documents (--pack): the starts of the documents of tokens[0..S] (the first 0; a
// document ends after each `sep`), and the targets of positions 0..S-1: the next token,
// or kNoTarget where it starts another document.
struct PackedDocs {
  std::vector<i64> starts;
  std::vector<std::int32_t> targets;
};
PackedDocs pack_documents(const std::int32_t* tokens, i64 S, std::int32_t sep);
// The same from where documents begin among the S + 1 tokens (offsets in (0, S], as a
// document index gives them, io::TokenSource::last_document_starts): the token before each
// start predicts nothing.
PackedDocs pack_at_starts(const std::int32_t* tokens, i64 S, const std::vector<i64>& starts);


// Memory a run's process holds besides the two tiers (program, thread stacks, OpenBLAS and
// MPI buffers), counted when checking that a run fits the machine.
inline constexpr i64 kProcessAllowanceBytes = i64{256} << 20;

// Resolves the model (preset or sizes), opens and checks the data, picks the layout of
// ranks, N, the lengths and alpha, checks the budget of every rank, builds the schedule
// and this rank's runtime. `world` null means one process. Throws sppo::Error with a
// message naming the option and what would work. With o.dry_run (a plan's): no backend,
// no runtime; the plan's precision, kernel scratch, profile and ranks, and its
// budget_bytes unless --device-memory is given (DoesNotFit where a rank is over a budget).
StepSetup make_setup(const StepOptions& o, comm::Comm* world = nullptr);

// Reads a plan written by `sppo plan --out` (throws naming the file and what is wrong).
plan::Plan read_plan_file(const std::string& path);

// GPT-2 style initialisation from `seed`: N(0, 0.02) matrices, residual projections scaled
// by 1/sqrt(2L), zero biases, unit LayerNorm gains. Deterministic for any thread count.
void init_params(const ModelConfig& c, float* params, std::uint64_t seed);

// Mean loss over target positions [begin, end) of a step's per-position losses; with
// `targets` (masked-token training), over the positions in it that are predicted.
double mean_loss(const std::vector<float>& losses, i64 begin, i64 end);
double mean_loss(const std::vector<float>& losses, const std::vector<std::int32_t>& targets, i64 begin, i64 end);

// Masked-token training (--objective mlm, BERT's recipe): picks round(0.15 S) positions of
// tokens[0..S) (at least one), drawn from a hash of `seed` and the tokens themselves, so that
// every rank, layout and resumed run masks the same ones; each becomes the mask id (the last
// of the vocabulary, V - 1) with probability 0.8, a random id with 0.1, and stays with 0.1.
// Rewrites tokens in place and returns the targets [S]: the original token at the picked
// positions, kNoTarget elsewhere.
std::vector<std::int32_t> mask_tokens(std::int32_t* tokens, i64 S, int vocab, std::uint64_t seed);

}  // namespace sppo
