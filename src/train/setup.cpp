#include "train/setup.h"

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <unistd.h>

#include "comm/launcher.h"
#include "core/check.h"
#include "planner/plan.h"
#include "schedule/builders.h"
#include "schedule/memory.h"
#include "schedule/validate.h"
#include "sim/simulator.h"
#include "sim/solver.h"
#include "train/partition.h"
#include "train/profile_device.h"
#include "train/profile_machine.h"
#include "backends/cuda/cuda_backend.h"
#include "runtime/staged_comm.h"

namespace sppo {

plan::Plan read_plan_file(const std::string& path) {
  std::ifstream f(path);
  SPPO_CHECK(f.good(), "options") << "cannot read --plan " << path;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    SPPO_CHECK(false, "options") << "--plan " << path << " is not JSON: " << e.what();
  }
  return plan::plan_from_json(j);
}

DeviceBudget resolve_device_budget(i64 bytes, double fraction, i64 device_memory, i64 capacity) {
  DeviceBudget b;
  if (bytes > 0) {
    b.bytes = bytes;
    b.from = "--device-memory";
  } else if (fraction > 0) {
    b.bytes = i64(double(device_memory) * fraction);
    char buf[96];
    std::snprintf(buf, sizeof buf, "--device-memory %g%% of the device's %s", fraction * 100,
                  format_bytes(double(device_memory)).c_str());
    b.from = buf;
  } else if (capacity > 0) {
    b.bytes = capacity;
    b.from = "the device's " + format_bytes(double(device_memory)) + ", less " +
             format_bytes(double(kDeviceReserveBytes)) + " for the CUDA context and libraries (or its share, where "
             "ranks share it): --device-memory says otherwise";
    return b;
  }
  SPPO_CHECK(capacity == 0 || b.bytes <= capacity, "options")
      << "--device-memory of " << format_bytes(double(b.bytes)) << " is more than the device tier can hold, "
      << format_bytes(double(capacity)) << " (the device's " << format_bytes(double(device_memory)) << " less "
      << format_bytes(double(kDeviceReserveBytes)) << " for the CUDA context and libraries); use at most "
      << capacity << " bytes, or " << int(100.0 * double(capacity) / double(device_memory)) << "%";
  return b;
}

namespace {

int resolve_subseqs(const StepOptions& o, i64 S) {
  // Without a budget, auto aims at about 8K tokens a subsequence (make_setup refines it
  // under a budget).
  if (o.subseqs == "auto") return int(std::max<i64>(1, std::min<i64>(S, (S + 8191) / 8192)));
  i64 n = 0;
  try {
    n = parse_count(o.subseqs, "--subseqs");
  } catch (const Error&) {
    SPPO_CHECK(false, "options") << "--subseqs '" << o.subseqs
                                 << "' is not a count; give a positive integer or 'auto'";
  }
  SPPO_CHECK(n >= 1 && n <= S, "options")
      << "--subseqs " << n << " must be between 1 and --seq-len (" << S << ")";
  return int(n);
}

}  // namespace

double mean_loss(const std::vector<float>& losses, i64 begin, i64 end) {
  double s = 0;
  for (i64 t = begin; t < end; ++t) s += losses[std::size_t(t)];
  return end > begin ? s / double(end - begin) : 0.0;
}

double mean_loss(const std::vector<float>& losses, const std::vector<std::int32_t>& targets, i64 begin, i64 end) {
  double s = 0;
  i64 n = 0;
  for (i64 t = begin; t < end; ++t)
    if (targets[std::size_t(t)] != kNoTarget) {
      s += losses[std::size_t(t)];
      ++n;
    }
  return n > 0 ? s / double(n) : 0.0;
}

std::vector<std::int32_t> mask_tokens(std::int32_t* tokens, i64 S, int vocab, std::uint64_t seed) {
  std::uint64_t h = 1469598103934665603ull ^ seed;  // FNV-1a over the tokens
  for (i64 t = 0; t < S; ++t) {
    h ^= std::uint32_t(tokens[t]);
    h *= 1099511628211ull;
  }
  std::mt19937_64 rng(h);
  const i64 picked = std::max<i64>(1, std::llround(0.15 * double(S)));
  std::vector<i64> order(static_cast<std::size_t>(S));
  for (i64 t = 0; t < S; ++t) order[std::size_t(t)] = t;
  std::vector<std::int32_t> targets(static_cast<std::size_t>(S), kNoTarget);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::uniform_int_distribution<std::int32_t> any(0, vocab - 1);
  for (i64 k = 0; k < picked; ++k) {
    std::uniform_int_distribution<i64> pick(k, S - 1);
    std::swap(order[std::size_t(k)], order[std::size_t(pick(rng))]);
    const i64 t = order[std::size_t(k)];
    targets[std::size_t(t)] = tokens[t];
    const double r = u(rng);
    if (r < 0.8) tokens[t] = vocab - 1;
    else if (r < 0.9) tokens[t] = any(rng);
  }
  return targets;
}

PackedDocs pack_documents(const std::int32_t* tokens, i64 S, std::int32_t sep) {
  std::vector<i64> starts;  // the separator ends its document: the next one begins after it
  for (i64 t = 0; t < S; ++t)
    if (tokens[t] == sep) starts.push_back(t + 1);
  return pack_at_starts(tokens, S, starts);
}

PackedDocs pack_at_starts(const std::int32_t* tokens, i64 S, const std::vector<i64>& starts) {
  PackedDocs d;
  d.starts.push_back(0);
  d.targets.assign(tokens + 1, tokens + S + 1);
  for (const i64 j : starts) {
    if (j <= 0 || j > S) continue;  // offset S + 1 and beyond lie past the sequence's targets
    d.targets[std::size_t(j - 1)] = kNoTarget;
    if (j < S) d.starts.push_back(j);
  }
  return d;
}

void init_params(const ModelConfig& c, float* params, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float std_w = 0.02f, std_resid = 0.02f / std::sqrt(2.0f * float(c.layers));
  float* p = params;
  for (const auto& spec : parameter_specs(c)) {
    const i64 n = spec.numel();
    const std::string& name = spec.name;
    auto ends_with = [&](const char* suf) {
      const std::string s(suf);
      return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
    };
    if (spec.shape.size() == 2) {
      const bool resid = ends_with("attn.out.weight") || ends_with("mlp.proj.weight");
      const float sd = resid ? std_resid : std_w;
      for (i64 k = 0; k < n; ++k) p[k] = sd * normal(rng);
    } else {
      const float fill = (ends_with("ln1.weight") || ends_with("ln2.weight") || ends_with("ln_f.weight") ||
                          ends_with("_norm.weight"))  // Qwen3's q_norm, k_norm
                             ? 1.0f
                             : 0.0f;
      std::fill(p, p + n, fill);
    }
    p += n;
  }
}

