#include "backends/cuda/library_attention.h"

#include <algorithm>
#include <cstdint>
#include <sstream>

#include "backend/attention_pieces.h"
#include "backends/cuda/attention.h"
#include "backends/cuda/check.h"
#include "backends/cuda/ops.h"
#include "core/check.h"

// Note [The library's backward from delta]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A fused attention library's backward takes the forward's output O beside dO and computes
// delta = rowsum(dO * O) itself, the only use it makes of O (there is no dropout here). The
// backend interface passes delta instead, computed once per query span in double
// (attention_backward_delta), because O is not always at hand: a ring's backward sends q,
// dout, lse and delta round the ring, not O. So the backward gives the library an output
// made for it, O' = dO delta / |dO|^2 per row and head, whose rowsum with dO is delta up to
// one bf16 rounding of O' relative to delta itself (O's own rounding errs relative to the sum
// of |dO O|, which cancellation can make far larger than delta). A row whose dO is 0 gets O'
// = 0, and its delta, rowsum(0 * O), is 0 too.

namespace sppo::cuda {

namespace {

constexpr std::size_t kAlign = 256;
constexpr int kMinRows = 64;  // the shortest key part or query chunk a call is cut to

std::size_t aligned(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

char* advance(const void* p, i64 elems, std::size_t bytes) {
  return const_cast<char*>(static_cast<const char*>(p)) + elems * i64(bytes);
}

// A call's scratch: the Workspace it was given, else memory from CUDA's stream-ordered pool;
// buffers taken in order, 256-byte aligned, and given back to a mark.
class CallScratch {
 public:
  CallScratch(const Workspace& ws, std::size_t need, cudaStream_t stream) {
    if (ws.bytes > 0) {
      // The slab hands out 256-byte aligned blocks; a workspace inside one may start anywhere.
      const std::uintptr_t at = reinterpret_cast<std::uintptr_t>(ws.base);
      const std::size_t skip = (kAlign - at % kAlign) % kAlign;
      base_ = static_cast<char*>(ws.base) + skip;
      size_ = ws.bytes > skip ? ws.bytes - skip : 0;
      SPPO_ASSERT_MSG(need <= size_, "library attention: a call needs " << need << " bytes of scratch, given "
                                                                        << size_);
    } else if (need > 0) {
      SPPO_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&pool_), need, stream));
      base_ = pool_;
      size_ = need;
      stream_ = stream;
    }
  }
  ~CallScratch() {
    if (pool_) SPPO_CUDA_CHECK(cudaFreeAsync(pool_, stream_));  // after the call's work, in stream order
  }
  CallScratch(const CallScratch&) = delete;
  CallScratch& operator=(const CallScratch&) = delete;
  void* take(std::size_t bytes) {
    const std::size_t at = used_;
    used_ += aligned(bytes);
    SPPO_ASSERT_MSG(used_ <= size_, "library attention: scratch overrun (" << used_ << " of " << size_ << ")");
    return base_ + at;
  }
  std::size_t mark() const { return used_; }
  void reset(std::size_t mark) { used_ = mark; }

 private:
  char* pool_ = nullptr;
  cudaStream_t stream_ = nullptr;
  char* base_ = nullptr;
  std::size_t size_ = 0, used_ = 0;
};

}  // namespace

// The resolved layout of a call's tensors.
struct LibraryAttention::Heads {
  int Z = 0, Zkv = 0, A = 0;
  i64 ldq = 0, ldk = 0, ldv = 0, ldo = 0;
  i64 ld_lse = 0;  // head stride of lse and delta: the whole call's query rows
  std::size_t ab = 0;
  static Heads of(const AttnShape& d, DType act) {
    Heads h;
    h.Z = d.Z;
    h.Zkv = d.Zkv > 0 ? d.Zkv : d.Z;
    h.A = d.A;
    h.ldq = d.ldq > 0 ? d.ldq : i64(d.Z) * d.A;
    h.ldo = d.ldo > 0 ? d.ldo : i64(d.Z) * d.A;
    h.ldk = d.ldk > 0 ? d.ldk : i64(h.Zkv) * d.A;
    h.ldv = d.ldv > 0 ? d.ldv : i64(h.Zkv) * d.A;
    h.ld_lse = d.Tq;
    h.ab = std::size_t(dtype_bytes(act));
    return h;
  }
};

// The library calls of (part of) a call and the scratch they need; `refused`: why the library
// takes one of their graphs not.
struct LibraryAttention::CallPlan {
  std::vector<KVRef> blocks;  // the call's blocks, cut to key parts
  std::vector<AttnPiece> pieces;
  std::size_t need = 0;
  std::string refused;
};

