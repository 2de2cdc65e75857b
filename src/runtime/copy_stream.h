// A copy stream: one worker thread that runs copies in submission order, like a CUDA
// stream on a copy engine. Compute continues while it works; an Event says when a
// submitted task has finished and records when it ran (for traces and exposed-time
// accounting).
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace sppo {

class Event {
 public:
  // Blocks until the task has run; returns the seconds spent waiting.
  double wait();
  bool done() const;
  double start_s() const { return start_s_; }  // relative to the stream's clock origin
  double end_s() const { return end_s_; }

 private:
  friend class CopyStream;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  double start_s_ = 0, end_s_ = 0;
};

class CopyStream {
 public:
  explicit CopyStream(double (*clock)());
  ~CopyStream();
  CopyStream(const CopyStream&) = delete;
  CopyStream& operator=(const CopyStream&) = delete;

  // Queues `task`; the returned event completes when it has run. An exception thrown by a
  // task is a bug (copies do not fail) and aborts.
  std::shared_ptr<Event> submit(std::function<void()> task);
  void synchronize();

 private:
  void loop();

  double (*clock_)();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<Event>>> queue_;
  bool stop_ = false;
  int in_flight_ = 0;
  std::condition_variable idle_cv_;
  std::thread worker_;
};

}  // namespace sppo
