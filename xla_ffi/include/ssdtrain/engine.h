// The process-wide activation store: file space allocator, host cache with
// write-behind / forwarding / LIFO read-ahead, host tier, I/O thread pool and
// statistics. Device (CUDA) specifics live in ffi_cuda.cu and reach the engine
// through DeviceHooks; no CUDA call is made by anything in this header's
// implementation unless CUDA handlers have run.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "ssdtrain/status.h"

namespace ssdtrain {

constexpr uint64_t kAlign = 4096;
constexpr uint64_t kKiB = 1024, kMiB = 1024 * kKiB, kGiB = 1024 * kMiB;
inline uint64_t RoundUp(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

struct Config {
  std::vector<std::string> directories;
  uint64_t capacity_bytes = 64 * kGiB;
  uint64_t host_cache_bytes = 2 * kGiB;
  uint64_t host_tier_bytes = 1 * kGiB;
  uint64_t staging_bytes = 1 * kGiB;
  int io_threads = 8;
  uint64_t chunk_bytes = 8 * kMiB;
  int o_direct = 2;  // 0 off, 1 on, 2 auto
  int gds = 2;       // 0 off, 1 on, 2 auto (kvikio builds only)
  uint64_t prefetch_bytes = 1 * kGiB;
  bool forwarding = true;
  int on_full = 0;      // store full: 0 error, 1 keep the tensor in the host tier
  bool verify = false;  // crc32c of every tensor written, checked after every disk read
  bool exact_loads = false;  // device loads read the handle first (a sync) instead of predicting
  uint64_t bandwidth_cap = 0;  // bytes/s per direction of the file I/O, 0 = none
  // > 0: directory i serves only device (i % device_groups): each device's tensors go to its
  // own files, with capacity_bytes split evenly. 0: every tensor striped over all directories.
  int device_groups = 0;

  static Config Defaults();
  // Parses "key=value" lines on top of the defaults. EINVAL on bad input.
  static Status Parse(std::string_view kv, Config* out);
};

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
  void Destroy();
};

// crc32c (Castagnoli), hardware (SSE4.2) where available, else slicing-by-8.
uint32_t Crc32c(uint32_t crc, const void* data, uint64_t len);

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
                                             bool o_direct, int io_threads,
                                             std::string* why_not);
#endif

enum class WState { kNone, kQueued, kRunning, kDone, kCancelled, kFailed };

struct Entry {
  uint32_t id = 0;
  int64_t site = 0;
  int device = 0;  // XLA device ordinal of the store; only that device may load it
  int tier = 0;  // 0 nvme (through host cache), 1 host tier
  uint64_t nbytes = 0, padded = 0, seq = 0;
  std::string name;
  bool filling = true;   // the store is still copying bytes in
  bool released = false;
  bool freed = false;
  int loads = 0;
  // Loads left before the entry is released (counted when the program was compiled);
  // kUncounted: released by a sweep (its handle left the execution, or the count was unknown);
  // kManual: stored through the C ABI (probe, tests), released by release_all() only.
  static constexpr int64_t kUncounted = -1, kManual = -2;
  int64_t uses_left = kUncounted;
  int64_t run_id = -1;  // XLA execution of the store (device path), for load prediction
  // Host copy (cache arena for tier 0, host-tier arena for tier 1).
  int host_arena = -1;  // 0 cache, 1 host tier, -1 none
  uint64_t host_off = 0;
  char* host_ptr = nullptr;
  bool host_valid = false;       // the host buffer holds the bytes (device: after host_ready)
  bool host_from_store = false;  // the host copy is the store's (forwarding) not a read-back
  // File copy.
  bool has_slot = false;
  uint64_t file_off = 0;  // logical (striped) offset
  WState w = WState::kNone;
  int w_pending = 0;
  // Read into the host buffer (demand or read-ahead).
  bool reading = false;
  // The host buffer holds bytes read from the file that no load has used yet: never evicted
  // (evicting it would read the same bytes again).
  bool read_unconsumed = false;
  int r_pending = 0;
  Status r_status;
  int pins = 0;   // loads copying out of the host buffer
  int loading = 0;  // loads in progress (the site's next store must not release it)
  bool kept_full = false;  // on_full=keep: held in the host tier because the files were full
  // verify: crc32c of the nbytes, set before (or by the last piece of) the write.
  bool crc_set = false;
  uint32_t crc = 0;
  std::atomic<int> w_io_left{0}, r_io_left{0};  // pieces whose syscalls are not done
  Status error;   // sticky (failed write)
  void* dev = nullptr;  // owned by the device module
};
using EntryPtr = std::shared_ptr<Entry>;