// A chunk of a call's query rows, [row0, row0 + rows), and its plan.
struct LibraryAttention::Chunk {
  int row0 = 0, rows = 0;
  CallPlan plan;
};

LibraryAttention::LibraryAttention(std::unique_ptr<SdpaLibrary> lib, DType act, bool length_classes)
    : lib_(std::move(lib)), act_(act), classes_(length_classes) {}

SdpaGraphKey LibraryAttention::key_of(bool backward, const Heads& h, int rows, int keys, PieceMask mask) const {
  SdpaGraphKey k;
  k.backward = backward;
  k.Z = h.Z, k.Zkv = h.Zkv, k.A = h.A;
  k.ldq = h.ldq, k.ldk = h.ldk, k.ldv = h.ldv;
  k.ld_dout = backward ? h.ldo : 0;
  k.rows = int(classes_ ? sdpa_length_class(rows) : rows);
  k.keys = int(classes_ ? sdpa_length_class(keys) : keys);
  k.padded = classes_;
  k.mask = mask;
  k.act = act_;
  return k;
}

std::string LibraryAttention::check(const AttnShape& d, int rows) {
  const Heads h = Heads::of(d, act_);
  const auto id = std::make_tuple(h.Z, h.Zkv, h.A, h.ldq, h.ldk, h.ldv, h.ldo, rows);
  auto it = checked_.find(id);
  if (it != checked_.end()) return it->second;
  std::string why;
  if (act_ != DType::BF16) why = "the library computes in bf16 (this run's activations are fp32)";
  for (const bool bwd : {false, true})
    for (const PieceMask m : {PieceMask::BottomRight, PieceMask::None}) {
      if (!why.empty()) break;
      const SdpaGraphKey key = key_of(bwd, h, rows, rows, m);
      const std::string r = lib_->check(key);
      if (!r.empty()) why = describe(key) + ": " + r;
    }
  return checked_.emplace(id, why).first->second;
}

LibraryAttention::CallPlan LibraryAttention::plan(bool backward, const Heads& h, const std::vector<KVRef>& blocks,
                                                  int Tq, i64 q_pos0, std::size_t limit) {
  int longest = 0;
  for (const KVRef& b : blocks) longest = std::max(longest, b.Tk);
  // Within a block's scratch, key parts of at most kLibraryKeyRows (Note [Library scratch]).
  if (limit > 0 && backward) longest = std::min(longest, kLibraryKeyRows);
  AttnShape d;
  d.Z = h.Z, d.Zkv = h.Zkv, d.A = h.A;
  d.ldk = int(h.ldk), d.ldv = int(h.ldv);
  int widest = 0;
  for (const KVRef& b : blocks) widest = std::max(widest, b.Tk);
  CallPlan p;
  for (int R = std::max(longest, 1);; R = std::max(kMinRows, R / 2)) {
    p.blocks = R >= widest ? blocks : split_blocks(blocks, R, d, h.ab);
    p.pieces = attention_pieces(Tq, q_pos0, key_spans(p.blocks));
    std::size_t rows_side = 0, rest = 0;
    for (const AttnPiece& pc : p.pieces) {
      const SdpaGraphKey key = key_of(backward, h, pc.rows, pc.keys, pc.mask);
      if (const std::string why = lib_->check(key); !why.empty()) {
        p.refused = describe(key) + ": " + why;
        return p;
      }
      const LibraryCallBytes b =
          library_call_bytes(backward, Tq, key.rows, int(p.pieces.size()), h.Z, h.Zkv, h.A, h.ab);
      rows_side = std::max(rows_side, b.rows_side);
      rest = std::max(rest, aligned(b.per_key_row / 2 * std::size_t(key.keys)) * (backward ? 2 : 0) +
                                aligned(lib_->workspace_bytes(key)));
    }
    p.need = rows_side + rest;
    if (limit == 0 || p.need <= limit || R <= kMinRows) return p;
  }
}

bool LibraryAttention::chunks(bool backward, const Heads& h, const std::vector<KVRef>& blocks, int row0, int Tq,
                              i64 q_pos0, std::size_t limit, std::vector<Chunk>& out) {
  CallPlan p = plan(backward, h, blocks, Tq, q_pos0 + row0, limit);
  if (!p.refused.empty()) {
    refused_ = p.refused;
    return false;
  }
  if (limit > 0 && p.need > limit && Tq > kMinRows) {  // too long for the scratch: in halves
    const int half = Tq / 2;
    return chunks(backward, h, blocks, row0, half, q_pos0, limit, out) &&
           chunks(backward, h, blocks, row0 + half, Tq - half, q_pos0, limit, out);
  }
  out.push_back({row0, Tq, std::move(p)});
  return true;
}

