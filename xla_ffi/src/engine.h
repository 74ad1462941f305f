// The process-wide activation store. Internal, as every header under src/ is: the library's
// contract is its C ABI (include/ssdtrain/c_api.h) and its XLA FFI handlers. Its parts, one file
// each (data flows down this list):
//   engine.cc       store and load: what the handlers call; setup, whole-store operations
//   entries.cc      entries (detail/entry.h) and their lifetimes: handles, lookup, load
//                   prediction, counted release at the last load, sweeps, freeing
//   host_memory.cc  host memory: the host cache (write-behind, forwarding, read-ahead buffers)
//                   and the host tier, eviction and write-back to make room
//   io.cc           I/O scheduling: write-behind, reads, read-ahead, synchronous bounce I/O
//   file_space.cc   the store files, their slots and striping (detail/file_space.h)
//   stats.cc        statistics
// and below them the backends (io_backend.h), the thread pool and the allocators (detail/).
// Device (CUDA) specifics live in the device module (src/cuda/) and reach the engine through
// DeviceHooks and the device module support methods; no CUDA call is made by anything here
// unless CUDA handlers have run.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "config.h"
#include "detail/entry.h"
#include "detail/file_space.h"
#include "detail/host_memory.h"
#include "detail/thread_pool.h"
#include "io_backend.h"
#include "status.h"

namespace ssdtrain {

// Implemented by the CUDA module. All calls are made with the engine's lock held unless stated
// otherwise.
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
  // A load of `e` would be served from a device copy now: read-ahead skips it.
  virtual bool HasDeviceCopy(const Entry& e) = 0;
  // Releases the entries whose last load's device copy has completed (all of them, waiting for
  // their copies, when `wait`). Called before the engine gives up for lack of space.
  virtual void ReclaimReleases(bool wait) = 0;
  // Grows the staging arena of every GPU that has one to `bytes` (ssdtrain_grow_staging).
  virtual Status GrowStaging(uint64_t bytes) = 0;
  // Device counters as "key=value" lines (StatsString), their reset, and the timeline of the
  // latest device copies ("op device bytes start_s end_s name" lines, oldest first; cleared).
  virtual void AppendStats(std::ostream& o) = 0;
  virtual void ResetStats() = 0;
  virtual std::string TakeTimeline() = 0;
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
  // Bytes of loads that took a disk read (each read counts once), and bytes read that no load
  // took (the entry was released first: read ahead, never loaded).
  uint64_t disk_loaded_bytes = 0, disk_unused_bytes = 0;
  uint64_t bounce_writes = 0, bounce_reads = 0;
  double stall_seconds = 0, write_seconds = 0, read_seconds = 0;
  double handle_sync_seconds = 0;
  uint64_t staging_in_use = 0, staging_peak = 0;
  uint64_t full_kept_tensors = 0, full_kept_bytes = 0;  // on_full=keep
  uint64_t spilled_tensors = 0, spilled_bytes = 0;      // host,nvme stores the host tier refused
  // Of those, the ones the host tier had the free bytes for, in extents too small: fragmentation.
  uint64_t fragmented_spills = 0, fragmented_spill_bytes = 0;
  uint64_t checksum_failures = 0;
  // Lifetimes: entries released after their counted last load, stores nobody loads (never
  // kept), sweeps and the entries they released.
  uint64_t counted_releases = 0, unused_stores = 0, sweeps = 0, swept_entries = 0;
  // Loads of a retired entry (a background sweep fell inside the dispatch of the step that
  // loads it), and retired entries released to make room for a store.
  uint64_t revived_entries = 0, retired_reclaimed = 0;
};

// Per-device counters (device = the XLA device ordinal the handler ran on).
struct DeviceStats {
  uint64_t bytes_written = 0, tensors_written = 0, bytes_read = 0, tensors_read = 0;
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
  // Grows the device staging arena to `bytes` (config().staging_bytes; the GPUs that have one
  // through DeviceHooks::GrowStaging). Lock NOT held. Between programs only (c_api.h).
  Status GrowStaging(uint64_t bytes);

