#include "schedule/ir.h"

#include <algorithm>
#include <cstdio>
#include <ostream>
#include <sstream>

#include "core/check.h"
#include "core/layout.h"

namespace sppo::sched {

i64 Schedule::offset(int i) const {
  SPPO_ASSERT(i >= 0 && i <= int(lengths.size()));
  i64 o = 0;
  for (int j = 0; j < i; ++j) o += lengths[j];
  return o;
}

i64 Schedule::seq_len() const { return offset(int(lengths.size())); }

std::pair<int, int> owned_layers(const Schedule& s, int rank) {
  return s.owned.empty() ? std::pair<int, int>{0, s.layers} : s.owned.at(std::size_t(rank));
}

ResidualMove residual_move(const Schedule& s, int rank, const Op& op) {
  if (op.kind != OpKind::Backward || !s.place.residual_host()) return {};
  const auto [b, e] = owned_layers(s, rank);
  const bool own = b <= op.layer_begin && op.layer_end <= e;
  return {own && op.layer_end < e, own && op.layer_begin > b};
}

void Spans::push_back(const value_type& r) {
  SPPO_CHECK(n_ < kMax, "schedule") << "a piece holds at most " << kMax << " token ranges";
  r_[std::size_t(n_++)] = r;
}

i64 span_tokens(const Spans& s) {
  i64 n = 0;
  for (const auto& [b, e] : s) n += e - b;
  return n;
}

i64 overlap(const Spans& a, const Spans& b) {
  i64 n = 0;
  for (const auto& [ab, ae] : a)
    for (const auto& [bb, be] : b) n += std::max<i64>(0, std::min(ae, be) - std::max(ab, bb));
  return n;
}

std::vector<std::pair<i64, i64>> overlaps(const Spans& a, const Spans& b) {
  std::vector<std::pair<i64, i64>> out;
  for (const auto& [ab, ae] : a)
    for (const auto& [bb, be] : b)
      if (std::min(ae, be) > std::max(ab, bb)) out.push_back({std::max(ab, bb), std::min(ae, be)});
  std::sort(out.begin(), out.end());
  return out;
}

Spans piece_spans(i64 l, int piece, int pieces, RingLayout layout) {
  SPPO_ASSERT(piece >= 0 && piece < pieces);
  if (layout == RingLayout::Contiguous || pieces == 1) return {piece_range(l, piece, pieces)};
  Spans s;
  for (int c : {piece, 2 * pieces - 1 - piece}) {
    const auto r = piece_range(l, c, 2 * pieces);
    if (r.second > r.first) s.push_back(r);
  }
  return s;
}

bool is_hidden_message(const Op& op) {
  return (op.kind == OpKind::Send || op.kind == OpKind::Recv) &&
         (op.payload == Payload::Hidden || op.payload == Payload::HiddenGrad);
}

HiddenId hidden_id(const Op& op) {
  return {op.payload, op.payload == Payload::Hidden ? op.layer_begin : op.layer_end, op.subseq};
}

bool has_input(const Op& op, int layers) {
  return op.kind == OpKind::Forward ? op.layer_begin > 0 : op.kind == OpKind::Backward && op.layer_end < layers;
}

bool has_output(const Op& op, int layers) {
  return op.kind == OpKind::Forward ? op.layer_end < layers : op.kind == OpKind::Backward && op.layer_begin > 0;
}

HiddenId input_id(const Op& op) {
  if (op.kind == OpKind::Forward) return {Payload::Hidden, op.layer_begin, op.subseq};
  return {Payload::HiddenGrad, op.layer_end, op.subseq};
}

HiddenId output_id(const Op& op) {
  if (op.kind == OpKind::Forward) return {Payload::Hidden, op.layer_end, op.subseq};
  return {Payload::HiddenGrad, op.layer_begin, op.subseq};
}

Spans member_spans(const Spans& piece, int t, int tp) {
  const auto [rb, re] = piece_range(span_tokens(piece), t, tp);
  Spans out;
  i64 row = 0;  // the piece's row at the start of each range
  for (const auto& [b, e] : piece) {
    const i64 lo = std::max(rb, row), hi = std::min(re, row + (e - b));
    if (hi > lo) out.push_back({b + (lo - row), b + (hi - row)});
    row += e - b;
  }
  return out;
}

Spans Schedule::spans(const Op& op) const { return spans(op.subseq, op.piece, op.pieces); }

Spans Schedule::spans(int subseq, int piece, int pieces) const {
  const i64 l = lengths.at(std::size_t(subseq));
  const bool ring_piece = pieces > 1 && pieces == par.cp;
  return piece_spans(l, piece, pieces, ring_piece ? par.ring_layout : RingLayout::Contiguous);
}

namespace {

// Where member `piece` of op's ring holds its first key, relative to the start of op's
// subsequence; kBefore when it holds one before the subsequence. A context-parallel member
// holds its piece of every subsequence so far, so past subsequence 0 it always holds one
// before; an MSP task's owner holds every earlier position.
constexpr i64 kBefore = -1;

i64 first_key_in_subseq(const Schedule& s, const Op& op, int piece) {
  if (!op.group.empty()) {
    const int rank = op.group.at(std::size_t(piece));
    const auto mine = owned_layers(s, rank);
    const bool owner = mine.first <= op.layer_begin && op.layer_end <= mine.second;
    if (owner && op.subseq > 0) return kBefore;
  } else if (op.subseq > 0) {
    return kBefore;
  }
  return s.spans(op, piece).front().first;
}

}  // namespace

i64 ring_first_key(const Schedule& s, const Op& op, int piece) {
  const i64 rel = first_key_in_subseq(s, op, piece);
  if (rel != kBefore) return s.offset(op.subseq) + rel;
  if (!op.group.empty()) return 0;
  // The member's piece of subsequence 0 starts before l_0 <= o_j for every later j: the
  // least of all its pieces' starts.
  return s.spans(0, piece, op.pieces).front().first;
}

i64 ring_step_bytes(const Schedule& s, const Op& op, i64 H, int Z, int act_bytes, bool causal) {
  const int R = op.pieces, me = op.piece, t = op.step;
  if (t < 1 || t > R - 1) return 0;  // a backward's last step: dK, dV never leave their owner
  const bool forward = op.payload == Payload::KV;
  const i64 f32 = 4;
  const i64 travel = forward ? H * act_bytes : 2 * H * act_bytes + 2 * Z * f32;
  const i64 back = forward ? H * act_bytes + Z * f32 : H * act_bytes;
  const int passed = (me - t + 1 + R) % R;  // step 1 sends its own queries, later ones forward
  const int got = (me - t + R) % R;
  i64 bytes = span_tokens(s.spans(op, passed)) * travel;
  // In the subsequence's own positions: a key before it is seen by every query.
  const i64 first_key = first_key_in_subseq(s, op, me);
  for (const auto& [b, e] : s.spans(op, got))
    if (!causal || first_key == kBefore || first_key <= e - 1) bytes += (e - b) * back;
  return bytes;
}

i64 rsa_step_bytes(const Schedule& s, const Op& op, i64 H, int act_bytes) {
  const int R = op.pieces, me = op.piece, t = op.step;
  if (t < 1 || t > R - 1) return 0;
  const i64 row = H * act_bytes;
  const i64 block = span_tokens(s.spans(op, (me - t + 1 + R) % R)) * row;
  if (op.payload == Payload::KV) return 2 * block;
  return 3 * block + 2 * span_tokens(s.spans(op, (me - t + R) % R)) * row;
}

i64 alltoall_bytes(const Schedule& s, const Op& op, int rank, const ModelConfig& c, ActPrecision p) {
  const UlyssesShard u = s.ulysses_shard(rank);
  const i64 T = span_tokens(s.spans(op));
  // The exchanges of one layer: the forward's (again in a backward that rebuilds its input),
  // the backward's.
  auto sent = [&](std::initializer_list<UlyssesExchange> xs) {
    i64 b = 0;
    for (UlyssesExchange x : xs) b += ulysses_sent_bytes(c, T, p, u, x);
    return b;
  };
  const i64 layers = op.layer_end - op.layer_begin;
  if (op.payload != Payload::KVGrad) return layers * sent({UlyssesExchange::Heads, UlyssesExchange::Rows});
  i64 rebuilt = 0;
  for (int l = op.layer_begin; l < op.layer_end; ++l) rebuilt += s.place.input_rebuilt(l) ? 1 : 0;
  return layers * sent({UlyssesExchange::GradHeads, UlyssesExchange::GradRows}) +
         (rebuilt > 0 ? rebuilt * sent({UlyssesExchange::Heads, UlyssesExchange::Rows}) : 0);
}

MessageKey message_key(const Op& op) {
  MessageKey m{op.payload, op.subseq, op.piece, op.pieces, op.layer_begin, op.layer_end, 0, op.tokens};
  if (op.kind == OpKind::RingStep) {
    m.piece = -1;
    m.tokens = 0;
    m.step = op.step;
  }
  return m;
}

int message_tag(const Op& op) {
  const MessageKey k = message_key(op);
  const int slot = op.kind == OpKind::RingStep ? k.step : k.piece;
  return ((int(k.payload) * 4096 + (k.subseq & 4095)) * 64 + (slot & 63)) * 64 + (k.layer_begin & 63);
}

const char* to_string(OpKind k) {
  switch (k) {
    case OpKind::Forward: return "F";
    case OpKind::Backward: return "B";
    case OpKind::Offload: return "O";
    case OpKind::Prefetch: return "P";
    case OpKind::WaitOffload: return "WO";
    case OpKind::WaitPrefetch: return "WP";
    case OpKind::Send: return "send";
    case OpKind::Recv: return "recv";
    case OpKind::RingStep: return "ring";
    case OpKind::AllReduce: return "allreduce";
    case OpKind::AllToAll: return "alltoall";
    case OpKind::ReduceScatter: return "reducescatter";
    case OpKind::AllGather: return "allgather";
  }
  SPPO_ASSERT(false);
  return "";
}

const char* to_string(Payload p) {
  switch (p) {
    case Payload::None: return "none";
    case Payload::Hidden: return "hidden";
    case Payload::HiddenGrad: return "hidden_grad";
    case Payload::KV: return "kv";
    case Payload::KVGrad: return "kv_grad";
    case Payload::Weights: return "weights";
    case Payload::WeightGrads: return "weight_grads";
    case Payload::TiedGrads: return "tied_grads";
  }
  SPPO_ASSERT(false);
  return "";
}

namespace {

// Streams are used throughout: GCC 12 warns falsely (-Wrestrict) on chains of
// std::string operator+ with literals.
void put_layers(std::ostream& os, const Op& op) {
  os << 'L' << op.layer_begin << '-' << op.layer_end - 1;
}

void put_subseq(std::ostream& os, const Op& op) {
  os << 's' << op.subseq;
  if (op.pieces > 1) os << " p" << op.piece << '/' << op.pieces;
}

void put_tokens(std::ostream& os, const Op& op) {
  if (op.tokens > 0) os << " t" << op.tokens;
}

void put_fraction(std::ostream& os, double f) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", f);
  os << buf;
}

}  // namespace