bool LibraryAttention::plan_call(bool backward, const Heads& h, const std::vector<KVRef>& blocks, int Tq,
                                 i64 q_pos0, const Workspace& ws, std::vector<Chunk>& out) {
  // Query chunks of kLibraryQueryRows within a block's scratch (Note [Library scratch]), cut
  // further where one does not fit; without a scratch, the span whole. Every chunk is planned
  // before any runs, so that a graph the library refuses leaves the call undone.
  const int chunk = ws.bytes > 0 ? std::min(Tq, kLibraryQueryRows) : Tq;
  for (int r0 = 0; r0 < Tq; r0 += chunk)
    if (!chunks(backward, h, blocks, r0, std::min(chunk, Tq - r0), q_pos0, ws.bytes, out)) return false;
  return true;
}

bool LibraryAttention::forward(void* out, float* lse, const void* q, const std::vector<KVRef>& blocks,
                               const AttnShape& d, const Workspace& ws, cudaStream_t stream) {
  const Heads h = Heads::of(d, act_);
  std::vector<Chunk> cs;
  if (!plan_call(false, h, join_adjacent_blocks(blocks, d, h.ab), d.Tq, d.q_pos0, ws, cs)) return false;
  for (const Chunk& c : cs)
    forward_chunk(advance(out, c.row0 * h.ldo, h.ab), lse + c.row0, advance(q, c.row0 * h.ldq, h.ab), h, c, ws,
                  stream);
  return true;
}

void LibraryAttention::forward_chunk(void* out, float* lse, const void* q, const Heads& h, const Chunk& c,
                                     const Workspace& ws, cudaStream_t stream) {
  const CallPlan& p = c.plan;
  const int Tq = c.rows;
  const i64 za = i64(h.Z) * h.A;
  // The first piece over every row is copied into out/lse; every other is merged into them.
  const AttnPiece* first = nullptr;
  for (const AttnPiece& pc : p.pieces)
    if (!first && pc.rows == Tq) first = &pc;
  if (!first) attention_unseen_rows(out, lse, Tq, h.Z, h.A, h.ldo, h.ld_lse, act_, stream);
  if (p.pieces.empty()) return;
  CallScratch scratch(ws, p.need, stream);
  int* lengths = static_cast<int*>(scratch.take(2 * sizeof(int)));
  std::vector<const AttnPiece*> order;
  if (first) order.push_back(first);
  for (const AttnPiece& pc : p.pieces)
    if (&pc != first) order.push_back(&pc);
  for (const AttnPiece* pc : order) {
    const std::size_t mark = scratch.mark();
    const KVRef& b = p.blocks[std::size_t(pc->block)];
    const SdpaGraphKey key = key_of(false, h, pc->rows, pc->keys, pc->mask);
    void* o = scratch.take(std::size_t(key.rows) * std::size_t(za) * h.ab);
    float* stats = static_cast<float*>(scratch.take(std::size_t(key.rows) * h.Z * sizeof(float)));
    void* work = scratch.take(lib_->workspace_bytes(key));
    if (key.padded) attention_set_lengths(lengths, pc->rows, pc->keys, stream);
    lib_->forward(key, {advance(q, pc->q0 * h.ldq, h.ab), b.k, b.v, o, stats, lengths}, work, stream);
    if (pc == first) {
      copy_rows(out, act_, h.ldo, o, act_, za, Tq, int(za), stream);
      SPPO_CUDA_CHECK(cudaMemcpy2DAsync(lse, std::size_t(h.ld_lse) * sizeof(float), stats,
                                        std::size_t(key.rows) * sizeof(float), std::size_t(Tq) * sizeof(float),
                                        std::size_t(h.Z), cudaMemcpyDeviceToDevice, stream));
    } else {
      attention_merge_rows(advance(out, pc->q0 * h.ldo, h.ab), lse + pc->q0, o, stats, pc->rows, h.Z, h.A, h.ldo, za,
                           h.ld_lse, key.rows, act_, stream);
    }
    scratch.reset(mark);
  }
}

bool LibraryAttention::backward(void* dq, const void* dout, const void* q, const std::vector<KVRef>& blocks,
                                const float* lse, const float* delta, const AttnShape& d, const Workspace& ws,
                                cudaStream_t stream) {
  const Heads h = Heads::of(d, act_);
  std::vector<Chunk> cs;
  if (!plan_call(true, h, join_adjacent_blocks(blocks, d, h.ab), d.Tq, d.q_pos0, ws, cs)) return false;
  for (const Chunk& c : cs)
    backward_chunk(advance(dq, c.row0 * h.ldq, h.ab), advance(dout, c.row0 * h.ldo, h.ab),
                   advance(q, c.row0 * h.ldq, h.ab), lse + c.row0, delta + c.row0, h, c, ws, stream);
  return true;
}