namespace {

// --plan: a plan fixes the layout, the lengths and alpha; the model and S must agree.
plan::Plan read_plan(const StepOptions& o, const ModelConfig& model) {
  const plan::Plan p = read_plan_file(o.plan_path);
  const ParallelDims& a = o.par;
  const ParallelDims& d = p.par;
  SPPO_CHECK((a.pp == 1 || a.pp == d.pp) && (a.dp == 1 || a.dp == d.dp) && (a.cp == 1 || a.cp == d.cp) &&
                 (a.tp == 1 || a.tp == d.tp) && (a.ulysses == 1 || a.ulysses == d.ulysses),
             "options")
      << "--plan " << o.plan_path << " has the layout " << layout_text(d) << ", but " << layout_text(a)
      << " was given; drop --pp, --tp, --ulysses, --cp and --dp (the plan sets the layout)";
  SPPO_CHECK(p.seq_len == o.seq_len, "options")
      << "--plan " << o.plan_path << " is for --seq-len " << p.seq_len << ", not " << o.seq_len;
  SPPO_CHECK(to_json(p.model) == to_json(model), "options")
      << "--plan " << o.plan_path << " is for the model " << to_json(p.model).dump()
      << ", not " << to_json(model).dump() << "; pass the same model options";
  return p;
}

// MemAvailable of /proc/meminfo (0 when unknown).
i64 available_memory_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  i64 kib = 0;
  std::string unit;
  while (f >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

// The profile adaptive choices price with. Measured timings differ from rank to rank, and
// every rank must choose the same lengths and alpha, so rank 0 measures for all.
plan::HardwareProfile agreed_profile(const std::string& hardware, comm::Comm& w) {
  if (!hardware.empty() || w.size() == 1) return resolve_cpu_profile(hardware);
  const std::string mine = w.rank() == 0 ? plan::to_json(resolve_cpu_profile("")).dump() : "";
  const auto all = comm::allgather_strings(w, mine, "rank 0's measurement of this machine");
  return plan::profile_from_json(nlohmann::json::parse(all[0]), "rank 0's measurement");
}

// A run of a plan (--plan, no --hardware) prices with the plan's own profile where this
// machine has it (a preset, or the file it names), as the plan was priced, rather than
// measuring this one as it starts; where it does not, null (the caller measures). Rank 0
// decides for all, so that every rank takes the same profile.
std::optional<plan::HardwareProfile> plans_profile(const plan::Plan& p, comm::Comm& w) {
  std::string mine;
  if (w.rank() == 0) {
    try {
      mine = plan::to_json(plan::load_profile(p.hardware)).dump();
    } catch (const Error&) {
      mine = "";
    }
  }
  if (w.size() > 1) mine = comm::allgather_strings(w, mine, "rank 0's reading of the plan's profile")[0];
  if (mine.empty()) return std::nullopt;
  return plan::profile_from_json(nlohmann::json::parse(mine), "the plan's profile " + p.hardware);
}

}  // namespace

namespace {

// Note [Ranks and GPUs]: a CUDA rank drives one GPU: --device N, else its local rank (the
// launcher's, mpirun's, mpiexec's or srun's: Note [Launchers] in comm/launcher.h) modulo the
// GPUs it sees. Ranks of one machine that land on the same GPU share it: each takes its share of the
// device's memory, and their messages go through pinned host memory over MPI, since NCCL
// (2.28) refuses two ranks of one communicator on one device; ranks with a GPU each talk over
// NCCL. --comm nccl|mpi forces the transport (mpi on the CPU stages its messages all the same,
// which is how the CPU's tests run the GPUs' staging).
int local_rank(const comm::Comm& w) {
  const int r = comm::launcher_local_rank();
  return r >= 0 ? r : w.rank();
}

DevicePlacement place_on_device(const StepOptions& o, comm::Comm& w) {
  DevicePlacement p;
  const bool cuda = o.backend == "cuda" || (o.backend == "auto" && cuda_device_visible());
  const int n = cuda ? cuda_device_count() : 0;
  SPPO_CHECK(o.device < 0 || cuda, "options") << "--device " << o.device << " picks a GPU; this run is on the CPU "
                                              << "backend (drop --device, or use --backend cuda)";
  if (n == 0) return p;  // make_backend says what is missing
  SPPO_CHECK(o.device < n, "options") << "--device " << o.device << ": this process sees " << n << " GPU"
                                      << (n == 1 ? "" : "s") << " (0.." << n - 1 << ")";
  p.device = o.device >= 0 ? o.device : local_rank(w) % n;
  if (w.size() > 1) {
    char host[256] = {0};
    gethostname(host, sizeof host - 1);
    const std::string mine = std::string(host) + "/" + cuda_device_id(p.device);
    const auto all = comm::allgather_strings(w, mine, "every rank's GPU");
    p.sharing = int(std::count(all.begin(), all.end(), mine));
  }
  return p;
}

// The communicator for device memory, or null where the world serves (Note [Ranks and GPUs]).
std::unique_ptr<comm::Comm> device_comm(const StepOptions& o, comm::Comm& w, Backend& be, const DevicePlacement& p,
                                        std::string* name) {
  SPPO_CHECK(o.comm == "auto" || o.comm == "nccl" || o.comm == "mpi", "options")
      << "--comm '" << o.comm << "' is unknown; use auto, nccl or mpi";
  const bool cpu = std::string(be.name()) == "cpu";
  SPPO_CHECK(!cpu || o.comm != "nccl", "options") << "--comm nccl connects GPUs; the CPU backend's ranks talk over "
                                                     "MPI (--comm auto, or mpi to stage every message as on GPUs)";
  if (w.size() == 1) {
    *name = "";
    return nullptr;
  }
  if (cpu) {
    if (o.comm == "auto") {
      *name = "mpi";
      return nullptr;
    }
    *name = "mpi, every message staged through the copy streams (--comm mpi)";
    return std::make_unique<StagedComm>(w, be, true);
  }
  const bool nccl = o.comm == "nccl" || (o.comm == "auto" && p.sharing == 1 && cuda_nccl_built());
  if (nccl) {
    SPPO_CHECK(p.sharing == 1, "options")
        << "--comm nccl: " << p.sharing << " ranks drive GPU " << p.device << " of this machine, and NCCL refuses "
        << "two ranks of one communicator on one device; use --comm mpi (messages through pinned host memory), or "
        << "start one rank per GPU (mpirun -np <GPUs per node> per node)";
    *name = "nccl";
    return be.make_nccl_comm(w);
  }
  *name = p.sharing > 1 ? "mpi through pinned host memory (" + std::to_string(p.sharing) + " ranks share a GPU)"
                        : "mpi through pinned host memory";
  return std::make_unique<StagedComm>(w, be, false);
}

}  // namespace

namespace {

// make_setup in named stages, each readable alone: check the options, open the backend and
// the data, lay out the ranks, describe the step's shape, check the placements asked for,
// place the tensors under the budgets, predict and check the memory, make the runtime.
class SetupBuilder {
 public:
  SetupBuilder(const StepOptions& o, comm::Comm& w) : o_(o), w_(w), S_(o.seq_len) {}

  StepSetup build() {
    check_options();
    if (o_.dry_run) {
      take_plans_machine();
    } else {
      open_backend();
    }
    open_data();
    lay_out_ranks();
    describe_shape();
    check_placements();
    place_under_budget();
    predict();
    if (o_.dry_run) return std::move(s_);  // another machine's run: nothing of this one is checked or made
    check_machine_memory();
    make_runtime();
    return std::move(s_);
  }

