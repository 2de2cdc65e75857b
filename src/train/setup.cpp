#include "train/setup.h"

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <unistd.h>

#include "core/check.h"
#include "planner/plan.h"
#include "schedule/builders.h"
#include "schedule/memory.h"
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

RingChoice parse_ring(const std::string& text) {
  RingChoice r;
  std::size_t b = 0;
  while (b <= text.size()) {
    const std::size_t e = std::min(text.find(',', b), text.size());
    const std::string word = text.substr(b, e - b);
    if (word == "zigzag" || word == "contiguous") {
      r.layout = sched::parse_ring_layout(word);
    } else if (word == "flash" || word == "rsa") {
      r.algorithm = word;
    } else {
      SPPO_CHECK(false, "options") << "--ring '" << text << "': '" << word
                                   << "' is not a ring layout (zigzag, contiguous) or algorithm (flash, rsa); e.g. "
                                      "--ring zigzag or --ring rsa,contiguous";
    }
    b = e + 1;
  }
  return r;
}

namespace {

// --plan: a plan fixes the layout, the lengths and alpha; the model and S must agree.
plan::Plan read_plan(const StepOptions& o, const ModelConfig& model) {
  const plan::Plan p = read_plan_file(o.plan_path);
  SPPO_CHECK(p.system == "sppo", "options")
      << "--plan " << o.plan_path << " is a " << p.system << " plan; the runtime runs SPPO plans";
  SPPO_CHECK((o.pp == 1 || o.pp == p.pp) && (o.dp == 1 || o.dp == p.dp) && (o.cp == 1 || o.cp == p.sp) &&
                 (o.tp == 1 || o.tp == p.tp),
             "options")
      << "--plan " << o.plan_path << " has pp " << p.pp << ", sp " << p.sp << " and dp " << p.dp << ", but --pp "
      << o.pp << " --cp " << o.cp << " --dp " << o.dp << (o.tp > 1 ? " --tp " + std::to_string(o.tp) : "")
      << " were given; drop them (the plan sets the layout)";
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

}  // namespace

namespace {

// Note [Ranks and GPUs]: a CUDA rank drives one GPU: --device N, else its local rank (the
// launcher's: OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID, MPI_LOCALRANKID) modulo the GPUs it
// sees. Ranks of one machine that land on the same GPU share it: each takes its share of the
// device's memory, and their messages go through pinned host memory over MPI, since NCCL
// (2.28) refuses two ranks of one communicator on one device; ranks with a GPU each talk over
// NCCL. --comm nccl|mpi forces the transport (mpi on the CPU stages its messages all the same,
// which is how the CPU's tests run the GPUs' staging).
int local_rank(const comm::Comm& w) {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID", "PMI_LOCAL_RANK"})
    if (const char* x = std::getenv(v)) return std::max(0, std::atoi(x));
  return w.rank();
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

StepSetup make_setup(const StepOptions& o, comm::Comm* world) {
  StepSetup s;
  s.config = o.model;
  s.config.rope_seq_len = o.seq_len;  // "dynamic" RoPE scaling scales to the length trained at
  s.seed = o.seed;
  s.config.validate();
  SPPO_CHECK(o.seq_len >= 2, "options") << "--seq-len " << o.seq_len << " is too short; use at least 2";
  const i64 S = o.seq_len;
  static const std::unique_ptr<comm::Comm> alone = comm::make_solo();
  comm::Comm& w = world ? *world : *alone;
  // Timing matters to plans and adaptive choices only; a budget check needs the memory
  // model alone. With several ranks the profile comes first: it is a collective, and
  // nothing that can fail on one rank alone may run before it. One process measures it
  // only once the options and data have been checked.
  s.profile_measured = !o.plan_path.empty() || o.partition == "adaptive" || o.offload == "adaptive" ||
                       !o.hardware.empty();
  SPPO_CHECK(o.host_memory >= 0, "options") << "--host-memory must not be negative";
  s.profile = nominal_cpu_profile();
  bool profiled = false;
  // --host-memory is the host memory a device has, to every choice made with the profile.
  auto profile = [&]() -> const plan::HardwareProfile& {
    if (s.profile_measured && !profiled) {
      // A device is priced by its own measurement (a quick one, once per process), not by
      // the processor's: without --hardware a GPU run's offload ratios and lengths were
      // chosen with the CPU's rates.
      const bool device = o.hardware.empty() && s.backend && std::string(s.backend->name()) != "cpu";
      s.profile = device ? measured_device_profile(*s.backend) : agreed_profile(o.hardware, w);
    }
    if (o.host_memory > 0) s.profile.host_memory = o.host_memory;
    profiled = true;
    return s.profile;
  };
  SPPO_CHECK(o.partition == "length" || o.partition == "flops" || o.partition == "adaptive", "options")
      << "--partition '" << o.partition << "' is unknown; use length, flops or adaptive";
  SPPO_CHECK(o.optimizer_state.empty() || o.optimizer_state == "device" || o.optimizer_state == "host", "options")
      << "--optimizer-state '" << o.optimizer_state << "' is unknown; use device (the fp32 master weights and AdamW "
      << "state beside the weights) or host (in host memory, updated by the CPU)";
  if (w.size() > 1) profile();

  const DevicePlacement place = place_on_device(o, w);
  s.backend = make_backend(o.backend, o.precision, o.attention_kernels, place);
  s.attention = s.backend->prepare_attention(s.config);
  // A profile measured on this GPU says, per shape class, whose attention kernels are faster.
  if (!o.hardware.empty()) s.backend->prefer_attention(attention_classes(profile()));
  const ActPrecision precision = s.backend->act() == DType::F32 ? ActPrecision::F32 : ActPrecision::BF16;
  s.device_comm = device_comm(o, w, *s.backend, place, &s.comm_name);
  s.data = io::open_data(o.data, s.config.vocab, o.seed, io::DataOptions{0, o.data_dtype});
  s.data->check_vocab(s.config.vocab);
  s.repeat_task = o.data.empty() || o.data.rfind("repeat", 0) == 0;
  if (!o.labels.empty()) {
    SPPO_CHECK(!s.repeat_task, "options")
        << "--labels gives the targets of the tokens of --data (a token file); the built-in task has its own";
    SPPO_CHECK(s.config.causal, "options")
        << "--labels gives a causal model's next-token targets; a bidirectional model (--attention bidirectional) "
           "trains on masked tokens: drop --labels";
    s.labels = io::open_labels(o.labels, s.config.vocab);
    SPPO_CHECK(s.labels->size() == s.data->size(), "options")
        << "--labels " << o.labels << " holds " << s.labels->size() << " labels, but --data " << o.data << " holds "
        << s.data->size() << " tokens; give one label per token (scripts/tokenize_text.py --chat writes both)";
    s.labels->check_vocab(s.config.vocab);
    SPPO_CHECK(s.labels->max_token() >= 0, "options")
        << "--labels " << o.labels << " is " << io::kIgnoreLabel << " everywhere: no token would be trained on";
  }

  std::optional<plan::Plan> from_plan;
  if (!o.plan_path.empty()) from_plan = read_plan(o, s.config);
  const RingChoice ring = parse_ring(o.ring);
  s.layout = make_layout(from_plan ? from_plan->pp : o.pp, from_plan ? from_plan->dp : o.dp, o.zero, o.batch, w,
                         from_plan ? from_plan->sp : o.cp, from_plan ? from_plan->tp : o.tp);
  SPPO_CHECK(s.layout.tp <= s.config.heads, "options")
      << "--tp " << s.layout.tp << " splits the attention heads over its ranks, but the model has " << s.config.heads
      << "; use --tp " << s.config.heads << " or fewer";
  SPPO_CHECK(!s.config.llama() || sched::llama_tp_runs(s.config, s.layout.tp), "options")
      << "--tp " << s.layout.tp << " does not split the " << s.config.heads << " query heads over "
      << s.config.kv_head_count() << " key/value heads of the Llama-family model (--model " << o.model_preset
      << ") so that each rank's queries read its own key/value heads; use one of --tp " << [&] {
           std::string ok;
           for (int t = 1; t <= s.config.heads; ++t)
             if (sched::llama_tp_runs(s.config, t)) ok += (ok.empty() ? "" : ", ") + std::to_string(t);
           return ok;
         }() << " (a divisor of " << s.config.kv_head_count() << ", or a multiple whose ranks share each key/value head)";
  SPPO_CHECK(!o.recompute || s.layout.ranks() == 1, "options")
      << "--recompute is the one-process baseline; drop --pp and --dp";
  sim::StepShape shape;
  shape.pp = s.layout.pp;
  shape.dp = s.layout.dp;
  shape.sp = s.layout.cp;
  shape.tp = s.layout.tp;
  shape.ring_layout = from_plan ? sched::parse_ring_layout(from_plan->ring_layout) : ring.layout;
  shape.ring_rsa = ring.algorithm == "rsa";
  shape.zero = o.zero == 1;
  shape.optimizer_host = o.optimizer_state.empty() ? from_plan && from_plan->optimizer_state == "host"
                                                   : o.optimizer_state == "host";
  SPPO_CHECK(o.msp == "on" || o.msp == "off", "options") << "--msp must be on or off (got '" << o.msp << "')";
  shape.msp = from_plan ? from_plan->msp : o.msp == "on";
  shape.msp_reach = from_plan ? from_plan->msp_reach : o.msp_reach;
  SPPO_CHECK(shape.msp_reach == 0 || shape.msp_reach >= 2, "options")
      << "--msp-reach " << shape.msp_reach << ": use 0 (every idle stage group) or 2 or more";
  if (from_plan && (!from_plan->kv_host_layers.empty() || !from_plan->kv_recompute_layers.empty())) {
    // The plan's placement, unless --kv-cache says otherwise.
    shape.kv_place.assign(std::size_t(s.config.layers), sched::KvPlace::Device);
    for (int l : from_plan->kv_host_layers) shape.kv_place[std::size_t(l)] = sched::KvPlace::Host;
    for (int l : from_plan->kv_recompute_layers) shape.kv_place[std::size_t(l)] = sched::KvPlace::Recompute;
  }
  shape.precision = precision;
  if (from_plan) shape.stage_layers = from_plan->stage_layers;
  SPPO_CHECK(o.mlp_tile_rows == 0 || (shape.tp == 1 && !o.recompute), "options")
      << "--mlp-tile-rows runs the MLP of whole rows a tile at a time; it runs without --tp and --recompute "
         "(use --mlp-tile-rows 0 there)";
  shape.mlp_tile_rows = o.mlp_tile_rows;
  // Packed documents: the blocks keep them apart through the K/V on the device of one rank.
  SPPO_CHECK(!o.pack || o.doc_sep >= 0 || s.data->has_documents(), "options")
      << "--pack packs documents that --doc-sep ID ends (e.g. the tokenizer's end-of-text id), or those of a "
         "Megatron dataset's document index; " << s.data->describe() << " has no index";
  SPPO_CHECK(!o.pack || s.config.causal, "options")
      << "--pack keeps each document's causal attention to itself; a bidirectional model (--attention "
         "bidirectional, and so --ring rsa) has none to keep: drop --pack";
  SPPO_CHECK(o.doc_sep < s.config.vocab, "options")
      << "--doc-sep " << o.doc_sep << " is not a token id of the model's vocabulary of " << s.config.vocab;
  shape.packed = o.pack;
  shape.labeled = s.labels != nullptr;
  s.doc_sep = o.doc_sep;
  // The kernels' scratch comes from the device tier too.
  shape.block_scratch = s.backend->block_scratch(s.config);
  shape.head_scratch = s.backend->head_scratch(s.config, RuntimeOptions{}.head_chunk);

  // Where the K/V cache lives (--kv-cache) and what backward recomputes
  // (--recompute-tensors); Note [Placing tensors under a budget] below says what auto does.
  SPPO_CHECK(o.kv_cache == "device" || o.kv_cache == "host" || o.kv_cache == "recompute" || o.kv_cache == "auto",
             "options")
      << "--kv-cache '" << o.kv_cache << "' is unknown; use device, host, recompute or auto";
  const bool kv_host_ok = !o.recompute && !(shape.sp > 1 && shape.ring_rsa);
  const bool kv_recompute_ok = kv_host_ok && shape.tp == 1 && shape.sp == 1 && !shape.msp;
  SPPO_CHECK(o.kv_cache != "host" || kv_host_ok, "options")
      << "--kv-cache host streams K/V blocks of a rank's own subsequences; it runs without --ring rsa and "
         "--recompute (use --kv-cache device there)";
  SPPO_CHECK(o.kv_cache != "recompute" || kv_recompute_ok, "options")
      << "--kv-cache recompute recomputes K/V from a rank's whole rows of each layer's input, one rank's "
         "subsequences at a time; it runs without --tp, --cp, --msp on and --recompute (use --kv-cache host "
         "or device there)";
  const bool recompute_auto = o.recompute_tensors == "auto";
  if (!recompute_auto) shape.recompute = parse_recompute_tensors(o.recompute_tensors);
  else if (from_plan) shape.recompute = from_plan->recompute;
  SPPO_CHECK(!o.recompute || shape.recompute == 0, "options")
      << "--recompute already recomputes whole blocks from their inputs; drop --recompute-tensors "
      << recompute_tensors_text(shape.recompute) << " (or --recompute)";
  const bool attention_ok = shape.sp == 1 && !shape.msp;
  SPPO_CHECK(!(shape.recompute & kAttentionGroup) || attention_ok, "options")
      << "--recompute-tensors attention runs the attention again inside the backward, which a ring (--cp) or MSP "
         "pieces do not; recompute other tensors, or drop --cp and --msp on";
  const bool head_ok = !shape.msp;
  SPPO_CHECK(!(shape.recompute & kHeadGradGroup) || head_ok, "options")
      << "--recompute-tensors head_grad runs a stage's own LM head inside its last layer's backward, which MSP "
         "pieces on borrowed weights do not; recompute other tensors, or use --msp off";
  // The groups this layout can recompute.
  const SavedSet runnable = ~((attention_ok ? 0 : kAttentionGroup) | (head_ok ? 0 : kHeadGradGroup));
  const int L = s.config.layers;
  auto all_layers = [&](sched::KvPlace p) { return std::vector<sched::KvPlace>(std::size_t(L), p); };
  auto host_layers = [&](int per_stage) {  // the first `per_stage` layers of every stage
    std::vector<sched::KvPlace> host(std::size_t(L), sched::KvPlace::Device);
    sched::PipelineSpec stages;
    stages.layers = L;
    stages.pp = shape.pp;
    stages.stage_layers = shape.stage_layers;
    for (const auto& [b, e] : sched::stage_ranges(stages))
      for (int l = b; l < std::min(e, b + per_stage); ++l) host[std::size_t(l)] = sched::KvPlace::Host;
    return host;
  };
  if (o.kv_cache == "host") shape.kv_place = all_layers(sched::KvPlace::Host);
  if (o.kv_cache == "recompute") shape.kv_place = all_layers(sched::KvPlace::Recompute);
  if (o.kv_cache == "device") shape.kv_place.clear();
  sim::SimResult r;
  // Lengths, fractions and the schedule for this shape, and its prediction.
  auto choose = [&] {
    if (from_plan) {
      s.lengths = from_plan->lengths;
      s.alpha = from_plan->alpha;
    } else {
      int N = resolve_subseqs(o, S);
      const plan::HardwareProfile& hw = profile();
      if (o.subseqs == "auto" && o.device_memory > 0 && !o.recompute) {
        // Under a budget, auto is the fewest subsequences that fit with adaptive offload.
        const auto fit = sim::smallest_fitting_n(s.config, S, hw, precision, o.device_memory,
                                                 o.partition != "length", 1, int(std::min<i64>(S, 4096)), shape,
                                                 kTileTokens);
        if (fit.found) N = fit.subseqs;
      }
      SPPO_CHECK(!o.recompute || N == 1, "options")
          << "--recompute runs the whole sequence at once; drop --subseqs or set it to 1";
      if (!s.config.causal) {
        // Subsequences run one after another, so a position cannot see later ones.
        SPPO_CHECK(o.subseqs == "1" || o.subseqs == "auto" || N == 1, "options")
            << "--attention bidirectional sees the whole sequence at once, which subsequences run one after another "
               "cannot; use --subseqs 1 (ring attention, --cp, splits it over ranks instead)";
        N = 1;
      }
      // The simulator does not model recomputation: that baseline is checked by the arena
      // alone, and has no prediction.
      SubseqChoice choice = choose_subseqs(o.partition, o.offload, s.config, S, N,
                                           o.recompute ? 0 : o.device_memory, hw, shape);
      s.lengths = choice.lengths;
      s.alpha = choice.alpha;
      s.profile_measured = s.profile_measured && !o.recompute;
    }
    if (shape.msp) {
      const int N = int(s.lengths.size());
      SPPO_CHECK(shape.pp > 1 && !(shape.sp > 1 && shape.ring_rsa), "options")
          << "--msp on splits subsequences over pipeline stages: it needs --pp 2 or more, and runs without --ring rsa "
             "(got --pp "
          << shape.pp << (shape.sp > 1 && shape.ring_rsa ? " --ring rsa" : "") << ")";
      SPPO_CHECK(N >= shape.pp, "options") << "--msp on needs at least as many subsequences as stages (--subseqs " << N
                                           << ", --pp " << shape.pp << "); use --subseqs " << shape.pp << " or more";
      SPPO_CHECK(s.backend->act() == DType::F32, "options") << "--msp on runs fp32 activations on CPU ranks; use "
                                                               "--precision fp32";
      // A piece on every stage group, over its SP ranks, each piece's rows over its TP members.
      const i64 split = i64(shape.pp) * shape.sp * shape.tp;
      for (int i = 0; i < N; ++i)
        SPPO_CHECK(s.lengths[i] >= split, "options")
            << "--msp on splits subsequence " << i << " of " << s.lengths[i] << " tokens into up to " << split
            << " rows' shares (stages x --cp x --tp); use fewer --subseqs";
    }
    s.schedule = sim::build_step(s.config, s.lengths, s.alpha, shape);
    if (!o.recompute) r = sim::simulate(s.schedule, plan::CostModel(profile(), s.config, precision),
                                        sim::memory_rules(s.config, precision, shape));
    return o.device_memory == 0 || o.recompute || (r.peak_device_bytes <= o.device_memory &&
                                                   (o.host_memory == 0 || r.peak_host_bytes <= o.host_memory));
  };
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
  const bool any_auto = (o.kv_cache == "auto" && kv_host_ok) || (recompute_auto && !o.recompute);
  std::optional<DoesNotFit> first_error;
  auto fits = [&] {
    try {
      return choose();
    } catch (const DoesNotFit& e) {
      if (!any_auto) throw;
      if (!first_error) first_error = e;
      return false;
    }
  };
  const sim::StepShape asked = shape;
  bool fitted = fits();
  // The widest placements auto may reach, each the least memory of its kind: where none of
  // them fits, nothing narrower does (more recomputed or streamed never needs more), so
  // the search below is skipped.
  auto widest_fits = [&] {
    std::vector<std::pair<std::vector<sched::KvPlace>, SavedSet>> widest;
    const SavedSet all = recompute_auto && !o.recompute ? recompute_levels().back() | asked.recompute : asked.recompute;
    const SavedSet most = all & runnable;
    if (o.kv_cache == "auto") {
      widest.push_back({{}, most});
      if (kv_host_ok) widest.push_back({all_layers(sched::KvPlace::Host), most});
      if (kv_recompute_ok) widest.push_back({all_layers(sched::KvPlace::Recompute), most});
    } else {
      widest.push_back({asked.kv_place, most});
    }
    for (const auto& [kv, set] : widest) {
      if (kv == asked.kv_place && set == asked.recompute) continue;  // tried
      shape.kv_place = kv;
      shape.recompute = set;
      if (fits()) return true;
    }
    return false;
  };
  const bool reachable = fitted || (any_auto && widest_fits());
  shape = asked;
  if (!fitted && reachable && o.kv_cache == "auto" && kv_host_ok) {
    int lo = 1, hi = L;
    shape.kv_place = host_layers(hi);
    if (fits()) {
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        shape.kv_place = host_layers(mid);
        if (fits()) hi = mid;
        else lo = mid + 1;
      }
      shape.kv_place = host_layers(hi);
      fitted = choose();
    }
  }
  if (!fitted && reachable) {
    std::vector<std::vector<sched::KvPlace>> kvs = {asked.kv_place};
    if (o.kv_cache == "auto") {
      kvs = {{}};
      if (kv_host_ok) kvs.push_back(all_layers(sched::KvPlace::Host));
      if (kv_recompute_ok) kvs.push_back(all_layers(sched::KvPlace::Recompute));
    }
    std::vector<SavedSet> sets = {asked.recompute};
    if (recompute_auto && !o.recompute)
      for (std::size_t k = 1; k < recompute_levels().size(); ++k) sets.push_back(recompute_levels()[k] | asked.recompute);
    for (std::size_t tier = 1; tier <= sets.size() && !fitted; ++tier) {
      std::optional<sim::StepShape> best;
      double best_s = 0;
      for (const auto& kv : kvs) {
        const bool recomputed = !kv.empty() && kv.front() == sched::KvPlace::Recompute;
        const std::size_t level = recomputed ? tier - 1 : tier;
        if (level >= sets.size()) continue;
        // A level adds nothing where this layout cannot recompute what it adds.
        if (level > 0 && (sets[level] & runnable) == (sets[level - 1] & runnable)) continue;
        shape.kv_place = kv;
        shape.recompute = sets[level] & runnable;
        if (fits() && (!best || r.step_time_s < best_s)) best = shape, best_s = r.step_time_s;
      }
      if (best) {
        shape = *best;
        fitted = choose();
      }
    }
  }
  // Nothing fits: the placement asked for, and its answer, saying that auto tried more.
  const std::string exhausted =
      !fitted && any_auto ? "; nor does any placement --kv-cache auto and --recompute-tensors auto tried (K/V on the "
                            "host or recomputed, saved tensors recomputed)"
                          : "";
  // With the optimizer state on the device, moving it is one more way to fit (it costs each
  // step the update's copies and the host's update, Note [Optimizer state on the host]).
  const std::string state_hint =
      shape.optimizer_host ? ""
                           : "; --optimizer-state host moves AdamW's m and v (8 B a parameter of each rank's share) "
                             "and the fp32 master weights to the host";
  if (!fitted && any_auto) {
    shape = asked;
    if (first_error) throw DoesNotFit(first_error->what() + exhausted + state_hint);
    choose();
  }
  for (int p = 0; p < s.layout.pp; ++p)
    s.layout.stage_layers.push_back(s.schedule.owned.empty() ? std::pair<int, int>{0, s.config.layers}
                                                              : s.schedule.owned.at(std::size_t(s.layout.rank_of(0, p))));
  if (o.recompute) {
    // The simulator does not run the recompute schedule; its memory follows in closed form.
    const sched::MemoryRules rules = sim::memory_rules(s.config, precision, shape);
    s.predicted_peak_bytes = sched::recompute_peak_bytes(rules, S);
    s.predicted_peak_per_rank = {s.predicted_peak_bytes};
    s.predicted_host_bytes = sched::param_count(s.config, 0, L, true, true) * rules.host_state_bytes();
    SPPO_CHECK_FITS(o.device_memory == 0 || s.predicted_peak_bytes <= o.device_memory, "memory")
        << "--recompute needs " << format_bytes(double(s.predicted_peak_bytes)) << " of device memory at --seq-len "
        << S << ", over the --device-memory budget of " << format_bytes(double(o.device_memory))
        << "; shorten --seq-len, raise --device-memory, or drop --recompute for --subseqs auto --offload adaptive";
  } else {
    s.predicted_peak_bytes = r.peak_device_bytes;
    s.predicted_peak_per_rank = r.peak_bytes;
    s.predicted_sent_per_rank = r.sent_bytes;
    s.predicted_step_s = r.step_time_s;
    if (s.schedule.packed && s.profile_measured)
      s.simulate_packed = [sched = s.schedule, cost = plan::CostModel(profile(), s.config, precision),
                           rules = sim::memory_rules(s.config, precision, shape)](const std::vector<i64>& docs) mutable {
        sched.doc_starts = docs;
        return sim::simulate(sched, cost, rules).step_time_s;
      };
    s.predicted_bubble = r.bubble_ratio;
    s.predicted_host_bytes = r.peak_host_bytes;
    SPPO_CHECK_FITS(o.device_memory == 0 || r.peak_device_bytes <= o.device_memory, "memory")
        << (from_plan ? "--plan " + o.plan_path : std::string("this layout")) << " needs "
        << format_bytes(double(r.peak_device_bytes)) << " of device memory on its fullest rank, over the "
        << "--device-memory budget of " << format_bytes(double(o.device_memory))
        << (!exhausted.empty() ? exhausted
            : !s.schedule.any_kv_streamed() && kv_host_ok
                ? "; --kv-cache host or recompute keeps K/V and their gradients off the device"
                : "")
        << state_hint;
    SPPO_CHECK_FITS(o.host_memory == 0 || r.peak_host_bytes <= o.host_memory, "memory")
        << (from_plan ? "--plan " + o.plan_path : std::string("this layout")) << " holds "
        << format_bytes(double(r.peak_host_bytes)) << " (" << r.peak_host_bytes << " B) in host memory ("
        << (!s.schedule.any_kv_streamed() ? "offloaded activations" : "offloaded activations, K/V and their dK/dV sums")
        << (shape.optimizer_host ? ", the optimizer state" : "")
        << ") on its fullest rank, over the --host-memory budget of " << format_bytes(double(o.host_memory))
        << "; use --host-memory " << r.peak_host_bytes
        << " or more, or offload less (more --subseqs, a lower --offload ratio, --kv-cache device, or more "
           "--device-memory)";
  }

  // On the CPU both tiers are this machine's memory: what the step holds on its fullest
  // rank, times the ranks sharing the machine, must be there before the run starts.
  {
    const i64 per_rank = s.predicted_peak_bytes + s.predicted_host_bytes + kProcessAllowanceBytes;
    const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    const int ranks_here = local ? std::max(1, std::atoi(local)) : 1;
    const i64 available = available_memory_bytes();
    SPPO_CHECK_FITS(available <= 0 || per_rank <= available / ranks_here, "memory")
        << "this run needs " << format_bytes(double(per_rank)) << " of memory"
        << (ranks_here > 1 ? " per rank (" + std::to_string(ranks_here) + " ranks here)" : "") << " (device tier "
        << format_bytes(double(s.predicted_peak_bytes)) << ", host tier " << format_bytes(double(s.predicted_host_bytes))
        << ", " << format_bytes(double(kProcessAllowanceBytes)) << " for the process itself) but this machine has "
        << format_bytes(double(available)) << " available; shorten --seq-len or use a smaller model";
  }

  RuntimeOptions ro;
  ro.device_budget = o.device_memory;
  ro.host_budget = o.host_memory;
  ro.recompute = o.recompute;
  ro.rank = s.layout.rank;
  ro.comm = s.layout.ranks() > 1 ? &s.comm(w) : nullptr;
  ro.layers = s.layout.stage_layers.at(std::size_t(s.layout.stage()));
  ro.zero_shards = o.zero == 1 ? s.layout.dp * s.layout.cp : 1;
  ro.zero_index = o.zero == 1 ? s.layout.stage_index() : 0;
  ro.optimizer_host = shape.optimizer_host;
  ro.tp = s.layout.tp_shard();
  ro.block_scratch = shape.block_scratch;
  ro.head_scratch = shape.head_scratch;
  ro.backend = s.backend.get();
  ro.ring_rsa = ring.algorithm == "rsa";
  SPPO_CHECK(!ro.ring_rsa || (!s.config.causal && s.backend->act() == DType::F32), "options")
      << "--ring rsa is the two-pass Ring Self-Attention of bidirectional models (--attention bidirectional), in "
         "fp32; a causal model uses --ring flash";
  s.runtime = std::make_unique<Runtime>(s.config, ro);
  return s;
}

}  // namespace sppo
