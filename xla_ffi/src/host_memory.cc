// Host memory: the range allocator and mmap'd arenas, and the engine's use of them for the
// host cache (write-behind, forwarding and read-ahead buffers: eviction, write-back of
// forwarded entries to make room) and the host tier.
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <thread>
#include <vector>

#include "engine.h"

namespace ssdtrain {

// ---------------------------------------------------------------------------
// RangeAllocator / HostArena
// ---------------------------------------------------------------------------
void RangeAllocator::Reset(uint64_t capacity, uint64_t align) {
  align_ = align;
  capacity_ = capacity / align * align;
  free_.clear();
  if (capacity_) free_[0] = capacity_;
  in_use_ = peak_ = 0;
}

bool RangeAllocator::Alloc(uint64_t len, uint64_t* off) {
  len = RoundUp(len, align_);
  if (len == 0) len = align_;
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second >= len) {
      *off = it->first;
      uint64_t rest = it->second - len;
      uint64_t start = it->first + len;
      free_.erase(it);
      if (rest) free_[start] = rest;
      in_use_ += len;
      peak_ = std::max(peak_, in_use_);
      return true;
    }
  }
  return false;
}

void RangeAllocator::Free(uint64_t off, uint64_t len) {
  len = RoundUp(len, align_);
  if (len == 0) len = align_;
  in_use_ -= len;
  auto it = free_.emplace(off, len).first;
  auto next = std::next(it);
  if (next != free_.end() && it->first + it->second == next->first) {
    it->second += next->second;
    free_.erase(next);
  }
  if (it != free_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      free_.erase(it);
    }
  }
}

uint64_t RangeAllocator::largest_free() const {
  uint64_t m = 0;
  for (const auto& [o, l] : free_) m = std::max(m, l);
  return m;
}

Status HostArena::Init(uint64_t bytes, const char* what) {
  size = RoundUp(bytes, kAlign);
  alloc.Reset(size, kAlign);
  if (size == 0) return Status::Ok();
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED)
    return SysError(errno, std::string("mmap of ") + what + " (" + HumanBytes(size) + ")", __FILE__,
                    __LINE__);
  base = static_cast<char*>(p);
  return Status::Ok();
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14's value, for C libraries that predate it
#endif

int HostArena::Populate(unsigned threads) const {
  if (!base || !size) return 0;
  threads = std::max(1u, threads);
  const uint64_t slice = RoundUp((size + threads - 1) / threads, uint64_t{2} << 20);
  std::atomic<int> failed{0};  // errno is each thread's own: the first failure's, kept here
  std::vector<std::thread> pool;
  for (uint64_t off = 0; off < size; off += slice) {
    const uint64_t len = std::min(slice, size - off);
    pool.emplace_back([this, off, len, &failed] {
      int none = 0;
      if (madvise(base + off, len, MADV_POPULATE_WRITE) != 0)
        failed.compare_exchange_strong(none, errno);
    });
  }
  for (std::thread& t : pool) t.join();
  return failed;
}

void HostArena::Destroy() {
  if (base) munmap(base, size);
  base = nullptr;
  size = 0;
}

// ---------------------------------------------------------------------------
// Host buffers
// ---------------------------------------------------------------------------
bool Engine::AllocHost(Arena arena, uint64_t padded, uint64_t* off) {
  HostArena& a = arena == Arena::kCache ? cache_ : tier_;
  if (a.size == 0 || padded > a.size) return false;
  return a.alloc.Alloc(padded, off);
}

void Engine::FreeHostBuffer(Entry& e) {
  if (e.host_arena_ == Arena::kNone) return;
  if (hooks_) hooks_->BeforeHostFree(e);
  HostArena& a = e.host_arena_ == Arena::kCache ? cache_ : tier_;
  a.alloc.Free(e.host_off_, e.padded_);
  e.host_arena_ = Arena::kNone;
  e.host_ptr_ = nullptr;
  if (e.host_ == HostCopy::kRead)  // only an entry released before its load gets here
    stats_.disk_unused_bytes += e.nbytes_;
  e.host_ = HostCopy::kNone;
}

