#include "runtime/tensor_parallel.h"

#include "core/check.h"

namespace sppo {

TpGroup::TpGroup(comm::Comm& comm, int first, const TpShard& tp, int kv_replicas, double* waited_s)
    : comm_(comm), tp_(tp), waited_s_(waited_s) {
  for (int k = 0; k < tp.size; ++k) group_.push_back(first + k);
  SPPO_ASSERT(kv_replicas >= 1 && tp.size % kv_replicas == 0);
  for (int k = 0; k < kv_replicas; ++k) kv_group_.push_back(first + tp.index / kv_replicas * kv_replicas + k);
  SPPO_ASSERT(group_[std::size_t(tp.index)] == comm.rank());
}

void TpGroup::wait(comm::Request r, const char* what) {
  const double s = comm::wait_spinning(comm_, r, std::string("the tensor-parallel ") + what);
  if (waited_s_) *waited_s_ += s;
}

// The padded slots travel as elements of the activation type (bf16 rows move as they are); a
// reduce-scatter sums them in fp32: pad is [padded_rows, H] fp32 (core/layout.cpp tp_pad),
// room for either.
void TpGroup::all_gather(Backend& be, void* full, const void* mine, void* pad, int T, int H) {
  const DType a = be.act();
  const i64 slot = tp_.padded_rows(T) / tp_.size;  // rows a slot
  const auto [b, e] = tp_.rows(T);
  be.copy_cols(act_at(pad, i64(tp_.index) * slot * H, a), mine, int(e - b), H, H, 0);
  be.synchronize();
  wait(comm_.iallgather(act_at(pad, i64(tp_.index) * slot * H, a), pad, comm::Counts(group_.size(), slot * H),
                        comm::type_of(a), group_),
       "all-gather");
  for (int k = 0; k < tp_.size; ++k) {
    const auto [kb, ke] = piece_range(T, k, tp_.size);
    if (ke > kb) be.copy_cols(act_at(full, kb * H, a), act_at(pad, i64(k) * slot * H, a), int(ke - kb), H, H, 0);
  }
}

void TpGroup::reduce_scatter(Backend& be, void* mine, void* full, void* pad, int T, int H) {
  const DType a = be.act();
  const i64 slot = tp_.padded_rows(T) / tp_.size;
  float* sums = static_cast<float*>(pad);
  for (int k = 0; k < tp_.size; ++k) {
    const auto [kb, ke] = piece_range(T, k, tp_.size);
    float* dst = sums + i64(k) * slot * H;
    if (ke > kb) be.to_f32(dst, act_at(full, kb * H, a), (ke - kb) * H);
    // The slot's padding rows are summed too: zeros keep them finite.
    if (slot > ke - kb) be.fill_zero(dst + (ke - kb) * H, std::size_t((slot - (ke - kb)) * H) * 4);
  }
  be.synchronize();
  wait(comm_.ireduce_scatter(sums, sums + i64(tp_.index) * slot * H, comm::Counts(group_.size(), slot * H),
                             comm::Type::F32, group_),
       "reduce-scatter");
  const auto [b, e] = tp_.rows(T);
  be.put_cols(mine, sums + i64(tp_.index) * slot * H, true, int(e - b), H, H, 0);
}

void TpGroup::all_gather_rows(float* parts, int rows) {
  wait(comm_.iallgather(parts + i64(tp_.index) * rows, parts, comm::Counts(group_.size(), rows), comm::Type::F32,
                        group_),
       "all-gather of the rows' log-sum-exp");
}

void TpGroup::all_reduce(float* x, i64 n, const std::string& what) {
  const double s =
      comm::wait(comm_, comm_.iallreduce(x, n, comm::Type::F32, group_), "the tensor-parallel sum of " + what);
  if (waited_s_) *waited_s_ += s;
}

void TpGroup::all_reduce_kv_replicas(float* x, i64 n, const std::string& what) {
  if (kv_group_.size() < 2) return;
  const double s = comm::wait(comm_, comm_.iallreduce(x, n, comm::Type::F32, kv_group_),
                              "the key/value replicas' sum of " + what);
  if (waited_s_) *waited_s_ += s;
}

}  // namespace sppo
