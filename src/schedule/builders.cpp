#include "schedule/builders.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <tuple>

#include "core/check.h"
#include "schedule/memory.h"
#include "schedule/msp.h"
#include "schedule/weights.h"

namespace sppo::sched {

namespace {

// The ranks the pipeline builder lays out: every dimension but those expand_ulysses and
// expand_tensor_parallel add afterwards (Note [Rank layout] in core/parallel.h numbers them
// innermost).
ParallelDims before_expansion(ParallelDims par) {
  par.tp = 1;
  par.ulysses = 1;
  return par;
}

Op make(OpKind kind, int subseq) {
  Op op;
  op.kind = kind;
  op.subseq = subseq;
  return op;
}

}  // namespace

Schedule build_single(int layers, const std::vector<i64>& lengths, const std::vector<double>& alpha) {
  const int N = int(lengths.size());
  SPPO_CHECK(layers >= 1, "schedule") << "layers must be at least 1 (got " << layers << ")";
  SPPO_CHECK(N >= 1, "schedule") << "at least one subsequence is needed";
  SPPO_CHECK(int(alpha.size()) == N, "schedule")
      << "alpha has " << alpha.size() << " entries but there are " << N << " subsequences";
  for (int i = 0; i < N; ++i) {
    SPPO_CHECK(lengths[i] >= 1, "schedule") << "subsequence " << i << " has length " << lengths[i];
    SPPO_CHECK(alpha[i] >= 0 && alpha[i] <= 1, "schedule")
        << "alpha[" << i << "] = " << alpha[i] << " is outside [0, 1]";
  }
  SPPO_CHECK(alpha.back() == 0, "schedule")
      << "alpha of the last subsequence must be 0 (its backward runs first), got " << alpha.back();

  Schedule s;
  s.layers = layers;
  s.lengths = lengths;
  s.ops.resize(1);
  auto& ops = s.ops[0];
  auto push = [&](OpKind kind, int i, double fraction = 0) {
    Op op = make(kind, i);
    op.fraction = fraction;
    if (kind == OpKind::Forward || kind == OpKind::Backward) {
      op.layer_begin = 0;
      op.layer_end = layers;
    }
    ops.push_back(op);
  };
  for (int i = 0; i < N; ++i) {
    push(OpKind::Forward, i);
    if (i >= 1 && alpha[i - 1] > 0) push(OpKind::WaitOffload, i - 1);
    if (alpha[i] > 0) push(OpKind::Offload, i, alpha[i]);
  }
  for (int i = N - 1; i >= 0; --i) {
    if (i >= 1 && alpha[i - 1] > 0) push(OpKind::Prefetch, i - 1, alpha[i - 1]);
    push(OpKind::Backward, i);
    if (i >= 1 && alpha[i - 1] > 0) push(OpKind::WaitPrefetch, i - 1);
  }
  return s;
}


// ---------------------------------------------------------------------------------------
// The sequence pipeline.
//
// Note [Pipeline as tasks]: a task is the forward or backward of one stage's layers on one
// subsequence, run by one or more pieces (SP ranks of the stage; with MSP, the SP ranks of
// every stage group the subsequence is split over). Tasks are ordered by a global key,
// forward (stage i, subsequence k) in slot i + k, backward in slot (N + P - 1) + (P-1-i) +
// (N-1-k), stage breaking ties; every rank runs its tasks in that order. Every message goes
// from a task to a later one, or inside one task, so the schedule cannot deadlock.
// Messages match by identity (payload, subsequence, piece, layers, tokens), FIFO among
// equal identities, as MPI tags do.
//
// Note [MSP pieces]: a split task runs on the stage's own group and the helper groups
// together, its pieces contiguous, as one ring (runtime/ring.h, queries travel and keys
// stay): the stage's owner holds the keys of every earlier position of the stage's layers,
// each piece its own rows. So:
//  - the stage's weights come from the owner twice, for the helper's forwards of that stage
//    (sent at the start) and again for its backwards (sent when the owner starts its
//    backwards): Left pieces run at both ends of the step, so the copy is not held through
//    the middle, where memory peaks. A helper that runs nothing between its last forward
//    piece of the stage and its first backward one (a Right piece on an idle group, Note
//    [MSP idle groups] in schedule/msp.h) keeps the first copy instead. The weight
//    gradients (and, on the stage with the LM head, the loss of the helper's rows) go back
//    after the helper's last backward of that stage (Send WeightGrads), and the owner
//    receives them at the end of that task;
//  - forward: after it, each helper piece's K, V go to the owner (KV), which from then on
//    holds them for the later subsequences and gathers their dK, dV; the helper keeps its
//    own copy as a saved tensor for its backward;
//  - backward: before it, the owner returns the dK, dV it accumulated for the piece's rows
//    and drops its copy of their K, V (KVGrad); the ring then adds what the piece's own
//    queries and the other pieces' give, and the earlier positions' dK, dV accumulate on
//    the owner, where those keys are.
// Hidden states between a split task and its neighbours move as the overlaps of the
// producer's and the consumer's pieces (`first` says which rows); rows a rank produced
// for itself stay there.
// A helper piece pairs SP rank r of its group with SP rank r of the owner group (and, once
// expand_tensor_parallel makes the members, TP member t with member t).
namespace {

struct Piece {
  int rank;
  Spans spans;  // token ranges inside the subsequence (one unless a zigzag ring piece)
  int piece, pieces;
  bool helper;  // runs on a group other than the stage's own
};

struct Task {
  bool forward;
  int stage, subseq, d;
  int slot;
  std::vector<Piece> pieces;
};

}  // namespace

std::vector<std::pair<int, int>> stage_ranges(int layers, int pp, const std::vector<int>& stage_layers) {
  SPPO_CHECK(pp >= 1 && pp <= layers, "schedule")
      << "pipeline stages " << pp << " must be in [1, layers = " << layers << "]";
  std::vector<int> n = stage_layers;
  if (n.empty()) {
    for (int p = 0; p < pp; ++p) n.push_back(layers / pp + (p < layers % pp ? 1 : 0));
  }
  SPPO_CHECK(int(n.size()) == pp, "schedule") << "layer split has " << n.size() << " stages but pp = " << pp;
  std::vector<std::pair<int, int>> r;
  int b = 0;
  for (int p = 0; p < pp; ++p) {
    SPPO_CHECK(n[p] >= 1, "schedule") << "stage " << p << " has no layers";
    r.push_back({b, b + n[p]});
    b += n[p];
  }
  SPPO_CHECK(b == layers, "schedule") << "layer split sums to " << b << ", not " << layers;
  return r;
}

std::vector<std::pair<int, int>> stage_ranges(const PipelineSpec& spec) {
  return stage_ranges(spec.layers, spec.par.pp, spec.stage_layers);
}

namespace {

// build_pipeline in steps (Notes [Pipeline as tasks] and [MSP pieces] above): check the
// spec, lay out the tasks and their pieces in slot order, find what MSP's helpers borrow,
// then emit each task's ops on its pieces' ranks, and last the gradient reductions.
class PipelineBuilder {
 public:
  explicit PipelineBuilder(const PipelineSpec& spec)
      : spec_(spec), pre_(before_expansion(spec.par)), P_(pre_.pp), R_(pre_.cp), D_(pre_.dp),
        N_(int(spec.lengths.size())) {}

