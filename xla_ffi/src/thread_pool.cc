// The engine's I/O threads.
#include "detail/thread_pool.h"

namespace ssdtrain {

ThreadPool::ThreadPool(int n) {
  for (int i = 0; i < n; ++i) threads_.emplace_back([this] { Run(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::Submit(std::function<void()> fn, bool high) {
  {
    std::lock_guard<std::mutex> g(mu_);
    (high ? high_ : normal_).push_back(std::move(fn));
  }
  cv_.notify_one();
}

void ThreadPool::Run() {
  for (;;) {
    std::function<void()> fn;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !high_.empty() || !normal_.empty(); });
      if (!high_.empty()) {
        fn = std::move(high_.front());
        high_.pop_front();
      } else if (!normal_.empty()) {
        fn = std::move(normal_.front());
        normal_.pop_front();
      } else {
        return;  // stop_ and drained
      }
    }
    fn();
  }
}

}  // namespace ssdtrain
