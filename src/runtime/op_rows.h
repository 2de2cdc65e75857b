// The rows of the sequence that an F/B op of a schedule works on, in the form the model's
// kernels take them (model/gpt.h Subseq): the whole subsequence, or this rank's ring or
// MSP piece of it (Schedule::spans). The step's parts read the op list through it: which
// rows each block of K/V holds, which hidden states a piece takes from this rank's own.
#pragma once

#include "model/gpt.h"
#include "schedule/ir.h"

namespace sppo {

// F and B: the ops that run the model on rows of a subsequence.
inline bool is_compute(const sched::Op& op) {
  return op.kind == sched::OpKind::Forward || op.kind == sched::OpKind::Backward;
}

// The rows of subsequence op.subseq that F/B op `op` works on (Schedule::spans), at their
// global positions.
inline Subseq rows_of(const sched::Schedule& sc, const sched::Op& op) {
  const i64 o = sc.offset(op.subseq);
  if (op.pieces == 1) return Subseq{o, int(sc.lengths[op.subseq])};
  Subseq q;
  for (const auto& [b, e] : sc.spans(op)) {
    q.spans.push_back({o + b, int(e - b), q.T});
    q.T += int(e - b);
  }
  q.offset = q.spans.front().pos0;
  return q;
}

// The rows of them that member `index` of `size` holds (sched::member_spans: rows
// piece_range(T, index, size) of the piece): a tensor-parallel member's between the
// sequence-parallel regions, a Ulysses member's outside the attention.
inline Subseq member_rows(const sched::Schedule& sc, const sched::Op& op, int index, int size) {
  if (size == 1) return rows_of(sc, op);
  const i64 o = sc.offset(op.subseq);
  Subseq q;
  for (const auto& [b, e] : sched::member_spans(sc.spans(op), index, size)) {
    q.spans.push_back({o + b, int(e - b), q.T});
    q.T += int(e - b);
  }
  q.offset = q.spans.front().pos0;
  return q;
}

// The rows rank `rank` holds of them in its residual stream, the hidden states it passes on
// and takes in: its tensor-parallel member's or its Ulysses member's; all of them with neither.
inline Subseq member_rows(const sched::Schedule& sc, const sched::Op& op, int rank) {
  const RankShard r = sc.shard(rank);
  if (r.tp.on()) return member_rows(sc, op, r.tp.index, r.tp.size);
  return member_rows(sc, op, r.ulysses.index, r.ulysses.size);
}

// q as the blocks see it: with the step's packed documents (StepControl::docs), if any.
inline Subseq with_docs(Subseq q, const std::vector<i64>* docs) {
  q.docs = docs && !docs->empty() ? docs : nullptr;
  return q;
}

}  // namespace sppo