  // ---- CPU handlers -------------------------------------------------------
  // `device`: the XLA device ordinal of the call (per-device sites and statistics).
  // `uses`: loads per stored entry in its execution (0: nobody loads it; Entry::kUncounted,
  // Entry::kManual, Entry::kLaterInOrder).
  Status StoreFromHost(const void* src, uint64_t nbytes, int64_t site, Tier tier,
                       std::string_view name, uint32_t handle[2], int device = 0, int64_t uses = -1,
                       int64_t run_id = -1, int64_t pass = 0, int pass_dir = 0);
  // `consume`: this load is the entry's last (optimizer state updated in place): the entry is
  // released once its bytes are copied out, whatever its count. `exact`: the entry was stored
  // by an earlier execution that stored the next loads after it (optimizer state): the
  // read-ahead follows store order (PredictNext).
  // `order`: the load's LoadOrder (the handlers' "exact" attribute). The host reads every
  // handle; an ordered or streamed load's prediction is made as on the GPU and checked against
  // it (speculative_loads, handle_mismatches count them; nothing else depends on it).
  Status LoadToHost(const uint32_t handle[2], void* dst, uint64_t nbytes, int64_t site,
                    std::string_view name, int device = 0, bool consume = false,
                    LoadOrder order = LoadOrder::kActivation, int64_t run_id = -1, int64_t pass = 0,
                    int pass_dir = 0);

  // ---- building blocks (device module) -----------------------------------
  // Registers a new entry that `uses` loads will consume (-1: until a sweep) and reserves its
  // host buffer and file slot. e->host_ptr == nullptr means "no host buffer": use
  // WriteThrough. A store nobody loads (uses == 0) keeps nothing: the caller writes the
  // null handle (MakeNullHandle) instead. `run_id`: the XLA execution storing it (-1: none);
  // `pass`: the store's stream_pass (a layer stack's: one version of the stack per pass) and
  // `pass_dir` its layer order (stream_dir: +1 up, -1 down, 0 not given).
  Status BeginStore(int64_t site, Tier tier, uint64_t nbytes, std::string_view name, EntryPtr* out,
                    int device = 0, int64_t uses = -1, int64_t run_id = -1, int64_t pass = 0,
                    int pass_dir = 0);
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
  // `retire` (a sweep on a thread other than the dispatching one): such entries are retired
  // instead: a load still finds a retired entry (and revives it); its host and file room is
  // given back when a store needs it (oldest first), by a sweep without `retire`, or by
  // ReleaseAll. A sweep that finds a retired entry's handle held again revives it.
  Status Sweep(const uint32_t* pairs, uint64_t n_pairs, uint64_t seq_limit, uint64_t* released,
               bool retire = false);
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
  // Lock held. The handle of an ordered exact load (optimizer state: a site's chunks loaded in
  // the order an earlier execution stored them): the oldest entry of `site`, `device` and size
  // stored after the site's last exact load of `run_id` on `device` (NoteExactLoad), by the
  // execution that stored that load's entry (before the site's first: the execution that stored
  // the execution's first exact load's entry). Whether an entry was loaded before does not
  // matter: an update that failed loaded some of the state its retry loads again. `*left`:
  // entries on `device` past their site's last load in their site's execution (a site not loaded
  // yet: the first exact load's), besides it. False before the execution's first exact load (it
  // reads its handle) or when there is none.
  bool PredictOrderedLoad(int64_t site, int64_t run_id, int device, uint64_t nbytes, uint32_t h[2],
                          uint64_t* left) const;
  // Lock held. The execution a site's first ordered load in an execution is predicted from, among
  // the site's live entries `ids` of size `nbytes` (`first`: the execution that stored the
  // execution's first exact load's entry): `first` where its entries are the site's newest; the
  // one execution with entries there where `first` has none; else false (the load reads its
  // handle: an older version than another's, as a state leaf no update rewrites next to a
  // rewritten one not yet released, or an update's state loaded twice, cannot be told apart).
  bool FirstOrderedSource(const std::set<uint32_t>& ids, int64_t first, uint64_t nbytes,
                          int64_t* from) const;
  // Lock held. An exact load of execution `run_id` on `device` loaded `e`: the next ordered
  // loads of that execution on that device are predicted among the entries of `e`'s execution.
  void NoteExactLoad(int64_t run_id, int device, const Entry& e);
  // Lock held. The handle of a streamed load (a layer stack's, LoadOrder::kStream) of pass
  // `pass` of execution `run_id` on `device`: a pass's loads of a site step through the entries
  // one store pass of one execution stored there (a version of the stack), one at a time in
  // one direction of store order, which the passes' layer orders give, or else the pass's
  // first two loads of the site show (they read their handles; NoteStreamLoad). Predicted: the
  // next entry of that execution, site and size past the pass's last load of the site, in that
  // direction; whether an entry was loaded before does not matter. `*left`: entries still ahead
  // of the execution's streamed (site, pass) cursors in their directions, besides it. False
  // where the pass has no direction for the site yet or none is left.
  bool PredictStreamLoad(int64_t site, int64_t pass, int64_t run_id, int device, uint64_t nbytes,
                         uint32_t h[2], uint64_t* left) const;
  // Lock held. A streamed load of pass `pass` of execution `run_id` on `device` loaded `e`: the
  // (site, pass) cursor and its direction in store order: at the pass's first load of the
  // site, the product of the two passes' layer orders (`pass_dir`, e's pass_dir_) where both
  // are given, else none until the second load shows it.
  void NoteStreamLoad(int64_t run_id, int device, int64_t pass, int pass_dir, const Entry& e);