  Schedule build() {
    check();
    ranges_ = stage_ranges(spec_);
    start_schedule();
    make_tasks();
    find_helper_leases();
    send_helper_weights();
    pending_wait_.assign(std::size_t(s_.ranks()), -1);
    offloaded_.assign(std::size_t(s_.ranks()), {});
    prefetched_.assign(std::size_t(s_.ranks()), {});
    for (std::size_t ti = 0; ti < tasks_.size(); ++ti) emit_task(ti);
    reduce_gradients();
    return std::move(s_);
  }

 private:
  void check() {
    SPPO_CHECK(R_ >= 1 && D_ >= 1, "schedule") << "cp and dp must be at least 1";
    SPPO_CHECK(N_ >= 1, "schedule") << "at least one subsequence is needed";
    alpha_ = spec_.alpha.empty() ? std::vector<double>(std::size_t(N_), 0.0) : spec_.alpha;
    SPPO_CHECK(int(alpha_.size()) == N_, "schedule") << "alpha has " << alpha_.size() << " entries for " << N_
                                                     << " subsequences";
    SPPO_CHECK(alpha_.back() == 0, "schedule") << "alpha of the last subsequence must be 0";
    for (int i = 0; i < N_; ++i) {
      SPPO_CHECK(spec_.lengths[std::size_t(i)] >= R_ * (pre_.msp.on ? P_ : 1), "schedule")
          << "subsequence " << i << " of " << spec_.lengths[std::size_t(i)] << " tokens is shorter than its pieces";
      SPPO_CHECK(alpha_[std::size_t(i)] >= 0 && alpha_[std::size_t(i)] <= 1, "schedule")
          << "alpha[" << i << "] outside [0, 1]";
    }
    msp_ = pre_.msp.on && P_ > 1;
    SPPO_CHECK(!msp_ || N_ >= P_, "schedule") << "MSP needs N >= P (N = " << N_ << ", P = " << P_ << ")";
  }

  void start_schedule() {
    s_.par = pre_;
    s_.layers = spec_.layers;
    s_.lengths = spec_.lengths;
    s_.ops.resize(std::size_t(s_.ranks()));
    s_.owned.resize(std::size_t(s_.ranks()));
    for (int d = 0; d < D_; ++d)
      for (int p = 0; p < P_; ++p)
        for (int r = 0; r < R_; ++r) s_.owned[std::size_t(rank_of(d, p, r))] = ranges_[std::size_t(p)];
  }

  // Every (replica, stage, subsequence, direction) with its pieces, sorted by slot; and
  // where each sits in that order.
  void make_tasks() {
    for (int d = 0; d < D_; ++d)
      for (int i = 0; i < P_; ++i)
        for (int k = 0; k < N_; ++k)
          for (bool fwd : {true, false}) {
            Task t{fwd, i, k, d, fwd ? i + k : (N_ + P_ - 1) + (P_ - 1 - i) + (N_ - 1 - k), {}};
            // Stage groups that run the task.
            const std::vector<int> g = msp_ ? msp_groups(P_, N_, i, k, pre_.msp.reach) : std::vector<int>{i};
            const int pieces = int(g.size()) * R_;
            for (std::size_t h = 0; h < g.size(); ++h)
              for (int r = 0; r < R_; ++r) {
                const int piece = int(h) * R_ + r;
                const RingLayout layout = pieces == R_ ? pre_.ring_layout : RingLayout::Contiguous;
                t.pieces.push_back({rank_of(d, g[h], r),
                                    piece_spans(spec_.lengths[std::size_t(k)], piece, pieces, layout), piece, pieces,
                                    g[h] != i});
              }
            tasks_.push_back(std::move(t));
          }
    std::stable_sort(tasks_.begin(), tasks_.end(), [](const Task& a, const Task& b) {
      return std::tie(a.d, a.slot, a.stage) < std::tie(b.d, b.slot, b.stage);
    });
    for (auto& ops : s_.ops) ops.reserve(std::size_t(N_) * (R_ > 1 ? 2 * R_ + 6 : 8));
    index_.resize(tasks_.size());
    for (std::size_t t = 0; t < tasks_.size(); ++t)
      index_[slot_of(tasks_[t].d, tasks_[t].stage, tasks_[t].subseq, tasks_[t].forward)] = t;
  }

  // MSP: the last backward task of each (helper rank, stage), where its weight gradients go
  // home; and the (helper rank, stage) whose forward lease carries on into its backwards:
  // the helper runs nothing between its last forward piece of the stage and its first
  // backward one (a stage's last subsequence, on the idle group before it), so the weights
  // need not go home and come back, with the owner's backward waiting on them.
  void find_helper_leases() {
    for (std::size_t t = 0; t < tasks_.size(); ++t)
      for (const Piece& pc : tasks_[t].pieces)
        if (pc.helper) last_helper_task_[{pc.rank, tasks_[t].stage}] = t;
    if (!msp_) return;  // only MSP has helpers; a plain pipeline skips the walk
    std::map<std::pair<int, int>, std::pair<std::size_t, std::size_t>> ends;  // last forward, first backward task
    std::map<int, std::vector<std::size_t>> tasks_of;                         // rank -> its tasks, in order
    for (std::size_t t = 0; t < tasks_.size(); ++t)
      for (const Piece& pc : tasks_[t].pieces) {
        tasks_of[pc.rank].push_back(t);
        if (!pc.helper) continue;
        auto it = ends.try_emplace({pc.rank, tasks_[t].stage}, SIZE_MAX, SIZE_MAX).first;
        if (tasks_[t].forward) it->second.first = t;
        else if (it->second.second == SIZE_MAX) it->second.second = t;
      }
    for (const auto& [key, fb] : ends) {
      if (fb.first == SIZE_MAX || fb.second == SIZE_MAX) continue;
      const auto& mine = tasks_of[key.first];
      const auto after = std::upper_bound(mine.begin(), mine.end(), fb.first);
      if (after != mine.end() && *after == fb.second) lease_kept_.insert(key);
    }
  }