 private:
  void check_options() {
    s_.config = o_.model;
    s_.config.rope_seq_len = o_.seq_len;  // "dynamic" RoPE scaling scales to the length trained at
    s_.seed = o_.seed;
    s_.config.validate();
    SPPO_CHECK(o_.seq_len >= 2, "options") << "--seq-len " << o_.seq_len << " is too short; use at least 2";
    // Timing matters to plans and adaptive choices only; a budget check needs the memory
    // model alone. With several ranks the profile comes first: it is a collective, and
    // nothing that can fail on one rank alone may run before it. One process measures it
    // only once the options and data have been checked.
    s_.profile_measured = !o_.plan_path.empty() || o_.partition == "adaptive" || o_.offload == "adaptive" ||
                          !o_.hardware.empty();
    SPPO_CHECK(o_.host_memory >= 0, "options") << "--host-memory must not be negative";
    s_.profile = nominal_cpu_profile();
    if (!o_.plan_path.empty()) from_plan_ = read_plan(o_, s_.config);
    SPPO_CHECK(o_.partition == "length" || o_.partition == "flops" || o_.partition == "adaptive", "options")
        << "--partition '" << o_.partition << "' is unknown; use length, flops or adaptive";
    if (w_.size() > 1 && !o_.dry_run) profile();
  }

  // --dry-run: the machine of the plan (its backend's precision, kernel scratch and hardware
  // profile, its ranks, its budget) in place of this one's; nothing is allocated.
  void take_plans_machine() {
    SPPO_CHECK(from_plan_, "options")
        << "--dry-run checks a plan before its run, on the plan's machine: give --plan PLAN.json (sppo plan --out)";
    const plan::Plan& p = *from_plan_;
    precision_ = p.precision;
    s_.profile = plan::load_profile(o_.hardware.empty() ? p.hardware : o_.hardware);
    s_.profile.devices_per_node = p.gpus_per_node;
    if (o_.host_memory > 0) s_.profile.host_memory = o_.host_memory;
    s_.profile_measured = true;
    profiled_ = true;
    budget_ = o_.device_memory > 0 ? o_.device_memory : p.budget > 0 ? p.budget : s_.profile.usable_memory();
    s_.device_budget = {budget_, o_.device_memory > 0 ? "--device-memory"
                                 : p.budget > 0      ? "the plan's budget_bytes"
                                                     : "the profile's usable memory"};
    host_budget_ = s_.profile.host_memory;
    s_.host_budget = host_budget_;
  }

  // The profile adaptive choices price with, measured once when they need timings;
  // --host-memory is the host memory a device has, to every choice made with it.
  const plan::HardwareProfile& profile() {
    if (s_.profile_measured && !profiled_) {
      // A device is priced by its own measurement (a quick one, once per process), not by
      // the processor's: without --hardware a GPU run's offload ratios and lengths were
      // chosen with the CPU's rates. A plan's run by the plan's profile, where it is here.
      const bool device = o_.hardware.empty() && s_.backend && std::string(s_.backend->name()) != "cpu";
      const std::optional<plan::HardwareProfile> planned =
          from_plan_ && o_.hardware.empty() ? plans_profile(*from_plan_, w_) : std::nullopt;
      s_.profile = planned ? *planned : device ? measured_device_profile(*s_.backend) : agreed_profile(o_.hardware, w_);
    }
    if (o_.host_memory > 0) s_.profile.host_memory = o_.host_memory;
    profiled_ = true;
    return s_.profile;
  }

  void open_backend() {
    const DevicePlacement place = place_on_device(o_, w_);
    s_.backend = make_backend(o_.backend, o_.precision, o_.attention_kernels, place);
    s_.device_budget = resolve_device_budget(o_.device_memory, o_.device_memory_fraction,
                                             i64(s_.backend->device_memory()), i64(s_.backend->device_capacity()));
    budget_ = s_.device_budget.bytes;
    host_budget_ = s_.host_budget = o_.host_memory;
    s_.attention = s_.backend->prepare_attention(s_.config);
    // A profile measured on this GPU says, per shape class, whose attention kernels are faster.
    if (!o_.hardware.empty()) s_.backend->prefer_attention(attention_classes(profile()));
    precision_ = s_.backend->act() == DType::F32 ? ActPrecision::F32 : ActPrecision::BF16;
    s_.device_comm = device_comm(o_, w_, *s_.backend, place, &s_.comm_name);
  }

  void open_data() {
    s_.data = io::open_data(o_.data, s_.config.vocab, o_.seed, io::DataOptions{0, o_.data_dtype});
    s_.data->check_vocab(s_.config.vocab);
    s_.repeat_task = o_.data.empty() || o_.data.rfind("repeat", 0) == 0;
    if (o_.labels.empty()) return;
    SPPO_CHECK(!s_.repeat_task, "options")
        << "--labels gives the targets of the tokens of --data (a token file); the built-in task has its own";
    SPPO_CHECK(s_.config.causal, "options")
        << "--labels gives a causal model's next-token targets; a bidirectional model (--attention bidirectional) "
           "trains on masked tokens: drop --labels";
    s_.labels = io::open_labels(o_.labels, s_.config.vocab);
    SPPO_CHECK(s_.labels->size() == s_.data->size(), "options")
        << "--labels " << o_.labels << " holds " << s_.labels->size() << " labels, but --data " << o_.data
        << " holds " << s_.data->size()
        << " tokens; give one label per token (scripts/tokenize_text.py --chat writes both)";
    s_.labels->check_vocab(s_.config.vocab);
    SPPO_CHECK(s_.labels->max_token() >= 0, "options")
        << "--labels " << o_.labels << " is " << io::kIgnoreLabel << " everywhere: no token would be trained on";
  }

