// serve/work_queue.h: work runs off the caller's thread, in order per thread, a full queue
// refuses at once, and stop() runs what was queued before it joins.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "serve/work_queue.h"

namespace laplace {
namespace {

TEST(WorkQueue, AFullQueueRefusesAndStopRunsWhatWaits) {
  WorkQueue q(1, 2);
  std::mutex mu;
  std::condition_variable cv;
  bool release = false, started = false;
  std::atomic<int> ran{0};
  ASSERT_TRUE(q.post([&] {
    std::unique_lock<std::mutex> lk(mu);
    started = true;
    cv.notify_all();
    cv.wait(lk, [&] { return release; });
    ++ran;
  }));
  {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return started; });  // the thread is busy: what follows waits
  }
  EXPECT_TRUE(q.post([&] { ++ran; }));
  EXPECT_TRUE(q.post([&] { ++ran; }));
  EXPECT_EQ(q.pending(), 2);
  EXPECT_FALSE(q.post([&] { ++ran; })) << "a third waiting task passes the bound";
  {
    std::lock_guard<std::mutex> lk(mu);
    release = true;
  }
  cv.notify_all();
  q.stop();
  EXPECT_EQ(ran.load(), 3);
  EXPECT_FALSE(q.post([&] { ++ran; })) << "stopped";
}

TEST(WorkQueue, UnboundedRunsEverythingOffTheCallersThread) {
  WorkQueue q(2, 0);
  std::atomic<int> ran{0}, on_caller{0};
  const auto caller = std::this_thread::get_id();
  for (int i = 0; i < 1000; ++i)
    ASSERT_TRUE(q.post([&] {
      on_caller += std::this_thread::get_id() == caller;
      ++ran;
    }));
  q.stop();
  EXPECT_EQ(ran.load(), 1000);
  EXPECT_EQ(on_caller.load(), 0);
}

}  // namespace
}  // namespace laplace
