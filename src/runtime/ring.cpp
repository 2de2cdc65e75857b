#include "runtime/ring.h"

#include <cmath>

#include "core/check.h"

namespace sppo {

namespace {

// Ring messages' tags sit above every sched::message_tag (below 2^28) and below the
// trainer's own (2^30).
constexpr int kRingTagBase = 1 << 29;

enum Kind { kQ, kPartOut, kPartLse, kBwdQ, kBwdDout, kBwdLse, kBwdDelta, kDq };

struct Sent {
  comm::Request req;
  std::string what;
};

}  // namespace

int RingAttention::tag(int kind, int origin, int span) const {
  return kRingTagBase + ((((kind * 4096 + (ctx_.subseq & 4095)) * 64 + (ctx_.layer & 63)) * 8 + (origin & 7)) * 2 +
                         (span & 1));
}

int RingAttention::rows_of(int member) const {
  int rows = 0;
  for (const PosSpan& p : ctx_.spans[std::size_t(member)]) rows += p.rows;
  return rows;
}

void RingAttention::wait(comm::Request r, const std::string& what) {
  const double waited = comm::wait(*ctx_.comm, r, what);
  if (ctx_.waited_s) *ctx_.waited_s += waited;
}

// Note [Packed documents on the ring]: the messages stay those of the positional spans
// (ctx_.spans), so that the simulator's counts hold; every rank cuts each span at the
// document starts it knows as well as the owner does (the step's documents are global),
// computes a sub-span at a time, and lays out rows and LSE blocks sub-span after sub-span,
// as the owner's own attention does (an LSE block is [Z, rows] per kernel call). A
// sub-span whose document begins after every key this rank holds gets no keys: output 0,
// LSE -inf, which the merge weighs at nothing.
std::vector<PosSpan> RingAttention::sub_spans(const Subseq& q, const PosSpan& span) {
  Subseq one = q;
  one.spans = {span};
  return one.parts();
}

std::vector<KVRef> RingAttention::local_blocks(const PosSpan& queries, const BlockSaved& s, float* dk_self,
                                               float* dv_self, const Subseq& q, const ModelConfig& c,
                                               DType a) const {
  return attention_key_blocks(past_, s.k, s.v, dk_self, dv_self, q, queries, c, a);
}

void RingAttention::forward(Backend& be, BlockSaved& s, const ModelConfig& c, const Subseq& q,
                            const Workspace& scratch) {
  const int R = size(), me = ctx_.me, Z = c.heads;
  const DType a = be.act();
  const i64 H = c.q_width(), act = dtype_bytes(a);  // the queries' and outputs' rows: Z A
  comm::Comm& cm = *ctx_.comm;
  const int next = ctx_.members[std::size_t((me + 1) % R)], prev = ctx_.members[std::size_t((me + R - 1) % R)];
  const std::string where = " (ring, layer " + std::to_string(ctx_.layer) + ", subseq " + std::to_string(ctx_.subseq) + ")";
  std::vector<Sent> sent;
  std::vector<Buffer> keep;  // buffers of sends in flight

  // The other members' query pieces arrive from the previous member, nearest first.
  std::vector<Buffer> block(static_cast<std::size_t>(R));
  std::vector<comm::Request> block_req(std::size_t(R), comm::kDone);
  for (int t = 1; t < R; ++t) {
    const int g = (me - t + R) % R;
    block[std::size_t(g)] = ctx_.device->alloc(rows_of(g) * H * act, "ring: queries of member " + std::to_string(g));
    block_req[std::size_t(g)] = cm.irecv(block[std::size_t(g)].data(), block[std::size_t(g)].bytes(), prev, tag(kQ, g, 0));
  }
  be.synchronize();
  sent.push_back({cm.isend(s.q, i64(q.T) * H * act, next, tag(kQ, me, 0)), "the send of this rank's queries" + where});

  // Partial results for this rank's spans from every member that holds keys they see.
  const std::vector<PosSpan> mine = ctx_.spans[std::size_t(me)];
  struct Partial {
    Buffer out, lse;
    comm::Request out_req = comm::kDone, lse_req = comm::kDone;
  };
  std::vector<std::vector<Partial>> partial(static_cast<std::size_t>(R));
  for (auto& row : partial) row.resize(mine.size());
  for (int h = 0; h < R; ++h) {
    if (h == me) continue;
    for (std::size_t j = 0; j < mine.size(); ++j) {
      if (!sees(h, mine[j])) continue;
      Partial& p = partial[std::size_t(h)][j];
      p.out = ctx_.device->alloc(mine[j].rows * H * act, "ring: partial attention output");
      p.lse = ctx_.device->alloc(i64(Z) * mine[j].rows * i64(sizeof(float)), "ring: partial LSE");
      p.out_req = cm.irecv(p.out.data(), p.out.bytes(), ctx_.members[std::size_t(h)], tag(kPartOut, h, int(j)));
      p.lse_req = cm.irecv(p.lse.data(), p.lse.bytes(), ctx_.members[std::size_t(h)], tag(kPartLse, h, int(j)));
    }
  }

  // Every query span that meets this rank's streamed earlier blocks, in one pass once the
  // ring has passed; the partials wait for it.
  std::vector<PastQueries> past_queries;
  auto meets_past = [&](const void* q_rows, void* out_rows, float* lse, const PosSpan& sub) {
    if (!streamed_) return;
    PastQueries j;
    j.span = sub;
    j.from = q.doc_start(sub.pos0);
    j.q = q_rows;
    j.ldq = int(H);
    j.out = out_rows;
    j.lse = lse;
    past_queries.push_back(j);
  };
  struct Outgoing {
    Buffer out, lse;
    int owner, span;
  };
  std::vector<Outgoing> outgoing;
  auto send_partial = [&](Outgoing& o) {
    be.synchronize();
    sent.push_back({cm.isend(o.out.data(), o.out.bytes(), o.owner, tag(kPartOut, me, o.span)), "a partial output" + where});
    sent.push_back({cm.isend(o.lse.data(), o.lse.bytes(), o.owner, tag(kPartLse, me, o.span)), "a partial LSE" + where});
  };

  // This rank's own queries against its own keys.
  for (const PosSpan& part : q.parts()) {
    const i64 at = i64(part.row0) * H;
    be.attention_forward(act_at(s.attn_out, at, a), s.lse + i64(Z) * part.row0, act_at(s.q, at, a),
                         local_blocks(part, s, nullptr, nullptr, q, c, a), span_shape(c, part), scratch);
    meets_past(act_at(s.q, at, a), act_at(s.attn_out, at, a), s.lse + i64(Z) * part.row0, part);
  }

  // The ring: each piece is passed on as it arrives, then attended to here.
  for (int t = 1; t < R; ++t) {
    const int g = (me - t + R) % R;
    Buffer& qb = block[std::size_t(g)];
    wait(block_req[std::size_t(g)], "the queries of ring member " + std::to_string(g) + where);
    if (t < R - 1) sent.push_back({cm.isend(qb.data(), qb.bytes(), next, tag(kQ, g, 0)), "a forwarded query piece" + where});
    const auto& spans = ctx_.spans[std::size_t(g)];
    for (std::size_t j = 0; j < spans.size(); ++j) {
      const PosSpan& part = spans[j];
      if (!sees(me, part)) continue;
      Buffer out = ctx_.device->alloc(part.rows * H * act, "ring: partial attention output");
      Buffer lse = ctx_.device->alloc(i64(Z) * part.rows * i64(sizeof(float)), "ring: partial LSE");
      for (const PosSpan& sub : sub_spans(q, part)) {
        const i64 r = sub.row0 - part.row0;  // rows of this span before the sub-span
        void* sub_out = act_at(out.data(), r * H, a);
        float* sub_lse = lse.f32() + i64(Z) * r;
        const void* q_rows = act_at(qb.data(), i64(sub.row0) * H, a);
        const std::vector<KVRef> keys = local_blocks(sub, s, nullptr, nullptr, q, c, a);
        if (keys.empty()) {  // Note [Packed documents on the ring]; or only earlier blocks seen
          be.fill_zero(sub_out, std::size_t(sub.rows * H * act));
          const std::vector<float> none(std::size_t(Z) * std::size_t(sub.rows), -INFINITY);
          be.to_device(sub_lse, none.data(), none.size() * sizeof(float));
        } else {
          be.attention_forward(sub_out, sub_lse, q_rows, keys, span_shape(c, sub), scratch);
        }
        meets_past(q_rows, sub_out, sub_lse, sub);
      }
      outgoing.push_back({std::move(out), std::move(lse), ctx_.members[std::size_t(g)], int(j)});
      if (!streamed_) send_partial(outgoing.back());
    }
    keep.push_back(std::move(qb));
  }
  if (streamed_) {
    streamed_->forward_past(be, c, past_queries, scratch);
    for (Outgoing& o : outgoing) send_partial(o);
  }

  // Join the partials, in member order.
  for (int h = 0; h < R; ++h)
    for (std::size_t j = 0; j < mine.size(); ++j) {
      Partial& p = partial[std::size_t(h)][j];
      if (!p.out) continue;
      const std::string what = "the partial attention of ring member " + std::to_string(h) + where;
      wait(p.out_req, what);
      wait(p.lse_req, what);
      for (const PosSpan& sub : sub_spans(q, mine[j])) {
        const i64 r = sub.row0 - mine[j].row0;
        be.attention_merge(act_at(s.attn_out, i64(sub.row0) * H, a), s.lse + i64(Z) * sub.row0,
                           act_at(p.out.data(), r * H, a), p.lse.f32() + i64(Z) * r, span_shape(c, sub));
      }
    }
  for (const Sent& x : sent) wait(x.req, x.what);
  be.synchronize();
}

void RingAttention::backward(Backend& be, void* dqkv, const void* dout, const float* delta, const BlockSaved& s,
                             float* dk_self, float* dv_self, const ModelConfig& c, const Subseq& q,
                             const Workspace& scratch) {
  const int R = size(), me = ctx_.me, Z = c.heads, T = q.T;
  const DType a = be.act();
  const i64 H = c.q_width(), act = dtype_bytes(a), f32 = sizeof(float);  // Z A, as in forward
  comm::Comm& cm = *ctx_.comm;
  const int next = ctx_.members[std::size_t((me + 1) % R)], prev = ctx_.members[std::size_t((me + R - 1) % R)];
  const std::string where = " (ring backward, layer " + std::to_string(ctx_.layer) + ", subseq " +
                            std::to_string(ctx_.subseq) + ")";
  std::vector<Sent> sent;
  std::vector<Buffer> keep;

  // What travels: q, d attn_out, the final LSE and delta of each piece.
  struct Piece {
    Buffer q, dout, lse, delta;
    comm::Request req[4] = {comm::kDone, comm::kDone, comm::kDone, comm::kDone};
  };
  std::vector<Piece> piece(static_cast<std::size_t>(R));
  for (int t = 1; t < R; ++t) {
    const int g = (me - t + R) % R;
    Piece& p = piece[std::size_t(g)];
    const i64 rows = rows_of(g);
    p.q = ctx_.device->alloc(rows * H * act, "ring: queries of member " + std::to_string(g));
    p.dout = ctx_.device->alloc(rows * H * act, "ring: output gradient of member " + std::to_string(g));
    p.lse = ctx_.device->alloc(Z * rows * f32, "ring: LSE of member " + std::to_string(g));
    p.delta = ctx_.device->alloc(Z * rows * f32, "ring: delta of member " + std::to_string(g));
    p.req[0] = cm.irecv(p.q.data(), p.q.bytes(), prev, tag(kBwdQ, g, 0));
    p.req[1] = cm.irecv(p.dout.data(), p.dout.bytes(), prev, tag(kBwdDout, g, 0));
    p.req[2] = cm.irecv(p.lse.data(), p.lse.bytes(), prev, tag(kBwdLse, g, 0));
    p.req[3] = cm.irecv(p.delta.data(), p.delta.bytes(), prev, tag(kBwdDelta, g, 0));
  }
  be.synchronize();
  {
    const std::string what = "the send of this rank's queries and gradients" + where;
    sent.push_back({cm.isend(s.q, T * H * act, next, tag(kBwdQ, me, 0)), what});
    sent.push_back({cm.isend(dout, T * H * act, next, tag(kBwdDout, me, 0)), what});
    sent.push_back({cm.isend(s.lse, Z * T * f32, next, tag(kBwdLse, me, 0)), what});
    sent.push_back({cm.isend(delta, Z * T * f32, next, tag(kBwdDelta, me, 0)), what});
  }

  // Partial dq of this rank's spans from every member that holds keys they see.
  const std::vector<PosSpan> mine = ctx_.spans[std::size_t(me)];
  std::vector<std::vector<Buffer>> part_dq(static_cast<std::size_t>(R));
  for (auto& row : part_dq) row.resize(mine.size());
  std::vector<std::vector<comm::Request>> part_req(std::size_t(R), std::vector<comm::Request>(mine.size(), comm::kDone));
  for (int h = 0; h < R; ++h) {
    if (h == me) continue;
    for (std::size_t j = 0; j < mine.size(); ++j) {
      if (!sees(h, mine[j])) continue;
      part_dq[std::size_t(h)][j] = ctx_.device->alloc(mine[j].rows * H * act, "ring: partial dq");
      part_req[std::size_t(h)][j] = cm.irecv(part_dq[std::size_t(h)][j].data(), part_dq[std::size_t(h)][j].bytes(),
                                             ctx_.members[std::size_t(h)], tag(kDq, h, int(j)));
    }
  }

  // This rank's own queries: dq over its own keys, and their dK/dV.
  Buffer dq = ctx_.device->alloc_zeroed(T * H * act, "ring: dq");
  // A sub-span that sees none of this rank's keys adds nothing (Note [Packed documents on the ring]).
  auto attend = [&](void* dq_rows, const void* dout_rows, const void* q_rows, const float* lse, const float* dlt,
                    const PosSpan& part) {
    const std::vector<KVRef> keys = local_blocks(part, s, dk_self, dv_self, q, c, a);
    if (!keys.empty()) be.attention_backward(dq_rows, dout_rows, q_rows, keys, lse, dlt, span_shape(c, part), scratch);
  };
  // Every query span that meets this rank's streamed earlier blocks, in one pass once the
  // ring has passed; the partial dq wait for it.
  std::vector<PastQueries> past_queries;
  auto meets_past = [&](void* dq_rows, const void* dout_rows, const void* q_rows, const float* lse, const float* dlt,
                        const PosSpan& part) {
    if (!streamed_) return;
    PastQueries j;
    j.span = part;
    j.from = q.doc_start(part.pos0);
    j.q = q_rows;
    j.ldq = int(H);
    j.dq = dq_rows;
    j.dout = dout_rows;
    j.final_lse = lse;
    j.delta = dlt;
    past_queries.push_back(j);
  };
  struct Outgoing {
    Buffer dq;
    int owner, span;
  };
  std::vector<Outgoing> outgoing;
  auto send_partial = [&](Outgoing& o) {
    be.synchronize();
    sent.push_back({cm.isend(o.dq.data(), o.dq.bytes(), o.owner, tag(kDq, me, o.span)), "a partial dq" + where});
  };
  for (const PosSpan& part : q.parts()) {
    const i64 at = i64(part.row0) * H, z0 = i64(Z) * part.row0;
    attend(act_at(dq.data(), at, a), act_at(dout, at, a), act_at(s.q, at, a), s.lse + z0, delta + z0, part);
    meets_past(act_at(dq.data(), at, a), act_at(dout, at, a), act_at(s.q, at, a), s.lse + z0, delta + z0, part);
  }

  for (int t = 1; t < R; ++t) {
    const int g = (me - t + R) % R;
    Piece& p = piece[std::size_t(g)];
    for (comm::Request r : p.req) wait(r, "the queries and gradients of ring member " + std::to_string(g) + where);
    if (t < R - 1) {
      const std::string what = "a forwarded query piece" + where;
      sent.push_back({cm.isend(p.q.data(), p.q.bytes(), next, tag(kBwdQ, g, 0)), what});
      sent.push_back({cm.isend(p.dout.data(), p.dout.bytes(), next, tag(kBwdDout, g, 0)), what});
      sent.push_back({cm.isend(p.lse.data(), p.lse.bytes(), next, tag(kBwdLse, g, 0)), what});
      sent.push_back({cm.isend(p.delta.data(), p.delta.bytes(), next, tag(kBwdDelta, g, 0)), what});
    }
    const auto& spans = ctx_.spans[std::size_t(g)];
    for (std::size_t j = 0; j < spans.size(); ++j) {
      const PosSpan& part = spans[j];
      if (!sees(me, part)) continue;
      Buffer pdq = ctx_.device->alloc_zeroed(part.rows * H * act, "ring: partial dq");
      for (const PosSpan& sub : sub_spans(q, part)) {
        const i64 at = i64(sub.row0) * H, z0 = i64(Z) * sub.row0;
        void* dq_rows = act_at(pdq.data(), i64(sub.row0 - part.row0) * H, a);
        attend(dq_rows, act_at(p.dout.data(), at, a), act_at(p.q.data(), at, a), p.lse.f32() + z0,
               p.delta.f32() + z0, sub);
        meets_past(dq_rows, act_at(p.dout.data(), at, a), act_at(p.q.data(), at, a), p.lse.f32() + z0,
                   p.delta.f32() + z0, sub);
      }
      outgoing.push_back({std::move(pdq), ctx_.members[std::size_t(g)], int(j)});
      if (!streamed_) send_partial(outgoing.back());
    }
    keep.push_back(std::move(p.q));
    keep.push_back(std::move(p.dout));
    keep.push_back(std::move(p.lse));
    keep.push_back(std::move(p.delta));
  }

  if (streamed_) {
    streamed_->backward_past(be, c, past_queries, scratch);
    for (Outgoing& o : outgoing) send_partial(o);
  }

  // Sum the partial dq, in member order, into dq's columns of dqkv.
  for (int h = 0; h < R; ++h)
    for (std::size_t j = 0; j < mine.size(); ++j) {
      if (!part_dq[std::size_t(h)][j]) continue;
      wait(part_req[std::size_t(h)][j], "the partial dq of ring member " + std::to_string(h) + where);
      be.add_inplace(act_at(dq.data(), i64(mine[j].row0) * H, a), part_dq[std::size_t(h)][j].data(),
                     i64(mine[j].rows) * H);
    }
  // (A Llama-family block takes dq dense: BlockAttention::backward.)
  be.put_cols(dqkv, dq.data(), false, T, int(H), c.llama() ? int(H) : 3 * int(H), 0);
  for (const Sent& x : sent) wait(x.req, x.what);
  be.synchronize();
}

}  // namespace sppo