  // Validates the handle and marks the entry loaded. Lock held. `consume`: this load is the
  // entry's last (its CountLoad releases it, after the load's copy on the GPU).
  Status LookupForLoad(Lock& lk, const uint32_t handle[2], uint64_t nbytes, int64_t site,
                       std::string_view name, EntryPtr* out, int device = 0, bool consume = false);
  struct HostRef {
    EntryPtr e;
    const char* ptr = nullptr;
    bool pinned = false;     // e->pins was incremented
    char* bounce = nullptr;  // owned aligned buffer (free with free())
  };
  // Makes the bytes of `e` available in host memory (waits for a running
  // read-ahead, or reads from the file). Lock held (may be released while
  // waiting).
  Status AcquireHost(Lock& lk, const EntryPtr& e, HostRef* ref);
  void ReleaseHost(Lock& lk, HostRef* ref);
  // Lock held. A load used the bytes of `e`'s host buffer (GPU: through device staging).
  void ConsumeRead(Entry& e);
  // Read-ahead of `device`'s next predicted entries (-1: every device's; `after`: see
  // PredictNext). Lock held.
  void SchedulePrefetch(Lock& lk, int device = -1, const Entry* after = nullptr,
                        bool stream = false);
  // Returns (and clears) a recorded asynchronous error. Lock held.
  Status TakePendingError();
  // The host tier's free room and largest extent, for a full store's message ("" unless `tier`
  // spills from the host tier). Lock held.
  std::string SpilledFrom(Tier tier) const;
  // Counts a "host,nvme" store spilled for fragmentation, and says so once. Lock held.
  void NoteFragmentedSpill(const Entry& e);
  // Records `s` (the first such error is kept) for the next store, load or flush to return:
  // for a failure inside a hook that has no status to return. Lock held.
  void FailLater(const Status& s) {
    if (!s.ok() && pending_error_.ok()) pending_error_ = s;
  }

  // Waits until no write or read is in flight; returns (and clears) a pending I/O error.
  Status Flush();
  Status ReleaseAll();
  std::string StatsString();
  void ResetStats();
  // The device copies of the latest steps (DeviceHooks::TakeTimeline; empty without a GPU).
  std::string TakeTimeline();
  std::string FilePaths();
  // Test hooks (C ABI ssdtrain_debug_*): cut every store file to `size` bytes;
  // flip one byte at a logical (striped) store offset.
  Status DebugTruncate(uint64_t size);
  Status DebugCorrupt(uint64_t loff);

