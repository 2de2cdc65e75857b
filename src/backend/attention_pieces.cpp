#include "backend/attention_pieces.h"

#include <algorithm>

#include "core/check.h"

namespace sppo {

namespace {

i64 kv_stride(const AttnShape& d, int ld) { return ld > 0 ? ld : i64(d.Zkv > 0 ? d.Zkv : d.Z) * d.A; }

const void* advance(const void* p, i64 elems, std::size_t bytes) {
  return p ? static_cast<const char*>(p) + elems * i64(bytes) : nullptr;
}
float* advance(float* p, i64 elems) { return p ? p + elems : nullptr; }

}  // namespace

std::vector<AttnPiece> attention_pieces(int Tq, i64 q_pos0, const std::vector<KeySpan>& blocks) {
  std::vector<AttnPiece> pieces;
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    const i64 Tk = blocks[b].rows, off = q_pos0 - blocks[b].pos0;
    if (Tk <= 0 || Tq <= 0) continue;
    const i64 t0 = std::clamp<i64>(-off, 0, Tq);  // the first row that sees a key
    const i64 full = std::clamp<i64>(Tk - 1 - off, t0, Tq);  // the first row that sees them all
    i64 rest = t0;  // rows [rest, Tq) see every key
    if (full > t0) {
      const i64 t1 = std::min<i64>(Tq, full + 1);
      pieces.push_back({int(b), int(t0), int(t1 - t0), int(t1 + off), PieceMask::BottomRight});
      rest = t1;
    }
    if (rest < Tq) pieces.push_back({int(b), int(rest), int(Tq - rest), int(Tk), PieceMask::None});
  }
  return pieces;
}

std::vector<KeySpan> key_spans(const std::vector<KVRef>& blocks) {
  std::vector<KeySpan> spans;
  spans.reserve(blocks.size());
  for (const KVRef& b : blocks) spans.push_back({b.Tk, b.k_pos0});
  return spans;
}

std::vector<KVRef> join_adjacent_blocks(const std::vector<KVRef>& blocks, const AttnShape& d, std::size_t act_bytes) {
  const i64 ldk = kv_stride(d, d.ldk), ldv = kv_stride(d, d.ldv);
  std::vector<KVRef> joined;
  for (const KVRef& b : blocks) {
    if (!joined.empty()) {
      KVRef& p = joined.back();
      const bool grads = (p.dk != nullptr) == (b.dk != nullptr) && (p.dv != nullptr) == (b.dv != nullptr);
      if (grads && b.k_pos0 == p.k_pos0 + p.Tk && b.k == advance(p.k, p.Tk * ldk, act_bytes) &&
          b.v == advance(p.v, p.Tk * ldv, act_bytes) && b.dk == advance(p.dk, p.Tk * ldk) &&
          b.dv == advance(p.dv, p.Tk * ldv)) {
        p.Tk += b.Tk;
        continue;
      }
    }
    joined.push_back(b);
  }
  return joined;
}

std::vector<KVRef> split_blocks(const std::vector<KVRef>& blocks, int max_rows, const AttnShape& d,
                                std::size_t act_bytes) {
  SPPO_ASSERT_MSG(max_rows > 0, "split_blocks: parts of no rows");
  const i64 ldk = kv_stride(d, d.ldk), ldv = kv_stride(d, d.ldv);
  std::vector<KVRef> parts;
  for (const KVRef& b : blocks) {
    for (int r = 0; r < b.Tk; r += max_rows) {
      const int n = std::min(max_rows, b.Tk - r);
      parts.push_back({advance(b.k, r * ldk, act_bytes), advance(b.v, r * ldv, act_bytes), advance(b.dk, r * ldk),
                       advance(b.dv, r * ldv), n, b.k_pos0 + r});
    }
  }
  return parts;
}

i64 sdpa_length_class(i64 n) {
  if (n <= 64) return 64;
  i64 step = 8;  // 1/8 of n's power of two: 2^floor(log2(n - 1)) / 8
  while (step * 16 < n) step *= 2;
  return (n + step - 1) / step * step;
}

namespace {

constexpr std::size_t kAlign = 256;
std::size_t aligned(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

}  // namespace

LibraryCallBytes library_call_bytes(bool backward, int Tq, int rows_class, int pieces, int Z, int Zkv, int A,
                                    std::size_t act_bytes) {
  const std::size_t za = std::size_t(Z) * A, rows = std::size_t(rows_class);
  LibraryCallBytes b;
  b.rows_side = aligned(2 * sizeof(int)) + aligned(rows * Z * sizeof(float)) + aligned(rows * za * act_bytes);
  if (backward) {
    b.rows_side += aligned(std::size_t(Tq) * za * act_bytes);
    if (pieces > 1) b.rows_side += aligned(std::size_t(Tq) * za * sizeof(float));
    b.per_key_row = 2 * std::size_t(Zkv) * A * act_bytes;
  }
  return b;
}

std::size_t library_workspace_bound(int rows_class, int Z, int A) {
  return aligned(std::size_t(rows_class) * Z * (A + 1) * sizeof(float));
}

KernelScratch library_attention_scratch(const ModelConfig& c, std::size_t act_bytes) {
  const int Z = c.heads, Zkv = c.kv_head_count(), A = c.head_size();
  const int rows = int(sdpa_length_class(kLibraryQueryRows)), keys = int(sdpa_length_class(kLibraryKeyRows));
  const LibraryCallBytes b = library_call_bytes(true, kLibraryQueryRows, rows, 2, Z, Zkv, A, act_bytes);
  const std::size_t call = b.rows_side + 2 * aligned(b.per_key_row / 2 * std::size_t(keys)) +
                           library_workspace_bound(rows, Z, A);
  // The forward takes less (its O and Stats); 1 MiB for alignment and what a graph asks
  // for beside its accumulator.
  return KernelScratch{i64(call) + (i64{1} << 20), 0};
}

}  // namespace sppo
