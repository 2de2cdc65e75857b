// Where the K and V of (layer l, subsequence j) and their gradient sums are during a step,
// and how an attention reaches them.
//
// Contract, per layer of a step:
//  - device layer: K_j, V_j [rows, H/tp] are unit (j, l)'s saved k and v (a Ulysses
//    member's: every row of the piece for its key/value heads, runtime/ulysses.h)
//    (runtime/activation_store.h), for the rows of j that this rank's forward computed
//    (rows_of, runtime/op_rows.h). Their fp32 dK/dV accumulators, of the same shape, live
//    here: allocated and zeroed the first time a backward of layer l reaches block j,
//    added to (+=) by the backward of every later subsequence and of j itself, freed when
//    j's backward of layer l is done (release).
//  - MSP (Note [MSP pieces] in schedule/builders.cpp): a stage's owner also holds the K, V
//    of its helpers' pieces, received after their forward, with their dK/dV accumulators,
//    until it sends the sums back (take_held); on a host layer, on the host, streamed with
//    its own blocks. A helper keeps its pieces of another stage's layers on the device.
//  - host layer (KvPlace::Host): HostKvCache (runtime/kv_stream.h) keeps K_j, V_j and
//    their sums on the host from j's forward of the layer (after_forward) to j's backward
//    (restore); a ring piece's are this rank's rows of j, streamed to every piece's
//    queries as they pass.
//  - recompute layer (KvPlace::Recompute): no K_j, V_j after j's forward of the layer;
//    later subsequences recompute them from unit (j, l)'s x wherever the activation store
//    has it, and leave their gradients' sums, taken into the LayerNorm-1 output's, on the
//    host; restore gives j's backward zeroed accumulators of its own and those sums (du).
// attention() gives F/B op's layer l the attention that reaches every earlier block: on
// this rank (LocalAttention over the device blocks), round the ring for ring and MSP pieces
// (runtime/ring.h), or streamed from the host. At the end of a step nothing is held.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"
#include "core/config.h"
#include "model/gpt.h"
#include "runtime/activation_store.h"
#include "runtime/kv_stream.h"
#include "runtime/memory.h"
#include "runtime/op_rows.h"
#include "runtime/step_io.h"
#include "schedule/ir.h"

namespace sppo {

// The attention of one layer for one F/B op, with the earlier blocks it refers to.
class LayerAttention {
 public:
  BlockAttention& operator*() const { return *attn_; }

 private:
  friend class KvStore;
  std::unique_ptr<KVBlocks> past_;
  std::unique_ptr<PastAttention> window_;  // a ring piece's streamed earlier blocks
  std::unique_ptr<BlockAttention> attn_;   // after past_ and window_, so destroyed before them
};

class KvStore {
 public:
  // MSP: K, V of a helper's piece that its stage's owner holds, with their sums.
  struct Held {
    PosSpan rows;  // global positions (row0 0)
    Buffer k, v, dk, dv;
  };

  // `ops`: this rank's, whose forwards say which rows each block holds. The ring's
  // members and the waits on its messages come from `o` and `result`.
  KvStore(ActivationStore& act, Backend& be, MemoryTier& device, MemoryTier& host, const ModelConfig& c,
          const RuntimeOptions& o, const sched::Schedule& sc, const std::vector<sched::Op>& ops,
          std::pair<int, int> layers, StepResult& result);
  ~KvStore();