  // Weights for helpers go out first.
  void send_helper_weights() {
    for (const auto& [key, t] : last_helper_task_) {
      const auto [rank, stage] = key;
      const ParallelDims::Coord at = pre_.coord_of(rank);
      s_.ops[std::size_t(rank_of(at.replica, stage, at.ring))].push_back(
          msg(OpKind::Send, Payload::Weights, 0, stage, rank, 0, whole(rank)));
    }
  }

  // One task: on each piece's rank its leases, dK/dV returns, inputs, prefetches, ring
  // steps, the compute, K/V gathers, offload and weight-gradient returns; then its outputs
  // to the consumer task's pieces and the helpers' weight gradients taken home.
  void emit_task(std::size_t ti) {
    const Task& t = tasks_[ti];
    const int i = t.stage;
    // Producer of this task's input: F(i-1, k) or B(i+1, k).
    const int src_stage = t.forward ? i - 1 : i + 1;
    const Task* src =
        src_stage >= 0 && src_stage < P_ ? &tasks_[index_[slot_of(t.d, src_stage, t.subseq, t.forward)]] : nullptr;
    for (const Piece& pc : t.pieces) emit_piece(ti, pc, src);
    emit_outputs(t);
    // Helpers whose last piece of this stage this was send their weight gradients home; the
    // owner takes them now, so that they do not wait on the helper for the rest of the step.
    for (const Piece& h : t.pieces)
      if (h.helper && last_helper_task_[{h.rank, i}] == ti)
        s_.ops[std::size_t(owner_of(t, h))].push_back(msg(OpKind::Recv, Payload::WeightGrads, 0, i, h.rank, 0, whole(h.rank)));
  }

  void emit_piece(std::size_t ti, const Piece& pc, const Task* src) {
    const Task& t = tasks_[ti];
    const int i = t.stage, k = t.subseq;
    const bool split = t.pieces.size() > std::size_t(R_);
    auto& ops = s_.ops[std::size_t(pc.rank)];
    const int owner = owner_of(t, pc);
    emit_leases(t, pc, owner);
    // Backward of a split task: the owner returns each helper piece's dK, dV rows.
    if (!t.forward && !pc.helper && split)
      for (const Piece& h : t.pieces)
        if (h.helper && owner_of(t, h) == pc.rank)
          ops.push_back(msg(OpKind::Send, Payload::KVGrad, k, i, h.rank, span_tokens(h.spans), h));
    if (!t.forward && pc.helper) ops.push_back(msg(OpKind::Recv, Payload::KVGrad, k, i, owner, span_tokens(pc.spans), pc));
    // Input activations (or their gradients) from the producer pieces that overlap.
    const Payload act = t.forward ? Payload::Hidden : Payload::HiddenGrad;
    if (src)
      for (const Piece& q : src->pieces)
        if (q.rank != pc.rank)
          for (const Op& op : parts(msg(OpKind::Recv, act, k, i, q.rank, 0, pc), *src, t, q, pc)) ops.push_back(op);
    const int prefetch = !t.forward && !pc.helper ? bring_back_units(pc.rank, k) : -1;
    emit_ring(t, pc);
    Op c = with_layers(make(t.forward ? OpKind::Forward : OpKind::Backward, k), i);
    c.piece = pc.piece;
    c.pieces = pc.pieces;
    if (split)
      for (const Piece& q : t.pieces) c.group.push_back(q.rank);
    ops.push_back(std::move(c));
    if (prefetch >= 0) ops.push_back(make(OpKind::WaitPrefetch, prefetch));
    // Forward of a split task: the owner gathers a copy of each helper piece's K, V.
    if (t.forward && !pc.helper && split)
      for (const Piece& h : t.pieces)
        if (h.helper && owner_of(t, h) == pc.rank)
          ops.push_back(msg(OpKind::Recv, Payload::KV, k, i, h.rank, span_tokens(h.spans), h));
    if (t.forward && pc.helper) ops.push_back(msg(OpKind::Send, Payload::KV, k, i, owner, span_tokens(pc.spans), pc));
    if (t.forward && !pc.helper) offload_unit(pc.rank, k, split);
    if (pc.helper && !t.forward && last_helper_task_[{pc.rank, i}] == ti)
      ops.push_back(msg(OpKind::Send, Payload::WeightGrads, 0, i, owner, 0, whole(pc.rank)));
  }

  // A helper's lease of the stage's weights begins (Recv Weights); the owner sends its
  // helpers' backward leases when its own backwards begin.
  void emit_leases(const Task& t, const Piece& pc, int owner) {
    const int i = t.stage;
    auto& ops = s_.ops[std::size_t(pc.rank)];
    const bool lease_begins = pc.helper && borrowed_.insert({pc.rank, i, t.forward}).second &&
                              (t.forward || !lease_kept_.count({pc.rank, i}));
    if (lease_begins) ops.push_back(msg(OpKind::Recv, Payload::Weights, 0, i, owner, 0, whole(pc.rank)));
    if (!t.forward && !pc.helper && owner_backward_started_.insert(pc.rank * P_ + i).second)
      for (const auto& [key, last] : last_helper_task_)
        if (key.second == i && pre_.coord_of(key.first).replica == t.d &&
            pre_.coord_of(key.first).ring == pre_.coord_of(pc.rank).ring &&
            !lease_kept_.count(key))
          ops.push_back(msg(OpKind::Send, Payload::Weights, 0, i, key.first, 0, whole(key.first)));
  }

