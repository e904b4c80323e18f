#include "serve/work_queue.h"

namespace laplace {

WorkQueue::WorkQueue(int threads, int64_t max_pending) : max_pending_(max_pending) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
}

WorkQueue::~WorkQueue() { stop(); }

bool WorkQueue::post(std::function<void()> f) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_ || (max_pending_ > 0 && static_cast<int64_t>(queue_.size()) >= max_pending_)) return false;
    queue_.push_back(std::move(f));
  }
  cv_.notify_one();
  return true;
}

void WorkQueue::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  threads_.clear();
}

int64_t WorkQueue::pending() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int64_t>(queue_.size());
}

void WorkQueue::run() {
  for (;;) {
    std::function<void()> f;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopped, and nothing left to run
      f = std::move(queue_.front());
      queue_.pop_front();
    }
    f();
  }
}

}  // namespace laplace
