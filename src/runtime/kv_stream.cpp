#include "runtime/kv_stream.h"

#include <algorithm>
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
// chunk, so the kernels run on a few long blocks rather than many short ones). Loads go out on the host-to-device stream two chunks ahead; in backward a slot's
// dK/dV go back on the device-to-host stream, and the slot is loaded again only once they
// are out.
class StreamedAttention final : public BlockAttention {
 public:
  StreamedAttention(HostKvCache& cache, int l, int i, i64 T, bool backward) : c_(cache), l_(l), backward_(backward) {
    const i64 C = kv_chunk_rows(T);
    i64 largest = 0;
    for (int j = 0; j < i; ++j) {
      HostKvCache::Block& blk = c_.blocks_[l][j];
      if (!blk.k) continue;
      for (i64 r = 0; r < blk.rows;) {
        if (past_.empty() || past_.back().rows == C) past_.push_back({{}, 0, blk.pos0 + r});
        Chunk& ch = past_.back();
        SPPO_ASSERT_MSG(ch.pos0 + ch.rows == blk.pos0 + r, "host K/V blocks of one rank are consecutive positions");
        const int n = int(std::min<i64>(C - ch.rows, blk.rows - r));
        ch.pieces.push_back({&blk, r, n, ch.rows});
        ch.rows += n;
        r += n;
        largest = std::max<i64>(largest, ch.rows);
      }
    }
    const i64 act = dtype_bytes(c_.be_.act());
    for (std::size_t s = 0; s < std::min<std::size_t>(2, past_.size()); ++s) {
      Slot& slot = slots_[s];
      const std::string what = "blocks." + std::to_string(l) + " K/V window ";
      slot.k = c_.device_.alloc(largest * c_.width_ * act, what + "K");
      slot.v = c_.device_.alloc(largest * c_.width_ * act, what + "V");
      if (backward_) {
        slot.dk = c_.device_.alloc(largest * c_.width_ * i64(sizeof(float)), what + "dK");
        slot.dv = c_.device_.alloc(largest * c_.width_ * i64(sizeof(float)), what + "dV");
      }
    }
  }

  ~StreamedAttention() override {
    // The host sums must be complete before anything reads them, and no copy may still
    // touch the window when it is freed.
    for (Slot& s : slots_) {
      wait(s.loaded);
      wait(s.saved);
    }
  }

  void forward(Backend& be, BlockSaved& s, const ModelConfig& c, const Subseq& q, const Workspace& scratch) override {
    const std::vector<PosSpan> parts = q.parts();
    SPPO_ASSERT_MSG(parts.size() == 1, "K/V on the host runs subsequences of one span");
    const PosSpan& part = parts[0];
    const AttnShape d = span_shape(c, part);
    be.attention_forward(s.attn_out, s.lse, s.q, {own(s, part, nullptr, nullptr)}, d, scratch);
    if (past_.empty()) return;
    const DType a = be.act();
    Buffer out = c_.device_.alloc(i64(part.rows) * c.hidden * dtype_bytes(a), "blocks." + std::to_string(l_) + " partial output");
    Buffer lse = c_.device_.alloc(i64(c.heads) * part.rows * i64(sizeof(float)), "blocks." + std::to_string(l_) + " partial LSE");
    for (std::size_t b = 0; b < std::min<std::size_t>(2, past_.size()); ++b) load(b);
    for (std::size_t b = 0; b < past_.size(); ++b) {
      Slot& slot = slots_[b % 2];
      wait(slot.loaded);
      be.attention_forward(out.data(), lse.f32(), s.q, {ref(slot, past_[b])}, d, scratch);
      be.attention_merge(s.attn_out, s.lse, out.data(), lse.f32(), d);
      if (b + 2 < past_.size()) load(b + 2);
    }
  }

  void backward(Backend& be, void* dqkv, const void* dout, const float* delta, const BlockSaved& s, float* dk_self,
                float* dv_self, const ModelConfig& c, const Subseq& q, const Workspace& scratch) override {
    const std::vector<PosSpan> parts = q.parts();
    SPPO_ASSERT_MSG(parts.size() == 1, "K/V on the host runs subsequences of one span");
    const PosSpan& part = parts[0];
    const DType a = be.act();
    const int T = q.T, H = c.hidden;
    // As LocalAttention: dq accumulates in columns [0, H) of dqkv, the queries are read
    // from a copy in columns [H, 2H) with the same stride.
    be.zero_cols(dqkv, T, H, 3 * H, 0);
    void* q3 = act_at(dqkv, H, a);
    be.put_cols(q3, s.q, false, T, H, 3 * H, 0);
    AttnShape d = span_shape(c, part);
    d.ldq = 3 * H;
    for (std::size_t b = 0; b < std::min<std::size_t>(2, past_.size()); ++b) load(b);
    be.attention_backward(dqkv, dout, q3, {own(s, part, dk_self, dv_self)}, s.lse, delta, d, scratch);
    for (std::size_t b = 0; b < past_.size(); ++b) {
      Slot& slot = slots_[b % 2];
      wait(slot.loaded);
      be.attention_backward(dqkv, dout, q3, {ref(slot, past_[b])}, s.lse, delta, d, scratch);
      for (const Piece& pc : past_[b].pieces) {
        const std::size_t bytes = std::size_t(pc.rows) * std::size_t(c_.width_) * sizeof(float);
        const i64 from = pc.row0 * c_.width_, to = pc.at * c_.width_;
        c_.d2h_.copy(pc.blk->dk.f32() + from, slot.dk.f32() + to, bytes, {});
        slot.saved = c_.d2h_.copy(pc.blk->dv.f32() + from, slot.dv.f32() + to, bytes, {});
      }
      if (b + 2 < past_.size()) load(b + 2);
    }
  }

