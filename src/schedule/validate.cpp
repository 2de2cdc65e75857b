#include "schedule/validate.h"

#include <deque>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "schedule/weights.h"

namespace sppo::sched {

std::string Validation::message() const {
  std::string m;
  for (const auto& e : errors) m += (m.empty() ? "" : "\n") + e;
  return m;
}

namespace {

constexpr size_t kMaxErrors = 20;

struct Errors {
  std::vector<std::string>* out;
  void add(int rank, size_t index, const Op& op, const std::string& what) {
    if (out->size() >= kMaxErrors) return;
    std::ostringstream os;
    os << "rank " << rank << " op " << index << " '" << to_string(op) << "': " << what;
    out->push_back(os.str());
  }
};

using Compute = std::tuple<int, int, int, int>;  // layer, subseq, piece, pieces

Compute key(const Op& op, int l) { return {l, op.subseq, op.piece, op.pieces}; }

// Per-rank order checks: forward/backward pairing per layer and the offload state machine.
void check_order(const Schedule& s, int r, Errors& err) {
  std::set<Compute> forwarded, backwarded;
  std::set<int> fwd_subseq;
  // Offload state of a subsequence: 0 none, 1 offloading, 2 offloaded, 3 prefetching, 4 back.
  // A layer-major backward prefetches a layer at a time: the subsequence stays at 2 and
  // each of its layers goes 3, then 4 (layer_state).
  std::map<int, int> state;
  std::map<std::pair<int, int>, int> layer_state;  // (subseq, layer)
  // Offloads move units of the rank's own layers; pieces of other stages are not offloaded.
  const std::pair<int, int> own = s.owned.empty() ? std::make_pair(0, s.layers) : s.owned[r];
  const auto& ops = s.ops[r];
  auto layered = [](const Op& op) { return op.layer_end > op.layer_begin; };
  // Unit (i, l) is on the device for a backward.
  auto back = [&](int i, int l) {
    const int st = state[i];
    if (st == 0 || st == 4) return true;
    return st == 2 && layer_state[{i, l}] == 4;
  };
  for (size_t k = 0; k < ops.size(); ++k) {
    const Op& op = ops[k];
    const int N = int(s.lengths.size());
    if (op.subseq < 0 || op.subseq >= N) {
      err.add(r, k, op, "subsequence out of range");
      continue;
    }
    if (op.pieces < 1 || op.piece < 0 || op.piece >= op.pieces) err.add(r, k, op, "bad piece index");
    switch (op.kind) {
      case OpKind::Forward:
        if (op.layer_begin < 0 || op.layer_end > s.layers || op.layer_begin >= op.layer_end)
          err.add(r, k, op, "bad layer range");
        for (int l = op.layer_begin; l < op.layer_end; ++l)
          if (!forwarded.insert(key(op, l)).second) {
            err.add(r, k, op, "forward repeated");
            break;
          }
        fwd_subseq.insert(op.subseq);
        break;
      case OpKind::Backward: {
        bool own_op = op.layer_begin >= own.first && op.layer_end <= own.second;
        for (int l = op.layer_begin; l < op.layer_end; ++l) {
          if (!forwarded.count(key(op, l))) {
            err.add(r, k, op, "backward before its forward");
            break;
          }
          if (!backwarded.insert(key(op, l)).second) {
            err.add(r, k, op, "backward repeated");
            break;
          }
          // The layers above this one are done for the subsequence (the residual
          // gradient runs from the last layer down).
          if (l + 1 < op.layer_end) continue;
          if (l + 1 < own.second && own_op && !backwarded.count(key(op, l + 1))) {
            err.add(r, k, op, "backward of a layer before the layer above it");
            break;
          }
        }
        if (own_op)
          for (int l = op.layer_begin; l < op.layer_end; ++l)
            if (!back(op.subseq, l)) {
              err.add(r, k, op, "backward while its unit is not back on the device");
              break;
            }
        break;
      }
      case OpKind::Offload:
        if (!fwd_subseq.count(op.subseq)) err.add(r, k, op, "offload before the forward");
        if (state[op.subseq] != 0) err.add(r, k, op, "offload repeated");
        if (!(op.fraction > 0 && op.fraction <= 1)) err.add(r, k, op, "fraction outside (0, 1]");
        state[op.subseq] = 1;
        break;
      case OpKind::WaitOffload:
        if (state[op.subseq] != 1) err.add(r, k, op, "wait without a running offload");
        else state[op.subseq] = 2;
        break;
      case OpKind::Prefetch:
        if (state[op.subseq] != 2) {
          err.add(r, k, op, "prefetch before the offload completed");
        } else if (!layered(op)) {
          state[op.subseq] = 3;
        } else {
          for (int l = op.layer_begin; l < op.layer_end; ++l)
            if (layer_state[{op.subseq, l}] != 0) err.add(r, k, op, "prefetch of a layer repeated");
            else layer_state[{op.subseq, l}] = 3;
        }
        break;
      case OpKind::WaitPrefetch:
        if (!layered(op)) {
          if (state[op.subseq] != 3) err.add(r, k, op, "wait without a running prefetch");
          else state[op.subseq] = 4;
        } else {
          for (int l = op.layer_begin; l < op.layer_end; ++l)
            if (layer_state[{op.subseq, l}] != 3) err.add(r, k, op, "wait without a running prefetch");
            else layer_state[{op.subseq, l}] = 4;
        }
        break;
      case OpKind::Send:
      case OpKind::Recv:
      case OpKind::RingStep:
        if (op.peer < 0 || op.peer >= s.ranks() || op.peer == r) err.add(r, k, op, "bad peer");
        if (op.kind == OpKind::RingStep && (op.recv_peer < 0 || op.recv_peer >= s.ranks()))
          err.add(r, k, op, "bad ring source");
        break;
      case OpKind::AllReduce:
      case OpKind::ReduceScatter:
        break;
      case OpKind::AllGather:  // checked with their F or B (check_gathers)
        break;
      case OpKind::AllToAll: {
        // Before the F or B it belongs to (Note [Ulysses exchanges] in core/layout.h).
        const bool next_compute = k + 1 < ops.size() && ops[k + 1].kind == (op.payload == Payload::KV ? OpKind::Forward : OpKind::Backward) &&
                                  ops[k + 1].subseq == op.subseq && ops[k + 1].layer_begin == op.layer_begin &&
                                  ops[k + 1].layer_end == op.layer_end;
        if (!next_compute) err.add(r, k, op, "an all-to-all not followed by its forward or backward");
        break;
      }
    }
  }
  for (const auto& f : forwarded)
    if (!s.forward_only && !backwarded.count(f)) {
      Op op;
      std::tie(op.layer_begin, op.subseq, op.piece, op.pieces) = f;
      op.layer_end = op.layer_begin + 1;
      err.add(r, ops.size(), op, "forward without a backward");
    }
  for (const auto& [i, st] : state) {
    bool done = st == 0 || st == 4;
    if (st == 2) {  // every own layer prefetched a layer at a time and waited for
      done = true;
      for (int l = own.first; l < own.second; ++l) done = done && layer_state[{i, l}] == 4;
    }
    if (!done) {
      Op op;
      op.kind = OpKind::Offload;
      op.subseq = i;
      err.add(r, ops.size(), op, "offload never prefetched back and waited for");
    }
  }
}

// Note [ZeRO-3 gathers] (schedule/weights.h): the AllGather ops before each F or B are the
// layers its uses gather, in their order, over the rank's layer group (before its
// all-to-all, under Ulysses); there are none elsewhere.
void check_gathers(const Schedule& s, int r, Errors& err) {
  const auto& ops = s.ops[size_t(r)];
  const bool gathers = shards_weights(s.par.zero) && !s.place.weights_host();
  const LayerUses uses = gathers ? LayerUses(s, r) : LayerUses();
  std::vector<size_t> pending;  // the gathers since the last F or B
  for (size_t k = 0; k < ops.size(); ++k) {
    const Op& op = ops[k];
    if (op.kind == OpKind::AllGather) {
      if (!gathers) err.add(r, k, op, "a gather of weights the step does not shard (ZeRO-3 gathers them)");
      else if (op.group != s.par.layer_group(r)) err.add(r, k, op, "a gather over another group than the layer group");
      pending.push_back(k);
      continue;
    }
    const bool compute = op.kind == OpKind::Forward || op.kind == OpKind::Backward;
    if (op.kind == OpKind::AllToAll) continue;  // the op's own, between its gathers and it
    if (!compute) {
      for (size_t g : pending) err.add(r, g, ops[g], "a gather not followed by its forward or backward");
      pending.clear();
      continue;
    }
    const std::vector<int> want = gathers ? gathered_layers(uses, k) : std::vector<int>{};
    std::vector<int> got;
    for (size_t g : pending) got.push_back(ops[g].layer_begin);
    if (got != want) {
      std::string w;
      for (int l : want) w += (w.empty() ? "L" : ", L") + std::to_string(l);
      err.add(r, k, op, "gathers " + std::to_string(got.size()) + " layers before it, where its uses gather " +
                            (w.empty() ? "none" : w));
    }
    pending.clear();
  }
  for (size_t g : pending) err.add(r, g, ops[g], "a gather not followed by its forward or backward");
}

// Removes the first message equal to `key`; false when none has been sent yet.
bool take(std::deque<MessageKey>& q, const MessageKey& key) {
  for (auto it = q.begin(); it != q.end(); ++it)
    if (*it == key) {
      q.erase(it);
      return true;
    }
  return false;
}

// Executes the communication: sends are buffered, receives and ring steps wait for their
// message, all-reduces and all-to-alls wait for their whole group. No progress with ops left = deadlock.
void check_matching(const Schedule& s, Errors& err) {
  const int R = s.ranks();
  std::vector<size_t> pc(R, 0);
  std::map<std::pair<int, int>, std::deque<MessageKey>> channel;  // (src, dst)
  // (group, how many all-reduces of that group a rank passed before) -> ranks arrived
  std::map<std::pair<std::vector<int>, int>, std::set<int>> arrived;
  std::map<std::pair<std::vector<int>, int>, const Op*> met;  // the first member's op there
  std::vector<std::map<std::vector<int>, int>> passed(R);
  std::vector<bool> ring_posted(R, false);  // the send half of the current ring step is out
  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < R; ++r) {
      const auto& ops = s.ops[r];
      while (pc[r] < ops.size()) {
        const Op& op = ops[pc[r]];
        if (op.kind == OpKind::Send) {
          channel[{r, op.peer}].push_back(message_key(op));
        } else if (op.kind == OpKind::RingStep) {
          if (!ring_posted[r]) {
            channel[{r, op.peer}].push_back(message_key(op));
            ring_posted[r] = true;
            progress = true;
          }
          if (!take(channel[{op.recv_peer, r}], message_key(op))) break;
          ring_posted[r] = false;
        } else if (op.kind == OpKind::Recv) {
          if (!take(channel[{op.peer, r}], message_key(op))) break;
        } else if (op.kind == OpKind::AllReduce || op.kind == OpKind::ReduceScatter || op.kind == OpKind::AllToAll ||
                   op.kind == OpKind::AllGather) {
          bool member = false;
          for (int g : op.group) member |= g == r;
          if (!member) {
            err.add(r, pc[r], op, std::string(to_string(op.kind)) + " group does not contain its rank");
            return;
          }
          const auto at = std::make_pair(op.group, passed[r][op.group]);
          auto& there = arrived[at];
          // The group's members meet at the same collective: the same kind, layers and piece.
          auto [first, fresh] = met.try_emplace(at, &op);
          const Op& o = *first->second;
          if (!fresh && (o.kind != op.kind || o.payload != op.payload || o.subseq != op.subseq ||
                         o.layer_begin != op.layer_begin || o.layer_end != op.layer_end || o.pieces != op.pieces)) {
            err.add(r, pc[r], op, "meets '" + to_string(o) + "' of another member of its group");
            return;
          }
          there.insert(r);
          if (there.size() < op.group.size()) break;
          ++passed[r][op.group];
        }
        ++pc[r];
        progress = true;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    if (pc[r] < s.ops[r].size()) {
      err.add(r, pc[r], s.ops[r][pc[r]], "blocked forever (deadlock or unmatched communication)");
      return;
    }
  for (const auto& [ch, q] : channel)
    if (!q.empty()) {
      std::ostringstream os;
      os << "message from rank " << ch.first << " to rank " << ch.second << " never received";
      err.out->push_back(os.str());
      return;
    }
}

void check_memory(const Schedule& s, const ValidateOptions& o, Validation& v, Errors& err) {
  v.peak_bytes.assign(s.ranks(), 0);
  for (int r = 0; r < s.ranks(); ++r) {
    RankMemory mem(*o.memory, s, r);
    i64 cur = mem.fixed_bytes(), peak = cur;
    std::map<int, i64> pending;  // offload bytes released at its wait
    std::vector<MemEvent> ev;
    bool over = false;
    const auto& ops = s.ops[r];
    for (size_t k = 0; k < ops.size(); ++k) {
      const Op& op = ops[k];
      ev.clear();
      mem.events(op, &ev);
      if (op.kind == OpKind::Offload) {
        for (const auto& e : ev) pending[op.subseq] += -e.delta;
        continue;
      }
      if (op.kind == OpKind::WaitOffload) {
        cur -= pending[op.subseq];
        pending[op.subseq] = 0;
      }
      for (const auto& e : ev) {
        cur += e.delta;
        if (cur > peak) peak = cur;
      }
      if (o.budget > 0 && peak > o.budget && !over) {
        over = true;
        std::ostringstream os;
        os << "device memory " << peak << " B exceeds the budget of " << o.budget << " B";
        err.add(r, k, op, os.str());
      }
    }
    v.peak_bytes[r] = peak;
    if (mem.live_bytes() != 0) {
      std::ostringstream os;
      os << "rank " << r << ": " << mem.live_bytes() << " device bytes of activations left at the end";
      err.out->push_back(os.str());
    }
    if (mem.host_bytes() != mem.host_fixed_bytes()) {
      std::ostringstream os;
      os << "rank " << r << ": " << mem.host_bytes() - mem.host_fixed_bytes() << " host bytes left at the end";
      err.out->push_back(os.str());
    }
  }
}

}  // namespace

Validation validate(const Schedule& s, const ValidateOptions& o) {
  Validation v;
  Errors err{&v.errors};
  if (int(s.ops.size()) != s.ranks()) {
    v.errors.push_back("schedule has " + std::to_string(s.ops.size()) + " op lists for " +
                       std::to_string(s.ranks()) + " ranks");
    return v;
  }
  if (!s.owned.empty() && int(s.owned.size()) != s.ranks()) v.errors.push_back("owned layers not given per rank");
  for (int r = 0; r < s.ranks(); ++r) check_order(s, r, err), check_gathers(s, r, err);
  check_matching(s, err);
  if (const std::string why = rebuilt_inputs_error(s); !why.empty()) v.errors.push_back(why);
  if (o.memory && v.errors.empty()) check_memory(s, o, v, err);
  return v;
}

std::string rebuilt_inputs_error(const Schedule& s) {
  if (!s.place.any_input_rebuilt()) return "";
  const std::string no = "rebuilt layer inputs (--rebuild-inputs): ";
  if (int(s.place.inputs_rebuilt.size()) != s.layers)
    return no + "the list names " + std::to_string(s.place.inputs_rebuilt.size()) + " layers of " + std::to_string(s.layers);
  if (s.place.backward != BackwardOrder::Layer)
    return no + "the layer below runs again inside a layer's backward, which only the layer-major backward "
                "orders so; use --backward-order layer";
  if (s.par.tp > 1 || s.par.cp > 1) return no + "they run without --tp and --cp";
  for (int l = 0; l < s.layers; ++l) {
    if (!s.place.input_rebuilt(l)) continue;
    const std::string at = no + "layer " + std::to_string(l) + ": ";
    if (l == 0) return at + "the first layer's input has no layer below; name layers from 1";
    if (s.place.input_rebuilt(l - 1)) return at + "the layer below (" + std::to_string(l - 1) + ") must keep its input; "
                                              "name every other layer (odd)";
    if (s.place.kv_recomputed(l))
      return at + "its K/V are recomputed from its input of every earlier subsequence, which it does not keep; "
                  "keep its K/V on the device or the host (--kv-cache device|host)";
    if (s.place.kv_at(l - 1) == KvPlace::Host)
      return at + "the layer below streams its K/V from the host, and its forward run again reads them from the "
                  "device or recomputes them; keep them on the device or recompute them (--kv-cache "
                  "device|recompute)";
  }
  for (const auto& ops : s.ops)  // a layout's checks may come before its ops
    for (const Op& op : ops) {
      if (op.kind != OpKind::Forward) continue;
      if (!op.group.empty()) return no + "MSP's pieces run on borrowed weights; use --msp off";
      if (s.place.input_rebuilt(op.layer_begin))
        return no + "layer " + std::to_string(op.layer_begin) + " is the first of a pipeline stage, whose layer "
                    "below runs on another rank; name layers inside the stages";
    }
  return "";
}

}  // namespace sppo::sched