// Implemented by the CUDA module. All calls are made with Engine::mu held
// unless stated otherwise.
class DeviceHooks {
 public:
  virtual ~DeviceHooks() = default;
  // Lock NOT held. Blocks until the host copy of `e` really holds the bytes
  // (the D2H of a device store completed).
  virtual Status WaitHostReady(Entry& e) = 0;
  // The host buffer of `e` is about to be freed or reused.
  virtual void BeforeHostFree(Entry& e) = 0;
  // `e` is being freed: drop device-side copies.
  virtual void OnEntryFree(Entry& e) = 0;
  // Releases the entries whose last load's device copy has completed (all of them, waiting for
  // their copies, when `wait`). Called before the engine gives up for lack of space.
  virtual void ReclaimReleases(bool wait) = 0;
};

struct Stats {
  uint64_t bytes_written = 0, tensors_written = 0, bytes_read = 0, tensors_read = 0;
  uint64_t disk_bytes_written = 0, disk_bytes_read = 0, disk_tensors_written = 0,
           disk_tensors_read = 0;
  uint64_t write_skipped_bytes = 0, write_skipped_tensors = 0;
  uint64_t forwarded_tensors = 0, forwarded_bytes = 0;
  uint64_t staging_forwarded_tensors = 0;
  uint64_t speculative_loads = 0;  // loads that predicted their handle (verified on device)
  uint64_t handle_mismatches = 0;
  uint64_t staging_waits = 0;  // staging reuses ordered after a still-running user (GPU side)
  uint64_t prefetch_hits = 0, prefetch_misses = 0, prefetch_issued = 0;
  uint64_t disk_loaded_bytes = 0;  // loads served by a file read (each read counted once)
  uint64_t bounce_writes = 0, bounce_reads = 0;
  double stall_seconds = 0, write_seconds = 0, read_seconds = 0;
  double handle_sync_seconds = 0;
  uint64_t staging_in_use = 0, staging_peak = 0;
  uint64_t full_kept_tensors = 0, full_kept_bytes = 0;  // on_full=keep
  uint64_t checksum_failures = 0;
  // Lifetimes: entries released after their counted last load, stores nobody loads (never
  // kept), sweeps and the entries they released.
  uint64_t counted_releases = 0, unused_stores = 0, sweeps = 0, swept_entries = 0;
};

// Per-device counters (device = the XLA device ordinal the handler ran on).
struct DeviceStats {
  uint64_t bytes_written = 0, tensors_written = 0, bytes_read = 0, tensors_read = 0;
};

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

class Engine {
 public:
  using Clock = std::chrono::steady_clock;
  using Lock = std::unique_lock<std::mutex>;

  static Status Create(const Config& cfg, std::shared_ptr<Engine>* out);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const Config& config() const { return cfg_; }

  // ---- CPU handlers -------------------------------------------------------
  // `device`: the XLA device ordinal of the call (per-device sites and statistics).
  // `uses`: loads per stored entry in its execution (0: nobody loads it; Entry::kUncounted,
  // Entry::kManual).
  Status StoreFromHost(const void* src, uint64_t nbytes, int64_t site, int tier,
                       std::string_view name, uint32_t handle[2], int device = 0,
                       int64_t uses = -1);
  Status LoadToHost(const uint32_t handle[2], void* dst, uint64_t nbytes, int64_t site,
                    std::string_view name, int device = 0);