  // Before the backward of subsequence k on `rank`: the offload started after the last
  // forward is waited for; k's unit comes back now (exposed) unless an earlier backward
  // prefetched it; the next offloaded unit down starts coming back, and is returned, to be
  // waited for after this backward (-1: none).
  int bring_back_units(int rank, int k) {
    auto& ops = s_.ops[std::size_t(rank)];
    if (pending_wait_[std::size_t(rank)] >= 0) {
      ops.push_back(make(OpKind::WaitOffload, pending_wait_[std::size_t(rank)]));
      pending_wait_[std::size_t(rank)] = -1;
    }
    // Offloaded subsequences of this rank, ascending; the top is the next to need its unit.
    auto& stack = offloaded_[std::size_t(rank)];
    auto& prefetched = prefetched_[std::size_t(rank)];
    if (!stack.empty() && stack.back() == k) {
      if (!prefetched.count(k)) {
        ops.push_back(prefetch_op(k));
        ops.push_back(make(OpKind::WaitPrefetch, k));
      }
      stack.pop_back();
    }
    if (stack.empty() || stack.back() >= k || prefetched.count(stack.back())) return -1;
    const int next = stack.back();
    prefetched.insert(next);
    ops.push_back(prefetch_op(next));
    return next;
  }

  // After an own-stage forward of subsequence k: wait for the previous offload, start this one.
  void offload_unit(int rank, int k, bool split) {
    auto& ops = s_.ops[std::size_t(rank)];
    if (pending_wait_[std::size_t(rank)] >= 0) {
      ops.push_back(make(OpKind::WaitOffload, pending_wait_[std::size_t(rank)]));
      pending_wait_[std::size_t(rank)] = -1;
    }
    if (split || alpha_[std::size_t(k)] <= 0) return;
    Op off = make(OpKind::Offload, k);
    off.fraction = alpha_[std::size_t(k)];
    ops.push_back(std::move(off));
    pending_wait_[std::size_t(rank)] = k;
    offloaded_[std::size_t(rank)].push_back(k);
  }

  // Ring attention over the task's pieces (a stage group's SP ranks, or with MSP every
  // group's): M-1 steps in forward, M in backward (the last brings dK, dV home).
  void emit_ring(const Task& t, const Piece& pc) {
    const int M = int(t.pieces.size());
    if (M <= 1) return;
    const bool split = t.pieces.size() > std::size_t(R_);
    const int steps = t.forward ? M - 1 : M;
    for (int st = 1; st <= steps; ++st) {
      Op ring = with_layers(make(OpKind::RingStep, t.subseq), t.stage);
      ring.payload = t.forward ? Payload::KV : Payload::KVGrad;
      ring.step = st;
      ring.piece = pc.piece;
      ring.pieces = pc.pieces;
      ring.tokens = span_tokens(pc.spans);
      ring.peer = t.pieces[std::size_t((pc.piece + 1) % M)].rank;
      ring.recv_peer = t.pieces[std::size_t((pc.piece + M - 1) % M)].rank;
      if (split)  // who holds which keys (sched::ring_first_key)
        for (const Piece& q : t.pieces) ring.group.push_back(q.rank);
      s_.ops[std::size_t(pc.rank)].push_back(std::move(ring));
    }
  }

  // Outputs to the consumer pieces: F(i+1, k) or B(i-1, k).
  void emit_outputs(const Task& t) {
    const int dst_stage = t.forward ? t.stage + 1 : t.stage - 1;
    if (dst_stage < 0 || dst_stage >= P_) return;
    const Task& dst = tasks_[index_[slot_of(t.d, dst_stage, t.subseq, t.forward)]];
    const Payload act = t.forward ? Payload::Hidden : Payload::HiddenGrad;
    for (const Piece& pc : t.pieces)
      for (const Piece& q : dst.pieces)
        if (q.rank != pc.rank)
          for (const Op& op : parts(msg(OpKind::Send, act, t.subseq, dst_stage, q.rank, 0, q), t, dst, pc, q))
            s_.ops[std::size_t(pc.rank)].push_back(op);
  }

  // Replicas and SP ranks all-reduce the weight gradients; the tied embedding's (the first
  // stage's input embedding and the last stage's LM head are one parameter) are summed
  // between the two.
  void reduce_gradients() {
    if (R_ * D_ > 1 || spec_.replicated || spec_.par.ulysses > 1)  // Ulysses members: expand_ulysses
      for (int p = 0; p < P_; ++p) {
        std::vector<int> group;
        for (int d = 0; d < D_; ++d)
          for (int r = 0; r < R_; ++r) group.push_back(rank_of(d, p, r));
        for (int rank : group) {
          Op ar = with_layers(make(spec_.par.zero != ZeroStage::None ? OpKind::ReduceScatter : OpKind::AllReduce, 0), p);
          ar.payload = Payload::WeightGrads;
          ar.group = group;
          s_.ops[std::size_t(rank)].push_back(ar);
        }
      }
    if (P_ > 1 && spec_.tied)
      for (int d = 0; d < D_; ++d)
        for (int r = 0; r < R_; ++r) {
          Op tied = make(OpKind::AllReduce, 0);
          tied.payload = Payload::TiedGrads;
          tied.group = {rank_of(d, 0, r), rank_of(d, P_ - 1, r)};
          for (int rank : tied.group) s_.ops[std::size_t(rank)].push_back(tied);
        }
  }

  // Index of task (d, stage, k, forward) in index_.
  std::size_t slot_of(int d, int stage, int k, bool fwd) const {
    return ((std::size_t(d) * std::size_t(P_) + std::size_t(stage)) * std::size_t(N_) + std::size_t(k)) * 2 +
           (fwd ? 0 : 1);
  }
  int owner_of(const Task& t, const Piece& pc) const { return rank_of(t.d, t.stage, pc.piece % R_); }
  int rank_of(int d, int p, int r) const { return pre_.rank_of({d, p, r, 0, 0}); }
  static Piece whole(int rank) { return Piece{rank, {}, 0, 1, true}; }
  Op with_layers(Op op, int stage) const {
    op.layer_begin = ranges_[std::size_t(stage)].first;
    op.layer_end = ranges_[std::size_t(stage)].second;
    return op;
  }
  Op prefetch_op(int k) const {
    Op p = make(OpKind::Prefetch, k);
    p.fraction = alpha_[std::size_t(k)];
    return p;
  }
  Op msg(OpKind kind, Payload payload, int subseq, int stage, int peer, i64 tokens, const Piece& pc) const {
    Op op = with_layers(make(kind, subseq), stage);
    op.payload = payload;
    op.peer = peer;
    op.tokens = tokens;
    op.piece = pc.piece;
    op.pieces = pc.pieces;
    return op;
  }
  // Hidden-state messages from producer piece `from` to consumer piece `to`: the whole piece
  // where both tasks split the subsequence alike, else one a run of positions they share
  // (`first`: its first; a zigzag piece and a contiguous one can share two), ascending.
  static std::vector<Op> parts(const Op& op, const Task& producer, const Task& consumer, const Piece& from,
                               const Piece& to) {
    std::vector<Op> out;
    if (producer.pieces.size() == consumer.pieces.size()) {
      const i64 ov = overlap(from.spans, to.spans);
      if (ov > 0) out.push_back(op), out.back().tokens = ov;
      return out;
    }
    for (const auto& [b, e] : overlaps(from.spans, to.spans)) {
      out.push_back(op);
      out.back().first = b;
      out.back().tokens = e - b;
    }
    return out;
  }