  // The attention of F/B op `op` at layer l; with `backward`, its dK/dV accumulators too.
  // `weights`: the layer's (a recompute layer recomputes K/V with them and adds to their
  // gradients).
  LayerAttention attention(const sched::Op& op, int l, bool backward, const HostKvCache::LayerWeights& weights = {});
  // After the forward of layer l on subsequence i (rows q): on a host layer its K, V go to
  // the host and leave the device.
  void after_forward(int l, int i, const Subseq& q);
  // The dK/dV accumulators of every block that the backward of layer l on subsequence i
  // reaches (i's own, earlier subsequences', held pieces'), zeroed, where there are none
  // yet; a host layer's are the host's.
  void alloc_accumulators(int l, int i);
  // Before the backward of layer l on subsequence i, once its workspace is allocated: on a
  // host layer, K_i, V_i and i's sums come back onto the device.
  void restore(int l, int i);
  // [rows, H/tp] K and V of block (l, i) on a device layer (unit (i, l)'s k and v).
  const Buffer& k(int l, int i) { return act_.unit(i, l)[kK]; }
  const Buffer& v(int l, int i) { return act_.unit(i, l)[kV]; }
  // [rows, H/tp] fp32 the dK/dV accumulators of block (l, i).
  Buffer& dk(int l, int i) { return dk_[l][i]; }
  Buffer& dv(int l, int i) { return dv_[l][i]; }
  // [rows, H] fp32 on a recompute layer: the d(LayerNorm-1 output) later subsequences'
  // backward summed for block (l, i) (Note [dK/dV into the layer input]); else empty.
  Buffer& du(int l, int i) { return du_[l][i]; }
  // The backward of layer l on subsequence i is done: its sums are spent.
  void release(int l, int i);
  // MSP, the owner: K and V (`bytes` each) of a helper's piece at rows `rows` of
  // subsequence i, allocated here to receive them into; once they are in, received(l, i)
  // (a host layer's go to the host).
  Held& hold(int l, int i, const PosSpan& rows, i64 bytes);
  void received(int l, int i);
  // MSP, the owner: the dK/dV sums of the held piece of op's subsequence that starts at
  // position pos0, which it stops holding.
  std::pair<Buffer, Buffer> take_held(const sched::Op& op, int l, i64 pos0);
  // A forward-only step's end (Note [Forward-only steps] in schedule/builders.cpp): every
  // K, V held, on the device and the host, goes; after the copies have ended.
  void drop_all();
  // Nothing held at the end of the step (ASSERT).
  void check_empty() const;

 private:
  // The KV blocks of this rank's rows of subsequences j < i at layer l (with their dK/dV
  // accumulators when grads), one per span.
  KVBlocks past_blocks(int l, int i, bool grads);
  // Whether layer l's K/V stream on this rank: a host or recompute layer of its own (an
  // MSP helper keeps its pieces of another stage's layers on the device, as saved tensors).
  bool streamed(int l) const { return sched_.place.kv_streamed(l) && l >= lb_ && l < le_; }
  // How F/B op's queries reach their keys at layer l: on this rank, or round its ring
  // (`streamed`: this rank's earlier blocks come from the host rather than `past`).
  std::unique_ptr<BlockAttention> reach(const sched::Op& op, int l, const KVBlocks& past,
                                        PastAttention* streamed = nullptr);

  ActivationStore& act_;
  MemoryTier& device_;
  const ModelConfig& config_;
  const RuntimeOptions& opts_;
  const sched::Schedule& sched_;
  DType dtype_;  // of K, V
  i64 width_;    // of K, V and their sums: this tensor-parallel or Ulysses member's key/value heads
  int lb_, le_;
  double* ring_wait_s_;
  // The rows of each subsequence this rank computed at each layer ([L][N]; T = 0: none).
  std::vector<std::vector<Subseq>> rows_at_;
  std::vector<std::vector<Buffer>> dk_, dv_;     // [L][N] dK/dV accumulators
  std::vector<std::vector<Buffer>> du_;          // [L][N] a recompute layer's d(LayerNorm-1 output) sums
  HostKvCache::InputLookup inputs_;              // where an earlier unit's x is (the activation store)
  std::vector<std::vector<std::vector<Held>>> held_;  // [L][N] the owner's copies of helper pieces
  std::unique_ptr<HostKvCache> host_;            // layers whose K/V live on the host
};

}  // namespace sppo
