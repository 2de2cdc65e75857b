#include "runtime/ulysses.h"

#include <algorithm>
#include <string>

#include "core/check.h"

namespace sppo {

namespace {

const char* exchange_name(UlyssesExchange x) {
  switch (x) {
    case UlyssesExchange::Heads: return "queries, keys and values to their heads' members";
    case UlyssesExchange::Rows: return "attention output back to its rows' members";
    case UlyssesExchange::GradHeads: return "output gradients to their heads' members";
    case UlyssesExchange::GradRows: return "dq, dK, dV back to their rows' members";
  }
  return "";
}

// The part of the piece (its parts(), in row order) that holds position `pos`: a member's
// rows lie inside the piece's spans and are cut at the same documents, so each of their
// parts lies inside one of the piece's.
const PosSpan& part_holding(const std::vector<PosSpan>& parts, i64 pos) {
  for (const PosSpan& p : parts)
    if (p.pos0 <= pos && pos < p.pos0 + p.rows) return p;
  SPPO_ASSERT_MSG(false, "position " << pos << " is not in the piece");
  return parts.front();
}

char* bytes(void* p) { return static_cast<char*>(p); }
const char* bytes(const void* p) { return static_cast<const char*>(p); }

}  // namespace

UlyssesBuffers ulysses_buffers_from(const std::vector<void*>& ptrs) {
  SPPO_ASSERT(ptrs.size() >= std::size_t(kUlyssesBuffers));
  const void* const* t = ptrs.data() + (ptrs.size() - std::size_t(kUlyssesBuffers));
  auto f = [](const void* p) { return static_cast<float*>(const_cast<void*>(p)); };
  auto v = [](const void* p) { return const_cast<void*>(p); };
  return {v(t[0]), v(t[1]), f(t[2]), f(t[3]), v(t[4]), v(t[5]), f(t[6]), f(t[7]), v(t[8]), v(t[9]), v(t[10])};
}

UlyssesAttention::UlyssesAttention(const UlyssesContext& ctx, BlockAttention& inner)
    : ctx_(ctx), inner_(inner), act_(DType::F32) {
  const int U = size();
  SPPO_ASSERT(U > 1 && ctx.me >= 0 && ctx.me < U && int(ctx.rows.size()) == U);
  view_ = attention_view(ctx.model, TpShard{ctx.me, U});
  for (int j = 0; j < U; ++j) {
    rows_.push_back(piece_range(ctx.piece.T, j, U));
    heads_.push_back(TpShard{j, U});
    SPPO_ASSERT(ctx.rows[std::size_t(j)].T == rows_.back().second - rows_.back().first);
  }
}

template <typename Pack, typename Unpack>
void UlyssesAttention::exchange(Backend& be, UlyssesExchange x, Pack pack, Unpack unpack) {
  const int U = size(), me = ctx_.me;
  const ActPrecision p = act_ == DType::F32 ? ActPrecision::F32 : ActPrecision::BF16;
  const i64 T = ctx_.piece.T;
  comm::Counts send(static_cast<std::size_t>(U)), recv(static_cast<std::size_t>(U));
  i64 at = 0;
  for (int j = 0; j < U; ++j) {
    const i64 n = pack(j, bytes(ctx_.buf.send) + at);
    SPPO_ASSERT_MSG(n == ulysses_block_bytes(ctx_.model, T, p, me, j, U, x),
                    "a Ulysses block of " << n << " bytes where Note [Ulysses exchanges] has "
                                          << ulysses_block_bytes(ctx_.model, T, p, me, j, U, x));
    send[std::size_t(j)] = n;
    at += n;
  }
  for (int w = 0; w < U; ++w) recv[std::size_t(w)] = ulysses_block_bytes(ctx_.model, T, p, w, me, U, x);
  be.synchronize();  // the blocks are packed
  const double waited = comm::wait_spinning(
      *ctx_.comm, ctx_.comm->ialltoall(ctx_.buf.send, send, ctx_.buf.recv, recv, comm::Type::U8, ctx_.members),
      std::string("the Ulysses all-to-all of the ") + exchange_name(x));
  if (ctx_.waited_s) *ctx_.waited_s += waited;
  at = 0;
  for (int w = 0; w < U; ++w) {
    unpack(w, bytes(ctx_.buf.recv) + at);
    at += recv[std::size_t(w)];
  }
}

void UlyssesAttention::forward(Backend& be, BlockSaved& s, const ModelConfig& c, const Subseq& q,
                               const Workspace& scratch) {
  act_ = be.act();
  const i64 e = dtype_bytes(act_), A = c.head_size(), QW = c.q_width() * e, KV = c.kv_width() * e;
  const int me = ctx_.me;
  const i64 Tl = q.T;
  const TpShard mine = heads_[std::size_t(me)];
  const i64 q_me = mine.local_hidden(c) * e, kv_me = mine.local_kv_width(c) * e;  // bytes a row
  const std::vector<PosSpan> piece_parts = ctx_.piece.parts();
  // Heads: this member's rows of each member's heads' q, k, v; the piece's rows of its own.
  exchange(
      be, UlyssesExchange::Heads,
      [&](int j, char* at) {
        const auto [z0, z1] = heads_[std::size_t(j)].heads(c);
        const auto [g0, g1] = heads_[std::size_t(j)].kv_heads(c);
        const i64 qw = (z1 - z0) * A * e, kw = (g1 - g0) * A * e;
        be.copy_2d(at, qw, bytes(s.q) + z0 * A * e, QW, qw, Tl);
        be.copy_2d(at + Tl * qw, kw, bytes(s.k) + g0 * A * e, KV, kw, Tl);
        be.copy_2d(at + Tl * (qw + kw), kw, bytes(s.v) + g0 * A * e, KV, kw, Tl);
        return Tl * (qw + 2 * kw);
      },
      [&](int w, const char* at) {
        const auto [b, end] = rows_[std::size_t(w)];
        const i64 n = end - b;
        be.copy_2d(bytes(ctx_.buf.q) + b * q_me, n * q_me, at, n * q_me, n * q_me, 1);
        be.copy_2d(bytes(ctx_.k_cache) + b * kv_me, n * kv_me, at + n * q_me, n * kv_me, n * kv_me, 1);
        be.copy_2d(bytes(ctx_.v_cache) + b * kv_me, n * kv_me, at + n * (q_me + kv_me), n * kv_me, n * kv_me, 1);
      });
  BlockSaved heads = s;
  heads.q = ctx_.buf.q;
  heads.k = ctx_.k_cache;
  heads.v = ctx_.v_cache;
  heads.attn_out = ctx_.buf.o;
  heads.lse = ctx_.buf.lse;
  inner_.forward(be, heads, view_, ctx_.piece, scratch);
  // Rows: each member's rows of this member's heads' output and LSE.
  const i64 Zme = mine.local_heads(c), Z = c.heads;
  exchange(
      be, UlyssesExchange::Rows,
      [&](int j, char* at) {
        const auto [b, end] = rows_[std::size_t(j)];
        const i64 n = end - b;
        be.copy_2d(at, n * q_me, bytes(ctx_.buf.o) + b * q_me, n * q_me, n * q_me, 1);
        char* out = at + n * q_me;
        for (const PosSpan& part : ctx_.rows[std::size_t(j)].parts()) {
          const PosSpan& whole = part_holding(piece_parts, part.pos0);
          const i64 off = part.pos0 - whole.pos0, w = i64(part.rows) * 4;
          be.copy_2d(out, w, ctx_.buf.lse + Zme * whole.row0 + off, i64(whole.rows) * 4, w, Zme);
          out += Zme * w;
        }
        return n * (q_me + 4 * Zme);
      },
      [&](int w, const char* at) {
        const auto [z0, z1] = heads_[std::size_t(w)].heads(c);
        const i64 qw = (z1 - z0) * A * e;
        be.copy_2d(bytes(s.attn_out) + z0 * A * e, QW, at, qw, qw, Tl);
        const char* in = at + Tl * qw;
        for (const PosSpan& part : q.parts()) {
          const i64 pw = i64(part.rows) * 4;
          be.copy_2d(s.lse + Z * part.row0 + z0 * part.rows, pw, in, pw, pw, z1 - z0);
          in += (z1 - z0) * pw;
        }
      });
}

void UlyssesAttention::backward(Backend& be, void* dqkv, const void* dout, const float* delta, const BlockSaved& s,
                                float* dk_self, float* dv_self, const ModelConfig& c, const Subseq& q,
                                const Workspace& scratch) {
  act_ = be.act();
  const i64 e = dtype_bytes(act_), A = c.head_size(), QW = c.q_width() * e;
  const int me = ctx_.me;
  const i64 Tl = q.T, T = ctx_.piece.T, Z = c.heads;
  const TpShard mine = heads_[std::size_t(me)];
  const i64 Zme = mine.local_heads(c), q_me = mine.local_hidden(c) * e, kv_me = mine.local_kv_width(c);
  const std::vector<PosSpan> piece_parts = ctx_.piece.parts();
  // GradHeads: this member's rows of each member's heads' q, output gradient, LSE and delta.
  exchange(
      be, UlyssesExchange::GradHeads,
      [&](int j, char* at) {
        const auto [z0, z1] = heads_[std::size_t(j)].heads(c);
        const i64 qw = (z1 - z0) * A * e;
        be.copy_2d(at, qw, bytes(s.q) + z0 * A * e, QW, qw, Tl);
        be.copy_2d(at + Tl * qw, qw, bytes(dout) + z0 * A * e, QW, qw, Tl);
        char* out = at + 2 * Tl * qw;
        for (const float* stat : {static_cast<const float*>(s.lse), delta})
          for (const PosSpan& part : q.parts()) {
            const i64 pw = i64(part.rows) * 4;
            be.copy_2d(out, pw, stat + Z * part.row0 + z0 * part.rows, pw, pw, z1 - z0);
            out += (z1 - z0) * pw;
          }
        return Tl * (2 * qw + 8 * (z1 - z0));
      },
      [&](int w, const char* at) {
        const auto [b, end] = rows_[std::size_t(w)];
        const i64 n = end - b;
        be.copy_2d(bytes(ctx_.buf.q) + b * q_me, n * q_me, at, n * q_me, n * q_me, 1);
        be.copy_2d(bytes(ctx_.buf.o) + b * q_me, n * q_me, at + n * q_me, n * q_me, n * q_me, 1);
        const char* in = at + 2 * n * q_me;
        for (float* stat : {ctx_.buf.lse, ctx_.buf.delta})
          for (const PosSpan& part : ctx_.rows[std::size_t(w)].parts()) {
            const PosSpan& whole = part_holding(piece_parts, part.pos0);
            const i64 off = part.pos0 - whole.pos0, pw = i64(part.rows) * 4;
            be.copy_2d(stat + Zme * whole.row0 + off, i64(whole.rows) * 4, in, pw, pw, Zme);
            in += Zme * pw;
          }
      });
  BlockSaved heads = s;
  heads.q = ctx_.buf.q;
  heads.k = ctx_.k_cache;
  heads.v = ctx_.v_cache;
  heads.attn_out = nullptr;  // the inner backward reads the output only through delta
  heads.lse = ctx_.buf.lse;
  inner_.backward(be, ctx_.buf.dq, ctx_.buf.o, ctx_.buf.delta, heads, ctx_.dk_cache, ctx_.dv_cache, view_, ctx_.piece,
                  scratch);
  // The replicas of a key/value head each added their own queries' part: the sum is the
  // piece's complete dK, dV, which the first replica returns.
  if (ctx_.replicas.size() > 1) {
    be.synchronize();
    for (float* sums : {ctx_.dk_cache, ctx_.dv_cache}) {
      const double waited = comm::wait_spinning(
          *ctx_.comm, ctx_.comm->iallreduce(sums, T * kv_me, comm::Type::F32, ctx_.replicas),
          "the Ulysses key/value replicas' sum of dK, dV");
      if (ctx_.waited_s) *ctx_.waited_s += waited;
    }
  }
  // The inner attention's dq: dense [T, Zu A] for a Llama-family model, else columns
  // [0, Zu A) of [T, 3 Zu A] (BlockAttention::backward); the block's likewise on its rows.
  const i64 dq_pitch = view_.llama() ? q_me : 3 * q_me, block_pitch = c.llama() ? QW : 3 * c.hidden * e;
  const bool first = me % mine.kv_replicas(c) == 0;
  // GradRows: each member's rows of this member's heads' dq and, from a head's first
  // replica, of its complete dK, dV.
  exchange(
      be, UlyssesExchange::GradRows,
      [&](int j, char* at) {
        const auto [b, end] = rows_[std::size_t(j)];
        const i64 n = end - b, kw = kv_me * 4;
        be.copy_2d(at, q_me, bytes(ctx_.buf.dq) + b * dq_pitch, dq_pitch, q_me, n);
        if (!first) return n * q_me;
        be.copy_2d(at + n * q_me, n * kw, bytes(ctx_.dk_cache) + b * kw, n * kw, n * kw, 1);
        be.copy_2d(at + n * (q_me + kw), n * kw, bytes(ctx_.dv_cache) + b * kw, n * kw, n * kw, 1);
        return n * (q_me + 2 * kw);
      },
      [&](int w, const char* at) {
        const TpShard& h = heads_[std::size_t(w)];
        const auto [z0, z1] = h.heads(c);
        const i64 qw = (z1 - z0) * A * e;
        be.copy_2d(bytes(dqkv) + z0 * A * e, block_pitch, at, qw, qw, Tl);
        if (w % h.kv_replicas(c) != 0) return;
        const auto [g0, g1] = h.kv_heads(c);
        const i64 kw = (g1 - g0) * A * 4, row = i64(c.kv_width()) * 4;
        be.copy_2d(bytes(dk_self) + g0 * A * 4, row, at + Tl * qw, kw, kw, Tl);
        be.copy_2d(bytes(dv_self) + g0 * A * 4, row, at + Tl * (qw + kw), kw, kw, Tl);
      });
}

}  // namespace sppo