  // The ranks' layout: a plan's, or the options'; what tensor parallelism can split.
  void lay_out_ranks() {
    const auto& fp = from_plan_;
    // A plan's layout, with the ring's algorithm and the ZeRO stage as the options give them.
    ParallelDims par = o_.par;
    if (fp) {
      par = fp->par;
      par.ring_algorithm = o_.par.ring_algorithm;
      par.zero = o_.par.zero;
    }
    // What the model lets each kind of parallelism split comes first: it says more than the
    // job's rank count would.
    const ModelConfig& c = s_.config;
    const int tp = par.tp;
    // (Degrees below 1 are make_layout's to refuse.)
    SPPO_CHECK(tp <= c.heads, "options")
        << "--tp " << tp << " splits the attention heads over its ranks, but the model has " << c.heads
        << "; use --tp " << c.heads << " or fewer";
    SPPO_CHECK(tp < 1 || !c.llama() || sched::llama_tp_runs(c, tp), "options")
        << "--tp " << tp << " does not split the " << c.heads << " query heads over "
        << c.kv_head_count() << " key/value heads of the Llama-family model (--model " << o_.model_preset
        << ") so that each rank's queries read its own key/value heads; use one of --tp " << [&] {
             std::string ok;
             for (int t = 1; t <= c.heads; ++t)
               if (sched::llama_tp_runs(c, t)) ok += (ok.empty() ? "" : ", ") + std::to_string(t);
             return ok;
           }() << " (a divisor of " << c.kv_head_count() << ", or a multiple whose ranks share each key/value head)";
    const int U = par.ulysses;
    SPPO_CHECK(U < 1 || ulysses_runs(c, U), "options")
        << "--ulysses " << U << " does not split the " << c.heads << " query heads"
        << (c.llama() ? " over " + std::to_string(c.kv_head_count()) + " key/value heads" : "") << " so that each rank's queries read key/value heads of its own; use one of --ulysses " << [&] {
             std::string ok;
             for (int u = 1; u <= c.heads; ++u)
               if (ulysses_runs(c, u)) ok += (ok.empty() ? "" : ", ") + std::to_string(u);
             return ok;
           }() << " (at most the key/value heads, or a multiple of them whose ranks share each one's queries)";
    s_.layout = o_.dry_run ? make_layout(par, o_.batch) : make_layout(par, o_.batch, w_);
    s_.plan = from_plan_;
    SPPO_CHECK(!o_.recompute || s_.layout.ranks() == 1, "options")
        << "--recompute is the one-process baseline; drop --pp and --dp";
  }

  // The step's shape: the layout (with the ring and MSP), the plan's placements, precision,
  // tiles, packed documents and labels, and the kernels' scratch.
  void describe_shape() {
    const auto& fp = from_plan_;
    shape_.par = s_.layout.par;
    SPPO_CHECK(shape_.par.msp.reach == 0 || shape_.par.msp.reach >= 2, "options")
        << "--msp-reach " << shape_.par.msp.reach << ": use 0 (every idle stage group) or 2 or more";
    // The plan's placements, where the options leave them to it (each option's own below).
    if (fp) shape_.place = fp->place;
    shape_.place.residual_grads = o_.place.residual_grads;
    shape_.precision = precision_;
    if (fp) shape_.stage_layers = fp->stage_layers;
    SPPO_CHECK(o_.mlp_tile_rows == 0 || (shape_.par.tp == 1 && !o_.recompute), "options")
        << "--mlp-tile-rows runs the MLP of whole rows a tile at a time; it runs without --tp and --recompute "
           "(use --mlp-tile-rows 0 there)";
    shape_.place.mlp_tile_rows = o_.mlp_tile_rows;
    // Packed documents: the blocks keep them apart through the K/V on the device of one rank.
    SPPO_CHECK(!o_.pack || o_.doc_sep >= 0 || s_.data->has_documents(), "options")
        << "--pack packs documents that --doc-sep ID ends (e.g. the tokenizer's end-of-text id), or those of a "
           "Megatron dataset's document index; " << s_.data->describe() << " has no index";
    SPPO_CHECK(!o_.pack || s_.config.causal, "options")
        << "--pack keeps each document's causal attention to itself; a bidirectional model (--attention "
           "bidirectional, and so --ring rsa) has none to keep: drop --pack";
    SPPO_CHECK(o_.doc_sep < s_.config.vocab, "options")
        << "--doc-sep " << o_.doc_sep << " is not a token id of the model's vocabulary of " << s_.config.vocab;
    shape_.packed = o_.pack;
    shape_.labeled = s_.labels != nullptr;
    shape_.forward_only = o_.forward_only;
    SPPO_CHECK(!o_.forward_only || (!o_.recompute && !shape_.par.msp.on && !from_plan_), "options")
        << "an evaluation runs the forward alone: it runs without --recompute, --msp on and --plan";
    s_.doc_sep = o_.doc_sep;
    // The kernels' scratch comes from the device tier too (a dry run's: the plan's backend's).
    shape_.block_scratch = o_.dry_run ? from_plan_->block_scratch : s_.backend->block_scratch(s_.config);
    shape_.head_scratch =
        o_.dry_run ? from_plan_->head_scratch : s_.backend->head_scratch(s_.config, RuntimeOptions{}.head_chunk);
    SPPO_CHECK(shape_.par.ulysses == 1 || (!shape_.par.msp.on && !shape_.par.rsa()), "options")
        << "--ulysses turns each subsequence's rows into heads around the attention; it runs without "
        << (shape_.par.msp.on ? "--msp on (MSP's pieces move hidden states in runs of positions): use --msp off"
                              : "--ring rsa (the two-pass ring is for whole heads of bidirectional models): use "
                                "--ring flash");
    SPPO_CHECK(shape_.par.ring_algorithm != RingAlgorithm::Rsa ||
                   (!s_.config.causal && precision_ == ActPrecision::F32),
               "options")
        << "--ring rsa is the two-pass Ring Self-Attention of bidirectional models (--attention bidirectional), in "
           "fp32; a causal model uses --ring flash";
    check_state();
    check_zero();
  }

  // --zero 2 and 3 (Notes [ZeRO-2] and [ZeRO-3] in schedule/weights.h): what sharding the
  // gradients, and the weights, runs with.
  void check_zero() const {
    if (!shards_gradients(shape_.par.zero)) return;
    const std::string zero = "--zero " + std::to_string(stage_number(shape_.par.zero));
    const ParallelDims& par = shape_.par;
    const char* refused = par.zero_shards() < 2 ? nullptr
                          : par.zero_sharding_refused() ? par.zero_sharding_refused()
                          : o_.recompute                ? "--recompute (the full-recompute baseline)"
                                                        : nullptr;
    SPPO_CHECK(par.zero_shards() >= 2, "options")
        << zero << " shards the " << (shape_.par.zero == ZeroStage::Weights ? "weights and gradients" : "gradients")
        << " over the ranks that hold the same layers (each stage's --dp, --cp and --ulysses ranks), and this "
           "layout has one; add --dp, --cp or --ulysses, or use --zero 0";
    SPPO_CHECK(!refused, "options") << zero << " reduce-scatters each layer's gradient into the rank's shard as its "
                                    << "last backward ends; it does not run with " << (refused ? refused : "")
                                    << ". Use --zero 1 there";
  }

  // --optimizer-state and --weights (Note [Weights on the host] in schedule/weights.h): the
  // layers' weights on the host are the optimizer's master there, and a layer is brought
  // whole to the one rank that runs it. auto is the plan's, else the device: the setup does
  // not search these placements.
  void check_state() {
    Placements& pl = shape_.place;
    if (o_.place.optimizer_state) pl.optimizer_state = *o_.place.optimizer_state;
    if (o_.place.weights) pl.weights = *o_.place.weights;
    if (!pl.weights_host()) return;
    SPPO_CHECK(pl.optimizer_host(), "options")
        << "--weights host keeps the layers' fp32 weights and gradients in host memory, where the optimizer's "
           "update reads them: it needs --optimizer-state host (or use --weights device)";
    const char* layout = weights_refused();
    SPPO_CHECK(!layout, "options") << "--weights host brings each layer's weights whole to the rank that runs it; "
                                   << "it does not run with " << (layout ? layout : "")
                                   << ". It runs on one process, with --pp, --cp and --dp; or use --weights device";
  }
  // The layout --weights host does not run in, named; null: none.
  const char* weights_refused() const {
    return shape_.par.msp.on                      ? "--msp on (helpers borrow a stage's weights whole)"
           : shape_.par.tp > 1                    ? "--tp (each rank holds shards of every layer)"
           : shape_.par.zero != ZeroStage::None   ? "--zero 1 to 3 (the master is sharded over the replicas)"
           : o_.recompute                         ? "--recompute (the full-recompute baseline)"
                                                  : nullptr;
  }
  bool weights_ok() const { return !weights_refused(); }