std::string to_string(const Op& op) {
  std::ostringstream os;
  os << to_string(op.kind) << ' ';
  switch (op.kind) {
    case OpKind::Forward:
    case OpKind::Backward:
      put_layers(os, op);
      os << ' ';
      put_subseq(os, op);
      if (!op.group.empty()) {
        os << " [";
        for (size_t k = 0; k < op.group.size(); ++k) os << (k ? "," : "") << op.group[k];
        os << ']';
      }
      break;
    case OpKind::Offload:
    case OpKind::Prefetch:
      if (op.layer_end > op.layer_begin) put_layers(os, op), os << ' ';  // a layer's part
      put_subseq(os, op);
      os << ' ';
      put_fraction(os, op.fraction);
      break;
    case OpKind::WaitOffload:
    case OpKind::WaitPrefetch:
      if (op.layer_end > op.layer_begin) put_layers(os, op), os << ' ';
      put_subseq(os, op);
      break;
    case OpKind::Send:
    case OpKind::Recv:
      os << to_string(op.payload) << ' ';
      put_subseq(os, op);
      put_tokens(os, op);
      if (op.first >= 0) os << " @" << op.first;
      os << (op.kind == OpKind::Send ? " -> r" : " <- r") << op.peer;
      break;
    case OpKind::RingStep:
      os << to_string(op.payload) << ' ';
      put_layers(os, op);
      os << ' ';
      put_subseq(os, op);
      os << " step" << op.step;
      put_tokens(os, op);
      os << " -> r" << op.peer << " <- r" << op.recv_peer;
      break;
    case OpKind::AllToAll:
      os << to_string(op.payload) << ' ';
      put_layers(os, op);
      os << ' ';
      put_subseq(os, op);
      os << " [";
      for (size_t k = 0; k < op.group.size(); ++k) os << (k ? "," : "") << op.group[k];
      os << ']';
      break;
    case OpKind::AllGather:
    case OpKind::ReduceScatter:
    case OpKind::AllReduce:
      os << to_string(op.payload) << ' ';
      if (op.payload != Payload::TiedGrads) put_layers(os, op), os << ' ';
      os << '[';
      for (size_t k = 0; k < op.group.size(); ++k) os << (k ? "," : "") << op.group[k];
      os << ']';
      break;
  }
  return os.str();
}

