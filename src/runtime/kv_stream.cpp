#include "runtime/kv_stream.h"

#include <algorithm>
#include <optional>
#include <string>

#include "core/check.h"

namespace sppo {

namespace {

std::string block_name(int l, int j) {
  return "blocks." + std::to_string(l) + " subseq " + std::to_string(j) + " ";
}

}  // namespace

// The window: slot b % 2 holds chunk b of the earlier blocks' rows, kv_chunk_rows(T)
// consecutive positions at most, from one block or several (short subsequences share a
// chunk, so the kernels run on a few long blocks rather than many short ones), and in
// backward sums slot b % 3 its gradient sums. Loads go out on the host-to-device stream two
// chunks ahead; in backward a sums slot goes back out on the device-to-host stream, and is
// loaded again only once it is out.
//
// Note [A third slot in backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The sums rotate over three slots where everything else rotates over two. With two,
// loading chunk b + 2 right after queueing chunk b's kernels and its sums' copy out reused
// chunk b's own sums: the host waited for them to leave, so the compute stream ran dry for
// the whole copy out of every chunk (on an H200, gpt-7b's layer at 64K with 8 subsequences:
// 5.48 s a step against 4.04 simulated). With three, chunk b + 2's sums go where chunk
// b - 1's were, which left while chunk b's kernels ran. K, V (and x) need no third slot:
// the copies into a slot start only after the kernels queued before them (CopyStream), so
// they never overwrite what a kernel still reads; the device-to-host copies of the sums
// are what the host has to wait for.
//
// The two kinds of streamed layer differ in what a slot holds and brings in (load), what a
// chunk needs before the kernels run on it (prepare), and where its gradients go (send_sums).
class ChunkedAttention : public BlockAttention, public PastAttention {
 public:
  ~ChunkedAttention() override {
    // The host sums must be complete before anything reads them, and no copy may still
    // touch the window when it is freed.
    for (Slot& s : slots_) wait(s.loaded);
    for (Slot& s : sums_) wait(s.saved);
  }

  // Packed documents cut the subsequence into spans, one call each against its own keys;
  // only the first span's document can have begun in an earlier subsequence, so it alone
  // meets the streamed chunks, from its document's start on.
  void forward(Backend& be, BlockSaved& s, const ModelConfig& c, const Subseq& q, const Workspace& scratch) override {
    const DType a = be.act();
    const i64 QW = c.q_width();
    const std::vector<PosSpan> parts = q.parts();
    for (const PosSpan& part : parts) {
      const i64 at = i64(part.row0) * QW;
      be.attention_forward(act_at(s.attn_out, at, a), s.lse + i64(c.heads) * part.row0, act_at(s.q, at, a),
                           attention_key_blocks(KVBlocks{}, s.k, s.v, nullptr, nullptr, q, part, c, a),
                           span_shape(c, part), scratch);
    }
    const PosSpan first = parts[0];
    PastQueries j;
    j.span = first;
    j.from = q.doc_start(first.pos0);
    j.q = act_at(s.q, i64(first.row0) * QW, a);
    j.ldq = int(QW);
    j.out = act_at(s.attn_out, i64(first.row0) * QW, a);
    j.lse = s.lse + i64(c.heads) * first.row0;
    forward_past(be, c, {j}, scratch);
  }

  void forward_past(Backend& be, const ModelConfig& c, const std::vector<PastQueries>& queries,
                    const Workspace& scratch) override {
    if (past_.empty() || queries.empty()) return;
    const DType a = be.act();
    i64 rows = 0, from = queries[0].from;
    for (const PastQueries& j : queries) {
      rows = std::max<i64>(rows, j.span.rows);
      from = std::min(from, j.from);
    }
    from_ = queries[0].from;  // a Recompute layer's: one span (no ring)
    const std::string name = "blocks." + std::to_string(l_);
    Buffer out = c_.device_.alloc(rows * c.q_width() * dtype_bytes(a), name + " partial output");
    Buffer lse = c_.device_.alloc(i64(c.heads) * rows * i64(sizeof(float)), name + " partial LSE");
    // Chunks wholly before every span's document are not brought in (backward still moves
    // them: their sums pass through, Note [dK/dV with host-resident K/V]).
    std::size_t b0 = 0;
    while (b0 < past_.size() && end_of(past_[b0]) <= from) ++b0;
    for (std::size_t b = b0; b < std::min<std::size_t>(b0 + 2, past_.size()); ++b) load(b);
    for (std::size_t b = b0; b < past_.size(); ++b) {
      Slot& slot = slots_[b % 2];
      prepare(be, slot, past_[b]);
      for (const PastQueries& j : queries) {
        const std::vector<KVRef> keys = refs(slot, slot, past_[b], j.from, a);
        if (keys.empty()) continue;
        AttnShape d = span_shape(c, j.span);
        d.ldq = j.ldq;
        be.attention_forward(out.data(), lse.f32(), j.q, keys, d, scratch);
        be.attention_merge(j.out, j.lse, out.data(), lse.f32(), d);
      }
      if (b + 2 < past_.size()) load(b + 2);
    }
  }