  // ---- building blocks (device module) -----------------------------------
  // Registers a new entry that `uses` loads will consume (-1: until a sweep) and reserves its
  // host buffer and file slot. e->host_ptr == nullptr means "no host buffer": use
  // WriteThrough. A store nobody loads (uses == 0) keeps nothing: the caller writes the
  // null handle (MakeNullHandle) instead.
  Status BeginStore(int64_t site, int tier, uint64_t nbytes, std::string_view name,
                    EntryPtr* out, int device = 0, int64_t uses = -1);
  static void MakeNullHandle(uint32_t h[2]) { h[0] = h[1] = 0; }
  // Counts a store nobody loads (uses == 0).
  void CountUnusedStore(uint64_t nbytes, int device);
  // Lock held. One completed load of `e`: at its counted last load the entry is released.
  // `defer` (GPU): returns true instead of releasing when the release must wait for the
  // load's device copy (the caller queues it).
  bool CountLoad(const EntryPtr& e, bool defer = false);
  void ReleaseLocked(const EntryPtr& e) { Release(e); }
  // Releases every entry older than `seq_limit` (seq < seq_limit) whose {id, check} is not
  // among `pairs` (n_pairs pairs of uint32) and that no load is using. `*released`: how many.
  Status Sweep(const uint32_t* pairs, uint64_t n_pairs, uint64_t seq_limit, uint64_t* released);
  // True when enough uncounted entries were stored since the last sweep that one is due.
  bool SweepRequested();
  // The bytes are (or, for the device path, will be once WaitHostReady
  // returns) in e->host_ptr: start the write-behind.
  Status CommitStore(const EntryPtr& e);
  // Synchronous store through a bounce buffer; fill(dst, off, len) copies
  // bytes [off, off+len) of the tensor to dst.
  Status WriteThrough(const EntryPtr& e,
                      const std::function<Status(void*, uint64_t, uint64_t)>& fill);
  void AbortStore(const EntryPtr& e);
  void MakeHandle(const Entry& e, uint32_t h[2]) const;
  // Lock held. The handle a load at `site` in execution `run_id` on `device` most likely
  // carries: the newest entry of that execution, site, device and size not loaded yet (loads
  // of one site come back in reverse store order). `*left`: unloaded entries of the execution
  // besides it. False if there is none (the load must read its handle).
  bool PredictLoad(int64_t site, int64_t run_id, int device, uint64_t nbytes, uint32_t h[2],
                   uint64_t* left) const;
  uint32_t HandleCheck(uint32_t id) const;

  // Validates the handle and marks the entry loaded. Lock held.
  Status LookupForLoad(Lock& lk, const uint32_t handle[2], uint64_t nbytes, int64_t site,
                       std::string_view name, EntryPtr* out, int device = 0);
  struct HostRef {
    EntryPtr e;
    const char* ptr = nullptr;
    bool pinned = false;      // e->pins was incremented
    char* bounce = nullptr;   // owned aligned buffer (free with free())
  };
  // Makes the bytes of `e` available in host memory (waits for a running
  // read-ahead, or reads from the file). Lock held (may be released while
  // waiting).
  Status AcquireHost(Lock& lk, const EntryPtr& e, HostRef* ref);
  void ReleaseHost(Lock& lk, HostRef* ref);
  // Lock held. A load used the bytes of `e`'s host buffer (GPU: through device staging).
  void ConsumeRead(Entry& e);
  // Schedules read-ahead of the next predicted entries. Lock held.
  // Read-ahead of `device`'s next predicted entries (-1: every device's). Lock held.
  void SchedulePrefetch(Lock& lk, int device = -1);
  // Returns (and clears) a recorded asynchronous error. Lock held.
  Status TakePendingError();

  // Waits until no write or read is in flight; returns (and clears) a pending I/O error.
  Status Flush();
  Status ReleaseAll();
  std::string StatsString();
  void ResetStats();
  std::string FilePaths();
  // Test hooks (C ABI ssdtrain_debug_*): cut every store file to `size` bytes;
  // flip one byte at a logical (striped) store offset.
  Status DebugTruncate(uint64_t size);
  Status DebugCorrupt(uint64_t loff);

  // Device module support.
  std::mutex mu;
  std::condition_variable cv;
  Stats stats;
  DeviceHooks* hooks() { return hooks_.get(); }
  void SetHooks(std::unique_ptr<DeviceHooks> h) { hooks_ = std::move(h); }
  HostArena& cache_arena() { return cache_; }
  HostArena& tier_arena() { return tier_; }
  // Predicted next loads (newest first) within the read-ahead budget. Lock held.
  // Only entries stored by `device` unless it is -1.
  std::vector<EntryPtr> PredictNext(uint64_t budget, int device = -1);
  void AddStall(double s) { stats.stall_seconds += s; }
  std::atomic<bool> gds_active{false};