  // Where the K/V cache lives (--kv-cache) and what backward recomputes
  // (--recompute-tensors): what this layout can run.
  void check_placements() {
    const Auto<KvPlace> kv = o_.place.kv;
    const ParallelDims& par = shape_.par;
    Placements& pl = shape_.place;
    kv_host_ok_ = !o_.recompute && !par.rsa();
    kv_recompute_ok_ = kv_host_ok_ && par.tp == 1 && par.cp == 1 && par.ulysses == 1 && !par.msp.on && !o_.forward_only;
    SPPO_CHECK(kv != KvPlace::Host || kv_host_ok_, "options")
        << "--kv-cache host streams K/V blocks of a rank's own subsequences; it runs without --ring rsa and "
           "--recompute (use --kv-cache device there)";
    SPPO_CHECK(kv != KvPlace::Recompute || kv_recompute_ok_, "options")
        << "--kv-cache recompute recomputes K/V from a rank's whole rows of each layer's input, one rank's "
           "subsequences at a time; it runs without --tp, --cp, --ulysses, --msp on and --recompute, and in "
           "training only (use --kv-cache host or device there)";
    recompute_auto_ = !o_.place.recompute && !o_.forward_only;  // an evaluation saves nothing to recompute
    if (o_.forward_only) pl.recompute = 0;
    else if (!recompute_auto_) pl.recompute = *o_.place.recompute;
    SPPO_CHECK(!o_.recompute || pl.recompute == 0, "options")
        << "--recompute already recomputes whole blocks from their inputs; drop --recompute-tensors "
        << recompute_tensors_text(pl.recompute) << " (or --recompute)";
    const bool attention_ok = par.cp == 1 && par.ulysses == 1 && !par.msp.on;
    SPPO_CHECK(!(pl.recompute & kAttentionGroup) || attention_ok, "options")
        << "--recompute-tensors attention runs the attention again inside the backward, which a ring (--cp), "
           "Ulysses' all-to-alls (--ulysses) or MSP pieces do not; recompute other tensors, or drop --cp, --ulysses "
           "and --msp on";
    const bool head_ok = !par.msp.on;
    SPPO_CHECK(!(pl.recompute & kHeadGradGroup) || head_ok, "options")
        << "--recompute-tensors head_grad runs a stage's own LM head inside its last layer's backward, which MSP "
           "pieces on borrowed weights do not; recompute other tensors, or use --msp off";
    // The groups this layout can recompute.
    runnable_ = ~((attention_ok ? 0 : kAttentionGroup) | (head_ok ? 0 : kHeadGradGroup));
    if (kv == KvPlace::Host) pl.kv = all_layers(KvPlace::Host);
    if (kv == KvPlace::Recompute) pl.kv = all_layers(KvPlace::Recompute);
    if (kv == KvPlace::Device) pl.kv.clear();
    // The backward's order (Note [Layer-major backward] in schedule/builders.cpp): a layer
    // at a time runs inside each pipeline stage, not with MSP's borrowed weights.
    const Auto<BackwardOrder> order = o_.place.backward;
    layer_ok_ = !par.msp.on && !o_.forward_only;
    SPPO_CHECK(order != BackwardOrder::Layer || layer_ok_, "options")
        << "--backward-order layer runs the backward a layer at a time inside each pipeline stage, which MSP's "
           "pieces on borrowed weights do not; use --msp off, or --backward-order subseq";
    if (order) pl.backward = *order;  // auto: the plan's (else the paper's order, until it does not fit)
    // Note [Residual gradients on the host] (schedule/builders.cpp): only between the
    // layers of a layer-major backward, which --backward-order auto then is.
    if (pl.residual_host()) {
      SPPO_CHECK(order != BackwardOrder::Subseq && layer_ok_ &&
                     !(!order && from_plan_ && !from_plan_->place.layer_major()),
                 "options")
          << "--residual-grads host keeps the residual gradients on the host between the layers of the layer-major "
             "backward; it needs --backward-order layer (with --msp off" << (from_plan_ ? ", and a plan whose "
             "backward_order is layer" : "") << "), or use --residual-grads device";
      pl.backward = BackwardOrder::Layer;
    }
    check_rebuilt_inputs();
  }

  // --rebuild-inputs (Note [Rebuilt layer inputs] in schedule/builders.cpp): none, odd (1,
  // 3, 5, ...: each from the layer below, which keeps its input), a comma list of layers,
  // or auto (the plan's under --plan, else none).
  // A rebuilt layer cannot recompute its K/V: under --kv-cache recompute it keeps them on
  // the host. The backward becomes layer-major, as --residual-grads host makes it.
  void check_rebuilt_inputs() {
    using Kind = RebuildRequest::Kind;
    const RebuildRequest& asked = o_.place.rebuild;
    Placements& pl = shape_.place;
    const int L = s_.config.layers;
    if (asked.kind == Kind::None) pl.inputs_rebuilt.clear();
    if (asked.kind == Kind::None || (asked.kind == Kind::Auto && !pl.any_input_rebuilt())) return;
    std::vector<bool> rebuilt(std::size_t(L), false);
    if (asked.kind == Kind::Auto) {
      rebuilt = pl.inputs_rebuilt;
    } else if (asked.kind == Kind::Odd) {
      for (int l = 1; l < L; l += 2) rebuilt[std::size_t(l)] = true;
    } else {
      for (int l : asked.layers) {
        SPPO_CHECK(l < L, "options") << "--rebuild-inputs names layer " << l << ", not a layer of the model's " << L
                                     << "; use none, odd, or a comma list of layers from 1 to " << L - 1;
        rebuilt[std::size_t(l)] = true;
      }
    }
    SPPO_CHECK(o_.place.kv || from_plan_ || asked.kind == Kind::Auto, "options")
        << "--rebuild-inputs keeps the K/V of the layers it names (they cannot be recomputed without every "
           "earlier subsequence's input): name where the others keep theirs, --kv-cache device, host or recompute";
    SPPO_CHECK(o_.place.backward != BackwardOrder::Subseq && layer_ok_, "options")
        << "--rebuild-inputs runs the layer below's forward again inside a layer's backward, which only the "
           "layer-major backward orders so: use --backward-order layer" << (layer_ok_ ? "" : " and --msp off")
        << ", or --rebuild-inputs none";
    SPPO_CHECK(!o_.recompute, "options")
        << "--recompute already recomputes whole blocks from their inputs; drop --rebuild-inputs";
    pl.backward = BackwardOrder::Layer;
    if (pl.kv.empty()) pl.kv = all_layers(KvPlace::Device);
    for (int l = 0; l < L; ++l)
      if (rebuilt[std::size_t(l)] && pl.kv[std::size_t(l)] == KvPlace::Recompute) pl.kv[std::size_t(l)] = KvPlace::Host;
    pl.inputs_rebuilt = rebuilt;
    // The schedule's own checks, on this layout's schedule of one subsequence (its stages
    // and placements are the step's), before any work.
    const std::string why = sched::rebuilt_inputs_error(sched::build_step(s_.config, {S_}, {0.0}, shape_));
    SPPO_CHECK(why.empty(), "options") << why;
  }

