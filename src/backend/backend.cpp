#include "backend/backend.h"

#include <chrono>

#include "comm/comm.h"
#include "core/check.h"

namespace sppo {

double Event::wait() {
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_; });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

bool Event::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

void Event::signal(double start_s, double end_s) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    start_s_ = start_s;
    end_s_ = end_s;
    done_ = true;
  }
  cv_.notify_all();
}

namespace {

// The default clock: synchronise, read the wall clock (Backend::make_stream_clock).
class WallClock final : public StreamClock {
 public:
  explicit WallClock(Backend& be) : be_(be) {}
  void begin() override {
    be_.synchronize();
    t0_ = std::chrono::steady_clock::now();
  }
  void end(double* total) override {
    be_.synchronize();
    *total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }
  void collect() override {}

 private:
  Backend& be_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace

void Backend::add_norm_forward(void* y, const void* x, void* out, float* mean, float* rstd, const float* w,
                               const float* b, int T, int H, float eps, bool rms) {
  add_inplace(y, x, i64(T) * H);
  if (rms) rmsnorm_forward(out, rstd, y, w, T, H, eps);
  else layernorm_forward(out, mean, rstd, y, w, b, T, H, eps);
}

void Backend::adamw_spans(float* p, float* m, float* v, const float* g, const std::vector<AdamwSpan>& spans, float lr,
                          float beta1, float beta2, float eps, int t, void* p_act) {
  for (const AdamwSpan& s : spans)
    adamw(p + s.offset, m + s.state_offset, v + s.state_offset, g + s.grad_at(), s.count, lr, beta1, beta2, eps,
          s.weight_decay, t, p_act ? static_cast<char*>(p_act) + s.offset * dtype_bytes(act()) : nullptr);
}

std::vector<double> Backend::sum_squares_spans(const float* g, const std::vector<std::pair<i64, i64>>& ranges) {
  std::vector<double> sums;
  sums.reserve(ranges.size());
  for (const auto& [from, count] : ranges) sums.push_back(sum_squares(g + from, count));
  return sums;
}

std::unique_ptr<StreamClock> Backend::make_stream_clock() { return std::make_unique<WallClock>(*this); }

std::unique_ptr<comm::Comm> Backend::make_nccl_comm(comm::Comm&) {
  SPPO_CHECK(false, "comm") << "--comm nccl connects GPUs; the " << name()
                            << " backend's ranks talk over MPI (--comm auto or mpi)";
  return nullptr;
}

}  // namespace sppo
