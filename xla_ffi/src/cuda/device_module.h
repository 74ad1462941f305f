// The device (CUDA) module of the engine: what the CUDA handlers add to it. Per GPU it owns the
// copy streams, the device staging arena and a pool of events (DeviceState); per entry, the
// staging copy and the events of the entry's copies (DeviceEntry). It reaches the engine through
// the engine's device module support methods and serves it through DeviceHooks. Its parts, one
// file each:
//   device_module.cc  the module: per-GPU state (streams, staging, host arenas registered as
//                     pinned memory), the engine's DeviceHooks, teardown
//   events.cc         the event pool, fences (the asynchronous users of a buffer), timed copies
//   staging.cc        the staging arena: allocation (whole or a tensor's first piece), eviction,
//                     reuse fences, growing it between programs
//   host_copies.cc    the host copies of staged stores: issued, deferred (lazy) or elided
//   releases.cc       deferred releases: entries whose last load's copy is still queued
//   read_ahead.cc     read-ahead: host -> staging of the next predicted loads
//   handles.cu        handles on the device (handles.h): written, read, a prediction checked
//   store.cc, load.cc the store and the load of an activation (store_load.h)
// A new CUDA operation builds on the same parts: Module() and Device() for the GPU's state,
// AllocStaging/FreeStaging for staging room, Tracked/WaitTracked/AddFence for ordered copies,
// DeferRelease and StagePrefetch.
//
// Every method is called with the engine's lock held (Engine::LockState) and the call's GPU
// current (UseDevice) unless stated otherwise. Stream ordering is correctness: every copy out of
// or into an XLA buffer is ordered against the compute stream of the call, and every copy into
// or out of a buffer the module reuses (a staging range, a host buffer) leaves an event its next
// user waits for. No CUDA call is made by CPU handlers: the module is created by the first CUDA
// handler call.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "copy_tracker.h"
#include "cuda_check.h"
#include "engine.h"
#include "handles.h"

namespace ssdtrain {

// The device module's part of an entry.
struct DeviceEntry {
  int device = -1;
  // Copy in the device staging arena.
  bool staged = false;
  bool stage_from_store = false;
  bool stage_unused = false;  // a read-ahead copy no load has used yet
  bool d2h_deferred = false;  // a store's staging copy whose D2H is not issued yet (lazy host copy)
  // A store's copy of an entry only later executions load, oldest first (optimizer state): no
  // load of this execution takes it, so read-ahead may take its room (staging.cc).
  bool later_in_order = false;
  // The staging range, and the tensor bytes it holds: [0, stage_bytes) of the tensor. A tensor
  // larger than the room staging had keeps only its first piece there (stage_bytes < nbytes);
  // the rest lives in the host buffer only (a store copies it there directly on the compute
  // stream, a load copies it from there).
  uint64_t stage_off = 0, stage_len = 0, stage_bytes = 0;
  char* stage_ptr = nullptr;
  cudaEvent_t stage_ready = nullptr;      // the staging copy is complete after this
  cudaEvent_t stage_d2h = nullptr;        // the D2H read of the staging copy is done
  std::vector<cudaEvent_t> stage_fences;  // async users of the staging region
  // Host copy.
  cudaEvent_t host_ready = nullptr;   // D2H into the host buffer done (E2): all of it
  cudaEvent_t host_direct = nullptr;  // a staged store's direct D2H of the bytes past staging done
  std::vector<cudaEvent_t> host_fences;  // async H2D readers of the host buffer
};

// The device module's state of one GPU.
struct DeviceState {
  int device = -1;
  cudaStream_t copy = nullptr;  // device -> host (stores)
  cudaStream_t h2d = nullptr;   // host -> device staging (read-ahead), so both directions overlap
  char* staging = nullptr;
  uint64_t staging_size = 0;
  RangeAllocator alloc;
  std::vector<cudaEvent_t> free_events;
  std::unordered_map<Entry*, EntryPtr> staged;
  // Store copies whose D2H is deferred, oldest first (entries that left that state are skipped
  // lazily), their staged bytes, the largest tensor staged whole so far, and the largest tensor
  // stored on this GPU (padded; read-ahead looks past its budget by it).
  std::deque<EntryPtr> deferred;
  uint64_t deferred_bytes = 0, largest = 0, largest_entry = 0;
  // Freed staging ranges whose last users may still run on some stream.
  struct PendingFree {
    uint64_t off = 0, len = 0;
    std::vector<cudaEvent_t> events;
  };
  std::vector<PendingFree> pending;
};

inline DeviceEntry* D(Entry& e) { return e.device_entry(); }

inline double SecondsSince(Engine::Clock::time_point t0) {
  return std::chrono::duration<double>(Engine::Clock::now() - t0).count();
}

class CudaModule final : public DeviceHooks {
 public:
  explicit CudaModule(Engine* eng) : eng_(eng) {}
  ~CudaModule() override;
  CudaModule(const CudaModule&) = delete;
  CudaModule& operator=(const CudaModule&) = delete;

