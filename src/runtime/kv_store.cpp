#include "runtime/kv_store.h"

#include <algorithm>

#include "core/check.h"
#include "runtime/ring.h"

namespace sppo {

namespace {

// Piece `piece` of F/B op `op`'s task.
sched::Op piece_op(const sched::Op& op, int piece) {
  sched::Op p = op;
  p.piece = piece;
  return p;
}

}  // namespace

KvStore::KvStore(ActivationStore& act, Backend& be, MemoryTier& device, MemoryTier& host, const ModelConfig& c,
                 const RuntimeOptions& o, const sched::Schedule& sc, const std::vector<sched::Op>& ops,
                 std::pair<int, int> layers, StepResult& result)
    : act_(act),
      device_(device),
      config_(c),
      opts_(o),
      sched_(sc),
      dtype_(be.act()),
      width_(RankShard{o.tp, o.ulysses}.heads().local_kv_width(c)),
      lb_(layers.first),
      le_(layers.second),
      ring_wait_s_(&result.ring_wait_s) {
  const int L = c.layers, N = int(sc.lengths.size());
  dk_.resize(L);
  dv_.resize(L);
  du_.resize(L);
  for (int l = 0; l < L; ++l) {
    dk_[l].resize(N);
    dv_[l].resize(N);
    du_[l].resize(N);
  }
  rows_at_.assign(L, std::vector<Subseq>(N));
  held_.resize(L);
  for (auto& layer : held_) layer.resize(N);
  for (const sched::Op& op : ops)
    if (op.kind == sched::OpKind::Forward)
      for (int l = op.layer_begin; l < op.layer_end; ++l) rows_at_[l][op.subseq] = rows_of(sc, op);
  if (sc.place.any_kv_streamed())
    host_ = std::make_unique<HostKvCache>(be, device, host, act.d2h(), act.h2d(), L, N, width_,
                                          &result.exposed_copy_s);
  double* waited = &result.exposed_copy_s;
  inputs_ = [&act, waited](int l, int j) {
    const auto [device, host] = act.saved_input(j, l, waited);
    return HostKvCache::InputRows{device, host};
  };
}

KvStore::~KvStore() = default;

LayerAttention KvStore::attention(const sched::Op& op, int l, bool backward, const HostKvCache::LayerWeights& weights) {
  LayerAttention a;
  if (sched_.place.kv_recomputed(l)) {
    SPPO_ASSERT(weights.p && weights.m && weights.g);
    a.attn_ = host_->recomputed_attention(l, op.subseq, rows_of(sched_, op).T, backward, weights, inputs_, config_);
    return a;
  }
  if (streamed(l) && op.pieces == 1) {
    a.attn_ = host_->attention(l, op.subseq, rows_of(sched_, op).T, backward);
    return a;
  }
  if (streamed(l)) {  // a ring or MSP piece: this rank's earlier rows from the host
    a.window_ = host_->past_attention(l, op.subseq, rows_of(sched_, op).T, backward);
    a.past_ = std::make_unique<KVBlocks>();
    a.attn_ = reach(op, l, *a.past_, a.window_.get());
    return a;
  }
  a.past_ = std::make_unique<KVBlocks>(past_blocks(l, op.subseq, backward));
  a.attn_ = reach(op, l, *a.past_);
  return a;
}

void KvStore::after_forward(int l, int i, const Subseq& q) {
  if (!streamed(l)) return;
  std::vector<Buffer>& unit = act_.unit(i, l);
  // The rank's rows by position (a zigzag ring piece: two spans), not cut at documents.
  const std::vector<PosSpan> spans = q.spans.empty() ? std::vector<PosSpan>{PosSpan{q.offset, q.T, 0}} : q.spans;
  if (sched_.place.kv_recomputed(l))
    host_->forget(l, i, unit[kK], unit[kV], spans);
  else
    host_->store(l, i, unit[kK], unit[kV], spans);
}

KVBlocks KvStore::past_blocks(int l, int i, bool grads) {
  KVBlocks past;
  // An MSP helper holds no earlier keys of another stage's layers: its stage's owner does.
  if (l < lb_ || l >= le_) return past;
  const i64 H = width_;  // the K/V cache's width
  for (int j = 0; j < i; ++j) {
    if (rows_at_[l][j].T > 0)
      for (const PosSpan& part : rows_at_[l][j].parts()) {
        const i64 at = i64(part.row0) * H;
        past.k.push_back(act_at(act_.unit(j, l)[kK].data(), at, dtype_));
        past.v.push_back(act_at(act_.unit(j, l)[kV].data(), at, dtype_));
        if (grads) {
          past.dk.push_back(dk_[l][j].f32() + at);
          past.dv.push_back(dv_[l][j].f32() + at);
        }
        past.offsets.push_back(part.pos0);
        past.lengths.push_back(part.rows);
      }
    for (auto& h : held_[l][j]) {
      past.k.push_back(h.k.data());
      past.v.push_back(h.v.data());
      if (grads) {
        past.dk.push_back(h.dk.f32());
        past.dv.push_back(h.dv.f32());
      }
      past.offsets.push_back(h.rows.pos0);
      past.lengths.push_back(h.rows.rows);
    }
  }
  return past;
}

void KvStore::alloc_accumulators(int l, int i) {
  if (streamed(l)) return;
  for (int j = 0; j <= i; ++j) {
    if (rows_at_[l][j].T > 0 && !dk_[l][j]) {
      const i64 bytes = i64(rows_at_[l][j].T) * width_ * i64(sizeof(float));
      dk_[l][j] = device_.alloc_zeroed(bytes, unit_name(l, j) + "dK");
      dv_[l][j] = device_.alloc_zeroed(bytes, unit_name(l, j) + "dV");
    }
    for (auto& h : held_[l][j])
      if (!h.dk) {
        const i64 bytes = i64(h.rows.rows) * width_ * i64(sizeof(float));
        h.dk = device_.alloc_zeroed(bytes, unit_name(l, j) + "held dK");
        h.dv = device_.alloc_zeroed(bytes, unit_name(l, j) + "held dV");
      }
  }
}

void KvStore::restore(int l, int i) {
  if (!streamed(l)) return;
  if (sched_.place.kv_recomputed(l)) {  // K_i, V_i are recomputed with the layer's other tensors
    host_->restore_sums(l, i, config_.hidden, &dk_[l][i], &dv_[l][i], &du_[l][i]);
    return;
  }
  std::vector<Buffer>& unit = act_.unit(i, l);
  host_->restore(l, i, &unit[kK], &unit[kV], &dk_[l][i], &dv_[l][i]);
}

void KvStore::release(int l, int i) {
  dk_[l][i].reset();
  dv_[l][i].reset();
  du_[l][i].reset();
}

KvStore::Held& KvStore::hold(int l, int i, const PosSpan& rows, i64 bytes) {
  Held h;
  h.rows = rows;
  h.k = device_.alloc(bytes, unit_name(l, i) + "K of an MSP piece");
  h.v = device_.alloc(bytes, unit_name(l, i) + "V of an MSP piece");
  held_[l][i].push_back(std::move(h));
  return held_[l][i].back();
}

void KvStore::received(int l, int i) {
  if (!streamed(l)) return;
  Held& h = held_[l][i].back();
  host_->store_held(l, i, h.k, h.v, h.rows);
  held_[l][i].pop_back();
}

std::pair<Buffer, Buffer> KvStore::take_held(const sched::Op& op, int l, i64 pos0) {
  if (streamed(l)) {
    std::pair<Buffer, Buffer> sums;
    host_->take_held(l, op.subseq, pos0, &sums.first, &sums.second);
    return sums;
  }
  auto& held = held_[l][op.subseq];
  auto h = std::find_if(held.begin(), held.end(), [&](const Held& x) { return x.rows.pos0 == pos0; });
  SPPO_ASSERT_MSG(h != held.end(), "'" << sched::to_string(op) << "' without the piece's K, V");
  std::pair<Buffer, Buffer> sums{std::move(h->dk), std::move(h->dv)};
  held.erase(h);
  return sums;
}

void KvStore::drop_all() {
  for (std::size_t i = 0; i < sched_.lengths.size(); ++i)
    for (int l = lb_; l < le_; ++l) {
      act_.unit(int(i), l)[kK].reset();
      act_.unit(int(i), l)[kV].reset();
    }
  if (host_) host_->clear();
}

void KvStore::check_empty() const {
  for (std::size_t i = 0; i < sched_.lengths.size(); ++i)
    for (std::size_t l = 0; l < held_.size(); ++l)
      SPPO_ASSERT_MSG(held_[l][i].empty(), "an MSP piece's K, V are left over: layer " << l << " subseq " << i);
}

std::unique_ptr<BlockAttention> KvStore::reach(const sched::Op& op, int l, const KVBlocks& past,
                                               PastAttention* streamed) {
  if (op.pieces == 1) return std::make_unique<LocalAttention>(past);
  const auto& sc = sched_;
  const int R = op.pieces, i = op.subseq;
  const std::vector<int> ring = op.group.empty() ? sc.par.ring_group(opts_.rank) : std::vector<int>{};
  RingContext ctx;
  ctx.comm = opts_.comm;
  for (int h = 0; h < R; ++h) {
    const sched::Op other = piece_op(op, h);
    ctx.spans.push_back(rows_of(sc, other).parts());
    ctx.first_key.push_back(sched::ring_first_key(sc, op, h));
    // An MSP task's members are its group (Note [MSP pieces]); a ring piece's are its ring
    // in piece order, each with this rank's tensor-parallel index (Note [Rank layout] in
    // core/parallel.h).
    ctx.members.push_back(op.group.empty() ? ring.at(std::size_t(h)) : op.group[std::size_t(h)]);
  }
  ctx.me = op.piece;
  ctx.subseq = i;
  ctx.layer = l;
  ctx.causal = config_.causal;
  ctx.device = &device_;
  ctx.waited_s = ring_wait_s_;
  if (sc.rsa_piece(op)) return std::make_unique<RsaAttention>(ctx);
  return std::make_unique<RingAttention>(ctx, past, streamed);
}

}  // namespace sppo
