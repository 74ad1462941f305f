// One stored tensor (Entry) and the vocabulary of its state: its tier, its lifecycle, the state
// and arena of its host copy, the state of its write. Internal to the engine (engine.h); the
// device module reads an entry through the accessors and changes it through the few transitions
// they list.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "ssdtrain/attributes.h"
#include "status.h"

namespace ssdtrain {

enum class WState { kNone, kQueued, kRunning, kDone, kCancelled, kFailed };

// Where a store keeps its bytes: the handlers' "tier" attribute (ssdtrain/attributes.h).
enum class Tier : int32_t {
  kNvme = SSDTRAIN_TIER_NVME,                    // the store files, through the host cache
  kHost = SSDTRAIN_TIER_HOST,                    // the host tier (pinned host memory only)
  kHostThenNvme = SSDTRAIN_TIER_HOST_THEN_NVME,  // the host tier while it has room, else the
                                                 // store files (a spill)
};
// The tier a handler's attribute names; BeginStore rejects a value that names none.
inline Tier TierFromAttr(int32_t value) { return static_cast<Tier>(value); }

// How a load finds its entry: the load handlers' "exact" attribute (ssdtrain/attributes.h).
enum class LoadOrder : int32_t {
  // stored by this execution: predicted among its entries (newest first)
  kActivation = SSDTRAIN_LOAD_ACTIVATION,
  // stored by an earlier execution: the handle is read
  kRead = SSDTRAIN_LOAD_READ,
  // an earlier execution's, a site's entries in its store order (optimizer state's chunks):
  // predicted after the execution's first such load
  kStoreOrder = SSDTRAIN_LOAD_STORE_ORDER,
  // a layer stack's: in each pass, each site steps through one execution's entries in one
  // direction of store order (Engine::PredictStreamLoad)
  kStream = SSDTRAIN_LOAD_STREAM,
};
inline LoadOrder LoadOrderFromAttr(int32_t value) { return static_cast<LoadOrder>(value); }

// The host arena holding an entry's host copy.
enum class Arena {
  kNone,      // no host copy
  kCache,     // the host cache (nvme tier: write-behind, forwarding, read-back)
  kHostTier,  // the host tier
};

// An entry's lifecycle, one state machine (the engine's transitions, lock held):
//
//   kFilling --end of the store's copy--> kLive --Retire--> kRetired
//      |      (CommitStore, WriteThrough,   ^  <--Revive---    |
//      |       AbortStore)                  |                  |
//      | Release                    Release |          Release |
//      v                                    v                  v
//   kReleasedFilling --end of the copy--> kReleased <----------+
//                                           | MaybeFree (nothing uses its buffers any more)
//                                           v
//                                         kFreed
enum class EntryLife : uint8_t {
  kFilling,          // the store is still copying the bytes in (a load waits for them)
  kLive,             // stored: a load finds it by its handle
  kRetired,          // a background sweep found it dead: a load still finds it (and revives
                     // it); released when its room is needed
  kReleasedFilling,  // released while its store still copies in: kReleased once that ends
  kReleased,         // no load can reach it; freed once nothing uses its buffers
  kFreed,            // its host buffer and file slot are given back
};

// What an entry's host buffer (Entry::host_ptr) holds, a second state machine, independent of
// the lifecycle (the engine's transitions, lock held):
//
//   kNone --CommitStore (BeginStore for an empty tensor)--> kStored
//   kNone --StartRead--> kReading --FinishRead--> kRead --ConsumeRead--> kReadTaken
//                                 (failed: kNone)
//   any --FreeHostBuffer (the buffer is evicted, reused or freed)--> kNone
enum class HostCopy : uint8_t {
  kNone,       // no bytes yet: no buffer, or one the store is filling or a read will fill
  kReading,    // a read from the store files into the buffer is running (demand or read-ahead)
  kStored,     // the store's own copy (forwarding; a device store's once WaitHostReady returns)
  kRead,       // read back from the files, and no load has taken it yet. Never evicted (that
               // would read the same bytes twice); a load consumes it (Engine::ConsumeRead)
  kReadTaken,  // read back from the files and taken by a load
};

// The device module's part of an entry (its staging copy and the events of its copies); defined
// and owned by the device module, opaque here.
struct DeviceEntry;

// One stored tensor. Its state is the engine's: the engine's mutex guards it (the identity is
// fixed once BeginStore returns). Others read it through the accessors below and change it
// through the few transitions after them.
class Entry {
 public:
  // Loads left before the entry is released (counted when the program was compiled);
  // kUncounted: released by a sweep (its handle left the execution, or the count was unknown);
  // kManual: stored through the C ABI (probe, tests), released by release_all() only.
  // A store's uses == kLaterInOrder (an optimizer's state) is kUncounted too, and says more: only
  // later executions load the entry, in store order, so its host copy is made at once (store.cc).
  // (The store's "uses" attribute, ssdtrain/attributes.h.)
  static constexpr int64_t kUncounted = SSDTRAIN_USES_UNCOUNTED, kManual = SSDTRAIN_USES_MANUAL,
                           kLaterInOrder = SSDTRAIN_USES_LATER_IN_ORDER;

  // ---- identity ------------------------------------------------------------
  uint32_t id() const { return id_; }
  int64_t site() const { return site_; }
  int device() const { return device_; }  // XLA device ordinal of the store
  Tier tier() const { return tier_; }
  uint64_t nbytes() const { return nbytes_; }
  uint64_t padded() const { return padded_; }  // nbytes rounded up to the file alignment
  uint64_t seq() const { return seq_; }        // store order
  const std::string& name() const { return name_; }
  int64_t run_id() const { return run_id_; }  // XLA execution of the store (device path)