  std::vector<KvPlace> all_layers(KvPlace p) const {
    return std::vector<KvPlace>(std::size_t(s_.config.layers), p);
  }
  // The layers [begin, end) of each pipeline stage of the shape.
  std::vector<std::pair<int, int>> stages() const {
    return sched::stage_ranges(s_.config.layers, shape_.par.pp, shape_.stage_layers);
  }
  // The K/V of the first `per_stage` layers of every stage on the host.
  std::vector<KvPlace> host_layers(int per_stage) const {
    std::vector<KvPlace> host(std::size_t(s_.config.layers), KvPlace::Device);
    for (const auto& [b, e] : stages())
      for (int l = b; l < std::min(e, b + per_stage); ++l) host[std::size_t(l)] = KvPlace::Host;
    return host;
  }

  // Lengths, fractions and the schedule for the current shape, and its prediction; whether
  // it fits the budgets.
  bool choose() {
    const ModelConfig& c = s_.config;
    if (from_plan_) {
      s_.lengths = from_plan_->lengths;
      s_.alpha = from_plan_->alpha;
    } else {
      int N = resolve_subseqs(o_, S_);
      const plan::HardwareProfile& hw = profile();
      if (o_.subseqs == "auto" && budget_ > 0 && o_.forward_only) {
        N = fewest_fitting_subseqs(hw);
      } else if (o_.subseqs == "auto" && budget_ > 0 && !o_.recompute) {
        // Under a budget, auto is the fewest subsequences that fit with adaptive offload.
        const auto fit = sim::smallest_fitting_n(c, S_, hw, precision_, budget_, o_.partition != "length",
                                                 1, int(std::min<i64>(S_, 4096)), shape_, kTileTokens);
        if (fit.found) N = fit.subseqs;
      }
      SPPO_CHECK(!o_.recompute || N == 1, "options")
          << "--recompute runs the whole sequence at once; drop --subseqs or set it to 1";
      if (!c.causal) {
        // Subsequences run one after another, so a position cannot see later ones.
        SPPO_CHECK(o_.subseqs == "1" || o_.subseqs == "auto" || N == 1, "options")
            << "--attention bidirectional sees the whole sequence at once, which subsequences run one after another "
               "cannot; use --subseqs 1 (ring attention, --cp, splits it over ranks instead)";
        N = 1;
      }
      // The simulator does not model recomputation: that baseline is checked by the arena
      // alone, and has no prediction. Under auto only the first refusal is ever shown
      // (fits()): the later ones skip the search over N that says what would fit.
      // An evaluation offloads nothing; its budget is checked once the step is simulated.
      SubseqChoice choice =
          choose_subseqs(o_.partition, o_.forward_only ? "none" : o_.offload, c, S_, N,
                         o_.recompute || o_.forward_only ? 0 : budget_, hw, shape_,
                         /*hint=*/!(any_auto_ && first_error_));
      s_.lengths = choice.lengths;
      s_.alpha = choice.alpha;
      s_.profile_measured = s_.profile_measured && !o_.recompute;
    }
    if (shape_.par.msp.on) check_msp();
    s_.schedule = sched::build_step(c, s_.lengths, s_.alpha, shape_);
    if (!o_.recompute)
      r_ = sim::simulate(s_.schedule, plan::CostModel(profile(), c, precision_),
                         sim::memory_rules(c, precision_, shape_));
    return budget_ == 0 || o_.recompute ||
           (r_.peak_device_bytes <= budget_ && (host_budget_ == 0 || r_.peak_host_bytes <= host_budget_));
  }

  // --subseqs auto in an evaluation under a budget: the fewest subsequences whose forward-only
  // step fits (its peak falls as N grows: the K/V are the same, a layer's saved tensors and
  // workspace shorter), searched by doubling, then halving the interval; the most tried
  // (4096, or S) where none fits, which predict() then refuses naming what it needs.
  int fewest_fitting_subseqs(const plan::HardwareProfile& hw) {
    const int most = int(std::min<i64>(S_, 4096));
    auto fits_with = [&](int N) {
      const SubseqChoice ch = choose_subseqs(o_.partition, "none", s_.config, S_, N, 0, hw, shape_, false);
      const sim::SimResult r =
          sim::simulate(sched::build_step(s_.config, ch.lengths, ch.alpha, shape_),
                        plan::CostModel(hw, s_.config, precision_), sim::memory_rules(s_.config, precision_, shape_));
      return r.peak_device_bytes <= budget_ && (host_budget_ == 0 || r.peak_host_bytes <= host_budget_);
    };
    int lo = 1, bad = 0;  // bad: the most tried that did not fit
    while (!fits_with(lo)) {
      if (lo == most) return most;
      bad = lo;
      lo = std::min(most, lo * 2);
    }
    while (lo - bad > 1) {
      const int mid = (lo + bad) / 2;
      (fits_with(mid) ? lo : bad) = mid;
    }
    return lo;
  }

  void check_msp() const {
    const int N = int(s_.lengths.size());
    SPPO_CHECK(shape_.par.pp > 1 && !(shape_.par.cp > 1 && shape_.par.rsa()), "options")
        << "--msp on splits subsequences over pipeline stages: it needs --pp 2 or more, and runs without --ring rsa "
           "(got --pp "
        << shape_.par.pp << (shape_.par.cp > 1 && shape_.par.rsa() ? " --ring rsa" : "") << ")";
    SPPO_CHECK(N >= shape_.par.pp, "options") << "--msp on needs at least as many subsequences as stages (--subseqs " << N
                                          << ", --pp " << shape_.par.pp << "); use --subseqs " << shape_.par.pp << " or more";
    SPPO_CHECK(precision_ == ActPrecision::F32, "options")
        << "--msp on runs fp32 activations only (Note [MSP in bf16] in sim/solver.cpp); use --precision fp32";
    // A piece on every stage group, over its cp ranks, each piece's rows over its tp members.
    const i64 split = i64(shape_.par.pp) * shape_.par.cp * shape_.par.tp * shape_.par.ulysses;
    for (int i = 0; i < N; ++i)
      SPPO_CHECK(s_.lengths[std::size_t(i)] >= split, "options")
          << "--msp on splits subsequence " << i << " of " << s_.lengths[std::size_t(i)] << " tokens into up to "
          << split << " rows' shares (stages x --cp x --tp); use fewer --subseqs";
  }

