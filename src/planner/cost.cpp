#include "planner/cost.h"

#include <algorithm>

#include "core/check.h"

namespace sppo::plan {

using sched::Op;
using sched::OpKind;
using sched::Payload;
using sched::Schedule;

CostModel::CostModel(const HardwareProfile& hw, const ModelConfig& model, ActPrecision precision)
    : hw_(hw), model_(model), precision_(precision) {
  act_bytes_ = precision == ActPrecision::F32 ? 4 : 2;
  kv_per_token_ = skeletal_bytes_per_token(model, precision);
  gemm_rate_ = hw.gemm_rate(model.hidden);
  attention_rate_ = hw.attention_rate(model.head_size());
}

double CostModel::gemm_flops(i64 tokens) const {
  return double(tokens) * 2.0 * model_.layer_matmul_params();
}

double CostModel::attention_flops(i64 o, i64 b, i64 e, i64 keys) const {
  const double n = double(e - b);
  // Scores and values: 2 Z A FLOPs each a query and key (Note [Head size]: Z A, not H).
  const double QW = model_.q_width();
  // Bidirectional: every query sees the o keys before and all of the subsequence's.
  if (!model_.causal) return 4.0 * QW * n * double(o + (keys > 0 ? keys : e));
  // Causal: sum over q in [b, e) of (o + q + 1)
  const double sum = n * double(o) + (double(e) * double(e + 1) - double(b) * double(b + 1)) / 2;
  return 4.0 * QW * sum;
}

double CostModel::head_flops(i64 tokens) const { return 6.0 * double(tokens) * model_.hidden * model_.vocab; }

double CostModel::attention_flops(i64 o, const sched::Spans& spans, i64 keys) const {
  if (!model_.causal && keys <= 0)
    for (const auto& [b, e] : spans) keys = std::max(keys, e);
  double f = 0;
  for (const auto& [b, e] : spans) f += attention_flops(o, b, e, keys);
  return f;
}

namespace {

// Packed documents: the attention FLOPs of the queries at positions [x, y) of the step (a
// causal model), each against its own document's keys up to itself; `prefix` receives the
// part against keys before position o (an earlier subsequence's). H: the queries' width, Z A.
double packed_attention_flops(double H, const std::vector<i64>& docs, i64 o, i64 x, i64 y, double* prefix) {
  double all = 0, before = 0;
  auto d = std::upper_bound(docs.begin(), docs.end(), x);  // the document of x begins at d[-1]
  const i64 first = d == docs.begin() ? 0 : *(d - 1);
  for (i64 start = first, b = x; b < y; start = *d++) {
    const i64 e = d == docs.end() ? y : std::min(y, *d);
    const double n = double(e - b);
    // sum over p in [b, e) of (p - start + 1) keys; of them, o - start lie before o
    all += (double(e) * double(e + 1) - double(b) * double(b + 1)) / 2 - n * double(start);
    if (start < o) before += n * double(o - start);
    b = e;
    if (d == docs.end()) break;
  }
  *prefix = 4.0 * H * before;
  return 4.0 * H * all;
}

}  // namespace

double CostModel::attention_s(i64 o, const sched::Spans& spans, i64 keys, const std::vector<i64>* docs) const {
  // Every query of the subsequence sees all o keys before it (of its own document when
  // packed): those run at the prefix rate of the span's query rows (each span is a kernel
  // call of its own).
  const bool packed = docs && !docs->empty() && model_.causal;
  double prefix = 0, prefix_s = 0, all = 0;
  for (const auto& [b, e] : spans) {
    double f = 4.0 * model_.q_width() * double(e - b) * double(o);
    if (packed) all += packed_attention_flops(model_.q_width(), *docs, o, o + b, o + e, &f);
    prefix += f;
    if (f > 0) prefix_s += f / hw_.attention_prefix_rate(model_.head_size(), e - b);
  }
  if (!packed) all = attention_flops(o, spans, keys);
  return prefix_s + (all - prefix) / attention_rate_;
}

double CostModel::rsa_attention_s(i64 T, i64 L, bool backward, int tp) const {
  const double scores = double(model_.heads) * double(T) * double(L) / tp;
  const double flops = (backward ? 10.0 : 4.0) * double(T) * double(L) * model_.q_width() / tp;
  double t = flops / hw_.gemm_rate(model_.head_size());
  if (hw_.elementwise_bw > 0)
    t += (backward ? kRsaScoreWordsBackward : kRsaScoreWords) * 4 * scores / hw_.elementwise_bw;
  return t;
}

double CostModel::layer_forward_s(i64 o, const sched::Spans& spans, i64 keys, const std::vector<i64>* docs) const {
  const i64 T = sched::span_tokens(spans);
  double t = gemm_flops(T) / gemm_rate_ + attention_s(o, spans, keys, docs);
  if (hw_.elementwise_bw > 0)
    t += kElementwiseWordsPerToken * model_.hidden * act_bytes_ * double(T) / hw_.elementwise_bw;
  return t + hw_.layer_overhead;
}

double CostModel::layer_backward_s(i64 o, const sched::Spans& spans, i64 keys, const std::vector<i64>* docs) const {
  const i64 T = sched::span_tokens(spans);
  double t = 2 * gemm_flops(T) / gemm_rate_ + 2.5 * attention_s(o, spans, keys, docs);
  if (hw_.elementwise_bw > 0)
    t += 2 * kElementwiseWordsPerToken * model_.hidden * act_bytes_ * double(T) / hw_.elementwise_bw;
  return t + hw_.layer_overhead;
}

double CostModel::tp_collective_s(i64 T, int tp) const {
  if (tp <= 1) return 0;
  // A ring all-gather or reduce-scatter of [T, H]: each member sends and receives (g-1)/g
  // of it; the group is tp consecutive devices (one node when tp <= devices_per_node).
  const bool intra = tp <= hw_.devices_per_node;
  const double bw = intra ? hw_.intra_node_bw : hw_.inter_node_bw;
  const double lat = intra ? hw_.intra_node_latency : hw_.inter_node_latency;
  const double bytes = double(T) * model_.hidden * act_bytes_;
  return double(tp - 1) / tp * bytes / bw + (tp - 1) * lat;
}

CostModel::UlyssesShare CostModel::ulysses_share(const Schedule& s, i64 T) const {
  const int U = s.par.ulysses;
  if (U == 1) return {};
  // The busiest member: the most rows (the first), the most heads (the first as well).
  return {double(UlyssesShard{0, U}.row_count(T)) / double(T),
          double(TpShard{0, U}.local_heads(model_)) / double(model_.heads)};
}

double CostModel::forward_s(const Op& op, const Schedule& s, i64 o) const {
  const sched::Spans spans = s.spans(op);
  const int n = op.layer_end - op.layer_begin, tp = s.par.tp;
  const i64 T = sched::span_tokens(spans);
  if (s.par.ulysses > 1) return ulysses_forward_s(op, s, o);
  // Tensor parallel: every FLOP and element divides over the group; each layer gathers
  // twice and reduce-scatters twice (model/tensor_parallel.h), the embedding once more,
  // and the head gathers its input and reduce-scatters its gradient.
  const i64 keys = s.lengths[std::size_t(op.subseq)];
  double t = n * (layer_forward_s(o, spans, keys, &s.doc_starts) - hw_.layer_overhead) / tp + n * hw_.layer_overhead;
  if (s.rsa_piece(op)) t += n * (rsa_attention_s(T, keys, false, tp) - attention_s(o, spans, keys) / tp);
  // Note [The loss in backward] (core/layout.h): the head may move to the backward.
  const bool head_here = op.layer_end == s.layers && !in_set(s.place.recompute, kSavedHeadGrad);
  if (head_here) t += head_flops(T) / gemm_rate_ / tp;
  if (tp > 1) t += tp_collective_s(T, tp) * (4.0 * n + (op.layer_begin == 0 ? 1 : 0) + (head_here ? 2 : 0));
  return t + n * mlp_tiles_s(T, s.place.mlp_tile_rows) + kv_stream_s(op, s, o, false) + recompute_s(op, s, o, false);
}

namespace {

// How a rank's earlier blocks of subsequence i reach the attention of its T query rows
// (HostKvCache::chunks): chunks of kv_chunk_rows(T) of the rank's rows in position order,
// each split into one piece per span of an earlier block it holds rows of. Alone, a rank
// holds every earlier position (o of them), each subsequence one span; a ring member (and
// an MSP owner on a ring, with its helpers' pieces paired with it) its share, o / R, in
// one span a subsequence (two on a zigzag ring), counted as each adding a piece (at most
// that many start inside a chunk). `queries`: the query spans that meet each chunk (the
// piece's own, or on a ring or MSP task every member's).
struct StreamShape {
  i64 chunks = 0;
  i64 pieces = 0;
  i64 rows = 0;
  i64 queries = 1;
};

StreamShape stream_shape(const Schedule& s, const Op& op, i64 o, i64 T) {
  const i64 C = kv_chunk_rows(T);
  StreamShape sh;
  const bool msp = !op.group.empty();
  const int share = msp ? s.par.cp : op.pieces;
  if (share == 1) {
    for (int j = 0; j < op.subseq; ++j) {
      if (sh.rows % C != 0) ++sh.pieces;  // a block that starts inside a chunk adds a piece to it
      sh.rows += s.lengths[std::size_t(j)];
    }
  } else {
    sh.rows = o / share;
    const bool zigzag = !msp && s.par.ring_layout == RingLayout::Zigzag;
    sh.pieces = i64(op.subseq) * (zigzag ? 2 : 1);
  }
  sh.chunks = (sh.rows + C - 1) / C;
  sh.pieces += sh.chunks;
  if (op.pieces > 1) {
    sh.queries = 0;
    for (int h = 0; h < op.pieces; ++h) sh.queries += i64(s.spans(op, h).size());
  }
  return sh;
}

}  // namespace

double CostModel::kv_stream_s(const Op& op, const Schedule& s, i64 o, bool backward, bool again) const {
  return kv_stream(op, s, o, backward, again, nullptr);
}

CostModel::StreamCopies CostModel::kv_stream_copies(const Op& op, const Schedule& s, i64 o, bool backward,
                                                    bool again) const {
  StreamCopies c;
  kv_stream(op, s, o, backward, again, &c);
  return c;
}

double CostModel::stream_chunks_s(double rows, double block, double summed, double attention, bool backward,
                                  bool sums_back, StreamCopies* copies) const {
  const double share = hw_.copy_compute_share;
  const i64 in_bytes = i64(rows * (sums_back ? block + summed : block));
  const i64 out_bytes = backward ? i64(rows * summed) : 0;
  const double in = h2d_s(in_bytes, backward), out = backward ? d2h_s(out_bytes, true) : 0.0;
  // Note [Streamed chunks]: the share of the copies the compute stream loses, and of the
  // rest what the attention does not cover.
  const double exposed = (1 - share) * std::max(0.0, std::max(in, out) - attention);
  if (copies) {
    copies->in_bytes += in_bytes;
    copies->out_bytes += out_bytes;
    copies->in_s += in;
    copies->out_s += out;
    copies->cover_s += attention;
    copies->exposed_s += exposed;
  }
  return share * (h2d_s(in_bytes, false) + d2h_s(out_bytes, false)) + exposed;
}

double CostModel::layer_stream_s(i64 o, const sched::Spans& spans, i64 l, int sp, int tp,
                                 const StreamedLayer& layer) const {
  if (o == 0) return 0;
  const bool recompute_kv = layer.recompute_kv, backward = layer.backward;
  const double width = double(TpShard{0, tp}.local_kv_width(model_));
  const double block = recompute_kv ? double(act_bytes_) * model_.hidden : 2.0 * act_bytes_ * width;
  const double summed = recompute_kv ? 4.0 * model_.hidden : 2.0 * 4 * width;
  const double attention = (backward ? 2.5 : 1.0) * attention_s(o, spans, l) / tp;
  return stream_chunks_s(double(o / sp), block, summed, attention, backward, layer.sums_back, nullptr);
}

double CostModel::kv_stream(const Op& op, const Schedule& s, i64 o, bool backward, bool again,
                            StreamCopies* copies) const {
  if (!s.place.any_kv_streamed()) return 0;
  // An MSP helper keeps its pieces of another stage's layers on the device.
  if (!op.group.empty() && !s.owned.empty()) {
    const auto [b, e] = s.owned.at(std::size_t(op.group.at(std::size_t(op.piece))));
    if (op.layer_begin < b || op.layer_end > e) return 0;
  }
  const sched::Spans spans = s.spans(op);
  const i64 T = sched::span_tokens(spans);
  // K, V and their sums are the K/V's width: G A of a member's key/value heads.
  const TpShard heads = s.par.ulysses > 1 ? TpShard{0, s.par.ulysses} : TpShard{0, s.par.tp};
  const double width = double(heads.local_kv_width(model_));
  const double kv = 2.0 * act_bytes_ * width, sums = 2.0 * 4 * width;  // bytes a token
  const double x = double(act_bytes_) * model_.hidden;
  // The attention's seconds on one member: the stream hides behind them (backward: 2.5x).
  const double attention = (backward ? 2.5 : 1.0) *
                           attention_s(o, spans, s.lengths[std::size_t(op.subseq)], &s.doc_starts) *
                           double(heads.local_heads(model_)) / double(model_.heads);
  const StreamShape shape = o > 0 ? stream_shape(s, op, o, T) : StreamShape{};
  // Every backward but the first (that of the last subsequence) finds sums that later
  // subsequences' backward left on the host, for its own block and every earlier one.
  const bool sums_back = backward && op.subseq + 1 < int(s.lengths.size());
  double t = 0;
  for (int l = op.layer_begin; l < op.layer_end; ++l) {
    if (!s.place.kv_streamed(l)) continue;
    const bool recompute = s.place.kv_recomputed(l);
    // A Recompute layer's sums are its d(LayerNorm-1 output), H fp32 a position.
    const double summed = recompute ? 4.0 * model_.hidden : sums;
    t += stream_chunks_s(double(shape.rows), recompute ? x : kv, summed, attention, backward, sums_back, copies);
    // A piece's copies: K and V (a Recompute layer: x) in; in backward its sums out, and
    // in once there are some.
    const int tensors = recompute ? 1 : 2;
    const int per_piece = tensors * (1 + (backward ? 1 : 0) + (sums_back ? 1 : 0));
    t += double(shape.pieces) * per_piece * hw_.copy_issue +
         double(shape.chunks * shape.queries) * hw_.attention_chunk;
    if (again) continue;  // a forward run again inside the backward moves nothing of its own
    // The subsequence's own block, waited for whole: K, V out after the forward; before
    // the backward K, V back with their sums (a Recompute layer: the sums only).
    const double own = recompute ? (sums_back ? summed : 0.0) : (backward ? kv + (sums_back ? sums : 0.0) : kv);
    const int own_copies = recompute ? (sums_back ? 1 : 0) : 2 * (1 + (sums_back ? 1 : 0));
    if (own > 0) t += backward ? h2d_s(i64(double(T) * own), false) : d2h_s(i64(double(T) * own), false);
    t += own_copies * hw_.copy_issue;
  }
  return t;
}

double CostModel::recompute_s(const Op& op, const Schedule& s, i64 o, bool backward) const {
  if (s.place.recompute == 0 && !s.place.any_kv_streamed()) return 0;
  const sched::Spans spans = s.spans(op);
  // A Ulysses member recomputes its rows' tensors (the attention and K/V are not recomputed
  // there: setup refuses them).
  const double rows = ulysses_share(s, sched::span_tokens(spans)).rows;
  double t = 0;
  for (int l = op.layer_begin; l < op.layer_end; ++l)
    t += layer_recompute_s(o, spans, s.place.recompute, {.kv = s.place.kv_recomputed(l), .backward = backward},
                           s.par.tp, s.lengths[std::size_t(op.subseq)], &s.doc_starts) *
         rows;
  return t;
}

double CostModel::layer_recompute_s(i64 o, const sched::Spans& spans, SavedSet groups, const RecomputedLayer& layer,
                                    int tp, i64 keys, const std::vector<i64>* docs) const {
  const bool kv = layer.kv, backward = layer.backward;
  const double T = double(sched::span_tokens(spans));
  const double H = model_.hidden, KV = model_.kv_width(), QW = model_.q_width();
  // With query/key norms (Note [Query/key norms]) each key is normed before RoPE: its
  // words again; q's group makes the keys before their norm too.
  const double k_norm = model_.qk_norm ? 2 * KV : 0, qk_norms = model_.qk_norm ? 2 * (QW + KV) : 0;
  // Elementwise words of a token: a LayerNorm reads and writes H twice; RoPE and a
  // residual add read and write H (RoPE on k: KV, the K/V's width G A).
  auto words_s = [&](double words, double tokens) {
    return hw_.elementwise_bw > 0 ? words * act_bytes_ * tokens / hw_.elementwise_bw : 0.0;
  };
  const auto& g = recompute_groups();
  auto has = [&](int k) { return (groups & g[std::size_t(k)].tensors) != 0; };
  double t = 0;
  // K and V of every earlier position, chunk by chunk: LayerNorm, two [KV, H] GEMMs,
  // RoPE; in backward their gradients also go into the layer input's sums and the weight
  // gradients (Note [dK/dV into the layer input], runtime/kv_stream.h): four GEMMs more,
  // and RoPE.
  // A backward that recomputes the attention first recomputes them once more for its
  // forward.
  if (kv) {
    const double passes = backward && has(2) ? 2 : 1;
    t += ((backward ? 12 : 4) + (passes - 1) * 4) * H * KV * double(o) / gemm_rate_ +
         words_s(2 * H + (backward ? 6 : 2) * KV + passes * k_norm + (backward ? k_norm : 0) +
                     (passes - 1) * (2 * H + 2 * KV),
                 double(o));
  }
  if (!backward) return t;
  double flops = 0, words = 0, attention = 0;
  int collectives = 0;
  if (has(0)) words += 2 * H;  // ln1
  if (has(1) || kv) {          // q, and the own K, V of a layer that recomputes them
    // q's group with key norms makes the keys before their norm: the k rows once with K, V.
    const double k_rows = has(1) && model_.qk_norm ? 2 * KV : 0;
    flops += ((has(1) ? 2 * QW : 0) + std::max(k_rows, kv ? 4 * KV : 0.0)) * T * H;
    words += (has(1) ? 2 * QW + qk_norms : 0) + (kv ? 2 * KV + (has(1) ? 0 : k_norm) : 0);
    ++collectives;
  }
  if (has(2)) attention = attention_s(o, spans, keys, docs);
  if (has(3)) flops += 2 * T * H * QW, words += 3 * H, ++collectives;  // x_mid
  if (has(4)) words += 2 * H;                                          // ln2
  if (has(5)) flops += 2 * T * H * model_.fc_width(), ++collectives;   // fc_pre
  return t + (flops / gemm_rate_ + attention + words_s(words, T)) / tp +
         collectives * tp_collective_s(i64(T), tp);
}

// Note [Ulysses, priced]: a Ulysses member runs every per-token part of a layer (GEMMs,
// elementwise traffic, the head, recomputed groups) on its rows of the piece, and the
// attention on every row of the piece for its heads: the busiest member (the first, with the
// most of both) sets the time. The all-to-alls are ops of their own (AllToAll, alltoall_s).
double CostModel::ulysses_forward_s(const Op& op, const Schedule& s, i64 o) const {
  const sched::Spans spans = s.spans(op);
  const int n = op.layer_end - op.layer_begin;
  const i64 T = sched::span_tokens(spans), keys = s.lengths[std::size_t(op.subseq)];
  const UlyssesShare share = ulysses_share(s, T);
  const double attention = attention_s(o, spans, keys, &s.doc_starts);
  const double rest = layer_forward_s(o, spans, keys, &s.doc_starts) - hw_.layer_overhead - attention;
  double t = n * (rest * share.rows + attention * share.heads + hw_.layer_overhead);
  const bool head_here = op.layer_end == s.layers && !in_set(s.place.recompute, kSavedHeadGrad);
  if (head_here) t += head_flops(T) / gemm_rate_ * share.rows;
  const i64 rows = UlyssesShard{0, s.par.ulysses}.row_count(T);
  return t + n * mlp_tiles_s(rows, s.place.mlp_tile_rows) + kv_stream_s(op, s, o, false) +
         recompute_s(op, s, o, false);
}

double CostModel::ulysses_backward_s(const Op& op, const Schedule& s, i64 o) const {
  const sched::Spans spans = s.spans(op);
  const int n = op.layer_end - op.layer_begin;
  const i64 T = sched::span_tokens(spans), keys = s.lengths[std::size_t(op.subseq)];
  const UlyssesShare share = ulysses_share(s, T);
  const double attention = 2.5 * attention_s(o, spans, keys, &s.doc_starts);
  const double rest = layer_backward_s(o, spans, keys, &s.doc_starts) - hw_.layer_overhead - attention;
  double t = n * (rest * share.rows + attention * share.heads + hw_.layer_overhead);
  if (op.layer_end == s.layers && in_set(s.place.recompute, kSavedHeadGrad)) {  // Note [The loss in backward]
    const double F = model_.ffn(), H = model_.hidden;
    const double words = model_.fc_width() + F + 2 * H;
    const double act = hw_.elementwise_bw > 0 ? words * act_bytes_ * double(T) / hw_.elementwise_bw : 0.0;
    t += (2 * double(T) * F * H / gemm_rate_ + act + head_flops(T) / gemm_rate_) * share.rows;
  }
  for (int l = op.layer_begin; l < op.layer_end; ++l)  // Note [Rebuilt layer inputs]: the layer below again
    if (s.place.input_rebuilt(l)) {
      const double again = layer_forward_s(o, spans, keys, &s.doc_starts), a = attention / 2.5;
      t += (again - hw_.layer_overhead - a) * share.rows + a * share.heads + hw_.layer_overhead +
           h2d_s(UlyssesShard{0, s.par.ulysses}.row_count(T) * model_.hidden * act_bytes_, false);
    }
  const i64 rows = UlyssesShard{0, s.par.ulysses}.row_count(T);
  return t + n * mlp_tiles_s(rows, s.place.mlp_tile_rows) + kv_stream_s(op, s, o, true) + recompute_s(op, s, o, true);
}

double CostModel::alltoall_s(const Op& op, const Schedule& s) const {
  i64 most = 0;
  for (int r : op.group) most = std::max(most, sched::alltoall_bytes(s, op, r, model_, precision_));
  // Each exchange sends U - 1 messages a member (pairwise), the group's members consecutive
  // ranks (Note [Rank layout] in core/parallel.h).
  const int U = int(op.group.size());
  int exchanges = 0;
  for (int l = op.layer_begin; l < op.layer_end; ++l)
    exchanges += op.payload == sched::Payload::KVGrad && s.place.input_rebuilt(l) ? 4 : 2;
  const bool intra = same_node(op.group.front(), op.group.back());
  const double bw = intra ? hw_.intra_node_bw : hw_.inter_node_bw;
  const double lat = intra ? hw_.intra_node_latency : hw_.inter_node_latency;
  return double(exchanges) * (U - 1) * lat + double(most) / bw;
}

double CostModel::backward_s(const Op& op, const Schedule& s, i64 o) const {
  const sched::Spans spans = s.spans(op);
  const int n = op.layer_end - op.layer_begin, tp = s.par.tp;
  const i64 keys = s.lengths[std::size_t(op.subseq)];
  if (s.par.ulysses > 1) return ulysses_backward_s(op, s, o);
  double t = n * (layer_backward_s(o, spans, keys, &s.doc_starts) - hw_.layer_overhead) / tp + n * hw_.layer_overhead;
  if (s.rsa_piece(op))
    t += n * (rsa_attention_s(sched::span_tokens(spans), keys, true, tp) - 2.5 * attention_s(o, spans, keys) / tp);
  // Backward gathers four times and reduce-scatters twice a layer, the embedding once.
  if (tp > 1) t += tp_collective_s(sched::span_tokens(spans), tp) * (6.0 * n + (op.layer_begin == 0 ? 1 : 0));
  // A recomputed attention first runs its forward again: on a streamed layer its earlier
  // blocks stream in once more.
  if (s.place.recompute & kAttentionGroup) t += kv_stream_s(op, s, o, false, true);
  // Note [The loss in backward]: the last layer's output again (its MLP activation and the
  // proj GEMM, as the forward's), then the head.
  if (op.layer_end == s.layers && in_set(s.place.recompute, kSavedHeadGrad)) {
    const double T = double(sched::span_tokens(spans)), F = model_.ffn(), H = model_.hidden;
    const double words = model_.fc_width() + F + 2 * H;  // the activation's in and out, the residual add
    const double act = hw_.elementwise_bw > 0 ? words * act_bytes_ * T / hw_.elementwise_bw : 0.0;
    t += (2 * T * F * H / gemm_rate_ + act + head_flops(i64(T)) / gemm_rate_) / tp;
    if (tp > 1) t += 3 * tp_collective_s(i64(T), tp);  // proj's reduce-scatter, the head's two
  }
  // Note [Rebuilt layer inputs] (schedule/builders.cpp): the layer below's forward again,
  // its input copied into the op's buffer (priced as from the host), its K/V recomputed
  // and streamed again where they are recomputed.
  for (int l = op.layer_begin; l < op.layer_end; ++l) {
    if (!s.place.input_rebuilt(l)) continue;
    const i64 T = sched::span_tokens(spans);
    t += layer_forward_s(o, spans, keys, &s.doc_starts) + mlp_tiles_s(T, s.place.mlp_tile_rows) +
         h2d_s(T * model_.hidden * act_bytes_, false);
    if (s.place.kv_recomputed(l - 1))
      t += layer_recompute_s(o, spans, 0, {.kv = true}, 1, keys, &s.doc_starts) +
           layer_stream_s(o, spans, keys, 1, 1, {.recompute_kv = true});
  }
  return t + n * mlp_tiles_s(sched::span_tokens(spans), s.place.mlp_tile_rows) + kv_stream_s(op, s, o, true) +
         recompute_s(op, s, o, true);
}

double CostModel::mlp_tiles_s(i64 T, i64 rows) const {
  if (rows <= 0 || T <= rows) return 0;
  return double((T + rows - 1) / rows - 1) * hw_.layer_overhead * kMlpTileOverheadShare;
}

double CostModel::d2h_s(i64 bytes, bool duplex) const {
  return double(bytes) / (hw_.d2h_bw * (duplex ? hw_.duplex_factor : 1.0));
}

double CostModel::h2d_s(i64 bytes, bool duplex) const {
  return double(bytes) / (hw_.h2d_bw * (duplex ? hw_.duplex_factor : 1.0));
}

double CostModel::host_update_s(i64 params, i64 moved) const {
  if (params == 0) return 0;
  const i64 fp32 = 4 * (moved < 0 ? params : moved);
  const double update = hw_.elementwise_bw > 0 ? double(kHostUpdateBytesPerParam * params) / hw_.elementwise_bw : 0.0;
  return d2h_s(fp32, false) + update + h2d_s(fp32, false);
}

double CostModel::message_s(i64 bytes, int src, int dst) const {
  if (same_node(src, dst)) return hw_.intra_node_latency + double(bytes) / hw_.intra_node_bw;
  return hw_.inter_node_latency + double(bytes) / hw_.inter_node_bw;
}

double CostModel::allreduce_s(i64 bytes, const std::vector<int>& group, bool across_replicas) const {
  const int copies = across_replicas ? replicas_ : 1;
  const int g = int(group.size()) * copies;
  if (g <= 1) return 0;
  bool intra = true;
  for (int d = 0; d < copies; ++d)
    for (int r : group) intra &= same_node(r + d * replica_ranks_, group.front());
  const double bw = intra ? hw_.intra_node_bw : hw_.inter_node_bw;
  const double lat = intra ? hw_.intra_node_latency : hw_.inter_node_latency;
  return 2.0 * (g - 1) / g * double(bytes) / bw + 2.0 * (g - 1) * lat;
}

i64 CostModel::message_bytes(const Op& op, const Schedule& s, int rank) const {
  // Ring steps of a tensor-parallel or Ulysses member move its heads only (members are
  // consecutive ranks).
  const TpShard member = s.tp_shard(rank), heads = s.shard(rank).heads();
  const i64 H = model_.hidden, QW = model_.q_width();  // the ring moves queries: Z A a row
  const int n = std::max(1, op.layer_end - op.layer_begin);
  if (op.kind == OpKind::RingStep) {
    const i64 bytes = (s.rsa_piece(op) ? sched::rsa_step_bytes(s, op, QW, act_bytes_)
                                        : sched::ring_step_bytes(s, op, QW, model_.heads, act_bytes_, model_.causal)) *
                      n;
    return heads.on() ? bytes * heads.local_heads(model_) / model_.heads : bytes;
  }
  i64 tokens = op.tokens;
  if (tokens == 0) tokens = sched::span_tokens(s.spans(op));
  switch (op.payload) {
    case Payload::None: return 0;
    case Payload::Hidden:
    case Payload::HiddenGrad: return tokens * H * act_bytes_;
    // An MSP piece's K, V and fp32 dK, dV: of the member's heads.
    case Payload::KV: return s.par.tp > 1 ? tokens * 2 * member.local_kv_width(model_) * act_bytes_ * n
                                      : tokens * kv_per_token_ * n;
    case Payload::KVGrad: return tokens * 2 * i64(member.local_kv_width(model_)) * 4 * n;
    case Payload::Weights:  // the member's shard
      return sched::param_count(model_, op.layer_begin, op.layer_end, member) * act_bytes_;
    case Payload::WeightGrads:
      // An MSP helper's gradients of the stage it borrowed; from the head's stage, with its
      // loss sum (fp64) and per-position losses (fp32).
      return sched::allreduce_bytes(op, model_, s.layers, member) +
             ((op.kind == OpKind::Send || op.kind == OpKind::Recv) && op.layer_end == s.layers ? 8 + 4 * s.seq_len()
                                                                                                : 0);
    case Payload::TiedGrads: return sched::allreduce_bytes(op, model_, s.layers, member);
  }
  SPPO_ASSERT(false);
  return 0;
}

}  // namespace sppo::plan
