// How a job's ranks share one training step (docs/design.md 6), and the parts of a step that
// live outside the schedule: which sequences each replica trains, the optimizer over each
// rank's own (or ZeRO-sharded) parameters, consolidated checkpoints and exports, and
// errors that every rank must agree on.
//
// Ranks: numbered as Note [Rank layout] in core/parallel.h says (ParallelDims::rank_of), the
// schedule builders' numbering too, so a tensor-parallel group is consecutive ranks, a
// stage's ring members consecutive groups, a replica's stages consecutive blocks, and rank 0
// is member 0 of ring member 0 of stage 0 of replica 0.
// Data: an optimizer step trains `batch` sequences, drawn from the data stream in order;
// replica d trains sequences [d * batch / dp, (d + 1) * batch / dp) of them, so dp
// replicas see exactly the tokens one process sees with --batch dp.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/check.h"
#include "core/config.h"
#include "core/parallel.h"
#include "io/checkpoint.h"
#include "runtime/executor.h"

namespace sppo {

// This rank's place in the job's parallelism.
struct ParallelLayout {
  ParallelDims par;
  int batch = 1;   // sequences per optimizer step, all replicas together
  int rank = 0;
  std::vector<std::pair<int, int>> stage_layers;  // [begin, end) of each stage (set with the schedule)

  int ranks() const { return par.ranks(); }
  ParallelDims::Coord at() const { return par.coord_of(rank); }
  int stage_of(int r) const { return par.coord_of(r).stage; }
  int replica_of(int r) const { return par.coord_of(r).replica; }
  int stage() const { return at().stage; }
  int replica() const { return at().replica; }
  int ring() const { return at().ring; }
  int tp_index() const { return at().member; }
  TpShard tp_shard() const { return {tp_index(), par.tp}; }
  UlyssesShard ulysses_shard() const { return {at().ulysses, par.ulysses}; }
  int per_replica() const { return batch / par.dp; }
  bool first_stage() const { return stage() == 0; }
  bool last_stage() const { return stage() == par.pp - 1; }
  int rank_of(int replica, int stage, int ring = 0, int t = 0) const {
    return par.rank_of({replica, stage, ring, 0, t});
  }
  // The ranks that hold the same layers and shards (every ring and Ulysses member of every
  // replica, with this rank's stage and tensor-parallel index), in the schedule's all-reduce
  // order; this rank's index in it is its ZeRO shard.
  comm::Group stage_group() const { return par.layer_group(rank); }
  int stage_index() const { return par.zero == ZeroStage::None ? 0 : par.zero_index(rank); }
  // Whether this rank holds what no other rank of its layer group does not also hold: the
  // first replica's first ring and Ulysses member (the copy consolidated checkpoints take).
  bool holds_first_copy() const { return at().replica == 0 && at().ring == 0 && at().ulysses == 0; }
};

// Checks the layout (its degrees, ZeRO stage and batch) against itself and against the job's
// rank count; throws sppo::Error naming the numbers and the mpirun -np that would work.
ParallelLayout make_layout(const ParallelDims& par, int batch, const comm::Comm& world);
// The same checks for a layout not started (a dry run): rank `rank` of par.ranks().
ParallelLayout make_layout(const ParallelDims& par, int batch, int rank = 0);

// Runs f on every rank; if it throws sppo::Error on any, every rank throws one Error
// holding the distinct messages (naming the ranks when they differ), so that a bad option
// ends the whole job with one message and exit 2 instead of leaving ranks waiting.
void on_every_rank(comm::Comm& world, const std::function<void()>& f);

// Work on this rank alone: an error here leaves the other ranks waiting on messages, so
// with several ranks it ends the whole job at once, naming the rank (exit 3 for a budget
// that does not fit, else 2).
template <typename F>
void on_this_rank(comm::Comm& world, F&& f) {
  try {
    f();
  } catch (const Error& e) {
    if (world.size() == 1) throw;
    world.abort(std::string(e.what()) + " (rank " + std::to_string(world.rank()) + ")",
                dynamic_cast<const DoesNotFit*>(&e) ? 3 : 2);
  }
}

// Makes the communicators of every all-reduce group of the schedule (collective), and of
// the tensor-parallel groups of model c.
void prepare_groups(comm::Comm& world, const sched::Schedule& s, const ModelConfig& c);

// Ends the job when the ranks were started with different options: names the ranks and
// the options that differ. `options` is a flat JSON object of this rank's settings.
void check_same_options(comm::Comm& world, const nlohmann::json& options);

struct AdamWSettings {
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0;
  float clip = 0;  // global gradient-norm clip; 0: off
};

// The optimizer step after the schedule has reduced the gradients: scales them by
// 1 / batch (the mean over the step's sequences), computes the global norm over every
// parameter once (the tied embedding counted on the first stage only), clips, updates
// this rank's AdamW state (no decay on vectors), and under ZeRO all-gathers the updated
// weights. With the state on the host (Runtime::state_on_host) the update is started
// and runs beside the next step's start (Note [Optimizer state on the host] in
// runtime/host_optimizer.h). Returns the norm before clipping; a non-finite norm leaves
// the weights alone.
double optimizer_step(Runtime& rt, const ParallelLayout& lay, comm::Comm& world, const AdamWSettings& hp,
                      int t);

// Full-model arrays in parameter_specs(c) order, on rank 0 only.
struct FullState {
  std::vector<float> params, grads, m, v;
};
// Collects this step's parameters (and gradients / AdamW state when asked) from every
// stage onto rank 0, in the consolidated layout. Every rank must call it.
FullState gather_full(Runtime& rt, const ParallelLayout& lay, comm::Comm& world, bool grads, bool optimizer);

// The initial weights of this rank's parameters: every rank draws the whole model from the
// seed (init_params) and keeps its own, so that any layout starts where one process does.
void init_owned(Runtime& rt, std::uint64_t seed);

// Loads a consolidated checkpoint (any layout it was saved from) into this rank's own
// parameters and AdamW state; returns its state.json. `from` receives the directory read.
nlohmann::json load_owned(Runtime& rt, const std::string& dir, std::string* from);

// The weights of `path` (an sppo checkpoint, or a Hugging Face model directory:
// io/hf.h) into this rank's own parameters (--init); the optimizer starts fresh.
void init_from(Runtime& rt, const std::string& path);

// The model --init PATH holds: its checkpoint's config, or its config.json's.
ModelConfig init_model(const std::string& path);

// Saves a consolidated checkpoint: rank 0 writes what gather_full collects (and `config`,
// the run's options, as its config.toml).
void save_consolidated(Runtime& rt, const ParallelLayout& lay, comm::Comm& world, const std::string& dir,
                       const nlohmann::json& state, const std::string& config = {});

// The io tensor list of a full-model array (names from parameter_specs, "<name><suffix>").
std::vector<io::CheckpointTensor> full_tensors(const ModelConfig& c, float* base, const char* suffix);

}  // namespace sppo