  // choose(), where a choice that cannot fit ends itself (DoesNotFit): under auto that is
  // the answer only when nothing else fits, so it is kept and the search goes on.
  bool fits() {
    try {
      return choose();
    } catch (const DoesNotFit& e) {
      if (!any_auto_) throw;
      if (!first_error_) first_error_ = e;
      return false;
    }
  }

  // The widest placements auto may reach, each the least memory of its kind: where none of
  // them fits, nothing narrower does (more recomputed or streamed never needs more), so
  // the search is skipped.
  bool widest_fits(const StepShape& asked) {
    std::vector<std::pair<std::vector<KvPlace>, SavedSet>> widest;
    const SavedSet all =
        recompute_auto_ && !o_.recompute ? recompute_levels().back() | asked.place.recompute : asked.place.recompute;
    const SavedSet most = all & runnable_;
    if (!o_.place.kv) {
      widest.push_back({{}, most});
      if (kv_host_ok_) widest.push_back({all_layers(KvPlace::Host), most});
      if (kv_recompute_ok_) widest.push_back({all_layers(KvPlace::Recompute), most});
    } else {
      widest.push_back({asked.place.kv, most});
    }
    for (const auto& [kv, set] : widest) {
      if (kv == asked.place.kv && set == asked.place.recompute) continue;  // tried
      shape_.place.kv = kv;
      shape_.place.recompute = set;
      if (fits()) return true;
    }
    return false;
  }

  // Note [Placing tensors under a budget]: the placement asked for is tried first (for
  // auto: every K/V on the device, nothing recomputed beyond --recompute-tensors). Where
  // it does not fit, --kv-cache auto puts the K/V of the fewest layers a stage on the host
  // that fit (each host layer trades its K/V and sums on the device for a window of two
  // chunks, so fitting is monotone in them). Where nothing fits that way either, auto
  // widens in tiers of rising recompute: tier t holds the recompute level t with the K/V
  // on the device or the host, and level t - 1 with the K/V recomputed (recompute_levels()
  // in core/layout.h); the fastest predicted that fits in the first tier with one wins.
  // A choice that cannot fit may end itself (DoesNotFit); under auto that is the answer
  // only when nothing else fits.
  void place_under_budget() {
    const bool order_auto = !o_.place.backward && layer_ok_ && !from_plan_;
    // Under --plan, auto is the plan's placement: a plan that does not fit is refused, not
    // placed anew.
    any_auto_ = !from_plan_ && ((!o_.place.kv && kv_host_ok_) || (recompute_auto_ && !o_.recompute) || order_auto);
    StepShape asked = shape_;
    fitted_ = fits();
    // --backward-order auto: the layer-major backward costs no compute (the same ops in
    // another order) and holds one layer's dK/dV sums, so it comes before any placement
    // that streams or recomputes; every placement after it keeps it.
    if (!fitted_ && order_auto) {
      shape_.place.backward = BackwardOrder::Layer;
      asked = shape_;
      fitted_ = fits();
    }
    const bool reachable = fitted_ || (any_auto_ && widest_fits(asked));
    shape_ = asked;
    if (!fitted_ && reachable && !o_.place.kv && kv_host_ok_) fewest_host_layers();
    if (!fitted_ && reachable) widen_in_tiers(asked);
    // Nothing fits: the placement asked for, and its answer, saying that auto tried more.
    exhausted_ = !fitted_ && any_auto_
                     ? "; nor does any placement --kv-cache auto and --recompute-tensors auto tried (K/V on the "
                       "host or recomputed, saved tensors recomputed)"
                     : "";
    // With the optimizer state on the device, moving it is one more way to fit (it costs
    // each step the update's copies and the host's update, Note [Optimizer state on the host]).
    state_hint_ = shape_.place.optimizer_host() || o_.forward_only ? ""
                                        : "; --optimizer-state host moves AdamW's m and v (8 B a parameter of each "
                                          "rank's share) and the fp32 master weights to the host";
    // With it there, the layers' weights and gradients can follow (Note [Weights on the host]).
    if (shape_.place.optimizer_host() && !shape_.place.weights_host() && weights_ok())
      state_hint_ = "; --weights host keeps the layers' weights and gradients on the host, bringing each layer's for "
                    "the forward and backward that run it";
    if (!fitted_ && any_auto_) {
      shape_ = asked;
      if (first_error_) throw DoesNotFit(first_error_->what() + exhausted_ + state_hint_);
      choose();
    }
    for (int p = 0; p < s_.layout.par.pp; ++p)
      s_.layout.stage_layers.push_back(s_.schedule.owned.empty()
                                           ? std::pair<int, int>{0, s_.config.layers}
                                           : s_.schedule.owned.at(std::size_t(s_.layout.rank_of(0, p))));
  }

  // --kv-cache auto: the K/V of the fewest layers a stage on the host that fit.
  void fewest_host_layers() {
    int lo = 1, hi = s_.config.layers;
    shape_.place.kv = host_layers(hi);
    if (!fits()) return;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      shape_.place.kv = host_layers(mid);
      if (fits()) hi = mid;
      else lo = mid + 1;
    }
    shape_.place.kv = host_layers(hi);
    fitted_ = choose();
  }

  // The tiers of rising recompute, the fastest fitting placement of the first tier with one.
  void widen_in_tiers(const StepShape& asked) {
    std::vector<std::vector<KvPlace>> kvs = {asked.place.kv};
    if (!o_.place.kv) {
      kvs = {{}};
      if (kv_host_ok_) kvs.push_back(all_layers(KvPlace::Host));
      if (kv_recompute_ok_) kvs.push_back(all_layers(KvPlace::Recompute));
    }
    std::vector<SavedSet> sets = {asked.place.recompute};
    if (recompute_auto_ && !o_.recompute)
      for (std::size_t k = 1; k < recompute_levels().size(); ++k) sets.push_back(recompute_levels()[k] | asked.place.recompute);
    for (std::size_t tier = 1; tier <= sets.size() && !fitted_; ++tier) {
      std::optional<StepShape> best;
      double best_s = 0;
      for (const auto& kv : kvs) {
        const bool recomputed = !kv.empty() && kv.front() == KvPlace::Recompute;
        const std::size_t level = recomputed ? tier - 1 : tier;
        if (level >= sets.size()) continue;
        // A level adds nothing where this layout cannot recompute what it adds.
        if (level > 0 && (sets[level] & runnable_) == (sets[level - 1] & runnable_)) continue;
        shape_.place.kv = kv;
        shape_.place.recompute = sets[level] & runnable_;
        if (fits() && (!best || r_.step_time_s < best_s)) best = shape_, best_s = r_.step_time_s;
      }
      if (best) {
        shape_ = *best;
        fitted_ = choose();
      }
    }
  }