  const PipelineSpec& spec_;
  const ParallelDims pre_;  // spec_.par before the expansions (tensor parallelism)
  const int P_, R_, D_, N_;
  std::vector<double> alpha_;
  bool msp_ = false;
  std::vector<std::pair<int, int>> ranges_;
  Schedule s_;
  std::vector<Task> tasks_;
  std::vector<std::size_t> index_;
  std::map<std::pair<int, int>, std::size_t> last_helper_task_;
  std::set<std::tuple<int, int, bool>> borrowed_;  // (helper rank, stage, forward) leases begun
  std::set<int> owner_backward_started_;           // stages whose owners sent the backward lease
  std::set<std::pair<int, int>> lease_kept_;
  // Offload bookkeeping per rank (own-stage, unsplit subsequences only): the offload to wait
  // for, the offloaded subsequences in order, those already prefetched.
  std::vector<int> pending_wait_;
  std::vector<std::vector<int>> offloaded_;
  std::vector<std::set<int>> prefetched_;
};

}  // namespace

Schedule build_pipeline(const PipelineSpec& spec) {
  return expand_tensor_parallel(expand_ulysses(PipelineBuilder(spec).build(), spec.par.ulysses), spec.par.tp);
}

Schedule build_step(const ModelConfig& c, const std::vector<i64>& lengths, const std::vector<double>& alpha,
                    const StepShape& shape, Replicas replicas) {
  Schedule s;
  const ParallelDims& par = shape.par;
  if (par.pp * par.cp * par.dp * par.ulysses == 1 && replicas == Replicas::All) {
    s = expand_tensor_parallel(build_single(c.layers, lengths, alpha), par.tp);
  } else {
    PipelineSpec spec;
    spec.layers = c.layers;
    spec.lengths = lengths;
    spec.alpha = alpha;
    spec.par = par;
    if (replicas == Replicas::One) {
      spec.par.dp = 1;
      spec.replicated = par.dp > 1;
    }
    spec.stage_layers = shape.stage_layers;
    spec.tied = c.tied_embeddings();
    s = build_pipeline(spec);
  }
  if (shape.forward_only) s = to_forward_only(std::move(s));
  else if (shape.place.layer_major()) s = to_layer_major(std::move(s));
  // The schedule's own parallelism is as built (one replica's, under Replicas::One); the
  // rest of it, and every placement, as the shape says.
  const int dp = s.par.dp;
  s.par = par;
  s.par.dp = dp;
  s.place = shape.place;
  s.packed = shape.packed;
  s.labeled = shape.labeled;
  s = with_weight_gathers(std::move(s));  // Note [ZeRO-3 gathers] in schedule/weights.h: from the stage as set
  // Note [One Ulysses member in the search]: a Ulysses group's members run the same ops on
  // rows and heads that differ by at most one, and the first has the most of both: its
  // compute and its memory are the group's largest (the all-to-alls are priced over every
  // member, CostModel::alltoall_s), so each collective ends as it arrives. The planner's
  // search (Replicas::One) simulates it
  // alone, the others' op lists left empty (the simulator waits in a collective for the
  // members with ops only); a U x cp stage then costs the search what a ring of cp does,
  // and the plan found is simulated whole before it is returned. The others' copies and
  // messages still share the first's PCIe switch, NUMA node and NIC: the simulator replays
  // each of the first's transfers once for every member without ops (contended_scales in
  // sim/simulator.cpp), so that its copies end, and free their bytes, when the whole
  // step's do.
  if (replicas == Replicas::One && par.ulysses > 1)
    for (int r = 0; r < s.ranks(); ++r)
      if (s.ulysses_shard(r).index != 0) s.ops[std::size_t(r)].clear();
  return s;
}

// Note [Layer-major backward]: the forward runs as in the paper's order; the backward takes
// each stage's layers from the last, each over the subsequences in reverse. Each
// subsequence's backward block of the paper's order (the gradient received from the next
// stage, the prefetch of the next subsequence to come back, its ring steps, its B, the
// waits that follow, the gradient sent to the previous stage) becomes one block per layer,
// the same ops on that layer alone, and the blocks run layer by layer; a block receives on
// the stage's last layer and sends on its first. So:
//  - a layer's dK/dV sums are allocated by its first backward (on B(l, N-1)) and the last
//    rows go with B(l, 0): one layer's sums are alive at a time, not every layer's;
//  - a prefetch brings back one layer's part of its subsequence's unit (the last layer's
//    with head_grad), P(l, i-1) beside B(l, i) as P(i-1) beside B(i);
//  - the residual gradient of every subsequence waits between its layers: [S, H] in the
//    activation type on the device from the first layer's backward to the last's;
//  - a weight gradient is complete after B(l, 0), so its bucket's reduction starts while
//    the layers below run;
//  - between pipeline stages a stage sends its first gradient only in its last pass, so
//    the stage before waits for its whole backward: the stages' backwards run one after
//    another, not overlapped (the simulator prices it; the planner weighs it).
// MSP's pieces borrow a stage's weights per task, which this order does not pair: refused.
//
// Note [Residual gradients on the host]: the residual gradients between the layers of a
// layer-major backward are [S, H] on the device, the whole sequence's, from the first
// layer's backward to the last's (every other tensor of that order is one subsequence's
// or one layer's). With Schedule::residual_host each B op of a layer but the stage's first
// sends its subsequence's residual gradient to the host when it ends, and each B op of a
// layer but the stage's last brings it back when it starts: the device holds the running
// subsequence's, the host [S, H]. The copies are the op's own (synchronous: a B op's
// compute is T tokens of a layer, its copies T rows of H), so that both are points of the
// program: the memory rules place them so (schedule/memory.cpp), the simulator adds them
// to the op's time, and the runtime makes them so (ActivationStore::residual_to_host,
// residual_back).
//
// Note [Rebuilt layer inputs]: in a layer-major backward each layer's saved input x is the
// largest tensor left once the rest is recomputed, [S, H] a layer over the whole step; with
// the K/V recomputed from it, it is all a layer keeps. Schedule::inputs_rebuilt names layers
// whose x the forward drops once the layer's forward has used it. Before its backward needs
// x_l of subsequence i, B(l, i) runs layer l-1's forward again on i, from x_{l-1} of i
// (kept: on the device, or on the host, copied into a buffer of the op's), which makes x_l
// again. That forward needs layer l-1's K/V of every earlier subsequence, and in a
// layer-major backward they are still there while layer l's backward runs (kept on the
// device, or recomputed from the kept x_{l-1}); it keeps nothing but its output: its saved
// tensors are the op's, freed when x_l is made. So:
//  - each rebuilt layer saves H e bytes a token: half of what a layer keeps with every other
//    tensor and the K/V recomputed. A rebuilt layer's own K/V stay on the device or the host
//    (recomputing them would need every earlier subsequence's x_l);
//  - it costs a layer's forward a B op (with the layer below's K/V recomputed again, where
//    they are), and, for the op's length, that layer's saved tensors and workspace;
//  - the forward runs again the same kernels on the same inputs as the step's forward, so
//    x_l is the forward's bit for bit, and so is every gradient;
//  - with the layers' weights on the host (Note [Weights on the host] in
//    schedule/weights.h), the layer below's come with the first B op of the layer's run
//    and stay for their own run, which follows: still two layers' at a time.
// Within a stage only (the layer below on the same rank), without TP, rings or MSP.
Schedule to_layer_major(Schedule s) {
  if (s.place.backward == BackwardOrder::Layer) return s;
  auto hidden_grad = [](const Op& op) { return is_hidden_message(op) && op.payload == Payload::HiddenGrad; };
  // The ops a backward block begins with.
  auto starts_block = [&](const Op& op) {
    return op.kind == OpKind::Prefetch || op.kind == OpKind::Backward ||
           (op.kind == OpKind::RingStep && op.payload == Payload::KVGrad) ||
           (op.kind == OpKind::AllToAll && op.payload == Payload::KVGrad) ||
           (op.kind == OpKind::Recv && hidden_grad(op));
  };
  for (int r = 0; r < s.ranks(); ++r) {
    std::vector<Op>& ops = s.ops[std::size_t(r)];
    for (const Op& op : ops)
      SPPO_CHECK(!((op.kind == OpKind::Send || op.kind == OpKind::Recv) && !is_hidden_message(op)) &&
                     !((op.kind == OpKind::Forward || op.kind == OpKind::Backward) && !op.group.empty()),
                 "options")
          << "the layer-major backward (--backward-order layer) does not run MSP's pieces: give --msp off, or "
             "--backward-order subseq";
    // The backward's part: from the first op that belongs to a subsequence's backward block.
    std::size_t first = ops.size();
    for (std::size_t k = 0; k < ops.size() && first == ops.size(); ++k)
      if (starts_block(ops[k])) first = k;
    if (first == ops.size()) continue;
    // Blocks: from an op that begins one to the next after its B; all-reduces end the step.
    std::vector<std::vector<Op>> blocks;
    std::vector<Op> block, tail;
    bool has_b = false;
    int lb = s.layers, le = 0;
    for (std::size_t k = first; k < ops.size(); ++k) {
      const Op& op = ops[k];
      if (op.kind == OpKind::AllReduce || op.kind == OpKind::ReduceScatter) {
        tail.push_back(op);
        continue;
      }
      SPPO_CHECK(tail.empty(), "schedule") << "an op after the step's all-reduces: " << to_string(op);
      SPPO_CHECK(!is_hidden_message(op) || hidden_grad(op), "schedule")
          << "a forward's message among the backward's ops: " << to_string(op);
      if (has_b && starts_block(op)) {
        blocks.push_back(std::move(block));
        block.clear();
        has_b = false;
      }
      block.push_back(op);
      if (op.kind == OpKind::Backward) {
        has_b = true;
        lb = std::min(lb, op.layer_begin);
        le = std::max(le, op.layer_end);
      }
    }
    if (!block.empty()) blocks.push_back(std::move(block));
    ops.resize(first);
    for (int l = le - 1; l >= lb; --l)
      for (const auto& b : blocks)
        for (Op op : b) {
          if (is_hidden_message(op)) {  // received on the stage's last layer, sent on its first
            if ((op.kind == OpKind::Recv && l == le - 1) || (op.kind == OpKind::Send && l == lb)) ops.push_back(op);
            continue;
          }
          op.layer_begin = l;
          op.layer_end = l + 1;
          ops.push_back(std::move(op));
        }
    ops.insert(ops.end(), tail.begin(), tail.end());
  }
  s.place.backward = BackwardOrder::Layer;
  return s;
}

void set_offload_fractions(Schedule* s, const std::vector<double>& alpha) {
  SPPO_CHECK(alpha.size() == s->lengths.size(), "schedule")
      << "alpha has " << alpha.size() << " entries for " << s->lengths.size() << " subsequences";
  for (auto& ops : s->ops)
    for (Op& op : ops)
      if (op.kind == OpKind::Offload || op.kind == OpKind::Prefetch) {
        SPPO_ASSERT(alpha[std::size_t(op.subseq)] > 0);
        op.fraction = alpha[std::size_t(op.subseq)];
      }
}

namespace {

bool is_compute(const Op& op) { return op.kind == OpKind::Forward || op.kind == OpKind::Backward; }

}  // namespace

// Note [Hidden states of MSP pieces under tensor parallelism]: between the sequence-parallel
// regions member t of a group holds rows piece_range(T, t, tp) of its piece (member_spans).
// Where a producer's and a consumer's pieces split a subsequence alike, member t sends its
// rows to member t. Where they do not (an MSP split task beside an unsplit one), a member's
// rows of the producer's piece meet several members' rows of the consumer's: each shared run
// of positions moves as its own message, member to member, and rows a group produced for
// itself move between its members where they change hands (a member keeps those that stay
// its own). The messages of one member pair go in ascending position, the same order on
// both sides.
Schedule expand_tensor_parallel(Schedule s, int tp) {
  SPPO_CHECK(tp >= 1, "schedule") << "tensor parallelism needs at least one rank a group (got " << tp << ")";
  SPPO_CHECK(s.par.tp == 1, "schedule") << "the schedule is already tensor parallel";
  if (tp == 1) return s;
  SPPO_CHECK(s.par.ulysses == 1, "options")
      << "--tp " << tp << " and --ulysses " << s.par.ulysses
      << " both split every layer's heads over their ranks; use one of them";
  for (std::size_t i = 0; i < s.lengths.size(); ++i)
    SPPO_CHECK(s.lengths[i] >= tp, "schedule")
        << "subsequence " << i << " has " << s.lengths[i] << " tokens, fewer than the " << tp
        << " tensor-parallel ranks that split it; use fewer --subseqs or a smaller --tp";
  std::vector<std::vector<Op>> ops_of = std::move(s.ops);
  std::vector<std::pair<int, int>> owned = std::move(s.owned);
  const ParallelDims before = s.par;
  Schedule out = std::move(s);  // the lengths, ring and layers stay; ops and owners are made anew
  out.par.tp = tp;
  // Rank r's member t (Note [Rank layout] in core/parallel.h).
  const auto member = [&](int r, int t) {
    ParallelDims::Coord c = before.coord_of(r);
    c.member = t;
    return out.par.rank_of(c);
  };
  out.ops.assign(std::size_t(out.ranks()), {});
  out.owned.assign(owned.empty() ? 0 : std::size_t(out.ranks()), {});
  const int L = out.layers;
  // Under MSP: where each hidden state is made and taken, by rank (Note above).
  bool msp = false;
  for (const auto& ops : ops_of)
    for (const Op& op : ops) msp |= is_compute(op) && !op.group.empty();
  std::vector<std::map<HiddenId, const Op*>> made(ops_of.size()), taken(ops_of.size());
  if (msp)
    for (std::size_t r = 0; r < ops_of.size(); ++r)
      for (const Op& op : ops_of[r]) {
        if (!is_compute(op)) continue;
        SPPO_CHECK(span_tokens(out.spans(op)) >= tp, "schedule")
            << "a piece of subsequence " << op.subseq << " has " << span_tokens(out.spans(op))
            << " tokens, fewer than the " << tp << " tensor-parallel ranks that split it; use fewer --subseqs";
        if (has_output(op, L)) made[r][output_id(op)] = &op;
        if (has_input(op, L)) taken[r][input_id(op)] = &op;
      }
  // The runs of positions that member a of producer p and member b of consumer c share,
  // within `run`.
  auto shared = [&](const Op& p, int a, const Op& c, int b, const Spans& run) {
    std::vector<std::pair<i64, i64>> runs;
    for (const auto& [lo, hi] : overlaps(member_spans(out.spans(p), a, tp), member_spans(out.spans(c), b, tp)))
      for (const auto& [rb, re] : run)
        if (std::min(hi, re) > std::max(lo, rb)) runs.push_back({std::max(lo, rb), std::min(hi, re)});
    return runs;
  };
  auto part = [](Op op, int peer, std::pair<i64, i64> run) {
    op.peer = peer;
    op.first = run.first;
    op.tokens = run.second - run.first;
    return op;
  };
  // Member t's messages with the group's other members of rows rank r made (maker p) for
  // itself (taker c): sent after p, received before c.
  auto in_group = [&](std::vector<Op>& ops, OpKind kind, int r, int t, const Op& p, const Op& c) {
    Op op;
    op.kind = kind;
    op.payload = c.kind == OpKind::Forward ? Payload::Hidden : Payload::HiddenGrad;
    op.layer_begin = c.layer_begin;
    op.layer_end = c.layer_end;
    op.subseq = c.subseq;
    op.piece = c.piece;
    op.pieces = c.pieces;
    const bool send = kind == OpKind::Send;
    for (int u = 0; u < tp; ++u)
      if (u != t)
        for (const auto& run : send ? shared(p, t, c, u, out.spans(p)) : shared(p, u, c, t, out.spans(p)))
          ops.push_back(part(op, member(r, u), run));
  };
  for (int r = 0; r < int(ops_of.size()); ++r)
    for (int t = 0; t < tp; ++t) {
      auto map = [&](int rank) { return rank < 0 ? rank : member(rank, t); };
      if (!owned.empty()) out.owned[std::size_t(member(r, t))] = owned.at(std::size_t(r));
      auto& ops = out.ops[std::size_t(member(r, t))];
      ops.reserve(ops_of[std::size_t(r)].size());
      for (const Op& src : ops_of[std::size_t(r)]) {
        const bool send = src.kind == OpKind::Send;
        // A whole piece (first < 0: the two tasks split the subsequence alike) goes member t
        // to member t, as without MSP, below.
        if (msp && is_hidden_message(src) && src.first >= 0) {
          const HiddenId id = hidden_id(src);
          const Op& p = *made.at(std::size_t(send ? r : src.peer)).at(id);
          const Op& c = *taken.at(std::size_t(send ? src.peer : r)).at(id);
          const Spans run{{src.first, src.first + src.tokens}};
          for (int u = 0; u < tp; ++u)
            for (const auto& shared_run : send ? shared(p, t, c, u, run) : shared(p, u, c, t, run))
              ops.push_back(part(src, member(src.peer, u), shared_run));
          continue;
        }
        if (msp && has_input(src, L) && made[std::size_t(r)].count(input_id(src)))
          in_group(ops, OpKind::Recv, r, t, *made[std::size_t(r)].at(input_id(src)), src);
        Op op = src;
        op.peer = map(op.peer);
        op.recv_peer = map(op.recv_peer);
        for (int& g : op.group) g = map(g);
        if (is_hidden_message(op)) {
          const i64 whole = op.tokens > 0 ? op.tokens : span_tokens(out.spans(op));
          SPPO_CHECK(whole >= tp, "schedule")
              << "subsequence " << op.subseq << " has " << whole << " tokens, fewer than the " << tp
              << " tensor-parallel ranks that split it; use fewer --subseqs or a smaller --tp";
          const auto [b, e] = piece_range(whole, t, tp);
          op.tokens = e - b;
        }
        ops.push_back(std::move(op));
        if (msp && has_output(src, L) && taken[std::size_t(r)].count(output_id(src)))
          in_group(ops, OpKind::Send, r, t, src, *taken[std::size_t(r)].at(output_id(src)));
      }
    }
  return out;
}

// Note [Ulysses members]: Ulysses (--ulysses U; runtime/ulysses.h) turns every rank of a
// schedule built without it into U members (Note [Rank layout] in core/parallel.h: the index
// inside the tensor-parallel one), which run the rank's op list together, member u on its
// rows of every piece (member_spans with u of U) and, in each layer's attention, on every row
// of the piece for its heads. So:
//  - before every F and B an AllToAll of the members names the exchanges its layers run
//    inside (Note [Ulysses exchanges] in core/layout.h): the simulator prices them there,
//    and the runtime, which runs them within the layers, passes over it;
//  - hidden states go member u to member u, carrying its rows (tokens: its share of the
//    piece's); ring steps run among the u-th members of a ring's ranks;
//  - the members' weights are whole on each, as ring members' are: a WeightGrads all-reduce
//    over a group of ranks takes every member of each (the layer group, Note [Rank layout]),
//    a TiedGrads one pairs member u of the first stage with member u of the last.
// MSP's pieces are refused (their hidden states move in runs of positions that a member's
// rows would cut again).
Schedule expand_ulysses(Schedule s, int U) {
  SPPO_CHECK(U >= 1, "schedule") << "Ulysses needs at least one rank a group (got " << U << ")";
  SPPO_CHECK(s.par.ulysses == 1 && s.par.tp == 1, "schedule")
      << "the schedule is already expanded for Ulysses or tensor parallelism";
  if (U == 1) return s;
  for (std::size_t r = 0; r < s.ops.size(); ++r)
    for (const Op& op : s.ops[r]) {
      if (!is_compute(op)) continue;
      SPPO_CHECK(op.group.empty(), "options")
          << "Ulysses (--ulysses) does not run MSP's pieces; use --msp off";
      const i64 T = span_tokens(s.spans(op));
      SPPO_CHECK(T >= U, "options") << "a piece of subsequence " << op.subseq << " has " << T
                                    << " tokens, fewer than the " << U
                                    << " Ulysses ranks that split it; use fewer --subseqs or a smaller --ulysses";
    }
  std::vector<std::vector<Op>> ops_of = std::move(s.ops);
  std::vector<std::pair<int, int>> owned = std::move(s.owned);
  const ParallelDims before = s.par;
  Schedule out = std::move(s);
  out.par.ulysses = U;
  const auto member = [&](int r, int u) {
    ParallelDims::Coord c = before.coord_of(r);
    c.ulysses = u;
    return out.par.rank_of(c);
  };
  out.ops.assign(std::size_t(out.ranks()), {});
  out.owned.assign(owned.empty() ? 0 : std::size_t(out.ranks()), {});
  for (int r = 0; r < int(ops_of.size()); ++r) {
    std::vector<int> members;
    for (int u = 0; u < U; ++u) members.push_back(member(r, u));
    for (int u = 0; u < U; ++u) {
      const int me = members[std::size_t(u)];
      if (!owned.empty()) out.owned[std::size_t(me)] = owned.at(std::size_t(r));
      auto& ops = out.ops[std::size_t(me)];
      ops.reserve(ops_of[std::size_t(r)].size() * 2);
      auto map = [&](int rank) { return rank < 0 ? rank : member(rank, u); };
      for (const Op& src : ops_of[std::size_t(r)]) {
        if (is_compute(src)) {
          Op a = src;
          a.kind = OpKind::AllToAll;
          a.payload = src.kind == OpKind::Forward ? Payload::KV : Payload::KVGrad;
          a.group = members;
          ops.push_back(std::move(a));
        }
        Op op = src;
        op.peer = map(op.peer);
        op.recv_peer = map(op.recv_peer);
        if (reduces_weight_grads(op)) {
          std::vector<int> group;
          for (int g : op.group)
            for (int v = 0; v < U; ++v) group.push_back(member(g, v));
          op.group = std::move(group);
        } else {
          for (int& g : op.group) g = map(g);
        }
        if (is_hidden_message(op)) {
          SPPO_ASSERT(op.first < 0);
          const i64 whole = op.tokens > 0 ? op.tokens : span_tokens(out.spans(op));
          const auto [b, e] = piece_range(whole, u, U);
          op.tokens = e - b;
        }
        ops.push_back(std::move(op));
      }
    }
  }
  return out;
}


// Note [Forward-only steps]: an evaluation runs SPPO's forward alone. The ops are the
// training step's F ops, with the forward's ring steps (payload KV), all-to-alls (KV),
// hidden states and ZeRO-3's gathers of the layers they run, in their order; every backward op, copy and reduction goes. What differs
// is what the F ops hold: nothing is saved for a backward, so each layer's saved tensors
// (its input x among them) are freed as the layer ends and the head computes the loss and
// the per-position losses without head_grad; the K/V of each finished subsequence stay,
// on the device or streamed from the host as place.kv says, since every later subsequence
// attends to them, until the rank's last F ends. Recomputed K/V would need every earlier
// subsequence's x, which the step does not keep, and MSP's pieces fill a backward's
// bubbles: neither runs here. With nothing to hold a stage back but the next stage, a
// stage would run ahead and pile its hidden states up in sends not yet taken, as many as
// the next stage lags (which no model of time predicts); instead each send ends before
// the stage's next op, in the runtime and the simulator alike. The memory rules (schedule/memory.h) and the runtime
// (runtime/executor.h) both follow this; a step of the same lengths holds at no point
// more than the training step's forward does.
Schedule to_forward_only(Schedule s) {
  for (auto& ops : s.ops) {
    std::vector<Op> kept;
    for (const Op& op : ops) {
      SPPO_CHECK(!((op.kind == OpKind::Send || op.kind == OpKind::Recv) && !is_hidden_message(op)) &&
                     !(op.kind == OpKind::Forward && !op.group.empty()),
                 "options")
          << "a forward-only step does not run MSP's pieces (they fill a backward's bubbles); give --msp off";
      const bool keep = op.kind == OpKind::Forward ||
                        ((op.kind == OpKind::RingStep || op.kind == OpKind::AllToAll) && op.payload == Payload::KV) ||
                        (is_hidden_message(op) && op.payload == Payload::Hidden);
      if (keep) kept.push_back(op);
    }
    ops = std::move(kept);
  }
  s.forward_only = true;
  return with_weight_gathers(std::move(s));  // its F ops' (Note [ZeRO-3 gathers] in schedule/weights.h)
}

}  // namespace sppo::sched
