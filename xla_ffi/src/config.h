// The engine's settings (parsed from the "key=value" lines that configure() sends) and the
// fault-injection test hook. Read once when an engine is created; nothing here changes after.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "status.h"

namespace ssdtrain {

constexpr uint64_t kAlign = 4096;
constexpr uint64_t kKiB = 1024, kMiB = 1024 * kKiB, kGiB = 1024 * kMiB;
inline uint64_t RoundUp(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

// Every field is set by Parse from the lines Python sends (jax_ssdtrain/_src/options/ holds
// the options, their defaults and checks): there are no defaults here, and a missing key is an
// error. A new option is a field here and its line in config.cc's table.
struct Config {
  std::vector<std::string> directories;
  uint64_t capacity_bytes{};
  uint64_t host_cache_bytes{};
  uint64_t host_tier_bytes{};
  uint64_t staging_bytes{};
  int io_threads{};
  uint64_t chunk_bytes{};
  int o_direct{};  // 0 off, 1 on, 2 auto
  int gds{};       // 0 off, 1 on, 2 auto (kvikio builds only)
  uint64_t prefetch_bytes{};
  bool forwarding{};
  int on_full{};             // store full: 0 error, 1 keep the tensor in the host tier
  bool verify{};             // crc32c of every tensor written, checked after every disk read
  bool exact_loads{};        // device loads read the handle first (a sync) instead of predicting
  uint64_t bandwidth_cap{};  // bytes/s per direction of the file I/O, 0 = none
  // > 0: directory i serves only device (i % device_groups): each device's tensors go to its
  // own files, with capacity_bytes split evenly. 0: every tensor striped over all directories.
  int device_groups{};

  // Parses "key=value" lines, one per field, each exactly once. EINVAL naming the key on a
  // missing, unknown, repeated or bad one.
  static Status Parse(std::string_view kv, Config* out);
  // The fields as "key=value" lines, in Parse's order (what the engine runs with).
  std::string ToString() const;
};

// Test hook: SSDTRAIN_FAULT="op:n:errno" (op in write, read, shortwrite,
// shortread) read when an engine is created. The n-th pwrite/pread syscall of
// that kind fails with errno (write/read) or transfers half of its bytes
// (shortwrite/shortread; errno ignored). Fires once.
struct FaultSpec {
  enum Op { kNone, kWrite, kRead, kShortWrite, kShortRead };
  Op op = kNone;
  uint64_t n = 0;
  int err = 0;
  std::atomic<uint64_t> writes{0}, reads{0};
  static Status Parse(const char* spec, FaultSpec* out);
  // Called before each syscall; returns kNone, or the fault to apply now.
  Op Next(bool write);
};

// A human-readable byte count ("1.50 GiB") for messages.
std::string HumanBytes(uint64_t n);

}  // namespace ssdtrain
