// The K/V cache on the host (Schedule::kv_host; DESIGN.md Note [dK/dV with host-resident
// K/V]).
//
// On a host layer, a subsequence's K and V leave the device when its forward of the layer
// is done (copied, then freed). The attention of each later subsequence attends to its own
// block on the device and streams every earlier block, in chunks of kv_chunk_rows rows
// (core/layout.h), through a window of two slots on the copy streams: while the kernels
// run on one chunk the next is on its way in. Forward joins
// the blocks' partial results by log-sum-exp (Backend::attention_merge). Backward streams
// the same blocks with their fp32 dK/dV partial sums, which live on the host: each slot's
// sums go back out once the kernels have added to them, and the backward of subsequence j
// takes its own K_j, V_j and its complete sums back onto the device. Every gradient is the
// device cache's to fp32 rounding: the kernels add the same terms, a block at a time.
//
// Memory (schedule/memory.h, MemTerm::KVWindow): the window is kv_window_bytes
// (core/layout.h), allocated while a layer's attention runs.
#pragma once

#include <memory>
#include <vector>

#include "backend/backend.h"
#include "model/gpt.h"
#include "runtime/memory.h"

namespace sppo {

class HostKvCache {
 public:
  // `width`: the cache's row width (this tensor-parallel member's heads x head size).
  // Copies go through d2h and h2d; the seconds the compute waits on them add to *waited_s.
  HostKvCache(Backend& be, MemoryTier& device, MemoryTier& host, CopyStream& d2h, CopyStream& h2d, int layers,
              int subseqs, i64 width, double* waited_s);
  ~HostKvCache();

  // After the forward of layer l on subsequence i (rows [pos0, pos0 + rows)): its K, V go
  // to the host and their device buffers are released.
  void store(int l, int i, Buffer& k, Buffer& v, i64 pos0, int rows);
  // Before the backward of layer l on subsequence i: K_i, V_i back on the device, and its
  // dK/dV accumulators with what later subsequences' backward added (zeros if none).
  void restore(int l, int i, Buffer* k, Buffer* v, Buffer* dk, Buffer* dv);
  // The attention of subsequence i at layer l: its own block, and the stored blocks of
  // every j < i streamed in. Holds the window until destroyed.
  // T: the query rows (chunks of kv_chunk_rows(T) rows, core/layout.h).
  std::unique_ptr<BlockAttention> attention(int l, int i, i64 T, bool backward);

 private:
  struct Block {
    Buffer k, v, dk, dv;  // on the host; dk, dv from the first backward that reaches the block
    i64 pos0 = 0;
    int rows = 0;
    int subseq = 0;
    i64 summed = 0;  // rows [0, summed) of dk, dv hold sums; the rest are not yet written
  };
  friend class StreamedAttention;
  Backend& be_;
  MemoryTier& device_;
  MemoryTier& host_;
  CopyStream& d2h_;
  CopyStream& h2d_;
  i64 width_;
  double* waited_s_;
  std::vector<std::vector<Block>> blocks_;  // [L][N]
};

}  // namespace sppo