  void backward(Backend& be, void* dqkv, const void* dout, const float* delta, const BlockSaved& s, float* dk_self,
                float* dv_self, const ModelConfig& c, const Subseq& q, const Workspace& scratch) override {
    const DType a = be.act();
    const int T = q.T, H = c.q_width();  // the queries' width, Z A
    const void* queries = s.q;
    int ldq = H;
    if (c.llama()) {  // as LocalAttention: dq dense [T, Z A] (block_backward's planar dqkv), q read in place
      be.fill_zero(dqkv, std::size_t(i64(T) * H * dtype_bytes(a)));
    } else {
      // As LocalAttention: dq accumulates in columns [0, H) of dqkv, the queries are read
      // from a copy in columns [H, 2H) with the same stride.
      be.zero_cols(dqkv, T, H, 3 * H, 0);
      void* q3 = act_at(dqkv, H, a);
      be.put_cols(q3, s.q, false, T, H, 3 * H, 0);
      queries = q3;
      ldq = 3 * H;
    }
    start_loads();
    const std::vector<PosSpan> parts = q.parts();
    for (const PosSpan& part : parts) {
      const i64 row = i64(part.row0) * ldq, z0 = i64(c.heads) * part.row0;
      AttnShape d = span_shape(c, part);
      d.ldq = ldq;
      be.attention_backward(act_at(dqkv, row, a), act_at(dout, i64(part.row0) * H, a), act_at(queries, row, a),
                            attention_key_blocks(KVBlocks{}, s.k, s.v, dk_self, dv_self, q, part, c, a),
                            s.lse + z0, delta + z0, d, scratch);
    }
    const PosSpan first = parts[0];
    PastQueries j;
    j.span = first;
    j.from = q.doc_start(first.pos0);
    j.q = act_at(queries, i64(first.row0) * ldq, a);
    j.ldq = ldq;
    j.dq = act_at(dqkv, i64(first.row0) * ldq, a);
    j.dout = act_at(dout, i64(first.row0) * H, a);
    j.final_lse = s.lse + i64(c.heads) * first.row0;
    j.delta = delta + i64(c.heads) * first.row0;
    backward_past(be, c, {j}, scratch);
  }

  void backward_past(Backend& be, const ModelConfig& c, const std::vector<PastQueries>& queries,
                     const Workspace& scratch) override {
    if (past_.empty()) return;
    const DType a = be.act();
    from_ = queries.empty() ? 0 : queries[0].from;  // a Recompute layer's: one span (no ring)
    start_loads();
    for (std::size_t b = 0; b < past_.size(); ++b) {
      Slot& slot = slots_[b % 2];
      Slot& sums = sums_[b % sum_count_];
      prepare(be, slot, past_[b]);
      for (const PastQueries& j : queries) {
        const std::vector<KVRef> keys = refs(slot, sums, past_[b], j.from, a);
        if (keys.empty()) continue;
        AttnShape d = span_shape(c, j.span);
        d.ldq = j.ldq;
        be.attention_backward(j.dq, j.dout, j.q, keys, j.final_lse, j.delta, d, scratch);
      }
      send_sums(be, slot, sums, past_[b], past_[b].rows <= T_ ? scratch : Workspace{});
      if (b + 2 < past_.size()) load(b + 2);
    }
  }

