// The engine's I/O threads: a fixed pool with two FIFO queues, demand reads (a load is
// waiting) ahead of write-behind and read-ahead.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ssdtrain {

class ThreadPool {
 public:
  explicit ThreadPool(int n);
  ~ThreadPool();
  void Submit(std::function<void()> fn, bool high_priority);

 private:
  void Run();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> high_, normal_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace ssdtrain
