// Moving bytes between host memory and the store files. A backend transfers one piece (an
// I/O request inside one file) synchronously on the calling I/O thread; the engine decides
// which pieces, when, and into which buffers. POSIX pread/pwrite always; kvikio/cuFile where
// GPUDirect Storage is active; a throttle around either emulates a slower array.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "config.h"
#include "status.h"

namespace ssdtrain {

class IoBackend {
 public:
  virtual ~IoBackend() = default;
  virtual const char* name() const = 0;
  virtual bool gds() const { return false; }
  // Transfers exactly `len` bytes (retrying short transfers) or fails.
  virtual Status Write(size_t file, const void* buf, uint64_t len, uint64_t off) = 0;
  virtual Status Read(size_t file, void* buf, uint64_t len, uint64_t off) = 0;
};

struct StoreFile {
  std::string dir;
  int fd = -1;
  bool unlinked = true;
  uint64_t size = 0;      // current allocated file size
  uint64_t max_size = 0;  // share of capacity_bytes
};

std::unique_ptr<IoBackend> MakePosixBackend(const std::vector<StoreFile>* files,
                                            FaultSpec* fault = nullptr);
// Time the bandwidth cap held transfers back (beyond their real duration).
struct ThrottleStats {
  std::atomic<uint64_t> write_wait_ns{0}, read_wait_ns{0};
};
// Caps each direction of `inner` at `cap` bytes/s in aggregate (Config::bandwidth_cap).
std::unique_ptr<IoBackend> MakeThrottledBackend(std::unique_ptr<IoBackend> inner, uint64_t cap,
                                                ThrottleStats* stats);
#ifdef SSDTRAIN_HAVE_KVIKIO
// Returns nullptr (and a reason) when kvikio cannot be used; the caller falls
// back to POSIX. `io_threads`: the engine's I/O threads, the least size of kvikio's pool.
std::unique_ptr<IoBackend> MakeKvikioBackend(const std::vector<StoreFile>* files, int gds,
                                             bool o_direct, int io_threads, std::string* why_not);
#endif

// crc32c (Castagnoli), hardware (SSE4.2) where available, else slicing-by-8.
uint32_t Crc32c(uint32_t crc, const void* data, uint64_t len);

}  // namespace ssdtrain