  // ---- per-GPU state and entries (device_module.cc) ------------------------------------
  // The state of GPU `dev`, made on first use (streams, staging; the host arenas are registered
  // as pinned memory with the first GPU).
  Status Device(int dev, DeviceState** out);
  // The state of GPU `dev` if it was made, else nullptr.
  DeviceState* FindDevice(int dev);
  // The device part of `e`, made (for GPU `dev`) if it has none yet.
  DeviceEntry* Attach(Entry& e, int dev);

  // ---- events and fences (events.cc) ---------------------------------------------------
  Status NewEvent(DeviceState* ds, cudaEvent_t* ev);
  void PutEvent(int dev, cudaEvent_t ev);
  // Records a fresh event on `stream` and appends it to `fences`, recycling completed ones.
  Status AddFence(DeviceState* ds, std::vector<cudaEvent_t>* fences, cudaStream_t stream);
  // Waits for every event of `fences` (on the host) and recycles them.
  void SyncAndRecycle(int dev, std::vector<cudaEvent_t>* fences);
  // Waits on the host for `ev` (null: nothing to wait for), in a hook with no status to return:
  // a failure is kept for the engine's next store, load or flush to return (Engine::FailLater).
  void HostWait(cudaEvent_t ev, const char* what);
  // `ev` completed (or is null). Lock not needed.
  static bool Done(cudaEvent_t ev);
  // No copy into, out of, or D2H from the staging range of `d` is pending.
  static bool Idle(DeviceEntry* d);
  // Issues `copy()` (a Status-returning lambda that enqueues work on `stream`) inside a timing
  // bracket of the copy tracker.
  template <typename F>
  Status Tracked(int dev, cudaStream_t stream, CopyOp op, uint64_t bytes, std::string_view name,
                 F&& copy) {
    CopyTracker::Mark m;
    SSD_RETURN_IF_ERROR(tracker_.Begin(dev, stream, &m));
    Status s = copy();
    if (!s.ok()) {
      tracker_.Cancel(&m);
      return s;
    }
    return tracker_.End(m, stream, op, bytes, name);
  }
  // Makes `stream` wait for `ev` (unless already complete), inside a kComputeWait bracket when
  // `stream` is the compute stream of a load.
  Status WaitTracked(int dev, cudaStream_t stream, cudaEvent_t ev, std::string_view name);
  CopyTracker& tracker() { return tracker_; }
  // Tensors larger than the staging room they found (staging_direct_*, staging_split_*
  // statistics): a store that copied `bytes` past staging directly to the host on the compute
  // stream; a load that took a first piece from staging and `host_bytes` from the host buffer.
  void CountDirectStore(uint64_t bytes) {
    direct_stores_++;
    direct_store_bytes_ += bytes;
  }
  void CountSplitLoad(uint64_t host_bytes) {
    split_loads_++;
    split_load_host_bytes_ += host_bytes;
  }

  // ---- the staging arena (staging.cc) --------------------------------------------------
  // Reserves staging for the first `want` bytes of `e` (at most the arena), to be written on
  // `stream` (nullptr: the caller orders its stream with OrderStaging before writing it).
  // Evicts copies, loaded entries first, then the oldest; idle ones before busy ones (a busy
  // one's users are waited for on the stream, not on the host); then store copies whose host
  // copy is still deferred (their D2H is issued first), oldest first; unused read-ahead copies
  // last. Read-ahead (prefetch_seq != 0) evicts only entries loaded already or older, and no
  // unused read-ahead copy. `partial`: where eviction cannot make `want` bytes of room, the
  // largest free range (at least kMinStagePiece, or `want` when smaller) is taken instead.
  // `*got`: the tensor bytes reserved (D(*e)->stage_bytes; 0: none); `*waits`: events `stream`
  // was made to wait for.
  Status AllocStaging(DeviceState* ds, const EntryPtr& e, cudaStream_t stream,
                      uint64_t prefetch_seq, uint64_t want, bool partial, uint64_t* got,
                      int* waits);
  static constexpr uint64_t kMinStagePiece = 1 << 20;
  // Orders `stream` after every earlier user of `e`'s staging range (AllocStaging with no
  // stream); `*waits` counts the events it waited for.
  Status OrderStaging(DeviceState* ds, const Entry& e, cudaStream_t stream, int* waits);
  // Frees the staging copy of `e` without waiting: the range's last users' events go to the
  // pending list (see AllocStaging).
  void FreeStaging(Entry& e);
  // Replaces the arena of `ds` by one of `bytes` (larger): every staged copy is evicted as
  // AllocStaging evicts (a deferred host copy issued, or elided where no load is left), the host
  // waits for every user of the old arena, which is then freed. EBUSY, nothing changed, while a
  // staged entry is filling or pinned; ENOMEM where the new arena cannot be allocated (the old
  // size is allocated again).
  Status GrowArena(DeviceState* ds, uint64_t bytes);
  // A load may copy `d`'s staging range (without forwarding, an nvme tensor comes back from the
  // file, not from its store's staging copy).
  bool StagingUsable(const Entry& e, const DeviceEntry& d) const;