 protected:
  // Every buffer either kind of slot holds: K, V [rows, width] (width: the K/V's, G A of
  // this member's key/value heads) and, in backward, their fp32 gradients; a Recompute
  // layer's also x [rows, H] and the d(LayerNorm-1 output) sums [rows, H] fp32.
  struct Slot {
    Buffer k, v, dk, dv, x, du;
    Buffer k_pre, k_rstd;  // a Recompute layer's with key norms, in backward
    std::shared_ptr<Event> loaded, saved;
  };
  using Piece = HostKvCache::Piece;
  using Chunk = HostKvCache::Chunk;

  ChunkedAttention(HostKvCache& cache, int l, int i, i64 T, bool backward)
      : c_(cache),
        l_(l),
        T_(T),
        backward_(backward),
        sum_count_(std::size_t(std::max(1, kv_window_sum_slots(backward)))) {
    past_ = c_.chunks(l, i, T, &largest_);
  }
  std::size_t slots() const { return std::min<std::size_t>(2, past_.size()); }
  std::size_t sum_slots() const { return backward_ ? std::min<std::size_t>(sum_count_, past_.size()) : 0; }

  // Starts bringing chunk b into its slot (after that slot's sums went out).
  virtual void load(std::size_t b) = 0;
  // Before the kernels run on chunk `ch` in `slot`: its copies are in, its K, V ready.
  virtual void prepare(Backend& be, Slot& slot, const Chunk& ch) = 0;
  // After the backward kernel on chunk `ch`: its gradients go out to the host sums.
  virtual void send_sums(Backend& be, Slot& slot, Slot& sums, const Chunk& ch, const Workspace& scratch) = 0;

  void wait(std::shared_ptr<Event>& e) {
    if (!e) return;
    *c_.waited_s_ += e->wait();
    e.reset();
  }

  HostKvCache& c_;
  int l_;
  i64 T_;  // the rows of the block whose scratch the kernels get
  bool backward_;
  i64 largest_ = 0;  // rows of the longest chunk
  // Packed documents: where the first span's document begins. Keys before it are not
  // attended, and RoPE counts a recomputed key's position from it.
  i64 from_ = 0;
  std::vector<Chunk> past_;
  std::size_t sum_count_;
  Slot slots_[2];  // K, V (a Recompute layer's x, K, V, dK, dV) and the loaded event
  Slot sums_[3];   // backward: the sums (dK, dV; a Recompute layer's d(LayerNorm-1 output)) and the saved event

 private:
  // The backward's first two chunks, once (started before the block's own attention, so
  // that they come in while it runs).
  void start_loads() {
    if (started_) return;
    started_ = true;
    for (std::size_t b = 0; b < std::min<std::size_t>(2, past_.size()); ++b) load(b);
  }
  // One past the last position chunk ch holds.
  static i64 end_of(const Chunk& ch) { return ch.pieces.back().pos0 + ch.pieces.back().rows; }
  // Chunk ch in its slot from position `from` on (the span's document start; keys before it
  // are another document's): a key block for each run of consecutive positions; none when
  // the whole chunk lies before it.
  std::vector<KVRef> refs(const Slot& slot, const Slot& sums, const Chunk& ch, i64 from, DType a) const {
    std::vector<KVRef> keys;
    // dK, dV: a Host layer's are its sums; a Recompute layer's are fresh, in the K/V slot.
    const Slot& g = sums.dk ? sums : slot;
    i64 next_row = -1;  // the slot row after the last key block's
    for (const Piece& pc : ch.pieces) {
      const i64 skip = std::max<i64>(0, from - pc.pos0);
      if (skip >= pc.rows) continue;
      const i64 row = pc.at + skip, pos = pc.pos0 + skip;
      const int rows = int(pc.rows - skip);
      if (!keys.empty() && row == next_row && keys.back().k_pos0 + keys.back().Tk == pos) {
        keys.back().Tk += rows;
      } else {
        const i64 at = row * c_.width_;  // the slot's rows: this member's K/V width
        keys.push_back(KVRef{act_at(slot.k.data(), at, a), act_at(slot.v.data(), at, a),
                             backward_ ? g.dk.f32() + at : nullptr, backward_ ? g.dv.f32() + at : nullptr, rows, pos});
      }
      next_row = row + rows;
    }
    return keys;
  }