namespace sppo {

namespace {

// Above the one-pass ring's tags (kRingTagBase + 2^25 and up).
constexpr int kRsaTagBase = (1 << 29) + (1 << 25);

enum RsaKind { kRsaK, kRsaV, kRsaBwdK, kRsaBwdV, kRsaBwdK2, kRsaDk, kRsaDv };

}  // namespace

int RsaAttention::tag(int kind, int origin) const {
  return kRsaTagBase + (((kind * 4096 + (ctx_.subseq & 4095)) * 64 + (ctx_.layer & 63)) * 8 + (origin & 7));
}

int RsaAttention::rows_of(int member) const {
  int rows = 0;
  for (const PosSpan& p : ctx_.spans[std::size_t(member)]) rows += p.rows;
  return rows;
}

i64 RsaAttention::col_of(int member) const {
  i64 col = 0;
  for (int g = 0; g < member; ++g) col += rows_of(g);
  return col;
}

void RsaAttention::circulate(Backend& be, const std::vector<const void*>& arrays, int kind,
                             const std::function<void(int, const std::vector<const void*>&)>& f, i64 row_bytes) {
  const int R = size(), me = ctx_.me;
  comm::Comm& cm = *ctx_.comm;
  const int next = ctx_.members[std::size_t((me + 1) % R)], prev = ctx_.members[std::size_t((me + R - 1) % R)];
  const std::string where = " (RSA ring, layer " + std::to_string(ctx_.layer) + ")";
  std::vector<std::vector<Buffer>> bufs(static_cast<std::size_t>(R));
  std::vector<std::vector<comm::Request>> reqs(static_cast<std::size_t>(R));
  for (int t = 1; t < R; ++t) {
    const int g = (me - t + R) % R;
    for (std::size_t a = 0; a < arrays.size(); ++a) {
      bufs[std::size_t(g)].push_back(ctx_.device->alloc(rows_of(g) * row_bytes, "RSA ring: a member's block"));
      reqs[std::size_t(g)].push_back(cm.irecv(bufs[std::size_t(g)].back().data(), bufs[std::size_t(g)].back().bytes(),
                                              prev, tag(kind + int(a), g)));
    }
  }
  be.synchronize();
  std::vector<comm::Request> sent;
  for (std::size_t a = 0; a < arrays.size(); ++a)
    sent.push_back(cm.isend(arrays[a], rows_of(me) * row_bytes, next, tag(kind + int(a), me)));
  f(me, arrays);
  for (int t = 1; t < R; ++t) {
    const int g = (me - t + R) % R;
    std::vector<const void*> got;
    for (std::size_t a = 0; a < arrays.size(); ++a) {
      const double waited = comm::wait(cm, reqs[std::size_t(g)][a], "a block of ring member " + std::to_string(g) + where);
      if (ctx_.waited_s) *ctx_.waited_s += waited;
      got.push_back(bufs[std::size_t(g)][a].data());
      if (t < R - 1) sent.push_back(cm.isend(got.back(), bufs[std::size_t(g)][a].bytes(), next, tag(kind + int(a), g)));
    }
    f(g, got);
  }
  for (comm::Request r : sent) {
    const double waited = comm::wait(cm, r, "a send of the RSA ring" + where);
    if (ctx_.waited_s) *ctx_.waited_s += waited;
  }
}

void RsaAttention::forward(Backend& be, BlockSaved& s, const ModelConfig& c, const Subseq& q, const Workspace&) {
  SPPO_ASSERT(be.act() == DType::F32);
  const int Z = c.heads, A = c.head_size(), H = c.hidden, T = q.T;
  const i64 S = cols();
  const float scale = float(1.0 / std::sqrt(double(A)));
  Buffer scores = ctx_.device->alloc(i64(Z) * T * S * i64(sizeof(float)), "RSA: score rows");
  float* p = scores.f32();
  const DType f32 = DType::F32;
  // Pass 1: keys go round; this rank's queries' scores against every member's keys.
  circulate(
      be, {s.k}, kRsaK,
      [&](int g, const std::vector<const void*>& k) {
        for (int z = 0; z < Z; ++z)
          be.gemm(false, true, T, rows_of(g), A, scale, act_at(s.q, i64(z) * A, f32), H, act_at(k[0], i64(z) * A, f32), H,
                  0.0f, p + i64(z) * T * S + col_of(g), int(S), f32, f32);
      },
      i64(H) * i64(sizeof(float)));
  be.softmax_rows(p, s.lse, i64(Z) * T, int(S), false);
  // Pass 2: values go round; out = P V, block by block (this rank's first).
  circulate(
      be, {s.v}, kRsaV,
      [&](int g, const std::vector<const void*>& v) {
        for (int z = 0; z < Z; ++z)
          be.gemm(false, false, T, A, rows_of(g), 1.0f, p + i64(z) * T * S + col_of(g), int(S),
                  act_at(v[0], i64(z) * A, f32), H, g == ctx_.me ? 0.0f : 1.0f, act_at(s.attn_out, i64(z) * A, f32), H,
                  f32, f32);
      },
      i64(H) * i64(sizeof(float)));
  be.synchronize();
}

void RsaAttention::backward(Backend& be, void* dqkv, const void* dout, const float*, const BlockSaved& s,
                            float* dk_self, float* dv_self, const ModelConfig& c, const Subseq& q, const Workspace&) {
  SPPO_ASSERT(be.act() == DType::F32);
  const int Z = c.heads, A = c.head_size(), H = c.hidden, T = q.T, R = size(), me = ctx_.me;
  const i64 S = cols(), row = i64(H) * i64(sizeof(float));
  const float scale = float(1.0 / std::sqrt(double(A)));
  const DType f32 = DType::F32;
  comm::Comm& cm = *ctx_.comm;
  Buffer pbuf = ctx_.device->alloc(i64(Z) * T * S * i64(sizeof(float)), "RSA: probabilities");
  Buffer dbuf = ctx_.device->alloc(i64(Z) * T * S * i64(sizeof(float)), "RSA: score gradients");
  float* p = pbuf.f32();
  float* ds = dbuf.f32();
  // This rank's keys' dK, dV from every other member's queries.
  std::vector<Buffer> in_dk(static_cast<std::size_t>(R)), in_dv(static_cast<std::size_t>(R));
  std::vector<comm::Request> in_req;
  for (int h = 0; h < R; ++h) {
    if (h == me) continue;
    in_dk[std::size_t(h)] = ctx_.device->alloc(T * row, "RSA: dK from a member");
    in_dv[std::size_t(h)] = ctx_.device->alloc(T * row, "RSA: dV from a member");
    in_req.push_back(cm.irecv(in_dk[std::size_t(h)].data(), T * row, ctx_.members[std::size_t(h)], tag(kRsaDk, h)));
    in_req.push_back(cm.irecv(in_dv[std::size_t(h)].data(), T * row, ctx_.members[std::size_t(h)], tag(kRsaDv, h)));
  }
  // Keys and values go round: the scores again (P from the saved LSE) and dP = dO V^T.
  circulate(
      be, {s.k, s.v}, kRsaBwdK,
      [&](int g, const std::vector<const void*>& kv) {
        const i64 col = col_of(g);
        for (int z = 0; z < Z; ++z) {
          be.gemm(false, true, T, rows_of(g), A, scale, act_at(s.q, i64(z) * A, f32), H, act_at(kv[0], i64(z) * A, f32),
                  H, 0.0f, p + i64(z) * T * S + col, int(S), f32, f32);
          be.gemm(false, true, T, rows_of(g), A, 1.0f, act_at(dout, i64(z) * A, f32), H, act_at(kv[1], i64(z) * A, f32),
                  H, 0.0f, ds + i64(z) * T * S + col, int(S), f32, f32);
        }
      },
      row);
  be.softmax_rows(p, s.lse, i64(Z) * T, int(S), true);
  be.softmax_backward_rows(ds, p, i64(Z) * T, int(S));  // dS = P (dP - rowsum(dP P))
  // Every member's dK = scale dS^T Q and dV = P^T dO for this rank's queries.
  std::vector<Buffer> out;
  std::vector<comm::Request> out_req;
  for (int g = 0; g < R; ++g) {
    const int Tg = rows_of(g);
    const i64 col = col_of(g);
    float* dk = dk_self;
    float* dv = dv_self;
    if (g != me) {
      out.push_back(ctx_.device->alloc(Tg * row, "RSA: dK for a member"));
      dk = out.back().f32();
      out.push_back(ctx_.device->alloc(Tg * row, "RSA: dV for a member"));
      dv = out.back().f32();
    }
    const float beta = g == me ? 1.0f : 0.0f;
    for (int z = 0; z < Z; ++z) {
      be.gemm(true, false, Tg, A, T, scale, ds + i64(z) * T * S + col, int(S), act_at(s.q, i64(z) * A, f32), H, beta,
              dk + i64(z) * A, H, f32, f32);
      be.gemm(true, false, Tg, A, T, 1.0f, p + i64(z) * T * S + col, int(S), act_at(dout, i64(z) * A, f32), H, beta,
              dv + i64(z) * A, H, f32, f32);
    }
    if (g != me) {
      be.synchronize();
      out_req.push_back(cm.isend(dk, Tg * row, ctx_.members[std::size_t(g)], tag(kRsaDk, me)));
      out_req.push_back(cm.isend(dv, Tg * row, ctx_.members[std::size_t(g)], tag(kRsaDv, me)));
    }
  }
  // Keys go round once more: dQ = scale dS K.
  Buffer dq = ctx_.device->alloc(T * row, "RSA: dq");
  circulate(
      be, {s.k}, kRsaBwdK2,
      [&](int g, const std::vector<const void*>& k) {
        for (int z = 0; z < Z; ++z)
          be.gemm(false, false, T, A, rows_of(g), scale, ds + i64(z) * T * S + col_of(g), int(S),
                  act_at(k[0], i64(z) * A, f32), H, g == me ? 0.0f : 1.0f, act_at(dq.data(), i64(z) * A, f32), H, f32,
                  f32);
      },
      row);
  be.put_cols(dqkv, dq.data(), false, T, H, 3 * H, 0);
  // The other members' contributions to this rank's dK, dV, in member order.
  for (comm::Request r : in_req) {
    const double waited = comm::wait(cm, r, "dK, dV from the RSA ring");
    if (ctx_.waited_s) *ctx_.waited_s += waited;
  }
  for (int h = 0; h < R; ++h) {
    if (h == me) continue;
    be.add_inplace(dk_self, in_dk[std::size_t(h)].data(), i64(T) * H);
    be.add_inplace(dv_self, in_dv[std::size_t(h)].data(), i64(T) * H);
  }
  for (comm::Request r : out_req) {
    const double waited = comm::wait(cm, r, "a send of dK, dV in the RSA ring");
    if (ctx_.waited_s) *ctx_.waited_s += waited;
  }
  be.synchronize();
}

}  // namespace sppo