void LibraryAttention::backward_chunk(void* dq, const void* dout, const void* q, const float* lse, const float* delta,
                                      const Heads& h, const Chunk& c, const Workspace& ws, cudaStream_t stream) {
  const CallPlan& p = c.plan;
  const int Tq = c.rows;
  if (p.pieces.empty()) return;
  const i64 za = i64(h.Z) * h.A, zkva = i64(h.Zkv) * h.A;
  CallScratch scratch(ws, p.need, stream);
  int* lengths = static_cast<int*>(scratch.take(2 * sizeof(int)));
  // Note [The library's backward from delta].
  void* o = scratch.take(std::size_t(Tq) * std::size_t(za) * h.ab);
  attention_synthetic_out(o, dout, delta, Tq, h.Z, h.A, h.ldo, h.ld_lse, act_, stream);
  // dQ summed over the pieces in fp32, added to dq once (one rounding); one piece adds directly.
  float* dq_sum = nullptr;
  if (p.pieces.size() > 1) {
    dq_sum = static_cast<float*>(scratch.take(std::size_t(Tq) * std::size_t(za) * sizeof(float)));
    SPPO_CUDA_CHECK(cudaMemsetAsync(dq_sum, 0, std::size_t(Tq) * std::size_t(za) * sizeof(float), stream));
  }
  for (const AttnPiece& pc : p.pieces) {
    const std::size_t mark = scratch.mark();
    const KVRef& b = p.blocks[std::size_t(pc.block)];
    const SdpaGraphKey key = key_of(true, h, pc.rows, pc.keys, pc.mask);
    float* stats = static_cast<float*>(scratch.take(std::size_t(key.rows) * h.Z * sizeof(float)));
    SPPO_CUDA_CHECK(cudaMemcpy2DAsync(stats, std::size_t(key.rows) * sizeof(float), lse + pc.q0,
                                      std::size_t(h.ld_lse) * sizeof(float), std::size_t(pc.rows) * sizeof(float),
                                      std::size_t(h.Z), cudaMemcpyDeviceToDevice, stream));
    void* dq_part = scratch.take(std::size_t(key.rows) * std::size_t(za) * h.ab);
    void* dk_part = scratch.take(std::size_t(key.keys) * std::size_t(zkva) * h.ab);
    void* dv_part = scratch.take(std::size_t(key.keys) * std::size_t(zkva) * h.ab);
    void* work = scratch.take(lib_->workspace_bytes(key));
    if (key.padded) attention_set_lengths(lengths, pc.rows, pc.keys, stream);
    lib_->backward(key,
                   {advance(q, pc.q0 * h.ldq, h.ab), b.k, b.v, advance(o, pc.q0 * za, h.ab),
                    advance(dout, pc.q0 * h.ldo, h.ab), stats, dq_part, dk_part, dv_part, lengths},
                   work, stream);
    if (dq_sum) add_rows(dq_sum + pc.q0 * za, DType::F32, za, dq_part, act_, za, pc.rows, int(za), stream);
    else add_rows(advance(dq, pc.q0 * h.ldq, h.ab), act_, h.ldq, dq_part, act_, za, pc.rows, int(za), stream);
    if (b.dk) add_rows(b.dk, DType::F32, h.ldk, dk_part, act_, zkva, pc.keys, int(zkva), stream);
    if (b.dv) add_rows(b.dv, DType::F32, h.ldv, dv_part, act_, zkva, pc.keys, int(zkva), stream);
    scratch.reset(mark);
  }
  if (dq_sum) add_rows(dq, act_, h.ldq, dq_sum, DType::F32, za, Tq, int(za), stream);
}

std::string describe(const SdpaGraphKey& k) {
  std::ostringstream os;
  os << (k.backward ? "backward" : "forward") << " of " << k.rows << " query rows x " << k.keys << " keys"
     << (k.mask == PieceMask::BottomRight ? " (causal, bottom-right)" : "") << ", " << k.Z << " heads";
  if (k.Zkv != k.Z) os << " over " << k.Zkv << " key/value heads";
  os << " of " << k.A << ", " << dtype_name(k.act) << ", row strides q " << k.ldq << " k " << k.ldk << " v " << k.ldv;
  if (k.backward) os << " dO " << k.ld_dout;
  if (k.padded) os << " (padded)";
  return os.str();
}

}  // namespace sppo::cuda