bool Engine::EvictOne(const Entry* exclude, uint64_t prefetch_seq, bool* evicted_unloaded) {
  Entry* best = nullptr;
  auto better = [](const Entry* a, const Entry* b) {
    // Loaded entries first (they are rarely needed again), then oldest.
    if (!b) return true;
    bool la = a->loads_ > 0, lb = b->loads_ > 0;
    if (la != lb) return la;
    return a->seq_ < b->seq_;
  };
  for (auto& [id, ep] : entries_) {
    Entry* e = ep.get();
    if (e == exclude || e->tier_ != Tier::kNvme || e->host_arena_ != Arena::kCache ||
        !e->host_valid())
      continue;
    if (e->w_ != WState::kDone || e->pins_ > 0 || e->reading() || e->filling()) continue;
    if (e->unconsumed_read()) continue;  // read ahead for a load still to come
    if (prefetch_seq && !(e->loads_ > 0 || e->seq_ < prefetch_seq)) continue;
    if (better(e, best)) best = e;
  }
  if (!best) return false;
  if (evicted_unloaded) *evicted_unloaded = best->loads_ == 0;
  FreeHostBuffer(*best);
  return true;
}

bool Engine::WriteBackForwarded(const Entry* exclude, bool all) {
  std::vector<EntryPtr> eligible;
  bool draining = false;
  for (auto& [id, ep] : entries_) {
    const Entry* e = ep.get();
    if (e == exclude || e->tier_ != Tier::kNvme || e->host_arena_ != Arena::kCache ||
        !e->host_valid())
      continue;
    // kCancelled in the table means a load cancelled it.
    if (e->w_ != WState::kCancelled || !e->has_slot_) continue;
    if (e->pins_ > 0 || e->loading_ > 0 || e->reading() || e->filling()) continue;
    if (e->w_pending_ > 0) {  // its cancelled pieces are still queued: eligible once they drain
      draining = true;
      continue;
    }
    eligible.push_back(ep);
  }
  if (eligible.empty()) return draining;
  std::sort(eligible.begin(), eligible.end(),
            [](const EntryPtr& a, const EntryPtr& b) { return a->seq_ < b->seq_; });
  if (!all) eligible.resize(1);  // the oldest
  for (const EntryPtr& e : eligible) {
    // Written after all (saturating: the skip may predate a reset_stats()).
    stats_.write_skipped_bytes -= std::min<uint64_t>(stats_.write_skipped_bytes, e->nbytes_);
    if (stats_.write_skipped_tensors) stats_.write_skipped_tensors--;
    EnqueueWrite(e);
  }
  return true;
}

Status Engine::AcquireCacheBuffer(Lock& lk, Entry& e, bool may_block) {
  if (e.padded_ > cache_.size) return Status::Ok();  // too large: bounce
  auto t0 = Clock::now();
  bool stalled = false;
  for (;;) {
    if (e.host_ptr_) break;  // someone else (read-ahead) gave it a buffer meanwhile
    uint64_t off;
    if (AllocHost(Arena::kCache, e.padded_, &off)) {
      e.host_arena_ = Arena::kCache;
      e.host_off_ = off;
      e.host_ptr_ = cache_.base + off;
      break;
    }
    // Loaded entries whose write forwarding skipped are only evictable once written: without
    // the write-backs below, the entries of a program that does not run again hold the cache
    // for good. Room taken from an entry no load has read yet costs that load a read of the
    // file: then every such loaded entry is written, so that they go first next time (without
    // this, whether they were ever written depended on how fast the stores came).
    bool evicted_unloaded = false;
    if (EvictOne(&e, 0, &evicted_unloaded)) {
      if (evicted_unloaded && may_block) WriteBackForwarded(&e, /*all=*/true);
      continue;
    }
    // Nothing evictable: write the oldest such entry and wait for some write to finish.
    const bool write_back = may_block && WriteBackForwarded(&e, /*all=*/false);
    if (may_block && (write_back || writes_inflight_ > 0 || reads_inflight_ > 0)) {
      stalled = true;
      cv_.wait(lk);
      continue;
    }
    break;  // cannot make room: caller bounces
  }
  if (stalled) stats_.stall_seconds += Seconds(t0, Clock::now());
  return Status::Ok();
}

}  // namespace ssdtrain