  bool started_ = false;
};

// A Host layer's window: K, V come in from the host and, in backward, their dK/dV sums in
// and out.
class StreamedAttention final : public ChunkedAttention {
 public:
  StreamedAttention(HostKvCache& cache, int l, int i, i64 T, bool backward)
      : ChunkedAttention(cache, l, i, T, backward) {
    const i64 act = dtype_bytes(c_.be_.act()), f32 = i64(sizeof(float)), rows = largest_ * c_.width_;
    const std::string what = "blocks." + std::to_string(l) + " K/V window ";
    for (std::size_t s = 0; s < slots(); ++s) {
      slots_[s].k = c_.device_.alloc(rows * act, what + "K");
      slots_[s].v = c_.device_.alloc(rows * act, what + "V");
    }
    for (std::size_t s = 0; s < sum_slots(); ++s) {
      sums_[s].dk = c_.device_.alloc(rows * f32, what + "dK");
      sums_[s].dv = c_.device_.alloc(rows * f32, what + "dV");
    }
  }

 private:
  void load(std::size_t b) override {
    Slot& slot = slots_[b % 2];
    Slot& sums = sums_[b % sum_count_];
    if (backward_) wait(sums.saved);
    const DType a = c_.be_.act();
    for (const Piece& pc : past_[b].pieces) {
      HostKvCache::Block& blk = *pc.blk;
      const i64 from = pc.row0 * c_.width_, to = pc.at * c_.width_;
      const std::size_t act = std::size_t(pc.rows) * std::size_t(c_.width_) * std::size_t(dtype_bytes(a));
      c_.h2d_.copy(act_at(slot.k.data(), to, a), act_at(blk.k.data(), from, a), act, {});
      slot.loaded = c_.h2d_.copy(act_at(slot.v.data(), to, a), act_at(blk.v.data(), from, a), act, {});
      if (!backward_) continue;
      const std::size_t f32 = std::size_t(pc.rows) * std::size_t(c_.width_) * sizeof(float);
      if (!blk.dk) {  // the first backward to reach the block: its sums start at zero
        const std::string what = block_name(l_, blk.subseq) + "host dK/dV";
        const i64 bytes = i64(blk.rows) * c_.width_ * i64(sizeof(float));
        blk.dk = c_.host_.alloc(bytes, what);
        blk.dv = c_.host_.alloc(bytes, what);
        blk.summed = 0;
      }
      if (pc.row0 < blk.summed) {  // the sums of the later subsequences' backward so far
        c_.h2d_.copy(sums.dk.f32() + to, blk.dk.f32() + from, f32, {});
        slot.loaded = c_.h2d_.copy(sums.dv.f32() + to, blk.dv.f32() + from, f32, {});
      } else {  // this backward is the first to reach these rows
        c_.be_.fill_zero(sums.dk.f32() + to, f32);
        c_.be_.fill_zero(sums.dv.f32() + to, f32);
        blk.summed = pc.row0 + pc.rows;
      }
    }
  }

  void prepare(Backend&, Slot& slot, const Chunk&) override { wait(slot.loaded); }

