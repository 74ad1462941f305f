// Bandwidth cap (Config::bandwidth_cap): wraps a backend so that each
// direction moves at most `cap` bytes/s in aggregate over all I/O threads.
// Used with a RAM-backed store to emulate slower (or faster-than-disk) arrays.
#include <mutex>
#include <thread>

#include "engine.h"

namespace ssdtrain {
namespace {

using Clock = std::chrono::steady_clock;

class ThrottledBackend final : public IoBackend {
 public:
  ThrottledBackend(std::unique_ptr<IoBackend> inner, uint64_t cap, ThrottleStats* stats)
      : inner_(std::move(inner)), cap_(static_cast<double>(cap)), stats_(stats) {}
  const char* name() const override { return inner_->name(); }
  bool gds() const override { return inner_->gds(); }

  Status Write(size_t file, const void* buf, uint64_t len, uint64_t off) override {
    Clock::time_point done = Reserve(true, len);
    Status s = inner_->Write(file, buf, len, off);
    Wait(true, done);
    return s;
  }

  Status Read(size_t file, void* buf, uint64_t len, uint64_t off) override {
    Clock::time_point done = Reserve(false, len);
    Status s = inner_->Read(file, buf, len, off);
    Wait(false, done);
    return s;
  }

 private:
  // Token bucket without burst: the transfer takes the next len/cap seconds of its
  // direction's timeline and may not complete before their end.
  Clock::time_point Reserve(bool write, uint64_t len) {
    std::lock_guard<std::mutex> g(mu_);
    Clock::time_point& next = next_free_[write];
    next = std::max(next, Clock::now()) +
           std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(len / cap_));
    return next;
  }

  void Wait(bool write, Clock::time_point done) {
    Clock::time_point now = Clock::now();
    if (now >= done) return;
    std::this_thread::sleep_until(done);
    uint64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(done - now).count();
    (write ? stats_->write_wait_ns : stats_->read_wait_ns).fetch_add(ns);
  }

  std::unique_ptr<IoBackend> inner_;
  double cap_;
  ThrottleStats* stats_;
  std::mutex mu_;
  Clock::time_point next_free_[2];
};

}  // namespace

std::unique_ptr<IoBackend> MakeThrottledBackend(std::unique_ptr<IoBackend> inner, uint64_t cap,
                                                ThrottleStats* stats) {
  return std::make_unique<ThrottledBackend>(std::move(inner), cap, stats);
}

}  // namespace ssdtrain
