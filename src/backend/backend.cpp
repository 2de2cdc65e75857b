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

std::unique_ptr<comm::Comm> Backend::make_nccl_comm(comm::Comm&) {
  SPPO_CHECK(false, "comm") << "--comm nccl connects GPUs; the " << name()
                            << " backend's ranks talk over MPI (--comm auto or mpi)";
  return nullptr;
}

}  // namespace sppo