  void send_sums(Backend&, Slot&, Slot& sums, const Chunk& ch, const Workspace&) override {
    for (const Piece& pc : ch.pieces) {
      const std::size_t bytes = std::size_t(pc.rows) * std::size_t(c_.width_) * sizeof(float);
      const i64 from = pc.row0 * c_.width_, to = pc.at * c_.width_;
      c_.d2h_.copy(pc.blk->dk.f32() + from, sums.dk.f32() + to, bytes, {});
      sums.saved = c_.d2h_.copy(pc.blk->dv.f32() + from, sums.dv.f32() + to, bytes, {});
    }
  }
};

// A Recompute layer's window (Note [dK/dV into the layer input] in kv_stream.h): a slot
// holds its chunk's rows of x (those that came from the host), its recomputed K, V and, in
// backward, its fresh dK, dV and the d(LayerNorm-1 output) sums of its rows; one LayerNorm
// output with its statistics serves every chunk in turn.
class RecomputedAttention final : public ChunkedAttention {
 public:
  RecomputedAttention(HostKvCache& cache, int l, int i, i64 T, bool backward, const HostKvCache::LayerWeights& w,
                      const HostKvCache::InputLookup& inputs, const ModelConfig& c)
      : ChunkedAttention(cache, l, i, T, backward), w_(w), inputs_(inputs), config_(c) {
    SPPO_ASSERT_MSG(c_.width_ == c.kv_width(), "a Recompute layer runs without tensor parallelism");
    // x, the LayerNorm-1 output and its gradient's sums are H wide; K, V, dK, dV G A.
    const i64 act = dtype_bytes(c_.be_.act()), f32 = i64(sizeof(float)), rows = largest_ * c.hidden,
              kv_rows = largest_ * c_.width_;
    const std::string what = "blocks." + std::to_string(l) + " recomputed K/V window ";
    for (std::size_t s = 0; s < slots(); ++s) {
      Slot& slot = slots_[s];
      slot.x = c_.device_.alloc(rows * act, what + "x");
      slot.k = c_.device_.alloc(kv_rows * act, what + "K");
      slot.v = c_.device_.alloc(kv_rows * act, what + "V");
      if (backward_) {
        slot.dk = c_.device_.alloc(kv_rows * f32, what + "dK");
        slot.dv = c_.device_.alloc(kv_rows * f32, what + "dV");
      }
      if (backward_ && c.qk_norm) {
        slot.k_pre = c_.device_.alloc(kv_rows * act, what + "K before its norm");
        slot.k_rstd = c_.device_.alloc(largest_ * c.kv_head_count() * f32, what + "key norm rstd");
      }
    }
    for (std::size_t s = 0; s < sum_slots(); ++s) sums_[s].du = c_.device_.alloc(rows * f32, what + "d LayerNorm-1 output");
    if (!past_.empty()) {
      norm_ = c_.device_.alloc(rows * act, what + "LayerNorm-1 output");
      mean_ = c_.device_.alloc(largest_ * f32, what + "LayerNorm-1 mean");
      rstd_ = c_.device_.alloc(largest_ * f32, what + "LayerNorm-1 rstd");
    }
  }

 private:
  // The rows of x that are on the host and, in backward, the sums.
  void load(std::size_t b) override {
    Slot& slot = slots_[b % 2];
    Slot& sums = sums_[b % sum_count_];
    if (backward_) wait(sums.saved);
    const DType a = c_.be_.act();
    const i64 H = config_.hidden;
    const std::size_t f32_row = std::size_t(H) * sizeof(float);
    for (const Piece& pc : past_[b].pieces) {
      HostKvCache::Block& blk = *pc.blk;
      const HostKvCache::InputRows x = inputs_(l_, blk.subseq);
      SPPO_ASSERT_MSG(x.device || x.host, "the input of layer " << l_ << " subseq " << blk.subseq << " is gone");
      if (!x.device)
        slot.loaded = c_.h2d_.copy(act_at(slot.x.data(), i64(pc.at) * H, a), act_at(x.host, pc.row0 * H, a),
                                   std::size_t(pc.rows) * std::size_t(H) * std::size_t(dtype_bytes(a)), {});
      if (!backward_) continue;
      if (!blk.du) {  // the first backward to reach the block: its sums start at zero
        blk.du = c_.host_.alloc(i64(blk.rows) * H * i64(sizeof(float)), block_name(l_, blk.subseq) + "host dU");
        blk.summed = 0;
      }
      float* du = sums.du.f32() + i64(pc.at) * H;
      if (pc.row0 < blk.summed) {
        slot.loaded = c_.h2d_.copy(du, blk.du.f32() + pc.row0 * H, std::size_t(pc.rows) * f32_row, {});
      } else {
        c_.be_.fill_zero(du, std::size_t(pc.rows) * f32_row);
        blk.summed = pc.row0 + pc.rows;
      }
    }
  }

