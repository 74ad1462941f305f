// One stored tensor (Entry) and the vocabulary of its state: its tier, the arena of its host
// copy, the state of its write. Internal to the engine (engine.h); the device module reads an
// entry through the accessors and changes it through the few transitions they list.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "status.h"

namespace ssdtrain {

enum class WState { kNone, kQueued, kRunning, kDone, kCancelled, kFailed };

// Where a store keeps its bytes. The values are those of the handlers' "tier" attribute (the
// Python side's tier codes): keep them.
enum class Tier : int32_t {
  kNvme = 0,          // the store files, through the host cache
  kHost = 1,          // the host tier (pinned host memory only)
  kHostThenNvme = 2,  // the host tier while it has room, else the store files (a spill)
};
// The tier a handler's attribute names; BeginStore rejects a value that names none.
inline Tier TierFromAttr(int32_t value) { return static_cast<Tier>(value); }

// The host arena holding an entry's host copy.
enum class Arena {
  kNone,      // no host copy
  kCache,     // the host cache (nvme tier: write-behind, forwarding, read-back)
  kHostTier,  // the host tier
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
  static constexpr int64_t kUncounted = -1, kManual = -2;

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
  char* host_ptr() const { return host_ptr_; }  // the host buffer; nullptr: none
  bool host_valid() const { return host_valid_; }
  bool filling() const { return filling_; }  // the store is still copying bytes in
  bool reading() const { return reading_; }  // a read into the host buffer is running
  bool loaded() const { return loads_ > 0; }
  bool pinned() const { return pins_ > 0; }  // a load is copying out of the host buffer
  // No load will take it any more (its counted loads are all issued, or it was released).
  bool no_loads_left() const { return released_ || uses_left_ == 0; }
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

  uint32_t id_ = 0;
  int64_t site_ = 0;
  int device_ = 0;  // only that device may load it
  Tier tier_ = Tier::kNvme;
  uint64_t nbytes_ = 0, padded_ = 0, seq_ = 0;
  std::string name_;
  bool filling_ = true;
  bool released_ = false;
  bool retired_ = false;  // a background sweep found it dead: released when its room is needed
  bool freed_ = false;
  int loads_ = 0;
  int64_t uses_left_ = kUncounted;
  int64_t run_id_ = -1;
  // Host copy (the cache for the nvme tier, the host-tier arena for the host tier).
  Arena host_arena_ = Arena::kNone;
  uint64_t host_off_ = 0;
  char* host_ptr_ = nullptr;
  bool host_valid_ = false;       // the host buffer holds the bytes (device: after host_ready)
  bool host_from_store_ = false;  // the host copy is the store's (forwarding) not a read-back
  // File copy.
  bool has_slot_ = false;
  uint64_t file_off_ = 0;  // logical (striped) offset
  WState w_ = WState::kNone;
  int w_pending_ = 0;
  // Read into the host buffer (demand or read-ahead).
  bool reading_ = false;
  // The host copy was read from the file and no load has taken it yet. Such a copy is never
  // evicted (that would read the same bytes twice); a load consumes it (Engine::ConsumeRead).
  bool unconsumed_read_ = false;
  int r_pending_ = 0;
  Status r_status_;
  int pins_ = 0;            // loads copying out of the host buffer
  int loading_ = 0;         // loads in progress (LoadingScope)
  bool kept_full_ = false;  // on_full=keep: held in the host tier because the files were full
  // verify: crc32c of the nbytes, set before (or by the last piece of) the write.
  bool crc_set_ = false;
  uint32_t crc_ = 0;
  std::atomic<int> w_io_left_{0}, r_io_left_{0};  // pieces whose syscalls are not done
  Status error_;
  DeviceEntry* dev_ = nullptr;  // owned by the device module
};
using EntryPtr = std::shared_ptr<Entry>;

}  // namespace ssdtrain
