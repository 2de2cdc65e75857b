#include "runtime/activation_store.h"

#include <algorithm>

#include "core/check.h"

namespace sppo {

std::string unit_name(int l, int i) {
  return "blocks." + std::to_string(l) + " subseq " + std::to_string(i) + " ";
}

ActivationStore::ActivationStore(Backend& be, MemoryTier& device, MemoryTier& host, const ModelConfig& c,
                                 ActPrecision precision, int subseqs, std::pair<int, int> layers, SavedSet recompute,
                                 std::vector<bool> inputs_rebuilt)
    : device_(device),
      host_(host),
      config_(c),
      lb_(layers.first),
      le_(layers.second),
      recompute_(recompute),
      rebuilt_(std::move(inputs_rebuilt)) {
  const int L = c.layers, N = subseqs;
  dev_.resize(N);
  host_copies_.resize(N);
  for (int i = 0; i < N; ++i) {
    dev_[i].resize(L);
    host_copies_[i].resize(L);
  }
  const std::size_t tensors = std::size_t(block_saved_count(c));
  for (int i = 0; i < N; ++i)
    for (int l = 0; l < L; ++l) {
      dev_[i][l].resize(tensors);
      host_copies_[i][l].resize(tensors);
    }
  head_grad_.resize(N);
  head_grad_host_.resize(N);
  residual_host_.resize(N);
  offload_first_.resize(N);
  offload_last_.resize(N);
  prefetch_first_.resize(N);
  prefetch_last_.resize(N);
  x_host_.assign(std::size_t(N), std::vector<const void*>(std::size_t(L), nullptr));
  x_copied_.assign(std::size_t(N), std::vector<std::shared_ptr<Event>>(std::size_t(L)));
  x_back_ = x_copied_;
  for (const auto& s : block_saved_specs(c, 1, precision)) roles_.push_back(s.role);
  SPPO_ASSERT(roles_.size() == tensors);
  d2h_ = be.make_copy_stream();
  h2d_ = be.make_copy_stream();
}

ActivationStore::~ActivationStore() = default;

i64 ActivationStore::offload(int i, double fraction) {
  if (fraction <= 0) return 0;
  // The same walk as the simulator's: the rank's layers in order (the first is needed
  // last in backward), each layer's offloadable tensors in table order, head_grad last.
  std::vector<std::pair<Buffer*, Buffer*>> tensors;
  std::vector<i64> sizes;
  std::vector<int> x_layer;  // the layer of each tensor that is an x, else -1
  // A rebuilt layer's x is gone by then (Note [Rebuilt layer inputs] in schedule/builders.cpp).
  auto rebuilt = [&](int l) { return l < int(rebuilt_.size()) && rebuilt_[std::size_t(l)]; };
  for (int l = lb_; l < le_; ++l)
    for (int k = 0; k < int(roles_.size()); ++k)
      if (roles_[k] == Role::Offloadable && !in_set(recompute_, k) && !(k == kSavedX && rebuilt(l))) {
        tensors.push_back({&dev_[i][l][k], &host_copies_[i][l][k]});
        sizes.push_back(dev_[i][l][k].bytes());
        x_layer.push_back(k == kSavedX ? l : -1);
      }
  if (le_ == config_.layers && !in_set(recompute_, kSavedHeadGrad)) {  // Note [The loss in backward]
    tensors.push_back({&head_grad_[i], &head_grad_host_[i]});
    sizes.push_back(head_grad_[i].bytes());
  }
  std::vector<bool> take;
  const i64 offloaded = select_offload(sizes, fraction, &take);
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    if (!take[t]) continue;
    Buffer& dev = *tensors[t].first;
    Buffer& host = *tensors[t].second;
    SPPO_ASSERT(dev);
    host = host_.alloc(dev.bytes(), "subseq " + std::to_string(i) + " host copy");
    device_.expect_release(dev.bytes());
    // The device bytes are really released when the copy completes.
    auto ev = d2h_->copy(host.data(), dev.data(), std::size_t(dev.bytes()), [&dev, tier = &device_] {
      const i64 bytes = dev.bytes();
      dev.reset();
      tier->settle(bytes);
    });
    if (!offload_first_[i]) offload_first_[i] = ev;
    offload_last_[i] = ev;
    if (t < x_layer.size() && x_layer[t] >= 0) {
      x_host_[i][std::size_t(x_layer[t])] = host.data();
      x_copied_[i][std::size_t(x_layer[t])] = ev;
    }
  }
  return offloaded;
}