  // K, V of the chunk from its rows of x: LayerNorm 1 block by block (each from the device
  // or from the slot), then the projection and RoPE on the whole chunk; in backward, fresh
  // dK, dV.
  void prepare(Backend& be, Slot& slot, const Chunk& ch) override {
    wait(slot.loaded);
    const DType a = be.act();
    const i64 H = config_.hidden;
    for (const Piece& pc : ch.pieces) {
      const HostKvCache::InputRows x = inputs_(l_, pc.blk->subseq);
      const void* rows = x.device ? act_at(x.device, pc.row0 * H, a) : act_at(slot.x.data(), i64(pc.at) * H, a);
      norm_forward(be, config_, act_at(norm_.data(), i64(pc.at) * H, a), mean_.f32() + pc.at, rstd_.f32() + pc.at,
                   rows, w_.p->ln1_w, w_.p->ln1_b, pc.rows);
    }
    // Only the rows the queries attend get K, V: those from the first span's document start
    // (RoPE positions from it, as that document's own keys had them).
    const i64 skip = skipped(ch), KV = config_.kv_width(), G = config_.kv_head_count();
    // In backward, key norms keep the keys before the norm and its statistics for theirs.
    const bool keep = backward_ && config_.qk_norm;
    if (skip < ch.rows)
      kv_project(be, act_at(slot.k.data(), skip * KV, a), act_at(slot.v.data(), skip * KV, a),
                 act_at(norm_.data(), skip * H, a), *w_.p, *w_.m, config_, ch.pos0 + skip - from_,
                 int(ch.rows - skip), keep ? act_at(slot.k_pre.data(), skip * KV, a) : nullptr,
                 keep ? slot.k_rstd.f32() + skip * G : nullptr);
    if (!backward_) return;
    const std::size_t f32 = std::size_t(ch.rows) * std::size_t(c_.width_) * sizeof(float);
    be.fill_zero(slot.dk.data(), f32);
    be.fill_zero(slot.dv.data(), f32);
  }

  // Note [dK/dV into the layer input]: dK (after RoPE's backward, and the key norm's: Note
  // [Query/key norms] in model/gpt.h) and dV [rows, G A] go through the k and v rows
  // [G A, H] of the projection into the sums of d(LayerNorm-1 output) [rows, H], and into
  // the projection's weight gradients (and its biases', where it has them), each through
  // the x slot in the activation type (the key norm's output through the K slot, whose
  // keys the attention has used).
  void send_sums(Backend& be, Slot& slot, Slot& sums, const Chunk& ch, const Workspace& scratch) override {
    const DType a = be.act();
    const int H = config_.hidden, KV = config_.kv_width(), QW = config_.q_width(), G = config_.kv_head_count();
    for (int kv = 0; kv < 2; ++kv) {
      const i64 row = QW + i64(kv) * KV;  // the k (v) rows of the qkv projection
      be.put_cols(slot.x.data(), kv == 0 ? slot.dk.f32() : slot.dv.f32(), true, ch.rows, KV, KV, 0);
      const i64 skip = skipped(ch);  // their dK, dV are zero: nothing attended them
      if (kv == 0 && skip < ch.rows)
        be.rope_backward(act_at(slot.x.data(), skip * KV, a), int(ch.rows - skip), config_.kv_head_count(),
                         config_.head_size(), ch.pos0 + skip - from_, rope_table(config_), KV);
      const void* d = slot.x.data();
      if (kv == 0 && config_.qk_norm) {  // rows before the skip stay zero: no keys were made there
        be.fill_zero(slot.k.data(), std::size_t(ch.rows) * std::size_t(KV) * std::size_t(dtype_bytes(a)));
        if (skip < ch.rows)
          be.rmsnorm_backward(act_at(slot.k.data(), skip * KV, a), w_.g->k_norm_w, act_at(slot.x.data(), skip * KV, a),
                              act_at(slot.k_pre.data(), skip * KV, a), w_.p->k_norm_w, slot.k_rstd.f32() + skip * G,
                              int(ch.rows - skip) * G, config_.head_size(), scratch);
        d = slot.k.data();
      }
      const void* w = act_at(w_.m->qkv_w, row * H, a);
      be.gemm(false, false, ch.rows, H, KV, 1.0f, d, KV, w, H, 1.0f, sums.du.data(), H, a, DType::F32);
      be.linear_backward(nullptr, w_.g->qkv_w + row * H, w_.g->qkv_b ? w_.g->qkv_b + row : nullptr, d, norm_.data(),
                         w, ch.rows, H, KV, 0, 0, scratch);
    }
    const std::size_t f32_row = std::size_t(H) * sizeof(float);
    for (const Piece& pc : ch.pieces)
      sums.saved = c_.d2h_.copy(pc.blk->du.f32() + pc.row0 * H, sums.du.f32() + i64(pc.at) * H,
                                std::size_t(pc.rows) * f32_row, {});
  }

  // Rows of chunk ch before the first span's document: not attended.
  i64 skipped(const Chunk& ch) const { return std::min<i64>(ch.rows, std::max<i64>(0, from_ - ch.pos0)); }

