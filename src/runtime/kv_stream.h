// The K/V cache on the host (Schedule::kv_place: KvPlace::Host, and KvPlace::Recompute's
// streaming; docs/design.md Note [dK/dV with host-resident K/V]).
//
// On a host layer, a subsequence's K and V leave the device when its forward of the layer
// is done (copied, then freed). The attention of each later subsequence attends to its own
// block on the device and streams every earlier block, in chunks of kv_chunk_rows rows
// (core/layout.h), through a window of two slots on the copy streams (the backward's sums
// through three: Note [A third slot in backward] in kv_stream.cpp): while the kernels
// run on one chunk the next is on its way in. Forward joins
// the blocks' partial results by log-sum-exp (Backend::attention_merge). Backward streams
// the same blocks with their fp32 dK/dV partial sums, which live on the host: each slot's
// sums go back out once the kernels have added to them, and the backward of subsequence j
// takes its own K_j, V_j and its complete sums back onto the device. Every gradient is the
// device cache's to fp32 rounding: the kernels add the same terms, a block at a time.
//
// Memory (schedule/memory.h, MemTerm::KVWindow): the window is kv_window_bytes
// (core/layout.h), allocated while a layer's attention runs.
//
// Under ring attention (runtime/ring.h) a rank's earlier blocks are its pieces of the
// earlier subsequences, positions with gaps between them; a chunk is kv_chunk_rows of
// those rows, each run of consecutive positions one key block of the kernels. The ring's
// queries, its own and every member's that travel past, meet the streamed blocks in one
// pass (PastAttention): each chunk comes in once and every query piece attends to it, so
// the stream moves a rank's share of the prefix once a layer, whatever the ring's size.
//
// A Recompute layer (KvPlace::Recompute) keeps no K, V at all: its window brings in the
// earlier blocks' layer input x instead (from the device, or from the host where an
// offload put it) and recomputes each chunk's K, V from it (LayerNorm 1, the k and v rows
// of the projection, RoPE; model/gpt.h kv_project) before the attention runs on them.
//
// Note [dK/dV into the layer input]: a Recompute layer's backward of subsequence i adds its
// part of an earlier block j's gradient, dK_j^(i) and dV_j^(i) [rows, G A] fp32, not into dK/dV
// sums but, through the projection that made K_j and V_j from the LayerNorm-1 output u_j
// (W_k, W_v [G A, H]: a Llama-family model's grouped-query K/V are G A wide, u_j H),
// straight into d u_j = sum_i (RoPE^T dK_j^(i)) W_k + dV_j^(i) W_v, and likewise into the
// weight gradients dW_k += (RoPE^T dK_j^(i))^T u_j, dW_v += dV_j^(i)^T u_j and their biases. Every
// map is linear, so the sums over i are those of the device cache's complete dK_j, dV_j to
// fp32 rounding; u_j is at hand, recomputed for the chunk. The host keeps d u_j [rows, H]
// fp32: half the bytes of dK_j and dV_j without grouped-query attention (G = Z), and half the
// traffic in and out. The backward of j
// itself computes its own blocks' dK_j, dV_j (from zero) as a device layer does, and adds
// the sum d u_j into its LayerNorm-1 output's gradient before that LayerNorm's backward.
#pragma once

#include <functional>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/gpt.h"
#include "runtime/memory.h"

namespace sppo {

// Query rows (one span of positions) that attend to a rank's streamed earlier blocks.
struct PastQueries {
  PosSpan span;             // the rows' positions (row0 unused)
  i64 from = 0;             // keys before it are another document's (Subseq::doc_start)
  const void* q = nullptr;  // [rows, ldq]
  int ldq = 0;              // row stride of q and, in backward, of dq
  float* lse = nullptr;     // forward: [Z, rows] merged into with the blocks' attention
  void* out = nullptr;      // forward: [rows, H], likewise
  void* dq = nullptr;       // backward: [rows, ldq] accumulates
  const void* dout = nullptr;    // backward: [rows, H] d attn_out
  const float* final_lse = nullptr;  // backward: [Z, rows] the queries' LSE over every key
  const float* delta = nullptr;      // backward: [Z, rows]
};

// The attention of many query spans against a rank's streamed earlier blocks of one layer,
// each chunk brought in once for all of them. Forward merges each span's attention over
// those keys into its out and LSE (log-sum-exp); backward adds to each span's dq and to the
// blocks' dK/dV sums.
class PastAttention {
 public:
  virtual ~PastAttention() = default;
  virtual void forward_past(Backend& be, const ModelConfig& c, const std::vector<PastQueries>& q,
                            const Workspace& scratch) = 0;
  virtual void backward_past(Backend& be, const ModelConfig& c, const std::vector<PastQueries>& q,
                             const Workspace& scratch) = 0;
};

class HostKvCache {
 public:
  // `width`: the cache's row width (this tensor-parallel member's heads x head size).
  // Copies go through d2h and h2d; the seconds the compute waits on them add to *waited_s.
  HostKvCache(Backend& be, MemoryTier& device, MemoryTier& host, CopyStream& d2h, CopyStream& h2d, int layers,
              int subseqs, i64 width, double* waited_s);
  ~HostKvCache();

