#include "train/parallel.h"

#include <algorithm>
#include <set>
#include <cmath>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/check.h"
#include "io/checkpoint.h"
#include "io/hf.h"
#include "train/setup.h"

namespace sppo {

namespace {

// Tags of the messages outside a step's schedule, above every sched::message_tag.
constexpr int kGatherTag = 1 << 30;

void copy_floats(float* dst, const float* src, i64 n) { std::memcpy(dst, src, std::size_t(n) * sizeof(float)); }

}  // namespace

ParallelLayout make_layout(const ParallelDims& par, int batch, int rank) {
  SPPO_CHECK(par.pp >= 1, "options") << "--pp must be at least 1 (got " << par.pp << ")";
  SPPO_CHECK(par.dp >= 1, "options") << "--dp must be at least 1 (got " << par.dp << ")";
  SPPO_CHECK(par.cp >= 1 && par.cp <= 8, "options") << "--cp must be 1 to 8 (got " << par.cp << ")";
  SPPO_CHECK(par.tp >= 1 && par.tp <= 8, "options") << "--tp must be 1 to 8 (got " << par.tp << ")";
  SPPO_CHECK(par.ulysses >= 1 && par.ulysses <= 64, "options")
      << "--ulysses must be 1 to 64 (got " << par.ulysses << ")";
  SPPO_CHECK(par.tp == 1 || par.ulysses == 1, "options")
      << "--tp " << par.tp << " and --ulysses " << par.ulysses
      << " both split every layer's heads over their ranks; use one of them (with --cp for more ranks)";
  par.check("options");
  ParallelLayout l;
  l.par = par;
  l.batch = batch == 0 ? par.dp : batch;
  SPPO_CHECK(l.batch >= 1 && l.batch % par.dp == 0, "options")
      << "--batch " << l.batch << " is not a positive multiple of --dp " << par.dp
      << " (every replica trains the same number of sequences a step)";
  l.rank = rank;
  return l;
}

ParallelLayout make_layout(const ParallelDims& par, int batch, const comm::Comm& world) {
  ParallelLayout l = make_layout(par, batch, world.rank());
  const int ranks = par.ranks();
  SPPO_CHECK(ranks == world.size(), "options")
      << "--pp " << par.pp << (par.tp > 1 ? " x --tp " + std::to_string(par.tp) : std::string())
      << (par.ulysses > 1 ? " x --ulysses " + std::to_string(par.ulysses) : std::string())
      << (par.cp > 1 ? " x --cp " + std::to_string(par.cp) : std::string()) << " x --dp " << par.dp << " = " << ranks
      << " ranks, but the job has " << world.size()
      << (world.size() == 1 ? " (started without mpirun)" : " (mpirun -np " + std::to_string(world.size()) + ")")
      << "; start it with mpirun -np " << ranks << " or change --pp / --tp / --ulysses / --cp / --dp";
  return l;
}

void on_every_rank(comm::Comm& world, const std::function<void()>& f) {
  // Messages travel with a first character that says whether the run does not fit ('3')
  // or was given bad input ('2'), so that every rank exits as the failing one would.
  std::string mine;
  try {
    f();
  } catch (const DoesNotFit& e) {
    if (world.size() == 1) throw;
    mine = std::string("3") + e.what();
  } catch (const Error& e) {
    if (world.size() == 1) throw;
    mine = std::string("2") + e.what();
  }
  if (world.size() == 1) return;
  const auto all = comm::allgather_strings(world, mine, "the other ranks' set-up");
  std::map<std::string, std::vector<int>> distinct;
  bool fits = true;
  for (int r = 0; r < int(all.size()); ++r)
    if (!all[std::size_t(r)].empty()) {
      distinct[all[std::size_t(r)].substr(1)].push_back(r);
      fits = fits && all[std::size_t(r)][0] == '3';
    }
  if (distinct.empty()) return;
  std::ostringstream os;
  bool first = true;
  for (const auto& [message, ranks] : distinct) {
    if (!first) os << "\n";
    first = false;
    os << message;
    if (int(ranks.size()) < world.size()) {
      os << " (rank" << (ranks.size() > 1 ? "s " : " ");
      for (std::size_t k = 0; k < ranks.size(); ++k) os << (k ? ", " : "") << ranks[k];
      os << ")";
    }
  }
  if (fits) throw DoesNotFit(os.str());
  throw Error(os.str());
}

void prepare_groups(comm::Comm& world, const sched::Schedule& s, const ModelConfig& c) {
  std::vector<comm::Group> groups;
  for (const auto& ops : s.ops)
    for (const sched::Op& op : ops)
      if ((op.kind == sched::OpKind::AllReduce || op.kind == sched::OpKind::ReduceScatter ||
           op.kind == sched::OpKind::AllGather) &&
          std::find(groups.begin(), groups.end(), op.group) == groups.end())
        groups.push_back(op.group);
  for (int r = 0; s.par.tp > 1 && r < s.ranks(); ++r) {  // tensor-parallel groups
    const comm::Group g = s.par.tp_group(r);
    if (g.front() != r) continue;
    groups.push_back(g);
    // The members that hold each key/value head (Note [Replicated key/value heads]).
    const int m = TpShard{0, s.par.tp}.kv_replicas(c);
    for (int h = 0; m > 1 && h < s.par.tp; h += m) groups.push_back(comm::Group(g.begin() + h, g.begin() + h + m));
  }
  for (int r = 0; s.par.ulysses > 1 && r < s.ranks(); ++r) {  // Ulysses groups (runtime/ulysses.h)
    const comm::Group g = s.par.ulysses_group(r);
    if (g.front() != r) continue;
    if (std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
    // The members that hold each key/value head (Note [Replicated key/value heads]).
    const int m = TpShard{0, s.par.ulysses}.kv_replicas(c);
    for (int h = 0; m > 1 && h < s.par.ulysses; h += m) groups.push_back(comm::Group(g.begin() + h, g.begin() + h + m));
  }
  world.prepare_groups(groups);
  // The pairs device messages travel between: the schedule's sends and receives, and every
  // two members of a ring or MSP task (kv_store.cpp: a ring piece's members are its ring's
  // ranks in piece order; an MSP task's, its group). The same list on every rank.
  std::set<std::pair<int, int>> pairs;
  for (int r = 0; r < int(s.ops.size()); ++r)
    for (const sched::Op& op : s.ops[std::size_t(r)]) {
      if (op.kind == sched::OpKind::Send) pairs.insert({r, op.peer});
      if (op.kind == sched::OpKind::Recv) pairs.insert({op.peer, r});
      const bool task = op.kind == sched::OpKind::Forward || op.kind == sched::OpKind::Backward ||
                        op.kind == sched::OpKind::RingStep;
      if (op.pieces <= 1 || !task) continue;
      std::vector<int> members;
      for (int h = 0; h < op.pieces; ++h)
        members.push_back(op.group.empty() ? s.par.ring_group(r).at(std::size_t(h)) : op.group[std::size_t(h)]);
      for (int a : members)
        for (int b : members)
          if (a != b) pairs.insert({a, b});
    }
  world.prepare_peers(std::vector<std::pair<int, int>>(pairs.begin(), pairs.end()));
}

void check_same_options(comm::Comm& world, const nlohmann::json& options) {
  if (world.size() == 1) return;
  const auto all = comm::allgather_strings(world, options.dump(), "the other ranks' options");
  const nlohmann::json ref = nlohmann::json::parse(all[0]);
  std::ostringstream os;
  for (int r = 1; r < int(all.size()); ++r) {
    const nlohmann::json other = nlohmann::json::parse(all[std::size_t(r)]);
    if (other == ref) continue;
    std::vector<std::string> keys;
    for (auto it = ref.begin(); it != ref.end(); ++it) keys.push_back(it.key());
    for (auto it = other.begin(); it != other.end(); ++it)
      if (!ref.contains(it.key())) keys.push_back(it.key());
    for (const auto& k : keys) {
      const std::string a = ref.contains(k) ? ref[k].dump() : "(unset)";
      const std::string b = other.contains(k) ? other[k].dump() : "(unset)";
      if (a == b) continue;
      if (os.tellp() > 0) os << ", ";
      os << "rank " << r << " has " << k << " " << b << " where rank 0 has " << a;
    }
  }
  if (os.tellp() == 0) return;
  throw Error("[comm] the ranks were started with different options: " + os.str() +
              "; start every rank with the same command line");
}

double optimizer_step(Runtime& rt, const ParallelLayout& lay, comm::Comm& world, const AdamWSettings& hp, int t) {
  Backend& be = rt.backend();
  float* g = rt.grads();
  const auto& spans = rt.shard();
  const auto& buckets = rt.buckets();
  // The global norm counts every parameter once: the tied embedding on the first stage
  // only, and replicated gradients (data parallel without ZeRO) on the first replica only.
  // The ranges of g counted, in order; their sums added in that order (one wait for the
  // device in all: the norm decides the clipping before the update).
  std::vector<std::pair<i64, i64>> counted;
  const bool tied_copy = lay.par.pp > 1 && lay.last_stage() && rt.config().tied_embeddings();
  // With the weights on the host the gradients are there too (Note [Weights on the host]).
  const bool on_host = rt.weights_on_host();
  SPPO_ASSERT(!on_host || lay.par.tp == 1);
  if (lay.par.tp == 1) {
    for (std::size_t k = 0; k < spans.size(); ++k) {
      if (tied_copy && buckets[k].name == "embed") continue;
      counted.emplace_back(spans[k].offset, spans[k].count);
    }
  } else {
    // Shards add up over the tensor-parallel group; what several members hold (a tensor
    // every member holds whole, a replicated key/value head) counts on its first holder.
    // The slices lie end to end in the flat array: one sum a run of counted ones.
    const auto [lb, le] = rt.layers();
    SPPO_ASSERT(!tied_copy || rt.param_specs().front().name == "embed.weight");
    const i64 embed = tied_copy ? rt.param_specs().front().numel() : 0;  // the stage's first tensor
    auto add = [&](i64 from, i64 to) {
      for (const ShardSpan& sp : spans) {
        const i64 b = std::max(from, sp.offset), e = std::min(to, sp.offset + sp.count);
        if (b < e) counted.emplace_back(b, e - b);
      }
    };
    i64 run = embed, end = embed;
    for (const ParamSlice& sl : param_slices(rt.config(), lb, le, rt.options().tp)) {
      if (sl.local < embed) continue;
      if (sl.copy) {
        add(run, end);
        run = end = sl.local + sl.count;
      } else {
        end = sl.local + sl.count;
      }
    }
    add(run, end);
  }
  // Under ZeRO-2 the gradients are the rank's pieces, laid out as the AdamW state: the
  // offsets of span k's range [from, from + count) move by its state_offset - offset.
  const bool sharded = rt.grads_sharded();
  const auto grad_at = [&](const ShardSpan& sp, i64 flat) { return sharded ? sp.state_offset + (flat - sp.offset) : flat; };
  if (sharded)
    for (auto& [from, count] : counted) {
      const auto sp = std::find_if(spans.begin(), spans.end(),
                                   [&](const ShardSpan& x) { return from >= x.offset && from < x.offset + x.count; });
      SPPO_ASSERT(sp != spans.end() && from + count <= sp->offset + sp->count);
      from = grad_at(*sp, from);
    }
  double ss = 0;
  if (on_host) {
    for (const auto& [from, count] : counted) ss += be.host_sum_squares(g + from, count);
  } else {
    for (double part : be.sum_squares_spans(g, counted)) ss += part;
  }
  if (lay.par.zero == ZeroStage::None && !lay.holds_first_copy()) ss = 0;
  std::vector<double> total{ss};
  comm::allreduce_sum(world, total, comm::world_group(world), "the gradient norm");
  const double norm = std::sqrt(total[0]);
  if (!std::isfinite(norm)) return norm;
  if (hp.clip > 0 && norm > hp.clip)
    for (const ShardSpan& sp : spans) {
      if (on_host) be.host_scale(g + sp.offset, sp.count, float(hp.clip / norm));
      else be.scale(g + grad_at(sp, sp.offset), sp.count, float(hp.clip / norm));
    }
  // AdamW per tensor, over the part of it whose state this rank keeps, bucket by bucket.
  std::vector<HostOptimizer::Piece> pieces;
  for (std::size_t k = 0; k < spans.size(); ++k) {
    const ShardSpan& sp = spans[k];
    i64 off = 0;
    for (const TensorSpec& spec : rt.param_specs()) {
      const i64 n = spec.numel();
      const i64 b = std::max(off, sp.offset), e = std::min(off + n, sp.offset + sp.count);
      if (b < e)
        pieces.push_back({k, b, e - b, sp.state_offset + (b - sp.offset), spec.shape.size() == 2 ? hp.weight_decay : 0.0f});
      off += n;
    }
  }
  const bool zero = lay.par.zero != ZeroStage::None && lay.par.zero_shards() > 1;
  if (rt.state_on_host()) {
    rt.start_host_update(std::move(pieces), {hp.lr, hp.beta1, hp.beta2, hp.eps, t},
                         zero ? lay.stage_group() : comm::Group{});
    return norm;
  }
  // Every tensor in a few kernels (Note [AdamW over many tensors] in backends/cuda/ops.cu);
  // the weights' working copy is refreshed after, in one pass, once ZeRO-1's all-gather has
  // brought the other ranks' shards.
  std::vector<AdamwSpan> update;
  update.reserve(pieces.size());
  // Under ZeRO-3 the weights too are the rank's pieces, laid out as the moments.
  const bool whole = !rt.weights_sharded();
  for (const HostOptimizer::Piece& q : pieces)
    update.push_back({whole ? q.offset : q.state_offset, q.count, q.state_offset, q.weight_decay,
                      sharded ? q.state_offset : -1});
  be.adamw_spans(rt.params(), rt.adam_m(), rt.adam_v(), g, update, hp.lr, hp.beta1, hp.beta2, hp.eps, t, nullptr);
  if (zero) rt.gather_updated_weights(world, lay.stage_group());
  else rt.refresh_weights();
  return norm;
}

std::vector<io::CheckpointTensor> full_tensors(const ModelConfig& c, float* base, const char* suffix) {
  std::vector<io::CheckpointTensor> t;
  float* p = base;
  for (const auto& s : parameter_specs(c)) {
    t.push_back({s.name + suffix, s.shape, p});
    p += s.numel();
  }
  return t;
}

FullState gather_full(Runtime& rt, const ParallelLayout& lay, comm::Comm& world, bool grads, bool optimizer) {
  const ModelConfig& c = rt.config();
  const i64 n = rt.num_params();
  // This stage's arrays, whole: under ZeRO, each replica holds pieces of the AdamW state
  // (and, after the reduce-scatter, of the gradients), so the stage group gathers them.
  std::vector<std::vector<float>> arrays;
  auto from_device = [&](const float* p) {
    std::vector<float> a(std::size_t(n), 0.0f);
    rt.read_device(a.data(), p, n);
    return a;
  };
  // The rank's pieces of an array laid out as the AdamW state, in place in a whole one.
  auto from_pieces = [&](const float* state, bool on_device) {
    std::vector<float> a(std::size_t(n), 0.0f);
    for (const ShardSpan& sp : rt.shard()) {
      if (on_device) rt.read_device(a.data() + sp.offset, state + sp.state_offset, sp.count);
      else rt.read_state(a.data() + sp.offset, state + sp.state_offset, sp.count);
    }
    return a;
  };
  arrays.push_back(rt.weights_sharded() ? from_pieces(rt.params(), true) : from_device(rt.params()));
  if (grads) arrays.push_back(rt.grads_sharded() ? from_pieces(rt.grads(), true) : from_device(rt.grads()));
  if (optimizer)
    for (float* state : {rt.adam_m(), rt.adam_v()}) arrays.push_back(from_pieces(state, false));
  if (lay.par.zero != ZeroStage::None && lay.par.zero_shards() > 1) {
    const comm::Group group = lay.stage_group();
    // The weights are whole on every replica, but under ZeRO-3.
    for (std::size_t a = rt.weights_sharded() ? 0 : 1; a < arrays.size(); ++a)
      for (const ParamBucket& b : rt.buckets())
        comm::wait(world, comm::iallgather_pieces(world, arrays[a].data() + b.offset, b.count, group),
                   "the gathering of the sharded optimizer state");
  }
  FullState full;
  if (lay.rank != 0 && !lay.holds_first_copy()) return full;
  // Stage owners of replica 0 send their arrays to rank 0, which places them by name.
  if (lay.rank != 0) {
    for (std::size_t a = 0; a < arrays.size(); ++a)
      comm::wait(world, world.isend(arrays[a].data(), n * i64(sizeof(float)), 0, kGatherTag + int(a)),
                 "rank 0 to take this stage's tensors");
    return full;
  }
  const i64 total = c.num_params();
  std::vector<std::vector<float>*> outs{&full.params};
  if (grads) outs.push_back(&full.grads);
  if (optimizer) outs.push_back(&full.m), outs.push_back(&full.v);
  for (auto* o : outs) o->assign(std::size_t(total), 0.0f);
  for (int p = 0; p < lay.par.pp; ++p)
    for (int t = 0; t < lay.par.tp; ++t) {
      const auto [b, e] = lay.stage_layers.at(std::size_t(p));
      const TpShard shard{t, lay.par.tp};
      i64 count = 0;
      for (const auto& s : parameter_specs(c, b, e, shard)) count += s.numel();
      std::vector<std::vector<float>> got;
      if (p == 0 && t == 0) {
        got = arrays;
      } else {
        for (std::size_t a = 0; a < outs.size(); ++a) {
          got.emplace_back(std::size_t(count));
          comm::wait(world,
                     world.irecv(got.back().data(), count * i64(sizeof(float)), lay.rank_of(0, p, 0, t),
                                 kGatherTag + int(a)),
                     "stage " + std::to_string(p) + (lay.par.tp > 1 ? " member " + std::to_string(t) : "") + "'s tensors");
        }
      }
      // The tied embedding is taken from the first stage (the last holds the same values),
      // a tensor every tensor-parallel member holds whole from member 0.
      const bool has_embed = b == 0 || (e == c.layers && c.tied_embeddings());
      const i64 embed_elems = has_embed ? (shard.vocab(c).second - shard.vocab(c).first) * c.hidden : 0;
      for (const ParamSlice& sl : param_slices(c, b, e, shard)) {
        if (p > 0 && sl.local < embed_elems) continue;
        if (sl.copy) continue;
        for (std::size_t a = 0; a < outs.size(); ++a)
          copy_floats(outs[a]->data() + sl.full, got[a].data() + sl.local, sl.count);
      }
    }
  return full;
}

namespace {

// This rank's flat parameter array (its layers, its shards) cut from a whole-model one.
std::vector<float> owned_part(const Runtime& rt, const std::vector<float>& full) {
  std::vector<float> mine(std::size_t(rt.num_params()));
  const auto [b, e] = rt.layers();
  for (const ParamSlice& sl : param_slices(rt.config(), b, e, rt.options().tp))
    copy_floats(mine.data() + sl.local, full.data() + sl.full, sl.count);
  return mine;
}

}  // namespace

void init_owned(Runtime& rt, std::uint64_t seed) {
  std::vector<float> full(std::size_t(rt.config().num_params()));
  init_params(rt.config(), full.data(), seed);
  rt.set_weights(owned_part(rt, full).data());
}

nlohmann::json load_owned(Runtime& rt, const std::string& dir, std::string* from) {
  const ModelConfig& c = rt.config();
  const std::size_t total = std::size_t(c.num_params());
  std::vector<float> params(total, 0.0f), m(total, 0.0f), v(total, 0.0f);
  auto opt = full_tensors(c, m.data(), ".m");
  for (auto& t : full_tensors(c, v.data(), ".v")) opt.push_back(t);
  nlohmann::json state = io::load_checkpoint(dir, full_tensors(c, params.data(), ""), opt, from);
  const std::vector<float> my_params = owned_part(rt, params), my_m = owned_part(rt, m), my_v = owned_part(rt, v);
  rt.set_weights(my_params.data());
  for (const ShardSpan& sp : rt.shard()) {
    rt.write_state(rt.adam_m() + sp.state_offset, my_m.data() + sp.offset, sp.count);
    rt.write_state(rt.adam_v() + sp.state_offset, my_v.data() + sp.offset, sp.count);
  }
  rt.refresh_weights();
  return state;
}

void init_from(Runtime& rt, const std::string& path) {
  const ModelConfig& c = rt.config();
  std::vector<float> params(std::size_t(c.num_params()), 0.0f);
  if (io::is_hf_dir(path)) io::hf_read_weights(path, c, params.data());
  else io::load_checkpoint_weights(path, full_tensors(c, params.data(), ""));
  rt.set_weights(owned_part(rt, params).data());
}

ModelConfig init_model(const std::string& path) {
  if (io::is_hf_dir(path)) return io::hf_read_config(path);
  std::string from;
  const nlohmann::json state = io::read_checkpoint_state(path, &from);
  return io::parse_checkpoint_state(state, from + "/" + io::kCheckpointStateFile).config;
}

void save_consolidated(Runtime& rt, const ParallelLayout& lay, comm::Comm& world, const std::string& dir,
                       const nlohmann::json& state, const std::string& config) {
  FullState full = gather_full(rt, lay, world, false, true);
  if (lay.rank != 0) return;
  const ModelConfig& c = rt.config();
  auto opt = full_tensors(c, full.m.data(), ".m");
  for (auto& t : full_tensors(c, full.v.data(), ".v")) opt.push_back(t);
  io::save_checkpoint(dir, full_tensors(c, full.params.data(), ""), opt, state, config);
}

}  // namespace sppo
