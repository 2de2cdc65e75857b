// Ring attention (context parallelism): the R ranks of a ring each hold one piece of every
// subsequence (schedule/ir.h piece_spans: contiguous, or zigzag for causal balance) and
// the keys and values of their own pieces only, as SPPO keeps K/V on the device that
// computed them. A block's queries meet every key they see by travelling round the ring.
//
// Note [Queries travel, keys stay]: with subsequences, the queries of subsequence i attend
// to the keys of every earlier subsequence, spread over all R ranks. Sending keys round
// the ring would move the whole prefix o_i + l_i again for every subsequence; sending the
// queries moves only the piece (l_i / R rows), whatever i is, and the dK/dV accumulators
// never leave their owner. So, per layer:
//  - forward: each rank's q piece goes round the ring (R - 1 steps, each forwarded as it
//    arrives). Every rank computes the attention of each piece it receives against its own
//    keys (a partial out and LSE over those keys, flash attention's one-pass form) and
//    returns it to the piece's owner, which joins the R partials by log-sum-exp
//    (Backend::attention_merge), in member order so that the result does not depend on
//    arrival order.
//  - backward: q, d attn_out, the final LSE and delta go round instead. Each rank adds the
//    piece's contribution to its own dK/dV accumulators (the final LSE and delta make every
//    key block's backward exact on its own) and returns a partial dq, which the owner sums.
//    When the ring has passed, this rank's dK/dV of the subsequence are complete.
// A (holder, query span) pair where the holder has no key at or before the span's last
// position exchanges nothing: both ends know it from the positions alone. The simulator
// prices exactly these messages (sched::ring_step_bytes, with sched::ring_first_key for
// who holds which keys), so each rank's traffic is predicted to the byte.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"
#include "model/gpt.h"
#include "runtime/kv_stream.h"
#include "runtime/memory.h"

namespace sppo {

struct RingContext {
  comm::Comm* comm = nullptr;
  std::vector<int> members;                 // world ranks in ring (piece) order
  int me = 0;                               // this rank's index in members
  std::vector<std::vector<PosSpan>> spans;  // [member]: its piece of the current subsequence
  std::vector<i64> first_key;               // [member]: the first position whose key it holds
  int subseq = 0, layer = 0;
  bool causal = true;                       // false: every query sees every key
  MemoryTier* device = nullptr;             // every buffer comes from the device tier
  double* waited_s = nullptr;               // adds the seconds spent waiting for messages
};

class RingAttention final : public BlockAttention {
 public:
  // `past`: this rank's own pieces of the earlier subsequences, one block per span; or,
  // with `streamed`, none there: they stream from the host, to every query piece that
  // passes in one go, once the ring has passed (runtime/kv_stream.h).
  RingAttention(const RingContext& ctx, const KVBlocks& past, PastAttention* streamed = nullptr)
      : ctx_(ctx), past_(past), streamed_(streamed) {}
  void forward(Backend& be, BlockSaved& s, const ModelConfig& c, const Subseq& q, const Workspace& scratch) override;
  void backward(Backend& be, void* dqkv, const void* dout, const float* delta, const BlockSaved& s, float* dk_self,
                float* dv_self, const ModelConfig& c, const Subseq& q, const Workspace& scratch) override;

 private:
  int size() const { return int(ctx_.members.size()); }
  // Whether member h holds a key that queries of span p see.
  bool sees(int h, const PosSpan& p) const {
    return !ctx_.causal || ctx_.first_key[std::size_t(h)] <= p.pos0 + p.rows - 1;
  }
  int rows_of(int member) const;
  std::vector<KVRef> local_blocks(const PosSpan& queries, const BlockSaved& s, float* dk_self, float* dv_self,
                                  const Subseq& q, const ModelConfig& c, DType a) const;
  // The span cut at the step's document starts (q's documents); itself without them.
  static std::vector<PosSpan> sub_spans(const Subseq& q, const PosSpan& span);
  int tag(int kind, int origin, int span) const;
  void wait(comm::Request r, const std::string& what);

  RingContext ctx_;
  const KVBlocks& past_;
  PastAttention* streamed_;
};

// The Sequence Parallelism paper's Ring Self-Attention (Li et al. 2021, --ring rsa), for a
// bidirectional model over one subsequence, two-pass and with the scores materialised:
//  - forward: keys go round the ring and each rank fills its queries' score rows
//    [Z, T, S] (S: the whole sequence), takes their softmax (keeping the LSE), then values
//    go round and out = P V block by block;
//  - backward: keys and values go round again; each rank rebuilds P from the LSE, forms
//    dP = dO V^T and dS = P (dP - rowsum(dP P)), accumulates dQ = dS K, and sends each
//    member its dK = dS^T Q and dV = P^T dO, which the owner adds to its accumulators.
// It holds Z x T x S fp32 scores where the one-pass ring holds none; `sppo bench sp` shows
// the difference. fp32 activations only (the GEMMs mix P in fp32 with the activations).
class RsaAttention final : public BlockAttention {
 public:
  explicit RsaAttention(const RingContext& ctx) : ctx_(ctx) {}
  void forward(Backend& be, BlockSaved& s, const ModelConfig& c, const Subseq& q, const Workspace& scratch) override;
  void backward(Backend& be, void* dqkv, const void* dout, const float* delta, const BlockSaved& s, float* dk_self,
                float* dv_self, const ModelConfig& c, const Subseq& q, const Workspace& scratch) override;

 private:
  int size() const { return int(ctx_.members.size()); }
  int rows_of(int member) const;
  i64 col_of(int member) const;  // first score column of a member's keys
  i64 cols() const { return col_of(size()); }
  // Circulates `arrays` (this rank's, each rows_of(me) x H activations) round the ring and
  // calls f(g, arrays of member g) for every member, this rank's first.
  void circulate(Backend& be, const std::vector<const void*>& arrays, int kind,
                 const std::function<void(int, const std::vector<const void*>&)>& f, i64 row_bytes);
  int tag(int kind, int origin) const;

  RingContext ctx_;
};

}  // namespace sppo