  HostKvCache::LayerWeights w_;
  HostKvCache::InputLookup inputs_;
  const ModelConfig& config_;
  Buffer norm_, mean_, rstd_;
};

std::vector<HostKvCache::Chunk> HostKvCache::chunks(int l, int i, i64 T, i64* largest) {
  const i64 C = kv_chunk_rows(T);
  std::vector<Chunk> past;
  *largest = 0;
  for (int j = 0; j < i; ++j) {
    // Subsequence j's blocks on this rank by position: its own rows, an MSP owner's
    // helpers' pieces.
    std::vector<Block*> blocks;
    if (blocks_[l][j].k || blocks_[l][j].recomputed) blocks.push_back(&blocks_[l][j]);
    for (Block& h : held_[l][j]) blocks.push_back(&h);
    std::sort(blocks.begin(), blocks.end(),
              [](const Block* a, const Block* b) { return a->spans.front().pos0 < b->spans.front().pos0; });
    for (Block* blk : blocks)
      for (const PosSpan& span : blk->spans)
        for (int r = 0; r < span.rows;) {
          if (past.empty() || past.back().rows == C) past.push_back({{}, 0, span.pos0 + r});
          Chunk& ch = past.back();
          const int n = int(std::min<i64>(C - ch.rows, span.rows - r));
          ch.pieces.push_back({blk, i64(span.row0) + r, n, ch.rows, span.pos0 + r});
          ch.rows += n;
          r += n;
          *largest = std::max<i64>(*largest, ch.rows);
        }
  }
  return past;
}

HostKvCache::HostKvCache(Backend& be, MemoryTier& device, MemoryTier& host, CopyStream& d2h, CopyStream& h2d,
                         int layers, int subseqs, i64 width, double* waited_s)
    : be_(be),
      device_(device),
      host_(host),
      d2h_(d2h),
      h2d_(h2d),
      width_(width),
      waited_s_(waited_s),
      blocks_(std::size_t(layers)),
      held_(std::size_t(layers)) {
  for (auto& layer : blocks_) layer.resize(std::size_t(subseqs));
  for (auto& layer : held_) layer.resize(std::size_t(subseqs));
}

HostKvCache::~HostKvCache() = default;

void HostKvCache::clear() {
  for (auto& layer : blocks_)
    for (Block& blk : layer) blk = Block{};
}

namespace {

int rows_of(const std::vector<PosSpan>& spans) {
  int rows = 0;
  for (const PosSpan& p : spans) rows += p.rows;
  return rows;
}

}  // namespace

void HostKvCache::copy_out(Block& blk, int i, const std::vector<PosSpan>& spans, Buffer& k, Buffer& v,
                           const std::string& name) {
  blk.spans = spans;
  blk.rows = rows_of(spans);
  blk.subseq = i;
  blk.k = host_.alloc(k.bytes(), name + "K on the host");
  blk.v = host_.alloc(v.bytes(), name + "V on the host");
  // The device bytes are released once the copies are done: at once, as the memory rules
  // count them.
  d2h_.copy(blk.k.data(), k.data(), std::size_t(k.bytes()), {});
  *waited_s_ += d2h_.copy(blk.v.data(), v.data(), std::size_t(v.bytes()), {})->wait();
  k.reset();
  v.reset();
}

std::shared_ptr<Event> HostKvCache::sums_in(const Block& blk, Buffer* dk, Buffer* dv, const std::string& name) {
  const i64 f32 = i64(blk.rows) * width_ * i64(sizeof(float));
  *dk = device_.alloc(f32, name + "dK");
  *dv = device_.alloc(f32, name + "dV");
  if (!blk.dk) {  // no later backward reached the block
    be_.fill_zero(dk->data(), std::size_t(f32));
    be_.fill_zero(dv->data(), std::size_t(f32));
    return nullptr;
  }
  SPPO_ASSERT(blk.summed == blk.rows);  // every row was reached
  h2d_.copy(dk->data(), blk.dk.data(), std::size_t(f32), {});
  return h2d_.copy(dv->data(), blk.dv.data(), std::size_t(f32), {});
}

void HostKvCache::store(int l, int i, Buffer& k, Buffer& v, const std::vector<PosSpan>& spans) {
  Block& blk = blocks_[l][i];
  SPPO_ASSERT_MSG(!blk.k, "K/V of layer " << l << " subseq " << i << " stored twice");
  copy_out(blk, i, spans, k, v, block_name(l, i));
}

void HostKvCache::restore(int l, int i, Buffer* k, Buffer* v, Buffer* dk, Buffer* dv) {
  Block& blk = blocks_[l][i];
  SPPO_ASSERT_MSG(blk.k, "backward of layer " << l << " subseq " << i << " before its K/V were stored");
  const std::string name = block_name(l, i);
  *k = device_.alloc(blk.k.bytes(), name + "k");
  *v = device_.alloc(blk.v.bytes(), name + "v");
  h2d_.copy(k->data(), blk.k.data(), std::size_t(blk.k.bytes()), {});
  std::shared_ptr<Event> done = h2d_.copy(v->data(), blk.v.data(), std::size_t(blk.v.bytes()), {});
  if (std::shared_ptr<Event> sums = sums_in(blk, dk, dv, name)) done = sums;
  *waited_s_ += done->wait();
  blk = Block{};
}

void HostKvCache::store_held(int l, int i, Buffer& k, Buffer& v, const PosSpan& rows) {
  copy_out(held_[l][i].emplace_back(), i, {PosSpan{rows.pos0, rows.rows, 0}}, k, v,
           block_name(l, i) + "an MSP piece's ");
}

void HostKvCache::take_held(int l, int i, i64 pos0, Buffer* dk, Buffer* dv) {
  auto& held = held_[l][i];
  auto blk = std::find_if(held.begin(), held.end(), [&](const Block& b) { return b.spans.front().pos0 == pos0; });
  SPPO_ASSERT_MSG(blk != held.end(), "layer " << l << " subseq " << i << ": no MSP piece at position " << pos0);
  if (std::shared_ptr<Event> sums = sums_in(*blk, dk, dv, block_name(l, i) + "an MSP piece's "))
    *waited_s_ += sums->wait();
  held.erase(blk);
}

std::unique_ptr<BlockAttention> HostKvCache::attention(int l, int i, i64 T, bool backward) {
  return std::make_unique<StreamedAttention>(*this, l, i, T, backward);
}

std::unique_ptr<PastAttention> HostKvCache::past_attention(int l, int i, i64 T, bool backward) {
  return std::make_unique<StreamedAttention>(*this, l, i, T, backward);
}

void HostKvCache::forget(int l, int i, Buffer& k, Buffer& v, const std::vector<PosSpan>& spans) {
  Block& blk = blocks_[l][i];
  SPPO_ASSERT_MSG(!blk.recomputed, "K/V of layer " << l << " subseq " << i << " dropped twice");
  blk.spans = spans;
  blk.rows = rows_of(spans);
  blk.subseq = i;
  blk.recomputed = true;
  k.reset();
  v.reset();
}

void HostKvCache::restore_sums(int l, int i, i64 hidden, Buffer* dk, Buffer* dv, Buffer* du) {
  Block& blk = blocks_[l][i];
  SPPO_ASSERT_MSG(blk.recomputed, "backward of layer " << l << " subseq " << i << " before its forward");
  const std::string name = block_name(l, i);
  // dK, dV are width_ (G A: no tensor parallelism) wide, the sums H.
  const i64 f32 = i64(blk.rows) * width_ * i64(sizeof(float)), sums = i64(blk.rows) * hidden * i64(sizeof(float));
  *dk = device_.alloc_zeroed(f32, name + "dK");
  *dv = device_.alloc_zeroed(f32, name + "dV");
  *du = device_.alloc(sums, name + "d LayerNorm-1 output sums");
  if (blk.du) {  // every row was reached by a later backward
    SPPO_ASSERT(blk.summed == blk.rows && blk.du.bytes() == sums);
    *waited_s_ += h2d_.copy(du->data(), blk.du.data(), std::size_t(sums), {})->wait();
  } else {
    be_.fill_zero(du->data(), std::size_t(sums));
  }
  blk = Block{};
}

std::unique_ptr<BlockAttention> HostKvCache::recomputed_attention(int l, int i, i64 T, bool backward,
                                                                  const LayerWeights& w, const InputLookup& inputs,
                                                                  const ModelConfig& c) {
  return std::make_unique<RecomputedAttention>(*this, l, i, T, backward, w, inputs, c);
}

}  // namespace sppo