 private:
  struct Slot {
    Buffer k, v, dk, dv;
    std::shared_ptr<Event> loaded, saved;
  };
  // Rows [row0, row0 + rows) of an earlier block, at row `at` of its chunk.
  struct Piece {
    HostKvCache::Block* blk;
    i64 row0;
    int rows;
    int at;
  };
  // Positions [pos0, pos0 + rows) of the earlier blocks.
  struct Chunk {
    std::vector<Piece> pieces;
    int rows = 0;
    i64 pos0 = 0;
  };

  static KVRef own(const BlockSaved& s, const PosSpan& part, float* dk, float* dv) {
    return {s.k, s.v, dk, dv, part.rows, part.pos0};
  }
  KVRef ref(const Slot& slot, const Chunk& ch) const {
    return {slot.k.data(), slot.v.data(), backward_ ? slot.dk.f32() : nullptr, backward_ ? slot.dv.f32() : nullptr,
            ch.rows, ch.pos0};
  }

  // Starts bringing chunk b into its slot (after that slot's sums went out).
  void load(std::size_t b) {
    Slot& slot = slots_[b % 2];
    wait(slot.saved);
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
        c_.h2d_.copy(slot.dk.f32() + to, blk.dk.f32() + from, f32, {});
        slot.loaded = c_.h2d_.copy(slot.dv.f32() + to, blk.dv.f32() + from, f32, {});
      } else {  // this backward is the first to reach these rows
        c_.be_.fill_zero(slot.dk.f32() + to, f32);
        c_.be_.fill_zero(slot.dv.f32() + to, f32);
        blk.summed = pc.row0 + pc.rows;
      }
    }
  }

  void wait(std::shared_ptr<Event>& e) {
    if (!e) return;
    *c_.waited_s_ += e->wait();
    e.reset();
  }

  HostKvCache& c_;
  int l_;
  bool backward_;
  std::vector<Chunk> past_;
  Slot slots_[2];
};

HostKvCache::HostKvCache(Backend& be, MemoryTier& device, MemoryTier& host, CopyStream& d2h, CopyStream& h2d,
                         int layers, int subseqs, i64 width, double* waited_s)
    : be_(be),
      device_(device),
      host_(host),
      d2h_(d2h),
      h2d_(h2d),
      width_(width),
      waited_s_(waited_s),
      blocks_(std::size_t(layers)) {
  for (auto& layer : blocks_) layer.resize(std::size_t(subseqs));
}

HostKvCache::~HostKvCache() = default;

void HostKvCache::store(int l, int i, Buffer& k, Buffer& v, i64 pos0, int rows) {
  Block& blk = blocks_[l][i];
  SPPO_ASSERT_MSG(!blk.k, "K/V of layer " << l << " subseq " << i << " stored twice");
  blk.pos0 = pos0;
  blk.rows = rows;
  blk.subseq = i;
  blk.k = host_.alloc(k.bytes(), block_name(l, i) + "K on the host");
  blk.v = host_.alloc(v.bytes(), block_name(l, i) + "V on the host");
  // The device bytes are released once the copies are done: at once, as the memory rules
  // count them.
  d2h_.copy(blk.k.data(), k.data(), std::size_t(k.bytes()), {});
  *waited_s_ += d2h_.copy(blk.v.data(), v.data(), std::size_t(v.bytes()), {})->wait();
  k.reset();
  v.reset();
}

void HostKvCache::restore(int l, int i, Buffer* k, Buffer* v, Buffer* dk, Buffer* dv) {
  Block& blk = blocks_[l][i];
  SPPO_ASSERT_MSG(blk.k, "backward of layer " << l << " subseq " << i << " before its K/V were stored");
  const std::string name = block_name(l, i);
  *k = device_.alloc(blk.k.bytes(), name + "k");
  *v = device_.alloc(blk.v.bytes(), name + "v");
  const i64 f32 = i64(blk.rows) * width_ * i64(sizeof(float));
  h2d_.copy(k->data(), blk.k.data(), std::size_t(blk.k.bytes()), {});
  std::shared_ptr<Event> done = h2d_.copy(v->data(), blk.v.data(), std::size_t(blk.v.bytes()), {});
  *dk = device_.alloc(f32, name + "dK");
  *dv = device_.alloc(f32, name + "dV");
  if (blk.dk) {  // every row was reached by a later backward
    SPPO_ASSERT(blk.summed == blk.rows);
    h2d_.copy(dk->data(), blk.dk.data(), std::size_t(f32), {});
    done = h2d_.copy(dv->data(), blk.dv.data(), std::size_t(f32), {});
  } else {
    be_.fill_zero(dk->data(), std::size_t(f32));
    be_.fill_zero(dv->data(), std::size_t(f32));
  }
  *waited_s_ += done->wait();
  blk = Block{};
}

std::unique_ptr<BlockAttention> HostKvCache::attention(int l, int i, i64 T, bool backward) {
  return std::make_unique<StreamedAttention>(*this, l, i, T, backward);
}

}  // namespace sppo
