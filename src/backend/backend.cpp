#include "backend/backend.h"

#include <chrono>

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

}  // namespace sppo
