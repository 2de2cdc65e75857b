#include "sim/simulator.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <iterator>
#include <map>
#include <memory>
#include <tuple>
#include <utility>

#include "core/check.h"
#include "schedule/builders.h"

namespace sppo::sim {

using sched::Op;
using sched::OpKind;
using sched::Payload;
using sched::Schedule;

namespace {

struct MemPoint {
  double t;
  i64 seq;
  i64 delta;
  int term;   // sched::MemTerm, or -1 for offloaded bytes on the host
};

// A transfer that may cross shared links: a copy to or from host memory, or a message
// between nodes. `rate` is what its own link gives it alone; `scale` (from the previous
// pass) stretches the part of its duration that moves bytes.
enum class Dir { D2H, H2D, Net };

struct Flow {
  int rank, peer;
  Dir dir;
  double start, bytes, rate;
};

// What the event loop reads of an op, in one place: it visits every op of every rank in
// each pass, a few ops of a rank at a time, so each op's data should come in together
// (lists beside the ops would each miss the cache).
struct SimOp {
  OpKind kind = OpKind::Forward;
  Payload payload = Payload::None;
  int subseq = 0;
  int peer = -1, recv_peer = -1;
  int layers = 1;     // max(1, layers of the op)
  double seconds = 0; // F, B: its time with the copy streams free (the same in every pass); AllToAll: its time
  i64 bytes = 0;      // Offload, Prefetch, Send, RingStep, AllToAll: the bytes it moves (sends)
  sched::MessageKey key;  // Send, Recv, RingStep
  int stream = -1;    // F, B: its streamed K/V chunks (RankEvents::streams), -1: none
  int use = -1;       // F, B with the weights on the host: its first layer's RankEvents::uses, -1: none
};

SimOp sim_op(const Op& op) {
  SimOp o{op.kind,      op.payload, op.subseq, op.peer, op.recv_peer, std::max(1, op.layer_end - op.layer_begin),
          0,           0,          {},        -1,          -1};
  if (op.kind == OpKind::Send || op.kind == OpKind::Recv || op.kind == OpKind::RingStep) o.key = sched::message_key(op);
  return o;
}

// Note [Streams on the copy streams]: the chunks a streamed layer's window brings in (and,
// in backward, the sums it sends out) go on the device's copy streams, one a direction,
// behind whatever copies are already queued there (runtime/kv_stream.h shares them with
// the activations' offloads and prefetches), at the pace the attention takes them.
// CostModel prices them with the streams free (kv_stream_s): only what the attention does
// not hide shows, (1 - share) max(0, max(in, out) - cover). Here an F/B op's first chunks
// wait for its copy streams (a backward's, most often, for the prefetch of the unit the
// next backward needs, queued just before it), which shows as (1 - share) max(0, max(wait_in
// + max(in, cover), wait_out + max(out, cover)) - cover); and the streams are then busy
// until the chunks are through, so a copy queued after the op waits for them. A backward
// that recomputes the attention streams twice, its forward's chunks first. Not priced:
// devices that share a PCIe switch or a NUMA node streaming at once (their copies share
// those links, Note [Shared host links]; replaying the streams there too took gpt-65b's
// 640K `--msp on` search from 6 to 21 s).
struct KvStream {
  i64 in_bytes = 0, out_bytes = 0;
  CostModel::StreamCopies parts[2];  // in the order they run
  int n = 0;
  double paced_in = 0, paced_out = 0;  // seconds the chunks hold each copy stream
  double exposed = 0;                  // their seconds in SimOp::seconds