  // ---- state (lock held) ----------------------------------------------------
  EntryLife life() const { return life_; }
  // The store is still copying bytes in.
  bool filling() const {
    return life_ == EntryLife::kFilling || life_ == EntryLife::kReleasedFilling;
  }
  bool retired() const { return life_ == EntryLife::kRetired; }
  // No load can reach it any more (freed or not).
  bool released() const {
    return life_ == EntryLife::kReleasedFilling || life_ == EntryLife::kReleased ||
           life_ == EntryLife::kFreed;
  }
  HostCopy host_copy() const { return host_; }
  char* host_ptr() const { return host_ptr_; }  // the host buffer; nullptr: none
  // The host buffer holds the bytes (device stores: once WaitHostReady returns).
  bool host_valid() const {
    return host_ == HostCopy::kStored || host_ == HostCopy::kRead || host_ == HostCopy::kReadTaken;
  }
  bool host_from_store() const { return host_ == HostCopy::kStored; }
  bool reading() const { return host_ == HostCopy::kReading; }  // a read into the host buffer
  bool unconsumed_read() const { return host_ == HostCopy::kRead; }
  bool loaded() const { return loads_ > 0; }
  bool pinned() const { return pins_ > 0; }  // a load is copying out of the host buffer
  // No load will take it any more (its counted loads are all issued, or it was released).
  bool no_loads_left() const { return released() || uses_left_ == 0; }
  const Status& error() const { return error_; }  // sticky (a failed write)

  // ---- transitions (lock held) ----------------------------------------------
  // The XLA execution of a device store, for load prediction.
  void set_run_id(int64_t run_id) { run_id_ = run_id; }
  // Zeroes the host buffer past the tensor's bytes (the padding written to the file).
  void ZeroHostPadding() {
    if (padded_ > nbytes_) memset(host_ptr_ + nbytes_, 0, padded_ - nbytes_);
  }
  // The device module's part (the engine hands it back through DeviceHooks::OnEntryFree).
  DeviceEntry* device_entry() const { return dev_; }
  void set_device_entry(DeviceEntry* d) { dev_ = d; }
  // While one exists the entry counts as being loaded: a sweep and a write-back leave it alone.
  // Made and destroyed with the engine's lock held.
  class LoadingScope {
   public:
    explicit LoadingScope(Entry& e) : e_(e) { e_.loading_++; }
    ~LoadingScope() { e_.loading_--; }
    LoadingScope(const LoadingScope&) = delete;
    LoadingScope& operator=(const LoadingScope&) = delete;

   private:
    Entry& e_;
  };

 private:
  friend class Engine;

  // The store's copy ended (committed, written through or aborted): kFilling -> kLive,
  // kReleasedFilling -> kReleased.
  void EndFilling() {
    if (life_ == EntryLife::kFilling)
      life_ = EntryLife::kLive;
    else if (life_ == EntryLife::kReleasedFilling)
      life_ = EntryLife::kReleased;
  }

  uint32_t id_ = 0;
  int64_t site_ = 0;
  int device_ = 0;  // only that device may load it
  Tier tier_ = Tier::kNvme;
  uint64_t nbytes_ = 0, padded_ = 0, seq_ = 0;
  std::string name_;
  EntryLife life_ = EntryLife::kFilling;
  int loads_ = 0;
  int64_t uses_left_ = kUncounted;
  int64_t run_id_ = -1;
  int64_t pass_ = 0;  // the stream_pass of the store (a layer stack's entries), else 0
  int pass_dir_ = 0;  // that pass's layer order (stream_dir): +1 up, -1 down, 0 not given
  // Host copy (the cache for the nvme tier, the host-tier arena for the host tier).
  Arena host_arena_ = Arena::kNone;
  uint64_t host_off_ = 0;
  char* host_ptr_ = nullptr;
  HostCopy host_ = HostCopy::kNone;
  // File copy.
  bool has_slot_ = false;  // file_off_ is a slot the entry holds (flag: see below)
  uint64_t file_off_ = 0;  // logical (striped) offset
  WState w_ = WState::kNone;
  int w_pending_ = 0;
  // Read into the host buffer (demand or read-ahead): pieces left, its outcome.
  int r_pending_ = 0;
  Status r_status_;
  int pins_ = 0;            // loads copying out of the host buffer
  int loading_ = 0;         // loads in progress (LoadingScope)
  bool kept_full_ = false;  // on_full=keep: held in the host tier because the files were full
  // verify: crc32c of the nbytes, set before (or by the last piece of) the write.
  bool crc_set_ = false;  // flag: see below
  uint32_t crc_ = 0;
  std::atomic<int> w_io_left_{0}, r_io_left_{0};  // pieces whose syscalls are not done
  Status error_;
  DeviceEntry* dev_ = nullptr;  // owned by the device module
  // Three flags stay flags, each independent of the two state machines above and of the
  // write's state (w_): has_slot_ (the file slot is held: taken by BeginStore, given back by a
  // failed write or by the free, whatever the lifecycle; a host-tier entry never has one),
  // kept_full_ (how BeginStore placed it, fixed after; only informative) and crc_set_ (crc_ is
  // known: data, set by whoever computes the checksum, the last write piece on an I/O thread).
};
using EntryPtr = std::shared_ptr<Entry>;

}  // namespace ssdtrain
