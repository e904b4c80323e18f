// A few threads that run posted work in order, off the HTTP event loops, with a bound on
// how much may wait: post() refuses when `max_pending` tasks already wait, so a burst is
// answered at once (429) instead of growing a queue that delays everything behind it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "core/thread_annotations.h"

namespace laplace {

class WorkQueue {
 public:
  // max_pending = 0: no bound (for work something else bounds already).
  WorkQueue(int threads, int64_t max_pending);
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  // Queues f; false (f dropped) when the queue is full or stopped.
  bool post(std::function<void()> f);
  // Runs what is queued, then joins the threads. Idempotent.
  void stop();
  int64_t pending() const;

 private:
  void run();

  const int64_t max_pending_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace laplace