  void add(const CostModel::StreamCopies& c) {
    if (c.in_bytes + c.out_bytes == 0) return;
    parts[n++] = c;
    in_bytes += c.in_bytes;
    out_bytes += c.out_bytes;
    if (c.in_bytes > 0) paced_in += std::max(c.in_s, c.cover_s);
    if (c.out_bytes > 0) paced_out += std::max(c.out_s, c.cover_s);
    exposed += c.exposed_s;
  }
  // Their seconds when the first chunks wait `wait_in` (`wait_out`) for the copy stream.
  double exposed_after(double wait_in, double wait_out, double share) const {
    double t = 0;
    for (int k = 0; k < n; ++k) {
      const CostModel::StreamCopies& c = parts[k];
      const double in = c.in_bytes > 0 ? (k == 0 ? wait_in : 0) + std::max(c.in_s, c.cover_s) : 0;
      const double out = c.out_bytes > 0 ? (k == 0 ? wait_out : 0) + std::max(c.out_s, c.cover_s) : 0;
      t += (1 - share) * std::max(0.0, std::max(in, out) - c.cover_s);
    }
    return t;
  }
};

// What a rank's ops do to device and host memory. It follows program order only, not
// time, so it is worked out once per simulate() and every contention pass reuses it; the
// times of the last pass then place the events.
struct RankEvents {
  std::vector<sched::MemEvent> ev;  // every op's events, in program order
  std::vector<size_t> first;        // op k's events are ev[first[k], first[k + 1])
  std::vector<SimOp> ops;           // op k's sim_op, with its seconds and bytes
  i64 fixed = 0;
  std::array<i64, sched::kMemTerms> fixed_terms{};
  i64 host_fixed = 0;               // host bytes held for the whole run (the optimizer state)
  i64 host_state = 0;               // parameters whose optimizer state the host updates
  i64 host_moved = -1;              // of them, those whose gradients and weights the update copies (-1: all)
  // With the layers' weights on the host (Note [Weights on the host] in schedule/weights.h):
  // the own layers' uses.
  std::vector<sched::LayerUse> uses;
  i64 layer_in = 0, layer_g = 0;  // --weights host: bytes of a layer's weights to the device, its gradient's back
  // Under ZeRO-3 (Note [ZeRO-3] in schedule/weights.h) the uses' loads are all-gathers over
  // this group (the layer group), and the gradients leave by the reduction as under ZeRO-2.
  std::vector<int> gather_group;
  i64 peak_host = 0;                // host bytes (fixed, offloaded, K/V), at most
  // Ops that move streamed K/V to or from the host (F/B, an MSP owner's Recv KV and Send
  // KVGrad): (op, host bytes it adds, the most it adds at any point inside it), for
  // refit_copies.
  struct KvHostOp {
    size_t op;
    i64 delta, rise;
  };
  std::vector<KvHostOp> kv_host;
  std::vector<KvStream> streams;    // of the F/B ops whose K/V chunks stream (SimOp::stream)
  // Per subsequence: its offloadable tensors' bytes on this rank (RankMemory::unit_tensors),
  // from which refit_copies sizes the copies for other fractions.
  std::vector<std::vector<i64>> unit_tensors;
  std::vector<std::vector<int>> unit_layers;  // and the layer of each (RankMemory::unit_layers)
};

// Note [Simulating again with other fractions]: only the copies depend on the fractions of
// a schedule's Offload and Prefetch ops, and each copy has one memory event (its release or
// its allocation). So for new fractions the copies' bytes, those events and the host's
// peak are worked out again and the rest is kept. This follows RankMemory: an offload moves
// select_offload(fraction) of the unit, the prefetch of that subsequence brings back
// whatever is on the host. A test holds it to simulating from scratch.
void refit_copies(RankEvents* re, const std::vector<Op>& ops) {
  std::vector<i64> on_host(re->unit_tensors.size(), 0), coming_back(re->unit_tensors.size(), 0);
  // A layer-major backward's prefetches bring one layer's part each.
  std::map<std::pair<size_t, int>, i64> layer_on_host, layer_coming_back;
  auto layered = [](const Op& op) { return op.layer_end > op.layer_begin; };
  i64 host = re->host_fixed;
  re->peak_host = host;
  auto kv = re->kv_host.begin();
  for (size_t k = 0; k < ops.size(); ++k) {
    const Op& op = ops[k];
    if (kv != re->kv_host.end() && kv->op == k) {  // host-resident K/V and their sums
      re->peak_host = std::max(re->peak_host, host + kv->rise);
      host += kv->delta;
      ++kv;
      continue;
    }
    const size_t i = size_t(op.subseq);
    if (op.kind == OpKind::WaitPrefetch) {  // Note [Host copies leave at the wait]
      if (layered(op)) {
        for (int l = op.layer_begin; l < op.layer_end; ++l) host -= std::exchange(layer_coming_back[{i, l}], 0);
        continue;
      }
      host -= coming_back[i];
      coming_back[i] = 0;
      continue;
    }
    if (op.kind != OpKind::Offload && op.kind != OpKind::Prefetch) continue;
    SPPO_ASSERT(re->first[k + 1] == re->first[k] + 1);
    i64 bytes = 0;
    if (op.kind == OpKind::Offload) {
      std::vector<bool> take;
      bytes = select_offload(re->unit_tensors[i], op.fraction, &take);
      for (size_t t = 0; t < take.size(); ++t)
        if (take[t] && i < re->unit_layers.size() && !re->unit_layers[i].empty())
          layer_on_host[{i, re->unit_layers[i][t]}] += re->unit_tensors[i][t];
      on_host[i] += bytes;
      host += bytes;
      re->peak_host = std::max(re->peak_host, host);
      re->ev[re->first[k]].delta = -bytes;
    } else if (layered(op)) {
      for (int l = op.layer_begin; l < op.layer_end; ++l) {
        const i64 part = std::exchange(layer_on_host[{i, l}], 0);
        layer_coming_back[{i, l}] += part;
        bytes += part;
      }
      on_host[i] -= bytes;
      re->ev[re->first[k]].delta = bytes;
    } else {
      bytes = on_host[i];
      on_host[i] = 0;
      coming_back[i] += bytes;
      re->ev[re->first[k]].delta = bytes;
    }
    re->ops[k].bytes = bytes;
  }
}

RankEvents rank_events(const sched::MemoryRules& rules, const CostModel& cost, const Schedule& s, int r,
                       const sched::UnitSizes& sizes) {
  RankEvents out;
  sched::RankMemory mem(rules, s, r, &sizes);
  out.fixed = mem.fixed_bytes();
  out.fixed_terms = mem.fixed_terms();
  out.host_fixed = mem.host_fixed_bytes();
  out.host_state = rules.optimizer_host ? mem.state_params() : 0;
  const auto& ops = s.ops[size_t(r)];
  out.first.reserve(ops.size() + 1);
  out.ops.reserve(ops.size());
  for (const Op& op : ops) out.ops.push_back(sim_op(op));
  if (sched::layer_weights_stream(s)) {
    const sched::LayerUses uses(s, r);
    out.uses = uses.uses();
    out.layer_in = mem.layer_copy_in();
    if (s.place.weights_host()) {
      out.layer_g = mem.layer_grad();
      out.host_moved = mem.resident_params();
    } else {
      for (const Op& op : ops)  // Note [ZeRO-3 gathers]: one group, the layer group's
        if (op.kind == OpKind::AllGather) out.gather_group = op.group;
    }
    for (size_t k = 0; k < ops.size(); ++k)
      if (uses.first(k) < uses.last(k)) out.ops[k].use = int(uses.first(k));
  }
  std::vector<i64> offsets(s.lengths.size() + 1, 0);
  for (size_t i = 0; i < s.lengths.size(); ++i) offsets[i + 1] = offsets[i] + s.lengths[i];
  for (size_t k = 0; k < ops.size(); ++k) {
    const Op& op = ops[k];
    SimOp& o = out.ops[k];
    if (op.kind == OpKind::Forward) o.seconds = cost.forward_s(op, s, offsets[size_t(op.subseq)]);
    if (op.kind == OpKind::Backward) {
      o.seconds = cost.backward_s(op, s, offsets[size_t(op.subseq)]);
      // Note [Residual gradients on the host] (schedule/builders.cpp): the op's own copies.
      const sched::ResidualMove moves = sched::residual_move(s, r, op);
      if (moves.in) o.seconds += cost.h2d_s(mem.residual_bytes(op), false);
      if (moves.out) o.seconds += cost.d2h_s(mem.residual_bytes(op), false);
    }
    if ((op.kind == OpKind::Forward || op.kind == OpKind::Backward) && s.place.any_kv_streamed()) {
      const i64 at = offsets[size_t(op.subseq)];
      const bool backward = op.kind == OpKind::Backward;
      KvStream stream;
      if (backward && (s.place.recompute & kAttentionGroup)) stream.add(cost.kv_stream_copies(op, s, at, false, true));
      stream.add(cost.kv_stream_copies(op, s, at, backward));
      if (stream.n > 0) {
        o.stream = int(out.streams.size());
        out.streams.push_back(stream);
      }
    }
    if (op.kind == OpKind::Offload) o.bytes = mem.offload_bytes(op);
    if (op.kind == OpKind::Prefetch) o.bytes = mem.prefetch_bytes(op);
    if (op.kind == OpKind::Send || op.kind == OpKind::RingStep) o.bytes = cost.message_bytes(op, s, r);
    if (op.kind == OpKind::AllToAll) {
      o.bytes = sched::alltoall_bytes(s, op, r, cost.model(), rules.precision);
      o.seconds = cost.alltoall_s(op, s);
    }
    out.first.push_back(out.ev.size());
    const i64 host_before = mem.host_bytes();
    mem.events(op, &out.ev);
    // Every host change but the offloads' (refit_copies works those out): the K/V of F/B
    // ops, and of an MSP owner's Recv KV and Send KVGrad.
    const bool copy = op.kind == OpKind::Offload || op.kind == OpKind::Prefetch || op.kind == OpKind::WaitPrefetch;
    if (!copy && (mem.op_host_peak() != host_before || mem.host_bytes() != host_before))
      out.kv_host.push_back({k, mem.host_bytes() - host_before, mem.op_host_peak() - host_before});
  }
  out.peak_host = mem.host_peak();
  out.first.push_back(out.ev.size());
  out.unit_tensors.resize(s.lengths.size());
  out.unit_layers.resize(s.lengths.size());
  for (size_t i = 0; i < s.lengths.size(); ++i) {
    out.unit_tensors[i] = mem.unit_tensors(int(i));
    out.unit_layers[i] = mem.unit_layers(int(i));
  }
  return out;
}

// Runs body(r) for every rank r < n on the OpenMP threads (a rank's memory events and
// accounting depend on that rank alone); the first exception is rethrown here.
template <class Body>
void for_each_rank(int n, const Body& body) {
  std::exception_ptr error;
#pragma omp parallel for schedule(dynamic)
  for (int r = 0; r < n; ++r) {
    try {
      body(r);
    } catch (...) {
#pragma omp critical(sppo_sim_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

struct RankState {
  size_t pc = 0;
  double t_compute = 0, t_out = 0, t_in = 0, t_net = 0;
  double busy = 0, exposed = 0;
  double ring_ready = 0;     // latest arrival of the ring steps before the next F/B
  int ring_steps = 0;        // ring steps since the last F/B
  bool posted = false;       // the current ring step's send, or all-reduce arrival, is out
  // Blocked on a receive when the inbox had taken this many messages: until another
  // arrives, visiting the rank again cannot unblock it.
  size_t waiting_since = kNotWaiting;
  static constexpr size_t kNotWaiting = ~size_t(0);
  std::vector<double> off_end, pre_end;  // per subsequence: when its offload (prefetch) ends
  // Per layer, with its weights on the host: when its working copy lands on the device, and
  // when its gradient's copy to the host ends.
  std::vector<double> weights_in, grads_out;
  std::vector<std::pair<double, double>> mem_span;  // per op: the interval its memory events fall in
};

// Messages sent to one rank and not yet received, by sender and payload, each list in
// the order sent: a receive takes the first from its sender with its key (messages between
// two ranks match in order, as MPI's do). Each list is mostly received in order, so the
// first entry is nearly always the one.
class Inbox {
 public:
  size_t arrived() const { return arrived_; }  // messages put so far
  void put(int src, const sched::MessageKey& key, double arrival) {
    ++arrived_;
    Queue& f = from(src, key.payload);
    f.q.push_back({key, arrival});
  }
  bool take(int src, const sched::MessageKey& key, double* arrival) {
    Queue& f = from(src, key.payload);
    for (size_t k = f.head; k < f.q.size(); ++k)
      if (f.q[k].key == key) {
        *arrival = f.q[k].arrival;
        if (k == f.head) ++f.head;
        else f.q.erase(f.q.begin() + std::ptrdiff_t(k));
        if (f.head == f.q.size()) f.q.clear(), f.head = 0;
        return true;
      }
    return false;
  }

 private:
  struct Message {
    sched::MessageKey key;
    double arrival;
  };
  struct Queue {
    int src;
    Payload payload;
    std::vector<Message> q;
    size_t head = 0;
  };
  // A rank hears from few others (ring and stage neighbours, MSP pieces).
  Queue& from(int src, Payload payload) {
    for (Queue& f : queues_)
      if (f.src == src && f.payload == payload) return f;
    queues_.push_back({src, payload, {}, 0});
    return queues_.back();
  }
  std::vector<Queue> queues_;
  size_t arrived_ = 0;
};

// Stretch factor per rank and op index of transfers, from the previous pass (0: the op
// was no transfer there, so 1; an empty list: no transfers on that rank).
using Scales = std::vector<std::vector<double>>;

struct Pass {
  SimResult res;      // everything but memory (account_memory adds it)
  double copy_s = 0;  // seconds of every host copy together
  std::vector<std::pair<std::pair<int, size_t>, Flow>> flows;
  std::vector<std::vector<std::pair<double, double>>> mem_span;  // per rank and op: RankState::mem_span
};

// Note [ZeRO's reductions priced whole]: under ZeRO the step's gradient reduction is a
// ReduceScatter, half a ring all-reduce on the wire; after the optimizer's update the
// group all-gathers the updated weights (ZeRO-1, ZeRO-2; under ZeRO-3 the embedding's, final
// norm's and head's alone), the other half, which is not an op of the step. The
// ReduceScatter is priced as the whole all-reduce, so that a ZeRO-1 or ZeRO-2 step costs
// what its reductions and its gathers of weights take. Under ZeRO-3 that overprices the
// step by the layers' half (they are gathered for each use instead, AllGather ops priced
// inside the F and B that start them): the planner's ZeRO-3 figures are lower bounds by at
// most one all-gather of the layers' weights.
//
// Note [Weights on the host] (schedule/weights.h), priced: an F/B op's layers run one after
// another, op.seconds / layers each. At a layer's start the copies it issues (the rank's
// first use: its own layer's; then the next use's layer) go on the copy-in lane behind
// what is queued there, and the layer waits for its own copy; at its end a gradient that
// leaves goes on the copy-out lane, and a gradient released there waits for its copy. The
// seconds waited stretch the op and count as exposed copy time. The copies go before the
// op's streamed K/V chunks (Note [Streams on the copy streams]), which wait behind them;
// they are not replayed on shared links (Note [Shared host links]).
// ZeRO-3's gathers (the AllGather ops, Note [ZeRO-3 gathers] in schedule/weights.h) are
// priced the same way, at half a ring all-reduce of the layer's fp32 weights over the
// group, and drawn on the network lane; but they are timed on the copy-in clock, so they
// queue behind the rank's host-to-device copies rather than its messages, and each is the
// rank's own transfer, not a collective that waits for the group's slowest member. Timing
// them on the network clock instead moved the planner's ZeRO-3 figures by up to 0.4%
// (gpt-7b at 512K on 8 H200s: 1068.6 to 1068.3 tokens/GPU/s, then under ZeRO-2; llama-3-8b
// at 512K on 8 H100s: 1055.9 to 1052.2) and would move DeepSpeed's, whose schedule is
// ZeRO-3.
// `copies` (may be null): each copy's lane, layer and span, for the trace.
struct LayerCopy {
  Lane lane;
  int layer;
  double start, end;
};
double layer_copies(RankState& rs, const RankEvents& re, const SimOp& op, double start, const CostModel& cost,
                    std::vector<LayerCopy>* copies) {
  const double layer_s = op.seconds / op.layers;
  double t = start, waited = 0;
  auto wait_until = [&](double ready) {
    if (ready > t) waited += ready - t, t = ready;
  };
  for (int k = 0; k < op.layers; ++k) {
    const sched::LayerUse& u = re.uses[size_t(op.use) + size_t(k)];
    for (int l : {u.load_now, u.load_next, u.load_below}) {
      if (l < 0) continue;
      const double at = std::max(rs.t_in, t);
      // A ring all-gather is the second half of a ring all-reduce.
      const bool gathered = !re.gather_group.empty();
      rs.t_in = rs.weights_in[size_t(l)] =
          at + (gathered ? cost.allreduce_s(re.layer_in, re.gather_group) / 2 : cost.h2d_s(re.layer_in, rs.t_out > at));
      if (copies) copies->push_back({gathered ? Lane::Network : Lane::CopyIn, l, at, rs.t_in});
    }
    wait_until(rs.weights_in[size_t(u.layer)]);
    if (u.load_below >= 0) wait_until(rs.weights_in[size_t(u.load_below)]);
    t += layer_s;
    if (u.grad_last && re.layer_g > 0) {
      const double at = std::max(rs.t_out, t);
      rs.t_out = rs.grads_out[size_t(u.layer)] = at + cost.d2h_s(re.layer_g, rs.t_in > at);
      if (copies) copies->push_back({Lane::CopyOut, u.layer, at, rs.t_out});
    }
    for (int l : u.grad_free)
      if (l >= 0) wait_until(rs.grads_out[size_t(l)]);
  }
  return waited;
}

Pass simulate_once(const Schedule& s, const CostModel& cost, const std::vector<RankEvents>& mem,
                   const SimOptions& options, const Scales& scales, bool want_flows) {
  const int R = s.ranks();
  const HardwareProfile& hw = cost.hw();
  std::vector<RankState> st(R);
  for (int r = 0; r < R; ++r) {
    st[r].mem_span.resize(s.ops[r].size());
    st[r].off_end.assign(s.lengths.size(), 0.0);
    st[r].pre_end.assign(s.lengths.size(), 0.0);
    if (sched::layer_weights_stream(s)) {
      st[r].weights_in.assign(size_t(s.layers), 0.0);
      st[r].grads_out.assign(size_t(s.layers), 0.0);
    }
  }
  std::vector<Inbox> inbox(R);  // messages in flight, by receiver
  // Each collective's group as a number, looked up once a pass: a Ulysses step has an
  // all-to-all on every F and B of every member. A collective ends once each member with
  // ops has arrived (Note [One Ulysses member in the search] in schedule/builders.cpp).
  std::vector<std::vector<int>> group_of(R);
  std::vector<size_t> arrivals;  // by group: its members with ops
  int groups = 0;
  {
    std::map<std::vector<int>, int> ids;
    const std::vector<int>* last = nullptr;
    int last_id = -1;
    for (int r = 0; r < R; ++r) {
      group_of[size_t(r)].assign(s.ops[size_t(r)].size(), -1);
      for (size_t k = 0; k < s.ops[size_t(r)].size(); ++k) {
        const Op& op = s.ops[size_t(r)][k];
        if (op.kind != OpKind::AllReduce && op.kind != OpKind::ReduceScatter && op.kind != OpKind::AllToAll) continue;
        if (!last || *last != op.group) {
          const auto [at, added] = ids.emplace(op.group, int(ids.size()));
          last_id = at->second;
          last = &op.group;
          if (added)
            arrivals.push_back(size_t(std::count_if(op.group.begin(), op.group.end(),
                                                    [&](int m) { return !s.ops[size_t(m)].empty(); })));
        }
        group_of[size_t(r)][k] = last_id;
      }
    }
    groups = int(ids.size());
  }
  // By group, then by the group's collectives in order: when each member arrived, and when
  // the collective ends (-1: not yet known).
  std::vector<std::vector<std::vector<double>>> arrived(static_cast<size_t>(groups));
  std::vector<std::vector<double>> reduced(static_cast<size_t>(groups));
  std::vector<std::vector<int>> passed(R, std::vector<int>(size_t(groups), 0));
  // The arrivals and end of the collective at op `pc` of rank r.
  auto collective = [&](int r, size_t pc) -> std::pair<std::vector<double>*, double*> {
    const int g = group_of[size_t(r)][pc];
    const size_t n = size_t(passed[size_t(r)][size_t(g)]);
    if (arrived[size_t(g)].size() <= n) {
      arrived[size_t(g)].resize(n + 1);
      reduced[size_t(g)].resize(n + 1, -1.0);
    }
    return {&arrived[size_t(g)][n], &reduced[size_t(g)][n]};
  };
  Pass pass;
  SimResult& res = pass.res;
  const bool nic_shared = hw.gpus_per_nic > 1 && hw.nic_bw > 0;
  res.forward_end.assign(R, std::vector<double>(s.lengths.size(), -1.0));
  res.sent_bytes.assign(R, 0);
  res.backward_start.assign(R, std::vector<double>(s.lengths.size(), -1.0));

  auto scale_of = [&](int r, size_t pc) {
    const double v = scales.empty() || scales[size_t(r)].empty() ? 0.0 : scales[size_t(r)][pc];
    return v > 0 ? v : 1.0;
  };
  auto record = [&](int r, Lane lane, size_t pc, double start, double end) {
    if (!options.record || end <= start) return;
    const Op& op = s.ops[size_t(r)][pc];
    res.events.push_back({r, lane, op.kind, to_string(op), start, end - start});
  };
  auto mem_at = [&](RankState& rs, double start, double end) { rs.mem_span[rs.pc] = {start, end}; };
  // A message's seconds on the network, stretched where it crosses a shared NIC.
  auto send_s = [&](int r, size_t pc, const SimOp& op, double start) {
    const i64 bytes = op.bytes;
    res.sent_bytes[size_t(r)] += bytes;
    const double alone = cost.message_s(bytes, r, op.peer);
    if (!nic_shared || cost.same_node(r, op.peer) || bytes == 0) return alone;
    const double lat = hw.inter_node_latency, move = alone - lat;
    if (want_flows) pass.flows.push_back({{r, pc}, {r, op.peer, Dir::Net, start + lat, double(bytes), bytes / move}});
    return lat + move * scale_of(r, pc);
  };

  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < R; ++r) {
      RankState& rs = st[r];
      if (rs.waiting_since != RankState::kNotWaiting && rs.waiting_since == inbox[size_t(r)].arrived()) continue;
      rs.waiting_since = RankState::kNotWaiting;
      const auto& ops = s.ops[r];
      const auto& sim_ops = mem[size_t(r)].ops;
      while (rs.pc < ops.size()) {
        const SimOp& op = sim_ops[rs.pc];
        switch (op.kind) {
          case OpKind::Forward:
          case OpKind::Backward: {
            double dur = op.seconds;
            const double start = rs.t_compute;
            if (op.use >= 0) {  // Note [Weights on the host]
              std::vector<LayerCopy> copies;
              const double waited = layer_copies(rs, mem[size_t(r)], op, start, cost, options.record ? &copies : nullptr);
              dur += waited;
              rs.exposed += waited;
              for (const LayerCopy& c : copies) {  // from the host, to it, or all-gathered (ZeRO-3)
                const bool in = c.lane == Lane::CopyIn, gathered = c.lane == Lane::Network;
                res.events.push_back({r, c.lane,
                                      gathered ? OpKind::AllGather : in ? OpKind::Prefetch : OpKind::Offload,
                                      (gathered ? "gather L" : in ? "weights L" : "grads L") + std::to_string(c.layer),
                                      c.start, c.end - c.start});
              }
            }
            if (op.stream >= 0) {  // Note [Streams on the copy streams]
              const KvStream& kv = mem[size_t(r)].streams[size_t(op.stream)];
              const double in_at = kv.in_bytes > 0 ? std::max(start, rs.t_in) : start;
              const double out_at = kv.out_bytes > 0 ? std::max(start, rs.t_out) : start;
              dur += kv.exposed_after(in_at - start, out_at - start, hw.copy_compute_share) - kv.exposed;
              if (kv.in_bytes > 0) rs.t_in = in_at + kv.paced_in;
              if (kv.out_bytes > 0) rs.t_out = out_at + kv.paced_out;
            }
            double end = start + dur;
            if (rs.ring_steps > 0) {
              // The last ring block's attention follows its arrival.
              end = std::max(end, rs.ring_ready + dur / double((rs.ring_steps + 1) * op.layers));
            }
            rs.ring_ready = 0;
            rs.ring_steps = 0;
            rs.busy += dur;
            rs.t_compute = end;
            if (op.kind == OpKind::Forward) res.forward_end[r][op.subseq] = end;
            else if (res.backward_start[r][op.subseq] < 0) res.backward_start[r][op.subseq] = start;
            record(r, Lane::Compute, rs.pc, start, end);
            mem_at(rs, start, end);
            break;
          }
          case OpKind::Offload: {
            const i64 bytes = op.bytes;
            const double start = std::max(rs.t_out, rs.t_compute);
            const double alone = cost.d2h_s(bytes, rs.t_in > start);
            const double end = start + alone * scale_of(r, rs.pc);
            if (want_flows && bytes > 0) pass.flows.push_back({{r, rs.pc}, {r, r, Dir::D2H, start, double(bytes), bytes / alone}});
            rs.t_out = end;
            rs.off_end[op.subseq] = end;
            record(r, Lane::CopyOut, rs.pc, start, end);
            mem_at(rs, start, end);
            if (bytes > 0) pass.copy_s += end - start;
            break;
          }
          case OpKind::Prefetch: {
            const i64 bytes = op.bytes;
            const double start = std::max(rs.t_in, rs.t_compute);
            const double alone = cost.h2d_s(bytes, rs.t_out > start);
            const double end = start + alone * scale_of(r, rs.pc);
            if (want_flows && bytes > 0) pass.flows.push_back({{r, rs.pc}, {r, r, Dir::H2D, start, double(bytes), bytes / alone}});
            rs.t_in = end;
            rs.pre_end[op.subseq] = end;
            record(r, Lane::CopyIn, rs.pc, start, end);
            mem_at(rs, start, end);
            if (bytes > 0) pass.copy_s += end - start;
            break;
          }
          case OpKind::WaitOffload:
          case OpKind::WaitPrefetch: {
            const double done = (op.kind == OpKind::WaitOffload ? rs.off_end : rs.pre_end)[op.subseq];
            if (done > rs.t_compute) {
              rs.exposed += done - rs.t_compute;
              rs.t_compute = done;
            }
            mem_at(rs, rs.t_compute, rs.t_compute);
            break;
          }
          case OpKind::Send: {
            const double start = std::max(rs.t_net, rs.t_compute);
            const double end = start + send_s(r, rs.pc, op, start);
            rs.t_net = end;
            // A forward-only step's stage waits for each hidden state to go before its next F
            // (Note [Forward-only steps] in schedule/builders.cpp).
            if (s.forward_only) rs.t_compute = end;
            inbox[size_t(op.peer)].put(r, op.key, end);
            record(r, Lane::Network, rs.pc, start, end);
            mem_at(rs, start, end);
            break;
          }
          case OpKind::Recv: {
            double arrival = 0;
            if (!inbox[size_t(r)].take(op.peer, op.key, &arrival)) goto waiting;
            mem_at(rs, std::max(rs.t_compute, arrival), std::max(rs.t_compute, arrival));
            rs.t_compute = std::max(rs.t_compute, arrival);
            break;
          }
          case OpKind::RingStep: {
            if (!rs.posted) {
              const double start = std::max(rs.t_net, rs.t_compute);
              const double end = start + send_s(r, rs.pc, op, start);
              rs.t_net = end;
              inbox[size_t(op.peer)].put(r, op.key, end);
              record(r, Lane::Network, rs.pc, start, end);
              rs.posted = true;
              progress = true;
            }
            double arrival = 0;
            if (!inbox[size_t(r)].take(op.recv_peer, op.key, &arrival)) goto waiting;
            rs.ring_ready = std::max({rs.ring_ready, arrival, rs.t_net});
            ++rs.ring_steps;
            rs.posted = false;
            mem_at(rs, arrival, arrival);
            break;
          }
          case OpKind::AllGather:  // ZeRO-3's, priced inside the next F or B's layers (layer_copies)
            break;
          case OpKind::AllToAll:    // Ulysses' exchanges, priced with the op (op.seconds)
          case OpKind::ReduceScatter:  // priced as an all-reduce (Note [ZeRO's reductions priced whole])
          case OpKind::AllReduce: {  // every member arrives, then all are held until it ends
            const Op& all = ops[rs.pc];
            const int g = group_of[size_t(r)][rs.pc];
            auto [there, end] = collective(r, rs.pc);
            if (!rs.posted) {
              there->push_back(std::max(rs.t_compute, rs.t_net));
              rs.posted = true;
              progress = true;
            }
            if (there->size() < arrivals[size_t(g)]) goto blocked;
            if (*end < 0) {
              const double last = *std::max_element(there->begin(), there->end());
              if (op.kind == OpKind::AllToAll) {
                *end = last + op.seconds;
              } else {
                const i64 bytes = sched::allreduce_bytes(all, cost.model(), s.layers, TpShard{0, s.par.tp});
                *end = last + cost.allreduce_s(bytes, all.group, all.payload == Payload::WeightGrads);
              }
            }
            const double start = std::max(rs.t_compute, rs.t_net);
            record(r, Lane::Network, rs.pc, start, *end);
            rs.t_compute = rs.t_net = std::max(start, *end);
            if (op.kind == OpKind::AllToAll) res.sent_bytes[size_t(r)] += op.bytes;
            mem_at(rs, start, rs.t_compute);
            rs.posted = false;
            ++passed[size_t(r)][size_t(g)];
            break;
          }
        }
        ++rs.pc;
        progress = true;
      }
      continue;
    waiting:
      rs.waiting_since = inbox[size_t(r)].arrived();
    blocked:
      // The rank runs on from here when it is next visited, after every other rank's turn:
      // ask for the ops it will read then now (with many ranks they would each miss).
      for (size_t k = rs.pc + 1; k < std::min(ops.size(), rs.pc + 5); k += 2) {
        __builtin_prefetch(&sim_ops[k]);
        __builtin_prefetch(&rs.mem_span[k], 1);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    SPPO_CHECK(st[r].pc == s.ops[r].size(), "sim")
        << "rank " << r << " is blocked forever at op " << st[r].pc << " '" << to_string(s.ops[r][st[r].pc])
        << "': the schedule deadlocks (run the validator)";

  double step = 0;
  for (const auto& rs : st) step = std::max({step, rs.t_compute, rs.t_out, rs.t_in, rs.t_net});
  res.step_time_s = step;
  double bubble_sum = 0;
  int busy_ranks = 0;
  for (RankState& rs : st) {
    res.exposed_copy_s = std::max(res.exposed_copy_s, rs.exposed);
    res.compute_s = std::max(res.compute_s, rs.busy);
    if (rs.busy > 0) {
      bubble_sum += (step - rs.busy) / rs.busy;
      ++busy_ranks;
    }
    pass.mem_span.push_back(std::move(rs.mem_span));
  }
  res.bubble_ratio = busy_ranks ? bubble_sum / busy_ranks : 0;
  if (step > 0) res.tokens_per_device_per_s = double(s.seq_len()) * s.par.dp / (double(R) * step);
  return pass;
}

// Every rank's memory over the step, from its events at the times of the pass: the peak,
// its terms and moment, and with `record` the timeline.
void account_memory(const Schedule& s, const std::vector<RankEvents>& mem, const SimOptions& options, Pass* pass) {
  const int R = s.ranks();
  SimResult& res = pass->res;
  res.peak_bytes.assign(R, 0);
  res.fixed_bytes.assign(R, 0);
  res.peak_terms.assign(R, {});
  res.host_at_peak.assign(R, 0);
  res.peak_time_s.assign(R, 0);
  if (options.record) res.memory.resize(R);
  // The events of each lane's ops come in time order (each lane runs its ops one after
  // another, and an op's events in order inside it), so the lanes are merged rather than
  // all points sorted; a lane found out of order is sorted first.
  auto before = [](const MemPoint& a, const MemPoint& b) { return a.t < b.t || (a.t == b.t && a.seq < b.seq); };
  auto lane_of = [](OpKind kind) {
    return kind == OpKind::Offload ? 1 : kind == OpKind::Prefetch ? 2 : kind == OpKind::Send ? 3 : 0;
  };
  const std::size_t subseqs = s.lengths.size();  // more where an op names a later one
  for_each_rank(R, [&](int r) {
    // Kept between calls on each thread: the planner accounts thousands of schedules.
    thread_local std::array<std::vector<MemPoint>, 4> lanes;
    thread_local std::vector<i64> coming_back;
    const auto& mem_span = pass->mem_span[size_t(r)];
    const RankEvents& re = mem[r];
    // The memory events at their times; a copy's host bytes are held from the offload's
    // start to the end of the wait for its prefetch (Note [Host copies leave at the wait]).
    for (auto& lane : lanes) lane.clear();
    coming_back.assign(subseqs, 0);
    i64 seq = 0;
    for (size_t k = 0; k < s.ops[r].size(); ++k) {
      const auto [start, end] = mem_span[k];
      const OpKind kind = s.ops[r][k].kind;
      auto& lane = lanes[size_t(lane_of(kind))];
      for (size_t e = re.first[k]; e < re.first[k + 1]; ++e)
        lane.push_back({start + re.ev[e].at * (end - start), seq++, re.ev[e].delta, int(re.ev[e].term)});
      const i64 bytes = re.ops[k].bytes;
      const int subseq = s.ops[r][k].subseq;
      if ((kind == OpKind::Prefetch || kind == OpKind::WaitPrefetch) && size_t(subseq) >= coming_back.size())
        coming_back.resize(size_t(subseq) + 1, 0);
      if (kind == OpKind::Offload && bytes > 0) lane.push_back({start, seq++, bytes, -1});
      if (kind == OpKind::Prefetch) coming_back[size_t(subseq)] += bytes;
      if (kind == OpKind::WaitPrefetch && coming_back[size_t(subseq)] > 0) {
        lane.push_back({end, seq++, -coming_back[size_t(subseq)], -1});
        coming_back[size_t(subseq)] = 0;
      }
    }
    for (auto& lane : lanes)
      if (!std::is_sorted(lane.begin(), lane.end(), before)) std::sort(lane.begin(), lane.end(), before);
    i64 cur = re.fixed, peak = cur, host = re.host_fixed;
    std::array<i64, sched::kMemTerms> terms = re.fixed_terms;
    res.fixed_bytes[r] = cur;
    res.peak_terms[r] = terms;
    res.host_at_peak[r] = host;
    if (options.record) res.memory[r].push_back({0.0, cur});
    // The lanes merged as they are read: each step takes the earliest of their next points.
    std::array<std::size_t, 4> at{};
    for (;;) {
      int next = -1;
      for (int l = 0; l < 4; ++l)
        if (at[size_t(l)] < lanes[size_t(l)].size() &&
            (next < 0 || before(lanes[size_t(l)][at[size_t(l)]], lanes[size_t(next)][at[size_t(next)]])))
          next = l;
      if (next < 0) break;
      const MemPoint& p = lanes[size_t(next)][at[size_t(next)]++];
      if (p.term < 0) {
        host += p.delta;
        continue;
      }
      cur += p.delta;
      terms[std::size_t(p.term)] += p.delta;
      if (cur > peak) {
        peak = cur;
        res.peak_terms[r] = terms;
        res.host_at_peak[r] = host;
        res.peak_time_s[r] = p.t;
      }
      if (options.record) res.memory[r].push_back({p.t, cur});
    }
    res.peak_bytes[r] = peak;
  });
  res.peak_host_per_rank.assign(size_t(R), 0);
  for (int r = 0; r < R; ++r) {
    res.peak_host_per_rank[size_t(r)] = mem[size_t(r)].peak_host;
    res.peak_host_bytes = std::max(res.peak_host_bytes, mem[size_t(r)].peak_host);
    if (res.peak_bytes[size_t(r)] > res.peak_device_bytes) {
      res.peak_device_bytes = res.peak_bytes[size_t(r)];
      res.peak_rank = r;
    }
  }
}

// Note [Shared host links]: the replay. Links of one node are numbered: the uplink of each
// PCIe switch in each direction, the host memory of each NUMA node (both directions), and
// each NIC in each direction. Between consecutive starts and ends of flows, rates are the
// max-min fair allocation (progressive filling: raise every unfrozen flow's rate together
// until a link is full or a flow reaches its own rate; freeze those; repeat).
Scales contended_scales(const std::vector<std::pair<std::pair<int, size_t>, Flow>>& flows, const Schedule& s,
                        const HardwareProfile& hw, int replicas) {
  const int per_node = std::max(1, hw.devices_per_node);
  std::map<std::tuple<int, int, int>, int> link_id;  // (kind, index, dir) -> id
  std::vector<double> capacity;
  auto link = [&](int kind, int index, int dir, double cap) {
    auto [it, fresh] = link_id.emplace(std::make_tuple(kind, index, dir), int(capacity.size()));
    if (fresh) capacity.push_back(cap);
    return it->second;
  };
  struct F {
    double start = 0, left = 0, rate_cap = 0, end = 0, rate = 0;
    std::vector<int> links;
    bool done = false, active = false;
  };
  std::vector<F> fs;
  fs.reserve(flows.size());
  auto add = [&](const Flow& f, int rank, int peer) {
    F x;
    x.start = f.start;
    x.left = f.bytes;
    x.rate_cap = f.rate;
    auto local = [&](int r, int per) { return (r / per_node) * 4096 + (r % per_node) / per; };
    if (f.dir == Dir::Net) {
      x.links.push_back(link(2, local(rank, hw.gpus_per_nic), 0, hw.nic_bw));
      x.links.push_back(link(2, local(peer, hw.gpus_per_nic), 1, hw.nic_bw));
    } else {
      const int dir = f.dir == Dir::D2H ? 0 : 1;
      if (hw.gpus_per_pcie_switch > 1 && hw.pcie_switch_bw > 0)
        x.links.push_back(link(0, local(rank, hw.gpus_per_pcie_switch), dir, hw.pcie_switch_bw));
      if (hw.gpus_per_numa_node > 1 && hw.numa_host_bw > 0)
        x.links.push_back(link(1, local(rank, hw.gpus_per_numa_node), 0, hw.numa_host_bw));
    }
    fs.push_back(std::move(x));
  };
  // Every transfer replayed, by its flow, rank and peer: the flows' own first.
  std::vector<std::tuple<const Flow*, int, int>> replayed;
  const auto replay = [&](const Flow& f, int rank, int peer) {
    add(f, rank, peer);
    replayed.emplace_back(&f, rank, peer);
  };
  for (const auto& [key, f] : flows) replay(f, f.rank, f.peer);
  // Note [One Ulysses member in the search] (schedule/builders.cpp): where a Ulysses
  // group's members past the first have no ops, they still run, and their copies and
  // messages are the first's on as many rows or one fewer, issued as the first's are (the
  // group's all-to-alls hold its members together). A group's members sit side by side
  // (Note [Rank layout] in core/parallel.h), on the first's PCIe switch, NUMA node and
  // NIC: each of the first's transfers is replayed once more for every such member (a
  // message to the same member of the peer's group), which takes its share of those links;
  // only the first's are scaled. Replayed alone, the first's copies would run at their own
  // link's rate where the whole step's share it, its offloads would free their bytes
  // early, and the search would see a lower peak than the whole step has.
  if (s.par.ulysses > 1) {
    std::vector<std::vector<int>> stand_in(size_t(s.ranks()));  // by first member: the members without ops
    for (int r = 0; r < s.ranks(); ++r)
      if (s.ulysses_shard(r).index == 0 && !s.ops[size_t(r)].empty())
        for (int m : s.par.ulysses_group(r))
          if (m != r && s.ops[size_t(m)].empty()) stand_in[size_t(r)].push_back(m);
    for (const auto& [key, f] : flows)
      for (int m : stand_in[size_t(f.rank)])
        replay(f, m, f.dir == Dir::Net ? s.par.ulysses_group(f.peer)[size_t(s.ulysses_shard(m).index)] : m);
  }
  // The same for the data-parallel replicas the schedule stands for (the planner's search
  // simulates one of `replicas`: CostModel::price_replicas): replica k's ranks follow the
  // first's, k x its ranks on (Note [Rank layout]), and run its transfers at the same
  // times. Those on a node the first replica uses share its links; the others' slow
  // nothing that is scaled, and are left out.
  const int rr = s.ranks();
  if (replicas > s.par.dp && rr > 0) {
    const int last_node = (rr - 1) / per_node;
    const std::size_t first_replica = replayed.size();
    for (int k = 1; k < replicas / std::max(1, s.par.dp); ++k) {
      if ((k * rr) / per_node > last_node) break;  // replicas only further on
      for (std::size_t i = 0; i < first_replica; ++i) {
        const auto [f, rank, peer] = replayed[i];
        const int r2 = rank + k * rr, p2 = peer + k * rr;
        if (r2 / per_node <= last_node || (f->dir == Dir::Net && p2 / per_node <= last_node)) add(*f, r2, p2);
      }
    }
  }
  // Flows that share no link, directly or through others, do not slow each other down, so
  // each group of flows linked so (a NUMA node's copies, say) is replayed alone: the same
  // allocation, with as many events as the group has rather than the cluster.
  std::vector<int> root(capacity.size());
  for (size_t l = 0; l < root.size(); ++l) root[l] = int(l);
  auto find = [&](int l) {
    while (root[std::size_t(l)] != l) l = root[std::size_t(l)] = root[std::size_t(root[std::size_t(l)])];
    return l;
  };
  for (const F& f : fs)
    for (size_t j = 1; j < f.links.size(); ++j) root[std::size_t(find(f.links[j]))] = find(f.links[0]);
  std::vector<i64> group(fs.size());
  for (size_t k = 0; k < fs.size(); ++k)
    group[k] = fs[k].links.empty() ? i64(capacity.size() + k) : i64(find(fs[k].links[0]));
  std::vector<size_t> order(fs.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return group[a] < group[b] || (group[a] == group[b] && fs[a].start < fs[b].start);
  });
  std::vector<size_t> active, still;
  std::vector<double> used(capacity.size());
  std::vector<int> unfrozen_on(capacity.size());
  std::vector<char> full(capacity.size()), on_list(capacity.size(), 0);
  std::vector<int> links_now;
  for (size_t first = 0, last = 0; first < order.size(); first = last) {
  while (last < order.size() && group[order[last]] == group[order[first]]) ++last;
  // A group of stand-ins alone (another switch's or NUMA node's members) slows no
  // transfer that is scaled.
  if (std::none_of(order.begin() + std::ptrdiff_t(first), order.begin() + std::ptrdiff_t(last),
                   [&](size_t k) { return k < flows.size(); }))
    continue;
  size_t next = first;
  double t = fs[order[first]].start;
  while (next < last || !active.empty()) {
    while (next < last && fs[order[next]].start <= t) {
      fs[order[next]].active = true;
      active.push_back(order[next++]);
    }
    if (active.empty()) {
      t = fs[order[next]].start;
      continue;
    }
    // Progressive filling, over the links the active flows cross (the others carry none).
    links_now.clear();
    for (size_t k : active)
      for (int l : fs[k].links)
        if (!on_list[std::size_t(l)]) {
          on_list[std::size_t(l)] = 1;
          links_now.push_back(l);
        }
    for (int l : links_now) {
      on_list[std::size_t(l)] = 0;
      used[std::size_t(l)] = 0;
    }
    for (size_t k : active) fs[k].rate = -1;  // unfrozen
    for (;;) {
      for (int l : links_now) unfrozen_on[std::size_t(l)] = 0;
      bool any = false;
      for (size_t k : active)
        if (fs[k].rate < 0) {
          any = true;
          for (int l : fs[k].links) ++unfrozen_on[std::size_t(l)];
        }
      if (!any) break;
      double level = 1e300;
      for (int l : links_now)
        if (unfrozen_on[std::size_t(l)] > 0)
          level = std::min(level, (capacity[std::size_t(l)] - used[std::size_t(l)]) / unfrozen_on[std::size_t(l)]);
      for (size_t k : active)
        if (fs[k].rate < 0) level = std::min(level, fs[k].rate_cap);
      level = std::max(level, 0.0);
      // Freeze the flows at their own cap and those on links that are now full.
      for (int l : links_now) {
        const std::size_t j = std::size_t(l);
        full[j] = unfrozen_on[j] > 0 && capacity[j] - used[j] - level * unfrozen_on[j] <= 1e-9 * capacity[j];
      }
      for (size_t k : active) {
        if (fs[k].rate >= 0) continue;
        bool freeze = fs[k].rate_cap <= level * (1 + 1e-12);
        for (int l : fs[k].links) freeze |= full[std::size_t(l)];
        if (freeze) {
          fs[k].rate = level;
          for (int l : fs[k].links) used[std::size_t(l)] += level;
        }
      }
    }
    // Advance to the next start or the next completion.
    double dt = next < last ? fs[order[next]].start - t : 1e300;
    for (size_t k : active)
      if (fs[k].rate > 0) dt = std::min(dt, fs[k].left / fs[k].rate);
    SPPO_ASSERT(dt < 1e299);
    t += dt;
    still.clear();
    for (size_t k : active) {
      fs[k].left -= fs[k].rate * dt;
      if (fs[k].left <= 1e-6 * (1 + fs[k].rate_cap * 1e-9)) {
        fs[k].done = true;
        fs[k].end = t;
      } else {
        still.push_back(k);
      }
    }
    std::swap(active, still);
  }
  }
  Scales out(size_t(s.ranks()));
  for (size_t k = 0; k < flows.size(); ++k) {  // the stand-ins' after them are not scaled
    const auto [rank, pc] = flows[k].first;
    const Flow& f = flows[k].second;
    const double alone = f.bytes / f.rate;
    auto& of = out[size_t(rank)];
    if (of.empty()) of.assign(s.ops[size_t(rank)].size(), 0.0);
    of[pc] = alone > 0 ? std::max(1.0, (fs[k].end - f.start) / alone) : 1.0;
  }
  return out;
}

std::vector<RankEvents> prepare(const Schedule& s, const CostModel& cost, const sched::MemoryRules& rules) {
  SPPO_CHECK(int(s.ops.size()) == s.ranks(), "sim") << "schedule has " << s.ops.size()
                                                  << " op lists for " << s.ranks() << " ranks";
  const sched::UnitSizes sizes(rules, s);
  std::vector<RankEvents> mem(size_t(s.ranks()));
  for_each_rank(s.ranks(), [&](int r) { mem[size_t(r)] = rank_events(rules, cost, s, r, sizes); });
  return mem;
}

SimResult run(const Schedule& s, const CostModel& cost, const std::vector<RankEvents>& mem,
              const SimOptions& options) {
  const bool shared = cost.hw().shares_links();
  Scales scales;
  Pass pass = simulate_once(s, cost, mem, options, scales, shared);
  const double alone_copy_s = pass.copy_s;
  int passes = 1;
  while (shared && !pass.flows.empty() && passes < kContentionPasses) {
    Scales next = contended_scales(pass.flows, s, cost.hw(), cost.replicas());
    // Later passes average with the previous scales, so that two transfers pushing each
    // other in and out of overlap settle between the two.
    if (passes > 1)
      for (const auto& [key, f] : pass.flows) {
        const auto [r, pc] = key;
        const double before = scales[size_t(r)].empty() ? 0.0 : scales[size_t(r)][pc];
        if (before > 0) next[size_t(r)][pc] = (next[size_t(r)][pc] + before) / 2;
      }
    const double before = pass.res.step_time_s;
    scales = std::move(next);
    pass = simulate_once(s, cost, mem, options, scales, true);
    ++passes;
    if (std::fabs(pass.res.step_time_s - before) <= 1e-3 * before) break;
  }
  account_memory(s, mem, options, &pass);
  // Note [Pricing the host's update]: the step ends with the optimizer's update. With the
  // state on the device it is not priced (a few elementwise passes over the weights, as
  // with every system the planner compares). With the state on the host each rank's
  // gradients go down, the host's processor updates the state and the weights come back
  // up (CostModel::host_update_s); the step is as long as the slowest rank's. Priced in
  // series, after the schedule: neither the buckets' pipelining nor the next step's first
  // layers starting beside the update (runtime/host_optimizer.h) are credited, so this is
  // an upper bound.
  for (const RankEvents& re : mem)
    pass.res.host_update_s = std::max(pass.res.host_update_s, cost.host_update_s(re.host_state, re.host_moved));
  if (pass.res.host_update_s > 0) {
    pass.res.step_time_s += pass.res.host_update_s;
    pass.res.tokens_per_device_per_s = double(s.seq_len()) * s.par.dp / (double(s.ranks()) * pass.res.step_time_s);
  }
  pass.res.passes = passes;
  for (int r = 0; r < s.ranks(); ++r) pass.res.collective_bytes.push_back(sched::collective_bytes(s, r, cost.model()));
  pass.res.copy_slowdown = alone_copy_s > 0 && passes > 1 ? pass.copy_s / alone_copy_s : 1.0;
  return std::move(pass.res);
}

}  // namespace

SimResult simulate(const Schedule& s, const CostModel& cost, const sched::MemoryRules& rules,
                   const SimOptions& options) {
  return run(s, cost, prepare(s, cost, rules), options);
}

namespace {

bool copy_or_wait(OpKind k) {
  return k == OpKind::Offload || k == OpKind::Prefetch || k == OpKind::WaitOffload || k == OpKind::WaitPrefetch;
}

// Note [Another set of offloaded subsequences]: a builder gives a layout's schedules for
// every alpha the same ops but the copies and their waits (sched::set_offload_fractions),
// and no op's memory events depend on the copies but the copies' own (one event each, an
// offload's release at its end, a prefetch's allocation at its start: RankMemory). So the
// events of a schedule that offloads other subsequences are the old ones, op for op, with
// the copies' put in where its copies are. False when the other ops differ (the caller
// then works the events out afresh).
bool rebase(const RankEvents& old, const std::vector<Op>& old_ops, const std::vector<Op>& ops, RankEvents* out) {
  out->ev.clear();  // `out` may be an earlier schedule's, kept for its vectors' capacity
  out->first.clear();
  out->ops.clear();
  out->kv_host.clear();
  out->fixed = old.fixed;
  out->fixed_terms = old.fixed_terms;
  out->host_fixed = old.host_fixed;
  out->host_state = old.host_state;
  out->host_moved = old.host_moved;
  out->uses = old.uses;
  out->layer_in = old.layer_in;
  out->layer_g = old.layer_g;
  out->gather_group = old.gather_group;
  out->unit_tensors = old.unit_tensors;
  out->unit_layers = old.unit_layers;
  out->streams = old.streams;
  out->ops.reserve(ops.size());
  for (const Op& op : ops) out->ops.push_back(sim_op(op));
  out->first.reserve(ops.size() + 1);
  out->ev.reserve(old.ev.size() + ops.size() - std::min(ops.size(), old_ops.size()));
  size_t j = 0;
  auto kv = old.kv_host.begin();
  for (size_t k = 0; k < ops.size(); ++k) {
    out->first.push_back(out->ev.size());
    const Op& op = ops[k];
    if (op.kind == OpKind::Offload) out->ev.push_back({1.0, 0, sched::MemTerm::Units});
    if (op.kind == OpKind::Prefetch) out->ev.push_back({0.0, 0, sched::MemTerm::Units});
    if (copy_or_wait(op.kind)) continue;
    while (j < old_ops.size() && copy_or_wait(old_ops[j].kind)) ++j;
    if (j == old_ops.size() || !(old_ops[j] == op)) return false;
    out->ev.insert(out->ev.end(), old.ev.begin() + std::ptrdiff_t(old.first[j]),
                   old.ev.begin() + std::ptrdiff_t(old.first[j + 1]));
    out->ops[k].seconds = old.ops[j].seconds;
    out->ops[k].stream = old.ops[j].stream;
    out->ops[k].use = old.ops[j].use;
    out->ops[k].bytes = old.ops[j].bytes;
    if (kv != old.kv_host.end() && kv->op == j) out->kv_host.push_back({k, kv->delta, (kv++)->rise});
    ++j;
  }
  while (j < old_ops.size() && copy_or_wait(old_ops[j].kind)) ++j;
  if (j != old_ops.size()) return false;
  out->first.push_back(out->ev.size());
  refit_copies(out, ops);
  return true;
}

}  // namespace

// Note [A floor under the peak]: the least peak device bytes any timing of a schedule can
// reach, without timing it. The compute lane's events keep their program order under any
// timing; an offload or a send releases its bytes no earlier than it is issued; a prefetch
// allocates its bytes no later than the wait for it ends; a receive is posted no later
// than its own place in the program. So a walk of the ops in program order that releases
// at the issue, allocates a prefetch at its wait and drops any other allocation of a copy
// or send holds at each compute event no more than the timed walk does then, and its peak
// is a floor under the simulated one. The same layout at smaller fractions keeps more of
// each unit on the device between its offload and its wait, so the floor at the largest
// fractions is a floor for every alpha (solve_alpha's first test).
i64 peak_floor(const RankEvents& re, const std::vector<Op>& ops) {
  i64 cur = re.fixed, peak = cur;
  std::map<int, i64> coming;  // subsequence -> bytes its prefetch brings back at the wait
  std::vector<sched::MemEvent> op_ev;
  for (size_t k = 0; k < ops.size(); ++k) {
    const OpKind kind = ops[k].kind;
    op_ev.assign(re.ev.begin() + std::ptrdiff_t(re.first[k]), re.ev.begin() + std::ptrdiff_t(re.first[k + 1]));
    std::stable_sort(op_ev.begin(), op_ev.end(), [](const auto& a, const auto& b) { return a.at < b.at; });
    const bool copy = kind == OpKind::Offload || kind == OpKind::Prefetch || kind == OpKind::Send;
    if (kind == OpKind::WaitPrefetch) {
      cur += coming[ops[k].subseq];
      coming[ops[k].subseq] = 0;
      peak = std::max(peak, cur);
    }
    for (const auto& e : op_ev) {
      if (copy && e.delta > 0) {
        if (kind == OpKind::Prefetch) coming[ops[k].subseq] += e.delta;
        continue;
      }
      cur += e.delta;
      peak = std::max(peak, cur);
    }
  }
  return peak;
}

struct Resimulator::State {
  Schedule schedule;
  CostModel cost;
  sched::MemoryRules rules;
  std::vector<RankEvents> mem;
  // The schedule before: rebase writes into it, so that a search's many schedules of one
  // layout reuse its memory rather than fault in fresh pages for each (Resimulator::replace).
  std::vector<RankEvents> spare;
};

Resimulator::Resimulator(Schedule s, const CostModel& cost, const sched::MemoryRules& rules)
    : st_(std::make_unique<State>(State{std::move(s), cost, rules, {}, {}})) {
  st_->mem = prepare(st_->schedule, st_->cost, st_->rules);
}

bool Resimulator::replace(Schedule s) {
  State& st = *st_;
  std::vector<RankEvents>& mem = st.spare;
  mem.resize(st.mem.size());
  bool same = s.par == st.schedule.par && s.lengths == st.schedule.lengths && s.place == st.schedule.place;
  if (same) {
    std::vector<char> ok(size_t(s.ranks()), 0);
    for_each_rank(s.ranks(), [&](int r) {
      ok[size_t(r)] = rebase(st.mem[size_t(r)], st.schedule.ops[size_t(r)], s.ops[size_t(r)], &mem[size_t(r)]);
    });
    same = std::all_of(ok.begin(), ok.end(), [](char c) { return c != 0; });
  }
  st.schedule = std::move(s);
  if (same) std::swap(st.mem, st.spare);
  else st.spare = std::exchange(st.mem, prepare(st.schedule, st.cost, st.rules));
  return same;
}

Resimulator::~Resimulator() = default;
Resimulator::Resimulator(Resimulator&&) noexcept = default;
Resimulator& Resimulator::operator=(Resimulator&&) noexcept = default;

const Schedule& Resimulator::schedule() const { return st_->schedule; }

void Resimulator::set_fractions(const std::vector<double>& alpha) {
  sched::set_offload_fractions(&st_->schedule, alpha);
  for_each_rank(st_->schedule.ranks(),
                [&](int r) { refit_copies(&st_->mem[size_t(r)], st_->schedule.ops[size_t(r)]); });
}

i64 Resimulator::peak_floor() const {
  i64 most = 0;
  for (int r = 0; r < st_->schedule.ranks(); ++r)
    most = std::max(most, sim::peak_floor(st_->mem[size_t(r)], st_->schedule.ops[size_t(r)]));
  return most;
}

SimResult Resimulator::simulate(const SimOptions& options) const {
  return run(st_->schedule, st_->cost, st_->mem, options);
}

}  // namespace sppo::sim
