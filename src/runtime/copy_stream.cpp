#include "runtime/copy_stream.h"

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

CopyStream::CopyStream(double (*clock)()) : clock_(clock), worker_([this] { loop(); }) {}

CopyStream::~CopyStream() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

std::shared_ptr<Event> CopyStream::submit(std::function<void()> task) {
  auto ev = std::make_shared<Event>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.emplace_back(std::move(task), ev);
    ++in_flight_;
  }
  cv_.notify_one();
  return ev;
}

void CopyStream::synchronize() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return in_flight_ == 0; });
}

void CopyStream::loop() {
  for (;;) {
    std::pair<std::function<void()>, std::shared_ptr<Event>> item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    const double t0 = clock_();
    item.first();
    const double t1 = clock_();
    {
      std::lock_guard<std::mutex> lock(item.second->mu_);
      item.second->start_s_ = t0;
      item.second->end_s_ = t1;
      item.second->done_ = true;
    }
    item.second->cv_.notify_all();
    {
      std::lock_guard<std::mutex> lock(mu_);
      --in_flight_;
    }
    idle_cv_.notify_all();
  }
}

}  // namespace sppo