  // ---- device module support ------------------------------------------------
  // The engine's lock: it guards the engine's state, every entry's, and the device module's.
  Lock LockState() { return Lock(mu_); }
  DeviceHooks* hooks() { return hooks_.get(); }
  void SetHooks(std::unique_ptr<DeviceHooks> h) { hooks_ = std::move(h); }
  const HostArena& arena(Arena which) const { return which == Arena::kCache ? cache_ : tier_; }
  // Predicted next loads within the read-ahead budget. Lock held. Only entries stored by
  // `device` unless it is -1. Activations are loaded in reverse store order: the newest
  // unloaded entries first. With `after` (just loaded: state an earlier execution stored, such
  // as an optimizer's, which a step loads in its store order) the unloaded entries that the
  // same execution stored after it, oldest first.
  // With `stream` (after a streamed load on `device`): the entries each streamed site of the
  // execution loads next, in its direction, the sites' next ones first, then their second, ...
  std::vector<EntryPtr> PredictNext(uint64_t budget, int device = -1, const Entry* after = nullptr,
                                    bool stream = false);
  // Statistics the device module keeps (lock held): seconds a handler blocked on a copy, and
  // on reading a load's handle; predicted loads, and those found wrong on the device; staging
  // reuses ordered after a still-running user; device staging bytes taken and given back; a
  // load served from a staging copy (forwarded from its store, or read ahead).
  void AddStall(double s) { stats_.stall_seconds += s; }
  void AddHandleSync(double s) { stats_.handle_sync_seconds += s; }
  void CountSpeculativeLoad() { stats_.speculative_loads++; }
  void CountHandleMismatches(uint64_t n) { stats_.handle_mismatches += n; }
  void CountStagingWait() { stats_.staging_waits++; }
  void StagingAllocated(uint64_t bytes);
  void StagingFreed(uint64_t bytes) { stats_.staging_in_use -= bytes; }
  void CountStagedLoad(const Entry& e, bool from_store);
  uint32_t salt() const { return salt_; }  // its handles' check words (HandleCheckWithSalt)

 private:
  Engine() = default;
  Status Init(const Config& cfg);

  // ---- entries and their lifetimes (entries.cc) --------------------------
  uint32_t HandleCheck(uint32_t id) const;  // the check word of a handle
  void Release(const EntryPtr& e);          // no load can reach it any more
  void Retire(const EntryPtr& e);           // a background sweep found it dead (Sweep)
  void Revive(Entry& e);                    // a retired entry is loaded or held again
  // Releases the oldest retired entry (a store needs room); false when there is none.
  bool ReleaseOldestRetired();
  void MaybeFree(const EntryPtr& e);  // frees a released entry once nothing uses its buffers
  // A released entry whose write or read is still running frees its room when that I/O ends
  // (MaybeFree). Waits until some released entry is freed or no I/O is left in flight; true
  // when one was freed (the caller tries its allocation again).
  bool WaitForReleasedRoom(Lock& lk);
  // ---- host memory (host_memory.cc) ---------------------------------------
  bool AllocHost(Arena arena, uint64_t padded, uint64_t* off);
  void FreeHostBuffer(Entry& e);
  // Evicts one clean cached entry, loaded ones first, then the oldest; `evicted_unloaded`
  // (if given) says whether it was one no load has read yet. For read-ahead
  // (`prefetch_seq` != 0) only entries already loaded or older than prefetch_seq are considered.
  bool EvictOne(const Entry* exclude, uint64_t prefetch_seq, bool* evicted_unloaded = nullptr);
  // Queues the writes that forwarding skipped for loaded entries still holding their only copy
  // in the cache (`all`), or for the oldest of them, so that they become evictable (a later
  // load reads the file). True when one was queued or will be eligible once its cancelled
  // pieces drain (the caller waits), false when there is none.
  bool WriteBackForwarded(const Entry* exclude, bool all);
  Status AcquireCacheBuffer(Lock& lk, Entry& e, bool may_block);
  // ---- I/O scheduling (io.cc) ---------------------------------------------
  void EnqueueWrite(const EntryPtr& e);
  void WritePiece(const EntryPtr& e, const FileSpace::Piece& p);
  void FinishWrite(const EntryPtr& e);
  void StartRead(const EntryPtr& e, bool demand);
  void ReadPiece(const EntryPtr& e, const FileSpace::Piece& p);
  void FinishRead(const EntryPtr& e);
  Status SyncIo(bool write, char* buf, uint64_t loff, uint64_t len);
  // verify: checks the bytes read into `buf` against e's crc.
  Status CheckCrc(const Entry& e, const char* buf);
  void BusyBegin(bool write);
  void BusyEnd(bool write);