std::pair<const void*, const void*> ActivationStore::saved_input(int i, int l, double* waited_s) {
  const void* host = x_host_[i][std::size_t(l)];
  if (!host) return {dev_[i][l][kSavedX].data(), nullptr};
  if (const auto& back = x_back_[i][std::size_t(l)]) {
    *waited_s += back->wait();
    return {dev_[i][l][kSavedX].data(), nullptr};
  }
  *waited_s += x_copied_[i][std::size_t(l)]->wait();
  return {nullptr, host};
}

void ActivationStore::prefetch(int i) { prefetch(i, lb_, le_); }

void ActivationStore::prefetch(int i, int b, int e) {
  std::shared_ptr<Event> last;
  auto move_in = [&](Buffer& dev, Buffer& host, const std::string& what) {
    if (!host) return;
    dev = device_.alloc(host.bytes(), what);
    last = h2d_->copy(dev.data(), host.data(), std::size_t(host.bytes()), {});
    if (!prefetch_first_[i]) prefetch_first_[i] = last;
  };
  if (e == le_) move_in(head_grad_[i], head_grad_host_[i], "head_grad");
  for (int l = e - 1; l >= b; --l)
    for (std::size_t k = 0; k < roles_.size(); ++k) move_in(dev_[i][l][k], host_copies_[i][l][k], unit_name(l, i));
  if (!last) return;
  prefetch_last_[i] = last;
  for (int l = b; l < e; ++l) x_back_[i][std::size_t(l)] = last;
}

double ActivationStore::wait_offload(int i) { return offload_last_[i] ? offload_last_[i]->wait() : 0; }

double ActivationStore::wait_prefetch(int i) { return wait_prefetch(i, lb_, le_); }

double ActivationStore::wait_prefetch(int i, int b, int e) {
  const double waited = prefetch_last_[i] ? prefetch_last_[i]->wait() : 0;
  // The copies back are done: their host copies go (Note [Host copies leave at the wait]
  // in schedule/memory.h).
  if (e == le_) head_grad_host_[i].reset();
  for (int l = b; l < e; ++l) {
    for (Buffer& buf : host_copies_[i][std::size_t(l)]) buf.reset();
    x_host_[i][std::size_t(l)] = nullptr;
  }
  return waited;
}

namespace {

// `from`'s bytes into a new buffer of `tier` through `stream`, the copy waited for (the
// seconds added to *waited_s); `from` is released.
void move_through(Buffer& from, Buffer& into, MemoryTier& tier, CopyStream& stream, const std::string& what,
                  double* waited_s) {
  into = tier.alloc(from.bytes(), what);
  *waited_s += stream.copy(into.data(), from.data(), std::size_t(from.bytes()), {})->wait();
  from.reset();
}

}  // namespace

void ActivationStore::residual_to_host(int i, double* waited_s) {
  const std::size_t at = std::size_t(i);
  SPPO_ASSERT_MSG(head_grad_[at] && !residual_host_[at], "subsequence " << i << "'s residual gradient is not on the device");
  move_through(head_grad_[at], residual_host_[at], host_, *d2h_, "residual gradient " + std::to_string(i), waited_s);
}

void ActivationStore::residual_back(int i, double* waited_s) {
  const std::size_t at = std::size_t(i);
  SPPO_ASSERT_MSG(residual_host_[at] && !head_grad_[at], "subsequence " << i << "'s residual gradient is not on the host");
  move_through(residual_host_[at], head_grad_[at], device_, *h2d_, "residual gradient " + std::to_string(i), waited_s);
}

void ActivationStore::synchronize() {
  d2h_->synchronize();
  h2d_->synchronize();
}

void ActivationStore::trace(StepResult& result) const {
  for (std::size_t i = 0; i < offload_first_.size(); ++i) {
    if (offload_first_[i])
      add_span(result, "O" + std::to_string(i), sched::OpKind::Offload, Lane::CopyOut, offload_first_[i]->start_s(),
               offload_last_[i]->end_s());
    if (prefetch_first_[i])
      add_span(result, "P" + std::to_string(i), sched::OpKind::Prefetch, Lane::CopyIn, prefetch_first_[i]->start_s(),
               prefetch_last_[i]->end_s());
  }
}

void ActivationStore::check_empty() const {
  for (std::size_t i = 0; i < dev_.size(); ++i)
    for (std::size_t l = 0; l < dev_[i].size(); ++l)
      for (std::size_t k = 0; k < roles_.size(); ++k)
        SPPO_ASSERT_MSG(!dev_[i][l][k] && !host_copies_[i][l][k],
                        "tensor left over after the step: layer " << l << " subseq " << i);
  for (std::size_t i = 0; i < residual_host_.size(); ++i)
    SPPO_ASSERT_MSG(!residual_host_[i], "subsequence " << i << "'s residual gradient left on the host");
}

}  // namespace sppo