  // After the forward of layer l on subsequence i (this rank's rows of it: `spans`, one
  // span, or two for a zigzag ring piece): its K, V go to the host and their device buffers
  // are released.
  void store(int l, int i, Buffer& k, Buffer& v, const std::vector<PosSpan>& spans);
  // Before the backward of layer l on subsequence i: K_i, V_i back on the device, and its
  // dK/dV accumulators with what later subsequences' backward added (zeros if none).
  void restore(int l, int i, Buffer* k, Buffer* v, Buffer* dk, Buffer* dv);
  // MSP, a stage's owner: the K, V of a helper's piece of subsequence i (positions `rows`),
  // received into device buffers, go to the host, streamed with i's own block; take_held
  // gives back the piece's dK/dV sums (on the device, zeros if none) and drops it.
  void store_held(int l, int i, Buffer& k, Buffer& v, const PosSpan& rows);
  void take_held(int l, int i, i64 pos0, Buffer* dk, Buffer* dv);
  // Drops every stored block (a forward-only step's end, its copies ended).
  void clear();
  // The attention of subsequence i at layer l: its own block, and the stored blocks of
  // every j < i streamed in. Holds the window until destroyed.
  // T: the query rows (chunks of kv_chunk_rows(T) rows, core/layout.h).
  std::unique_ptr<BlockAttention> attention(int l, int i, i64 T, bool backward);
  // The stored blocks of every j < i alone, for ring attention (chunks of kv_chunk_rows(T)
  // rows). Holds the window until destroyed.
  std::unique_ptr<PastAttention> past_attention(int l, int i, i64 T, bool backward);

  // A Recompute layer. Where subsequence j's input x [rows, H] of layer l is when a later
  // subsequence needs it: on the device, or (host set) a host copy that can be read (the
  // lookup waits for a copy in flight).
  struct InputRows {
    const void* device = nullptr;
    const void* host = nullptr;
  };
  using InputLookup = std::function<InputRows(int l, int j)>;
  // The layer's weights (the LayerNorm and the projection's k and v rows) and their
  // gradients (the projection's, in backward).
  struct LayerWeights {
    const BlockParams* p = nullptr;
    const BlockMatrices* m = nullptr;
    BlockParams* g = nullptr;
  };
  // After the forward of layer l on subsequence i: K, V are released (recomputed when
  // needed); the block's rows are noted.
  void forget(int l, int i, Buffer& k, Buffer& v, const std::vector<PosSpan>& spans);
  // Before the backward of layer l on subsequence i: its own dK/dV accumulators [rows,
  // width] fp32, zeroed, and the d(LayerNorm-1 output) sums [rows, hidden] fp32 that later
  // subsequences' backward left on the host (zeros if none). hidden: H, the layer input's
  // width (grouped-query K/V are narrower).
  void restore_sums(int l, int i, i64 hidden, Buffer* dk, Buffer* dv, Buffer* du);
  // The attention of subsequence i at layer l, recomputing every earlier block's K, V.
  std::unique_ptr<BlockAttention> recomputed_attention(int l, int i, i64 T, bool backward, const LayerWeights& w,
                                                       const InputLookup& inputs, const ModelConfig& c);

 private:
  struct Block {
    Buffer k, v, dk, dv;  // on the host; dk, dv from the first backward that reaches the block
    Buffer du;            // a Recompute layer's d(LayerNorm-1 output) sums on the host, likewise
    std::vector<PosSpan> spans;  // the positions of its rows, in row order
    int rows = 0;
    int subseq = 0;
    bool recomputed = false;  // a Recompute layer's block: its rows only
    i64 summed = 0;  // rows [0, summed) of the sums hold sums; the rest are not yet written
  };
  // Rows [row0, row0 + rows) of an earlier block, positions pos0 .., at row `at` of its
  // chunk.
  struct Piece {
    Block* blk;
    i64 row0;
    int rows;
    int at;
    i64 pos0;
  };
  // kv_chunk_rows(T) rows at most of the earlier blocks, in position order.
  struct Chunk {
    std::vector<Piece> pieces;
    int rows = 0;
    i64 pos0 = 0;  // of its first row
  };
  // Block blk of subsequence i (positions `spans`) takes K, V to the host; their device
  // buffers are released.
  void copy_out(Block& blk, int i, const std::vector<PosSpan>& spans, Buffer& k, Buffer& v, const std::string& name);
  // Device dK/dV accumulators for block blk with the sums later backwards left on the host
  // (zeros where none did); the event of their copy in, or null.
  std::shared_ptr<Event> sums_in(const Block& blk, Buffer* dk, Buffer* dv, const std::string& name);
  // The earlier blocks of subsequence i at layer l as chunks for T query rows; *largest:
  // the most rows of one.
  std::vector<Chunk> chunks(int l, int i, i64 T, i64* largest);
  friend class ChunkedAttention;
  friend class StreamedAttention;
  friend class RecomputedAttention;
  Backend& be_;
  MemoryTier& device_;
  MemoryTier& host_;
  CopyStream& d2h_;
  CopyStream& h2d_;
  i64 width_;
  double* waited_s_;
  std::vector<std::vector<Block>> blocks_;  // [L][N]
  std::vector<std::vector<std::list<Block>>> held_;  // [L][N] MSP helpers' pieces
};

}  // namespace sppo