  std::mutex mu_;
  std::condition_variable cv_;
  Stats stats_;
  std::atomic<bool> gds_active_{false};
  Config cfg_;
  FileSpace space_;
  std::unique_ptr<IoBackend> backend_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<DeviceHooks> hooks_;
  HostArena cache_, tier_;
  bool warned_full_ = false;
  bool warned_fragmented_ = false;
  FaultSpec fault_;
  ThrottleStats throttle_;
  // Entries: ids with a salted check word (handles), by id, by (device, site) and, for
  // read-ahead and load prediction, the not-yet-loaded ones by store order.
  uint32_t salt_ = 0;
  uint32_t next_id_ = 1;
  uint64_t next_seq_ = 1;
  std::unordered_map<uint32_t, EntryPtr> entries_;                 // live entries
  std::map<std::pair<int, int64_t>, std::set<uint32_t>> by_site_;  // live ids per (device, site)
  std::map<uint64_t, EntryPtr> unloaded_;                          // by store seq
  struct ExactSource {
    int64_t run_id = -1;     // the loading execution
    int64_t stored_by = -1;  // the execution that stored what its first exact load read
    struct Cursor {
      int64_t stored_by = -1;  // the execution that stored the site's last loaded entry
      uint64_t seq = 0;        // that entry's store seq
    };
    // Per site and entry size loaded so far: a leaf's chunks of one size come in store order
    // (a scan's iterations), but its last, shorter chunk is stored and loaded outside the scan,
    // where XLA may run it before, between or after them.
    std::map<std::pair<int64_t, uint64_t>, Cursor> sites;
  };
  std::map<int, ExactSource> exact_sources_;  // per device (PredictOrderedLoad)
  struct StreamCursor {
    int64_t stored_by = -1;  // the execution that stored the site's last loaded entry
    int64_t store_pass = 0;  // and the pass of its store (one version of a stack)
    uint64_t seq = 0;        // that entry's store seq
    uint64_t nbytes = 0;
    int dir = 0;  // +1: the loads follow store order, -1: the reverse, 0: one load so far
    // Whether entry `a` comes before `b` in the direction of the loads.
    bool Nearer(const Entry* a, const Entry* b) const;
  };
  struct StreamSource {
    int64_t run_id = -1;                                        // the loading execution
    std::map<std::pair<int64_t, int64_t>, StreamCursor> sites;  // per (site, pass)
  };
  std::map<int, StreamSource> stream_sources_;  // per device (PredictStreamLoad)
  // Lock held. The entries at (`device`, `site`) of the cursor's execution, store pass and size,
  // live, past the cursor in its direction (none before it has one), in no particular order
  // (StreamCursor::Nearer orders them).
  std::vector<const Entry*> StreamAhead(int device, int64_t site, const StreamCursor& c) const;
  std::map<uint64_t, EntryPtr> retired_;  // by store seq (Retire)
  uint64_t retired_bytes_ = 0;
  // Uncounted entries (and bytes) stored since the last sweep; a sweep is due past the marks.
  uint64_t uncounted_since_sweep_ = 0, uncounted_bytes_since_sweep_ = 0;
  uint64_t sweep_mark_entries_ = 64, sweep_mark_bytes_ = 0;
  std::map<int, DeviceStats> device_stats_;
  // I/O in flight and its busy time; an asynchronous error for the next call to report.
  int writes_inflight_ = 0, reads_inflight_ = 0, pending_free_ = 0;
  uint64_t frees_ = 0;  // released entries freed so far (WaitForReleasedRoom waits on it)
  Status pending_error_;
  int active_[2] = {0, 0};
  Clock::time_point busy_since_[2];
};

// "tag 'name' (site S, id I)", for messages.
std::string DescribeTag(std::string_view name, int64_t site, uint32_t id);

inline double Seconds(Engine::Clock::time_point a, Engine::Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// The process-wide engine: EINVAL (why there is none) when no store is open.
std::shared_ptr<Engine> CurrentEngine(Status* st);
// The process-wide engine, or nullptr (no error) when no store is open.
std::shared_ptr<Engine> PeekEngine();
// Replaces the process-wide engine by one configured with `cfg`; nullptr: shuts the store down.
Status ReplaceEngine(const Config* cfg);
// The check word of handle id `id` under an engine's `salt`.
uint32_t HandleCheckWithSalt(uint32_t id, uint32_t salt);
// Whether handle `h` was made by an engine of this process that ReplaceEngine replaced (its
// check word matches a replaced engine's salt): a store made before a reconfiguration.
bool FromReplacedStore(const uint32_t h[2]);

}  // namespace ssdtrain