  // The predictions of the chosen schedule, and the budgets checked against them.
  void predict() {
    if (o_.recompute) {
      // The simulator does not run the recompute schedule; its memory follows in closed form.
      const sched::MemoryRules rules = sim::memory_rules(s_.config, precision_, shape_);
      s_.predicted_peak_bytes = sched::recompute_peak_bytes(rules, S_);
      s_.predicted_peak_per_rank = {s_.predicted_peak_bytes};
      s_.predicted_host_bytes = sched::param_count(s_.config, 0, s_.config.layers, true, true) * rules.host_state_bytes();
      SPPO_CHECK_FITS(budget_ == 0 || s_.predicted_peak_bytes <= budget_, "memory")
          << "--recompute needs " << format_bytes(double(s_.predicted_peak_bytes)) << " of device memory at --seq-len "
          << S_ << ", over the device budget of " << budget_text()
          << "; shorten --seq-len, raise --device-memory, or drop --recompute for --subseqs auto --offload adaptive";
      return;
    }
    s_.predicted_peak_bytes = r_.peak_device_bytes;
    s_.predicted_peak_per_rank = r_.peak_bytes;
    s_.predicted_host_per_rank = r_.peak_host_per_rank;
    s_.predicted_sent_per_rank = r_.sent_bytes;
    s_.predicted_collective_per_rank = r_.collective_bytes;
    s_.predicted_step_s = r_.step_time_s;
    if (s_.schedule.packed && s_.profile_measured)
      s_.simulate_packed = [sched = s_.schedule, cost = plan::CostModel(profile(), s_.config, precision_),
                            rules = sim::memory_rules(s_.config, precision_, shape_)](
                               const std::vector<i64>& docs) mutable {
        sched.doc_starts = docs;
        return sim::simulate(sched, cost, rules).step_time_s;
      };
    s_.predicted_bubble = r_.bubble_ratio;
    s_.predicted_host_bytes = r_.peak_host_bytes;
    const std::string what = from_plan_ ? "--plan " + o_.plan_path : std::string("this layout");
    SPPO_CHECK_FITS(budget_ == 0 || r_.peak_device_bytes <= budget_, "memory")
        << what << " needs " << format_bytes(double(r_.peak_device_bytes))
        << " of device memory on its fullest rank, over the device budget of " << budget_text()
        << (o_.forward_only ? (!s_.schedule.place.any_kv_streamed() && kv_host_ok_
                                   ? "; --kv-cache host keeps the K/V of finished subsequences off the device; "
                                     "--subseqs auto finds the fewest subsequences that fit"
                                   : "; --subseqs auto finds the fewest subsequences that fit, or shorten --seq-len")
            : !exhausted_.empty() ? exhausted_
            : !s_.schedule.place.any_kv_streamed() && kv_host_ok_
                ? "; --kv-cache host or recompute keeps K/V and their gradients off the device"
                : "")
        << (shape_.place.backward == BackwardOrder::Subseq && layer_ok_ && !o_.forward_only
                ? "; --backward-order layer holds one layer's dK/dV sums at a time, not every layer's"
                : "")
        << state_hint_;
    SPPO_CHECK_FITS(host_budget_ == 0 || r_.peak_host_bytes <= host_budget_, "memory")
        << what << " holds " << format_bytes(double(r_.peak_host_bytes)) << " (" << r_.peak_host_bytes
        << " B) in host memory ("
        << (!s_.schedule.place.any_kv_streamed() ? "offloaded activations" : "offloaded activations, K/V and their dK/dV sums")
        << (shape_.place.optimizer_host() ? ", the optimizer state" : "")
        << (shape_.place.weights_host() ? ", the weights and gradients" : "")
        << ") on its fullest rank, over the "
        << (o_.host_memory > 0 ? "--host-memory budget" : "host memory a device has in the plan's profile") << " of "
        << format_bytes(double(host_budget_))
        << "; use --host-memory " << r_.peak_host_bytes
        << " or more, or offload less (more --subseqs, a lower --offload ratio, --kv-cache device, or more "
           "--device-memory)";
  }

  // On the CPU both tiers are this machine's memory: what the step holds on its fullest
  // rank, times the ranks sharing the machine, must be there before the run starts.
  void check_machine_memory() const {
    const i64 per_rank = s_.predicted_peak_bytes + s_.predicted_host_bytes + kProcessAllowanceBytes;
    const int ranks_here = std::max(1, comm::launcher_local_size());
    const i64 available = available_memory_bytes();
    SPPO_CHECK_FITS(available <= 0 || per_rank <= available / ranks_here, "memory")
        << "this run needs " << format_bytes(double(per_rank)) << " of memory"
        << (ranks_here > 1 ? " per rank (" + std::to_string(ranks_here) + " ranks here)" : "") << " (device tier "
        << format_bytes(double(s_.predicted_peak_bytes)) << ", host tier "
        << format_bytes(double(s_.predicted_host_bytes)) << ", " << format_bytes(double(kProcessAllowanceBytes))
        << " for the process itself) but this machine has " << format_bytes(double(available))
        << " available; shorten --seq-len or use a smaller model";
  }

  void make_runtime() {
    RuntimeOptions ro;
    ro.device_budget = budget_;
    ro.host_budget = o_.host_memory;
    ro.recompute = o_.recompute;
    ro.rank = s_.layout.rank;
    ro.comm = s_.layout.ranks() > 1 ? &s_.comm(w_) : nullptr;
    ro.layers = s_.layout.stage_layers.at(std::size_t(s_.layout.stage()));
    ro.zero_shards = s_.layout.par.zero_shards();
    ro.zero_index = s_.layout.stage_index();
    ro.optimizer_host = shape_.place.optimizer_host();
    ro.weights_host = shape_.place.weights_host();
    ro.zero = shape_.par.zero;
    ro.tp = s_.layout.tp_shard();
    ro.ulysses = s_.layout.ulysses_shard();
    ro.block_scratch = shape_.block_scratch;
    ro.head_scratch = shape_.head_scratch;
    ro.backend = s_.backend.get();
    ro.inference = o_.forward_only;
    s_.runtime = std::make_unique<Runtime>(s_.config, ro);
  }

  std::string budget_text() const {
    return format_bytes(double(budget_)) + (s_.device_budget.from == "--device-memory" ? " (--device-memory)"
                                                                                       : " (" + s_.device_budget.from + ")");
  }

  const StepOptions& o_;
  comm::Comm& w_;
  const i64 S_;
  i64 budget_ = 0;  // the device tier's (StepSetup::device_budget), from open_backend on
  i64 host_budget_ = 0;  // the host tier's (StepSetup::host_budget)
  StepSetup s_;
  bool profiled_ = false;
  ActPrecision precision_ = ActPrecision::F32;
  std::optional<plan::Plan> from_plan_;
  StepShape shape_;
  sim::SimResult r_;  // the simulation of the last choice
  bool kv_host_ok_ = false, kv_recompute_ok_ = false, recompute_auto_ = false, any_auto_ = false;
  bool layer_ok_ = false;  // the layer-major backward runs in this layout
  SavedSet runnable_ = 0;
  bool fitted_ = false;
  std::optional<DoesNotFit> first_error_;
  std::string exhausted_, state_hint_;
};

}  // namespace

StepSetup make_setup(const StepOptions& o, comm::Comm* world) {
  static const std::unique_ptr<comm::Comm> alone = comm::make_solo();
  return SetupBuilder(o, world ? *world : *alone).build();
}

}  // namespace sppo