 private:
  Engine() = default;
  Status Init(const Config& cfg);
  Status OpenFiles();
  Status EnsureFileSpace(uint64_t loff, uint64_t len);
  template <typename F>
  void ForEachPiece(uint64_t loff, uint64_t len, F&& f) const;
  // One I/O request of an entry: `len` bytes at `file_off` of file `file`, `buf_off` into the
  // entry's host buffer.
  struct Piece {
    size_t file;
    uint64_t file_off, buf_off, len;
  };
  std::vector<Piece> Pieces(const Entry& e) const;
  bool AllocHost(int arena, uint64_t padded, uint64_t* off);
  void FreeHostBuffer(Entry& e);
  // Evicts one clean cached entry. For read-ahead (`prefetch_seq` != 0) only
  // entries already loaded or older than prefetch_seq are considered.
  bool EvictOne(const Entry* exclude, uint64_t prefetch_seq);
  // Queues the write that forwarding skipped for the oldest loaded entry still holding the
  // only copy in the cache, so that it becomes evictable (a later load reads the file).
  // True when one was queued or will be eligible once its cancelled pieces drain (the
  // caller waits), false when there is none.
  bool WriteBackOne(const Entry* exclude);
  Status AcquireCacheBuffer(Lock& lk, Entry& e, bool may_block);
  void EnqueueWrite(const EntryPtr& e);
  void WritePiece(const EntryPtr& e, size_t file, uint64_t foff, uint64_t buf_off,
                  uint64_t len);
  void FinishWrite(const EntryPtr& e);
  void StartRead(const EntryPtr& e, bool demand);
  void ReadPiece(const EntryPtr& e, size_t file, uint64_t foff, uint64_t buf_off,
                 uint64_t len);
  void FinishRead(const EntryPtr& e);
  Status SyncIo(bool write, char* buf, uint64_t loff, uint64_t len);
  // verify: checks the bytes read into `buf` against e's crc.
  Status CheckCrc(const Entry& e, const char* buf);
  void Release(const EntryPtr& e);
  void MaybeFree(const EntryPtr& e);
  void BusyBegin(bool write);
  void BusyEnd(bool write);
  void CountFileIo(bool write, size_t file, uint64_t len);

  Config cfg_;
  std::vector<StoreFile> files_;
  std::unique_ptr<IoBackend> backend_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<DeviceHooks> hooks_;
  HostArena cache_, tier_;
  // File space: one allocator per device group (one in all without device_groups). Group g
  // owns the logical offsets [g * group_span_, (g + 1) * group_span_).
  std::vector<RangeAllocator> slots_;
  uint64_t group_span_ = 0;
  size_t GroupOf(int device) const;
  bool SlotAlloc(int device, uint64_t len, uint64_t* off);
  void SlotFree(uint64_t off, uint64_t len);
  RangeAllocator& SlotGroup(int device);
  uint64_t SlotsInUse() const;
  uint64_t SlotsPeak() const;
  bool o_direct_ = false;
  bool warned_full_ = false;
  FaultSpec fault_;
  ThrottleStats throttle_;
  uint32_t salt_ = 0;
  uint32_t next_id_ = 1;
  uint64_t next_seq_ = 1;
  // Uncounted entries (and bytes) stored since the last sweep; a sweep is due past the marks.
  uint64_t uncounted_since_sweep_ = 0, uncounted_bytes_since_sweep_ = 0;
  uint64_t sweep_mark_entries_ = 64, sweep_mark_bytes_ = 0;
  std::unordered_map<uint32_t, EntryPtr> entries_;               // live entries
  std::map<std::pair<int, int64_t>, std::set<uint32_t>> by_site_;  // live ids per (device, site)
  std::map<int, DeviceStats> device_stats_;
  std::map<uint64_t, EntryPtr> unloaded_;                        // tier-0, by store seq
  int writes_inflight_ = 0, reads_inflight_ = 0, pending_free_ = 0;
  Status pending_error_;
  std::vector<uint64_t> file_bytes_written_, file_bytes_read_;
  int active_[2] = {0, 0};
  Clock::time_point busy_since_[2];
};

// Process-wide engine (created with defaults on first use if not configured).
std::shared_ptr<Engine> CurrentEngine(Status* st);

}  // namespace ssdtrain