  // ---- host copies of staged stores (host_copies.cc) -----------------------------------
  // Copies the staging copy of store `e` to its host buffer on the copy stream (after the copy
  // into staging); host_ready (for the host buffer) and stage_d2h (for the staging range) mark
  // its end.
  Status IssueD2H(DeviceState* ds, Entry& e);
  // The deferred host copy of `e` will never be needed: no load is left.
  void ElideD2H(DeviceState* ds, Entry& e);
  // Store `e` (host tier, staged) keeps its bytes in staging only; the D2H of the oldest
  // deferred copies is issued while more than the arena less room for two of the largest
  // tensors is deferred (so that a new store finds room among copies already on their way to
  // the host, and the copy stream has work while the forward pass runs).
  Status DeferD2H(DeviceState* ds, const EntryPtr& e);

  // ---- deferred releases (releases.cc) -------------------------------------------------
  // The release of `e` waits for its last load's copy on `stream`: no host thread blocks on it
  // (ReclaimReleases collects it once done).
  Status DeferRelease(DeviceState* ds, const EntryPtr& e, cudaStream_t stream);

  // ---- read-ahead (read_ahead.cc) ------------------------------------------------------
  // Copies the next predicted entries that sit in host memory into device staging on the h2d
  // stream (`after`, `stream`: Engine::PredictNext's; then within half the staging arena, so that
  // the stores of the same step keep room).
  Status StagePrefetch(DeviceState* ds, const Entry* after = nullptr, bool stream = false);

  // ---- handle checks (handles.h) -------------------------------------------------------
  HandleChecks& handle_checks() { return checks_; }
  // An error for every predicted load found wrong since the last call.
  Status TakeMismatch() { return checks_.TakeMismatch(eng_); }

  // ---- DeviceHooks (device_module.cc; ReclaimReleases: releases.cc) --------------------
  Status WaitHostReady(Entry& e) override;
  void BeforeHostFree(Entry& e) override;
  void OnEntryFree(Entry& e) override;
  bool HasDeviceCopy(const Entry& e) override;
  void ReclaimReleases(bool wait) override;
  Status GrowStaging(uint64_t bytes) override;  // staging.cc
  void AppendStats(std::ostream& o) override;
  void ResetStats() override;
  std::string TakeTimeline() override { return tracker_.TakeTimeline(); }

 private:
  // Drops pending staging ranges whose users all finished.
  void CollectPending(DeviceState* ds);
  // Orders `stream` after every pending user of [off, off + len); `*waits` counts the events it
  // had to wait for.
  Status OrderAfterPending(DeviceState* ds, uint64_t off, uint64_t len, cudaStream_t stream,
                           int* waits);
  // No load will take `e` any more (its counted loads are all issued, or it was released).
  static bool Dead(const Entry& e) { return e.no_loads_left(); }

  Engine* eng_;
  // Entries whose counted last load was enqueued: released once `done` (after the copy) fires.
  struct Deferred {
    EntryPtr e;
    cudaEvent_t done;
    int device;
  };
  std::vector<Deferred> deferred_;
  std::map<int, std::unique_ptr<DeviceState>> devices_;
  std::vector<void*> registered_;
  bool host_registered_ = false;
  uint64_t staged_prefetches_ = 0;
  HandleChecks checks_;
  CopyTracker tracker_;
  // Lazy host copies: never made (the entry died in staging), and forced by a staging reuse.
  uint64_t elided_bytes_ = 0, elided_tensors_ = 0, forced_d2h_ = 0;
  // CountDirectStore, CountSplitLoad.
  uint64_t direct_stores_ = 0, direct_store_bytes_ = 0, split_loads_ = 0,
           split_load_host_bytes_ = 0;
};

// The device module of `eng`, made on first use. Lock held.
CudaModule* Module(Engine& eng);

// Makes `dev` (XLA's device ordinal of the call) the calling thread's current device: the
// staging, streams and events the module makes belong to it. Lock not needed.
Status UseDevice(int dev);

}  // namespace ssdtrain