std::string to_string(const Schedule& s) {
  std::ostringstream os;
  const Placements& pl = s.place;
  os << "schedule ranks=" << s.ranks() << " layers=" << s.layers << " lengths=";
  for (size_t i = 0; i < s.lengths.size(); ++i) os << (i ? "," : "") << s.lengths[i];
  if (s.par.cp > 1 && s.par.ring_layout != RingLayout::Contiguous) os << " ring=" << to_string(s.par.ring_layout);
  if (s.par.zero != ZeroStage::None) os << " zero=" << stage_number(s.par.zero);
  if (pl.any_kv_streamed()) {
    os << " kv=";
    for (size_t l = 0; l < pl.kv.size(); ++l) os << (l ? "," : "") << to_string(pl.kv[l]);
  }
  if (pl.recompute) os << " recompute=" << recompute_tensors_text(pl.recompute);
  if (pl.mlp_tile_rows) os << " mlp_tile_rows=" << pl.mlp_tile_rows;
  if (pl.backward != BackwardOrder::Subseq) os << " backward=" << to_string(pl.backward);
  if (pl.weights_host()) os << " weights=host";
  if (pl.residual_host()) os << " residual=host";
  if (pl.any_input_rebuilt()) {
    os << " rebuilt=";
    bool first = true;
    for (int l = 0; l < s.layers; ++l)
      if (pl.input_rebuilt(l)) os << (std::exchange(first, false) ? "" : ",") << l;
  }
  os << '\n';
  for (size_t r = 0; r < s.ops.size(); ++r) {
    os << "rank " << r << ":\n";
    for (const Op& op : s.ops[r]) os << "  " << to_string(op) << '\n';
  }
  return os.str();
}

}  // namespace sppo::sched
