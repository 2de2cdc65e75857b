#include "runtime/host_optimizer.h"

#include <algorithm>
#include <utility>

#include "core/check.h"

namespace sppo {

HostOptimizer::HostOptimizer(Backend& be, MemoryTier& host, const std::vector<ParamBucket>& buckets,
                             const std::vector<ShardSpan>& shard, i64 state, const HostArrays* arrays,
                             Packing packing)
    : be_(be),
      buckets_(buckets),
      shard_(shard),
      master_(arrays ? Buffer() : host.alloc_zeroed(i64(fp32_bytes(state)), "fp32 master weights (optimizer on the host)")),
      m_(host.alloc_zeroed(i64(fp32_bytes(state)), "AdamW first moments")),
      v_(host.alloc_zeroed(i64(fp32_bytes(state)), "AdamW second moments")),
      grads_(arrays ? Buffer() : host.alloc_zeroed(i64(fp32_bytes(state)), "gradients' copy (optimizer on the host)")),
      master_p_(arrays ? arrays->master : master_.f32()),
      grads_p_(arrays ? arrays->grads : grads_.f32()),
      device_(arrays ? arrays->device : std::vector<float*>{}),
      packing_(packing),
      down_(be.make_copy_stream()),
      up_(be.make_copy_stream()),
      worker_([this] { work(); }) {
  SPPO_ASSERT(shard.size() == buckets.size());
  // The runtime's arrays are flat: every bucket whole, its state where its weights are.
  if (arrays) {
    SPPO_ASSERT(device_.size() == buckets.size() && !packing.grads && !packing.weights);
    for (const ShardSpan& sp : shard) SPPO_ASSERT(sp.state_offset == sp.offset);
  }
}

HostOptimizer::~HostOptimizer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
  down_->synchronize();
  up_->synchronize();
}

void HostOptimizer::load_master(const float* params) {
  SPPO_ASSERT(!in_flight_);
  if (!device_.empty()) return;  // the runtime's host arrays are the master
  for (const ShardSpan& sp : shard_)
    be_.to_host(master() + sp.state_offset, params + (packing_.weights ? sp.state_offset : sp.offset),
                fp32_bytes(sp.count));
}

void HostOptimizer::start(float* params, const float* grads, std::vector<Piece> pieces, const Settings& s,
                          comm::Comm* comm, comm::Group zero) {
  SPPO_ASSERT_MSG(!in_flight_, "an optimizer update started before the last one was done");
  // Every bucket's gradients go down at once, in order; the worker takes each as it lands.
  // With HostArrays they are there: only the device's copies of weights come back up.
  down_done_.clear();
  copied_bytes_ = 0;
  for (std::size_t b = 0; b < shard_.size(); ++b) {
    const ShardSpan& sp = shard_[b];
    if (!device_.empty()) {
      if (device_[b]) copied_bytes_ += 2 * i64(fp32_bytes(sp.count));  // down when the step ended, and up
      continue;
    }
    const float* from = grads + (packing_.grads ? sp.state_offset : sp.offset);
    down_done_.push_back(down_->copy(grads_p_ + sp.state_offset, from, fp32_bytes(sp.count), {}));
    copied_bytes_ += 2 * i64(fp32_bytes(sp.count));
  }
  taken_.assign(buckets_.size(), false);
  params_ = params;
  comm_ = comm;
  zero_ = std::move(zero);
  in_flight_ = true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    up_done_.assign(buckets_.size(), nullptr);
    updated_.assign(buckets_.size(), 0);
    next_ = Update{params, std::move(pieces), s};
  }
  cv_.notify_all();
}

void HostOptimizer::work() {
  for (;;) {
    Update u;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || next_; });
      if (!next_) return;
      u = std::move(*next_);
      next_.reset();
    }
    try {
      run(u);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      error_ = std::current_exception();
    }
    cv_.notify_all();
  }
}

void HostOptimizer::run(const Update& u) {
  const Settings& s = u.settings;
  std::size_t p = 0;
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    if (b < down_done_.size()) down_done_[b]->wait();
    for (; p < u.pieces.size() && u.pieces[p].bucket == b; ++p) {
      const Piece& q = u.pieces[p];
      const i64 at = q.state_offset;
      be_.host_adamw(master() + at, m() + at, v() + at, grads_p_ + at, q.count, s.lr, s.beta1, s.beta2, s.eps,
                     q.weight_decay, s.t);
    }
    const ShardSpan& sp = shard_[b];
    float* to = !device_.empty() ? device_[b] : u.params + (packing_.weights ? sp.state_offset : sp.offset);
    std::shared_ptr<Event> up = to ? up_->copy(to, master() + sp.state_offset, fp32_bytes(sp.count), {}) : nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      up_done_[b] = std::move(up);
      updated_[b] = 1;
    }
    cv_.notify_all();
  }
  SPPO_ASSERT_MSG(p == u.pieces.size(), "optimizer pieces out of bucket order");
}

bool HostOptimizer::ready(std::size_t b) {
  if (!in_flight_ || taken_.at(b)) return false;
  std::shared_ptr<Event> up;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return updated_[b] || error_; });
    if (error_) std::rethrow_exception(error_);
    up = up_done_[b];
  }
  if (up) up->wait();
  if (!zero_.empty()) {
    SPPO_ASSERT(!packing_.weights);
    const ParamBucket& k = buckets_[b];
    comm::wait(*comm_, comm::iallgather_pieces(*comm_, params_ + k.offset, k.count, zero_),
               "the all-gather of the updated weights");
  }
  taken_[b] = true;
  in_flight_ = !std::all_of(taken_.begin(), taken_.end(), [](bool t) { return t; });
  return true;
}

void HostOptimizer::gradients_taken() {
  if (!in_flight_) return;
  for (const auto& e : down_done_) e->wait();
}

}  // namespace sppo
