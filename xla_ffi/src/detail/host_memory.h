// Host memory the engine owns: anonymous mmap'd arenas (the host cache and the host tier; the
// CUDA module registers them as pinned memory) carved by first-fit range allocators. The
// same allocator also carves file space and device staging. Not thread-safe: the engine's
// mutex guards every arena and allocator.
#pragma once

#include <cstdint>
#include <map>

#include "config.h"
#include "status.h"

namespace ssdtrain {

// First-fit allocator over [0, capacity) in units of `align`.
class RangeAllocator {
 public:
  void Reset(uint64_t capacity, uint64_t align);
  bool Alloc(uint64_t len, uint64_t* off);
  void Free(uint64_t off, uint64_t len);
  uint64_t capacity() const { return capacity_; }
  uint64_t in_use() const { return in_use_; }
  uint64_t peak() const { return peak_; }
  void ResetPeak() { peak_ = in_use_; }
  uint64_t free_bytes() const { return capacity_ - in_use_; }
  uint64_t largest_free() const;

 private:
  std::map<uint64_t, uint64_t> free_;  // offset -> length
  uint64_t capacity_ = 0, align_ = kAlign, in_use_ = 0, peak_ = 0;
};

// An anonymous mmap'd host region carved by a RangeAllocator.
struct HostArena {
  char* base = nullptr;
  uint64_t size = 0;
  RangeAllocator alloc;
  Status Init(uint64_t bytes, const char* what);
  // Faults every page in from `threads` threads at once (MADV_POPULATE_WRITE: contents kept).
  // Returns 0, or a failed madvise's errno where the kernel cannot (before Linux 5.14, or no
  // memory): nothing is lost, the pages then fault in at their first touch (or
  // cudaHostRegister's, from one thread).
  int Populate(unsigned threads) const;
  void Destroy();
};

}  // namespace ssdtrain
