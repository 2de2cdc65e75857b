// The collectives of tensor parallelism's sequence-parallel regions (model/tensor_parallel.h
// TpCollectives) over a group of ranks of comm::Comm: consecutive world ranks, member k of
// the group holding rows piece_range(T, k, size) of each [T, H] activation.
//
// Rows do not divide evenly in general (subsequence lengths are the partition's), while
// the communicator's collectives split an array into equal pieces; so every collective
// goes through a padded buffer of size slots of ceil(T / size) rows, member k's rows in
// slot k. fp32 activations (CPU ranks).
#pragma once

#include <string>

#include "comm/comm.h"
#include "model/tensor_parallel.h"

namespace sppo {

class TpGroup final : public TpCollectives {
 public:
  // `first`: the group's first world rank; this rank is member tp.index. `kv_replicas`:
  // members holding each key/value head (Note [Replicated key/value heads]).
  TpGroup(comm::Comm& comm, int first, const TpShard& tp, int kv_replicas = 1, double* waited_s = nullptr);
  const TpShard& shard() const override { return tp_; }
  const comm::Group& group() const { return group_; }
  void all_gather(Backend& be, void* full, const void* mine, void* pad, int T, int H) override;
  void reduce_scatter(Backend& be, void* mine, void* full, void* pad, int T, int H) override;
  void all_gather_rows(float* parts, int rows) override;
  // Sums x[n] over the group in place (gradients of the replicated parameters).
  void all_reduce(float* x, i64 n, const std::string& what);
  // Sums x[n] over the members that hold this member's key/value head (its K/V rows'
  // weight gradients); nothing with one holder.
  void all_reduce_kv_replicas(float* x, i64 n, const std::string& what);

 private:
  void wait(comm::Request r, const char* what);

  comm::Comm& comm_;
  TpShard tp_;
  comm::Group group_;
  comm::Group kv_group_;  // the members holding this member's key/value head
  double* waited_s_;
};

}  // namespace sppo
