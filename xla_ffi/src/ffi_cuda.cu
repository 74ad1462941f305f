// CUDA FFI handlers and the device side of the engine (staging arena, copy
// stream, events). Stream-ordered correctness first:
//   store: D2D x -> staging on the compute stream (E1), handle written on the
//          compute stream, D2H staging -> pinned host on the copy stream after
//          E1 (E2), I/O threads wait E2 and write the file. Host-tier copies
//          (with forwarding) are lazy: the newest stores stay in staging
//          without a host copy (up to the staging arena less room for two of
//          the largest tensors); the D2H of the oldest is issued as new
//          stores push past that, or when its staging range must be reused.
//          The first loads of the backward pass take the newest stores, so
//          their bytes never cross the PCIe link in either direction.
//   load:  the handle is predicted on the host (newest unloaded entry of the
//          site in this XLA execution), the copy is enqueued, and a kernel
//          after it compares the handle on the device with the prediction: on
//          a mismatch it fills the output with 0xFF bytes (NaN in every float
//          type) and records it in mapped host memory, which the next load
//          reports as an error; the execution's last load syncs and reports it
//          itself, so a mismatch fails the step that made it. Without a
//          prediction (or with exact_loads) the handle is read first (a sync).
//          Copy: D2D from staging (forwarded / prefetched), else H2D from
//          pinned host (after E2), else file -> pinned -> H2D.
//   staging reuse: a freed staging range keeps the events of its last users
//          (copy in, D2H out, loads out); whichever stream allocates an
//          overlapping range next waits on them. No host thread blocks on a
//          staging range, so ranges whose copies are still queued can be
//          evicted and stores never stall the host.
//   read-ahead (host -> staging of the next predicted loads): never evicts a
//          read-ahead copy no load has used (it stops instead); a store takes
//          one only when nothing else frees room, which costs that load a
//          host-to-device copy, never a disk read: the host copy of a read
//          stays until its load (Entry::unconsumed_read).
// No CUDA call is made at load time or from CPU handlers: the module is
// created on the first CUDA handler call.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <unordered_map>

#include "ffi_common.h"
#include "ssdtrain/cuda_check.h"
#include "ssdtrain/detail/copy_tracker.h"

namespace ffi = xla::ffi;

namespace ssdtrain {

// The device module's part of an entry.
struct DeviceEntry {
  int device = -1;
  // Copy in the device staging arena.
  bool staged = false;
  bool stage_from_store = false;
  bool stage_unused = false;  // a read-ahead copy no load has used yet
  bool d2h_deferred = false;  // a store's staging copy whose D2H is not issued yet (lazy host copy)
  uint64_t stage_off = 0, stage_len = 0;
  char* stage_ptr = nullptr;
  cudaEvent_t stage_ready = nullptr;      // the staging copy is complete after this
  cudaEvent_t stage_d2h = nullptr;        // the D2H read of the staging copy is done
  std::vector<cudaEvent_t> stage_fences;  // async users of the staging region
  // Host copy.
  cudaEvent_t host_ready = nullptr;      // D2H into the host buffer done (E2)
  std::vector<cudaEvent_t> host_fences;  // async H2D readers of the host buffer
};

namespace {

using Lock = Engine::Lock;
using Clock = Engine::Clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

__global__ void WriteHandleKernel(uint32_t* h, uint32_t a, uint32_t b) {
  h[0] = a;
  h[1] = b;
}

// A predicted load's check, in mapped host memory (one slot per execution id
// modulo kMismatchSlots). Written by the device only on a mismatch.
struct MismatchSlot {
  unsigned long long run_id;
  unsigned int count;
  unsigned int predicted, actual, actual_check;
};
constexpr int kMismatchSlots = 64;

__global__ void VerifyHandleKernel(const uint32_t* handle, uint32_t want0, uint32_t want1,
                                   unsigned char* out, uint64_t nbytes, MismatchSlot* slot,
                                   unsigned long long run_id) {
  const uint32_t a = handle[0], b = handle[1];
  if (a == want0 && b == want1) return;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nbytes;
       i += stride)
    out[i] = 0xFF;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    volatile MismatchSlot* s = slot;
    s->run_id = run_id;
    s->predicted = want0;
    s->actual = a;
    s->actual_check = b;
    __threadfence_system();
    s->count = s->count + 1;
    __threadfence_system();
  }
}

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
  // lazily), their staged bytes, and the largest tensor staged so far.
  std::deque<EntryPtr> deferred;
  uint64_t deferred_bytes = 0, largest = 0;
  // Freed staging ranges whose last users may still run on some stream.
  struct PendingFree {
    uint64_t off = 0, len = 0;
    std::vector<cudaEvent_t> events;
  };
  std::vector<PendingFree> pending;
};

DeviceEntry* D(Entry& e) { return e.device_entry(); }

class CudaModule final : public DeviceHooks {
 public:
  explicit CudaModule(Engine* eng) : eng_(eng) {}

  ~CudaModule() override {
    for (Deferred& r : deferred_) {
      cudaEventSynchronize(r.done);
      cudaEventDestroy(r.done);
    }
    deferred_.clear();
    for (auto& [id, ds] : devices_) {
      int prev = -1;
      cudaGetDevice(&prev);
      cudaSetDevice(ds->device);
      if (ds->copy) cudaStreamSynchronize(ds->copy);
      if (ds->h2d) cudaStreamSynchronize(ds->h2d);
      for (cudaEvent_t ev : ds->free_events) cudaEventDestroy(ev);
      for (auto& pf : ds->pending)
        for (cudaEvent_t ev : pf.events) cudaEventDestroy(ev);
      if (ds->staging) cudaFree(ds->staging);
      if (ds->copy) cudaStreamDestroy(ds->copy);
      if (ds->h2d) cudaStreamDestroy(ds->h2d);
      if (prev >= 0) cudaSetDevice(prev);
    }
    for (void* p : registered_) cudaHostUnregister(p);
    if (mismatch_) cudaFreeHost(mismatch_);
    cudaGetLastError();
  }

  // Lock held. Mapped host slots the verify kernel writes on a mismatch (allocated once;
  // portable and mapped: one device address for every GPU).
  Status MismatchSlots(MismatchSlot** dev_ptr) {
    if (!mismatch_) {
      void* p = nullptr;
      SSD_CHECK_CUDA(cudaHostAlloc(&p, kMismatchSlots * sizeof(MismatchSlot),
                                   cudaHostAllocMapped | cudaHostAllocPortable));
      memset(p, 0, kMismatchSlots * sizeof(MismatchSlot));
      void* d = nullptr;
      cudaError_t err = cudaHostGetDevicePointer(&d, p, 0);
      if (err != cudaSuccess) cudaFreeHost(p);
      SSD_CHECK_CUDA(err);
      mismatch_ = static_cast<MismatchSlot*>(p);
      mismatch_dev_ = static_cast<MismatchSlot*>(d);
    }
    *dev_ptr = mismatch_dev_;
    return Status::Ok();
  }

  // Lock held. An error for every predicted load found wrong since the last call.
  Status TakeMismatch() {
    if (!mismatch_) return Status::Ok();
    for (int i = 0; i < kMismatchSlots; ++i) {
      volatile MismatchSlot* s = &mismatch_[i];
      unsigned int count = s->count;
      if (count == reported_[i]) continue;
      std::atomic_thread_fence(std::memory_order_acquire);
      const unsigned int n = count - reported_[i];
      reported_[i] = count;
      eng_->CountHandleMismatches(n);
      return Status(EIO, "a predicted load got the handle {" + std::to_string(s->actual) + ", " +
                             std::to_string(s->actual_check) + "} instead of entry " +
                             std::to_string(s->predicted) + " (XLA execution " +
                             std::to_string(s->run_id) +
                             "): this program loads a tag out of store order; its output was "
                             "filled with NaN and this step failed. Configure exact_loads=True "
                             "(SSDTRAIN_EXACT_LOADS=1) for such programs");
    }
    return Status::Ok();
  }

  // Lock held.
  Status Device(int dev, DeviceState** out) {
    auto it = devices_.find(dev);
    if (it != devices_.end()) {
      *out = it->second.get();
      return Status::Ok();
    }
    auto ds = std::make_unique<DeviceState>();
    ds->device = dev;
    SSD_CHECK_CUDA(cudaStreamCreateWithFlags(&ds->copy, cudaStreamNonBlocking));
    SSD_CHECK_CUDA(cudaStreamCreateWithFlags(&ds->h2d, cudaStreamNonBlocking));
    uint64_t want = RoundUp(eng_->config().staging_bytes, 256);
    if (want) {
      cudaError_t err = cudaMalloc(&ds->staging, want);
      if (err != cudaSuccess) {
        cudaGetLastError();
        fprintf(stderr,
                "ssdtrain: cannot allocate %llu bytes of device staging on GPU %d (%s); "
                "stores go through the slow unstaged path\n",
                static_cast<unsigned long long>(want), dev, cudaGetErrorString(err));
        ds->staging = nullptr;
        want = 0;
      }
    }
    ds->staging_size = want;
    ds->alloc.Reset(want, 256);
    if (!host_registered_) {
      host_registered_ = true;
      for (Arena which : {Arena::kCache, Arena::kHostTier}) {
        const HostArena* a = &eng_->arena(which);
        if (!a->base || !a->size) continue;
        cudaError_t err = cudaHostRegister(a->base, a->size, cudaHostRegisterPortable);
        if (err != cudaSuccess) {
          cudaGetLastError();
          fprintf(stderr,
                  "ssdtrain: cudaHostRegister of %llu bytes failed (%s); host copies use "
                  "pageable memory (slower, still correct)\n",
                  static_cast<unsigned long long>(a->size), cudaGetErrorString(err));
        } else {
          registered_.push_back(a->base);
        }
      }
    }
    *out = ds.get();
    devices_[dev] = std::move(ds);
    return Status::Ok();
  }

  Status NewEvent(DeviceState* ds, cudaEvent_t* ev) {
    if (!ds->free_events.empty()) {
      *ev = ds->free_events.back();
      ds->free_events.pop_back();
      return Status::Ok();
    }
    SSD_CHECK_CUDA(cudaEventCreateWithFlags(ev, cudaEventDisableTiming));
    return Status::Ok();
  }

  void PutEvent(int dev, cudaEvent_t ev) {
    if (!ev) return;
    auto it = devices_.find(dev);
    if (it == devices_.end()) {
      cudaEventDestroy(ev);
      return;
    }
    it->second->free_events.push_back(ev);
  }

  // Records a fresh event on `stream` and appends it to `fences`, recycling
  // completed ones.
  Status AddFence(DeviceState* ds, std::vector<cudaEvent_t>* fences, cudaStream_t stream) {
    for (size_t i = 0; i < fences->size();) {
      if (cudaEventQuery((*fences)[i]) == cudaSuccess) {
        ds->free_events.push_back((*fences)[i]);
        (*fences)[i] = fences->back();
        fences->pop_back();
      } else {
        cudaGetLastError();
        ++i;
      }
    }
    cudaEvent_t ev;
    SSD_RETURN_IF_ERROR(NewEvent(ds, &ev));
    cudaError_t err = cudaEventRecord(ev, stream);
    if (err != cudaSuccess) {
      ds->free_events.push_back(ev);
      SSD_CHECK_CUDA(err);
    }
    fences->push_back(ev);
    return Status::Ok();
  }

  void SyncAndRecycle(int dev, std::vector<cudaEvent_t>* fences) {
    for (cudaEvent_t ev : *fences) {
      cudaEventSynchronize(ev);
      PutEvent(dev, ev);
    }
    fences->clear();
    cudaGetLastError();
  }

  static bool Done(cudaEvent_t ev) {
    if (!ev) return true;
    cudaError_t e = cudaEventQuery(ev);
    if (e != cudaSuccess) cudaGetLastError();
    return e == cudaSuccess;
  }

  // No copy into, out of, or D2H from the staging range of `d` is pending.
  static bool Idle(DeviceEntry* d) {
    if (!Done(d->stage_ready) || !Done(d->stage_d2h)) return false;
    for (cudaEvent_t ev : d->stage_fences)
      if (!Done(ev)) return false;
    return true;
  }

  // Lock held. Frees the staging copy of `e` without waiting: the range's
  // last users' events go to the pending list (see AllocStaging).
  void FreeStaging(Entry& e) {
    DeviceEntry* d = D(e);
    if (!d || !d->staged) return;
    DeviceState::PendingFree pf;
    pf.off = d->stage_off;
    pf.len = d->stage_len;
    for (cudaEvent_t ev : {d->stage_ready, d->stage_d2h})
      if (ev) pf.events.push_back(ev);
    pf.events.insert(pf.events.end(), d->stage_fences.begin(), d->stage_fences.end());
    d->stage_ready = d->stage_d2h = nullptr;
    d->stage_fences.clear();
    auto it = devices_.find(d->device);
    if (it != devices_.end()) {
      DeviceState* ds = it->second.get();
      ds->alloc.Free(d->stage_off, d->stage_len);
      ds->staged.erase(&e);
      eng_->StagingFreed(d->stage_len);
      if (!pf.events.empty()) ds->pending.push_back(std::move(pf));
    } else {
      for (cudaEvent_t ev : pf.events) {
        cudaEventSynchronize(ev);
        cudaEventDestroy(ev);
      }
      cudaGetLastError();
    }
    d->staged = false;
    d->stage_unused = false;
    d->stage_ptr = nullptr;
  }

  // Lock held. Drops pending ranges whose users all finished.
  void CollectPending(DeviceState* ds) {
    for (size_t i = 0; i < ds->pending.size();) {
      auto& pf = ds->pending[i];
      bool done = true;
      for (cudaEvent_t ev : pf.events) done = done && Done(ev);
      if (!done) {
        ++i;
        continue;
      }
      ds->free_events.insert(ds->free_events.end(), pf.events.begin(), pf.events.end());
      pf = std::move(ds->pending.back());
      ds->pending.pop_back();
    }
  }

  // Lock held. Orders `stream` after every pending user of [off, off + len); `*waits` counts
  // the events it had to wait for.
  Status OrderAfterPending(DeviceState* ds, uint64_t off, uint64_t len, cudaStream_t stream,
                           int* waits) {
    for (const auto& pf : ds->pending) {
      if (pf.off >= off + len || off >= pf.off + pf.len) continue;
      for (cudaEvent_t ev : pf.events) {
        if (Done(ev)) continue;
        SSD_CHECK_CUDA(cudaStreamWaitEvent(stream, ev, 0));
        eng_->CountStagingWait();
        ++*waits;
      }
    }
    return Status::Ok();
  }

  // Lock held. Reserves staging for `e`, to be written on `stream`. Evicts
  // copies, loaded entries first, then the oldest; idle ones before busy
  // ones (a busy one's users are waited for on `stream`, not on the host);
  // then store copies whose host copy is still deferred (their D2H is issued
  // first), oldest first; unused read-ahead copies last. Read-ahead
  // (prefetch_seq != 0) evicts only entries loaded already or older, and no
  // unused read-ahead copy. `*waits`: events `stream` was made to wait for.
  Status AllocStaging(DeviceState* ds, const EntryPtr& e, cudaStream_t stream,
                      uint64_t prefetch_seq, bool* got, int* waits) {
    *got = false;
    *waits = 0;
    uint64_t len = RoundUp(e->nbytes(), 256);
    if (len > ds->staging_size) return Status::Ok();
    CollectPending(ds);
    for (;;) {
      uint64_t off;
      if (ds->alloc.Alloc(len, &off)) {
        DeviceEntry* d = D(*e);
        d->staged = true;
        d->stage_off = off;
        d->stage_len = len;
        d->stage_ptr = ds->staging + off;
        ds->staged[e.get()] = e;
        eng_->StagingAllocated(len);
        *got = true;
        return OrderAfterPending(ds, off, len, stream, waits);
      }
      Entry* best = nullptr;
      Entry* best_busy = nullptr;
      Entry* best_deferred = nullptr;
      Entry* best_unused = nullptr;
      auto better = [](Entry* a, Entry* b) {
        if (!b) return true;
        bool la = a->loaded(), lb = b->loaded();
        if (la != lb) return la;
        return a->seq() < b->seq();
      };
      for (auto& [raw, ep] : ds->staged) {
        if (raw == e.get() || raw->filling() || raw->pinned()) continue;
        if (prefetch_seq && !(raw->loaded() || raw->seq() < prefetch_seq)) continue;
        if (D(*raw)->stage_unused) {
          if (!prefetch_seq && better(raw, best_unused)) best_unused = raw;
        } else if (D(*raw)->d2h_deferred && !Dead(*raw)) {
          if (raw->seq() < (best_deferred ? best_deferred->seq() : UINT64_MAX)) best_deferred = raw;
        } else if (Idle(D(*raw))) {
          if (better(raw, best)) best = raw;
        } else if (better(raw, best_busy)) {
          best_busy = raw;
        }
      }
      Entry* victim = best            ? best
                      : best_busy     ? best_busy
                      : best_deferred ? best_deferred
                                      : best_unused;
      if (!victim) return Status::Ok();
      if (D(*victim)->d2h_deferred) {
        if (Dead(*victim)) {
          ElideD2H(ds, *victim);
        } else {
          SSD_RETURN_IF_ERROR(IssueD2H(ds, *victim));  // the range's next user waits for it
          forced_d2h_++;
        }
      }
      FreeStaging(*victim);
    }
  }

  // No load will take `e` any more (its counted loads are all issued, or it was released).
  static bool Dead(const Entry& e) { return e.no_loads_left(); }

  // Lock held. Copies the staging copy of store `e` to its host buffer on the copy stream
  // (after the copy into staging); host_ready (for the host buffer) and stage_d2h (for the
  // staging range) mark its end.
  Status IssueD2H(DeviceState* ds, Entry& e) {
    DeviceEntry* d = D(e);
    if (d->d2h_deferred) {
      d->d2h_deferred = false;
      ds->deferred_bytes -= d->stage_len;
    }
    if (d->stage_ready) SSD_CHECK_CUDA(cudaStreamWaitEvent(ds->copy, d->stage_ready, 0));
    SSD_RETURN_IF_ERROR(Tracked(ds->device, ds->copy, CopyOp::kD2H, e.nbytes(), e.name(), [&] {
      SSD_CHECK_CUDA(cudaMemcpyAsync(e.host_ptr(), d->stage_ptr, e.nbytes(), cudaMemcpyDeviceToHost,
                                     ds->copy));
      return Status::Ok();
    }));
    cudaEvent_t e2, e3;
    SSD_RETURN_IF_ERROR(NewEvent(ds, &e2));
    d->host_ready = e2;
    SSD_CHECK_CUDA(cudaEventRecord(e2, ds->copy));
    // The same point again, owned by the staging range (host_ready stays with the host copy).
    SSD_RETURN_IF_ERROR(NewEvent(ds, &e3));
    d->stage_d2h = e3;
    SSD_CHECK_CUDA(cudaEventRecord(e3, ds->copy));
    return Status::Ok();
  }

  // Lock held. The deferred host copy of `e` will never be needed: no load is left.
  void ElideD2H(DeviceState* ds, Entry& e) {
    DeviceEntry* d = D(e);
    d->d2h_deferred = false;
    ds->deferred_bytes -= d->stage_len;
    elided_bytes_ += e.nbytes();
    elided_tensors_++;
  }

  // Lock held. Store `e` (host tier, staged) keeps its bytes in staging only; the D2H of the
  // oldest deferred copies is issued while more than the arena less room for two of the
  // largest tensors is deferred (so that a new store finds room among copies already on
  // their way to the host, and the copy stream has work while the forward pass runs).
  Status DeferD2H(DeviceState* ds, const EntryPtr& e) {
    DeviceEntry* d = D(*e);
    d->d2h_deferred = true;
    ds->deferred_bytes += d->stage_len;
    ds->deferred.push_back(e);
    const uint64_t reserve = 2 * ds->largest;
    const uint64_t keep = ds->staging_size > reserve ? ds->staging_size - reserve : 0;
    auto stale = [](const EntryPtr& x) { return !x->device_entry() || !D(*x)->d2h_deferred; };
    while (!ds->deferred.empty() && (stale(ds->deferred.front()) || ds->deferred_bytes > keep)) {
      EntryPtr oldest = std::move(ds->deferred.front());
      ds->deferred.pop_front();
      if (stale(oldest)) continue;
      if (Dead(*oldest)) {
        ElideD2H(ds, *oldest);
        continue;
      }
      SSD_RETURN_IF_ERROR(IssueD2H(ds, *oldest));
    }
    // Entries that left the deferred state behind a live one are dropped now and then.
    if (ds->deferred.size() > 64 && ds->deferred.size() > 4 * ds->staged.size())
      ds->deferred.erase(std::remove_if(ds->deferred.begin(), ds->deferred.end(), stale),
                         ds->deferred.end());
    return Status::Ok();
  }

  // Lock held. Issues `copy()` (a Status-returning lambda that enqueues work on `stream`)
  // inside a timing bracket of the copy tracker.
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

  // Lock held. Makes `stream` wait for `ev` (unless already complete), inside a kComputeWait
  // bracket when `stream` is the compute stream of a load.
  Status WaitTracked(int dev, cudaStream_t stream, cudaEvent_t ev, std::string_view name) {
    if (!ev || Done(ev)) return Status::Ok();
    return Tracked(dev, stream, CopyOp::kComputeWait, 0, name, [&] {
      SSD_CHECK_CUDA(cudaStreamWaitEvent(stream, ev, 0));
      return Status::Ok();
    });
  }

  CopyTracker& tracker() { return tracker_; }
  std::map<int, std::unique_ptr<DeviceState>>& devices() { return devices_; }

  // ---- DeviceHooks --------------------------------------------------------
  Status WaitHostReady(Entry& e) override {
    DeviceEntry* d = D(e);
    if (d && d->d2h_deferred)  // only a load on the storing GPU can take a deferred copy
      return Status(EINVAL, "the bytes of " + DescribeTag(e.name(), e.site(), e.id()) +
                                " are in the device staging of GPU " + std::to_string(d->device) +
                                " (no host copy yet): load it there");
    if (d && d->host_ready) SSD_CHECK_CUDA(cudaEventSynchronize(d->host_ready));
    return Status::Ok();
  }

  void BeforeHostFree(Entry& e) override {
    DeviceEntry* d = D(e);
    if (!d) return;
    if (d->host_ready) {
      cudaEventSynchronize(d->host_ready);
      PutEvent(d->device, d->host_ready);
      d->host_ready = nullptr;
    }
    SyncAndRecycle(d->device, &d->host_fences);
  }

  bool HasDeviceCopy(const Entry& e) override {
    const DeviceEntry* d = e.device_entry();
    return d && d->staged && StagingUsable(e, *d);
  }

  // A load may copy `d`'s staging range (without forwarding, an nvme tensor comes back from the
  // file, not from its store's staging copy).
  bool StagingUsable(const Entry& e, const DeviceEntry& d) const {
    return eng_->config().forwarding || e.tier() != Tier::kNvme || !d.stage_from_store;
  }

  void OnEntryFree(Entry& e) override {
    DeviceEntry* d = D(e);
    if (!d) return;
    if (d->d2h_deferred) {
      auto it = devices_.find(d->device);
      if (it != devices_.end()) ElideD2H(it->second.get(), e);
      d->d2h_deferred = false;
    }
    FreeStaging(e);
    BeforeHostFree(e);
    delete d;
    e.set_device_entry(nullptr);
  }

  // Lock held. The release of `e` waits for its last load's copy on `stream`: no host thread
  // blocks on it (ReclaimReleases collects it once done).
  Status DeferRelease(DeviceState* ds, const EntryPtr& e, cudaStream_t stream) {
    cudaEvent_t ev;
    SSD_RETURN_IF_ERROR(NewEvent(ds, &ev));
    cudaError_t err = cudaEventRecord(ev, stream);
    if (err != cudaSuccess) {
      ds->free_events.push_back(ev);
      SSD_CHECK_CUDA(err);
    }
    deferred_.push_back(Deferred{e, ev, ds->device});
    return Status::Ok();
  }

  void ReclaimReleases(bool wait) override {
    for (size_t i = 0; i < deferred_.size();) {
      Deferred& r = deferred_[i];
      if (!wait && !Done(r.done)) {
        ++i;
        continue;
      }
      if (wait) cudaEventSynchronize(r.done);
      cudaGetLastError();
      EntryPtr e = std::move(r.e);
      PutEvent(r.device, r.done);
      r = std::move(deferred_.back());
      deferred_.pop_back();
      eng_->ReleaseLocked(e);
    }
  }

  void AppendStats(std::ostream& o) override {
    tracker_.Append(o);
    uint64_t deferred = 0;
    for (const auto& [dev, ds] : devices_) deferred += ds->deferred_bytes;
    o << "d2h_elided_bytes=" << elided_bytes_ << '\n'
      << "d2h_elided_tensors=" << elided_tensors_ << '\n'
      << "d2h_forced=" << forced_d2h_ << '\n'
      << "d2h_deferred_bytes=" << deferred << '\n';
  }

  void ResetStats() override {
    tracker_.Reset();
    elided_bytes_ = elided_tensors_ = forced_d2h_ = 0;
  }

  std::string TakeTimeline() override { return tracker_.TakeTimeline(); }

  // Lock held: copies the next predicted entries that sit in host memory
  // into device staging on the h2d stream.
  Status StagePrefetch(DeviceState* ds) {
    const uint64_t budget = std::min<uint64_t>(eng_->config().prefetch_bytes, ds->staging_size);
    if (!budget) return Status::Ok();
    // Only this device's entries: staging, streams and events belong to one device.
    for (const EntryPtr& e : eng_->PredictNext(budget, ds->device)) {
      if (e->filling() || e->reading() || !e->host_ptr() || !e->host_valid() || e->nbytes() == 0)
        continue;
      DeviceEntry* d = D(*e);
      if (!d) {
        d = new DeviceEntry();
        d->device = ds->device;
        e->set_device_entry(d);
      }
      if (d->staged) continue;
      bool got = false;
      int waits = 0;
      SSD_RETURN_IF_ERROR(AllocStaging(ds, e, ds->h2d, e->seq(), &got, &waits));
      if (!got) break;
      d->stage_from_store = false;
      d->stage_unused = true;
      Status s = [&]() -> Status {
        if (d->host_ready) SSD_CHECK_CUDA(cudaStreamWaitEvent(ds->h2d, d->host_ready, 0));
        SSD_RETURN_IF_ERROR(
            Tracked(ds->device, ds->h2d, CopyOp::kReadAhead, e->nbytes(), e->name(), [&] {
              SSD_CHECK_CUDA(cudaMemcpyAsync(d->stage_ptr, e->host_ptr(), e->nbytes(),
                                             cudaMemcpyHostToDevice, ds->h2d));
              return Status::Ok();
            }));
        cudaEvent_t ready;
        SSD_RETURN_IF_ERROR(NewEvent(ds, &ready));
        d->stage_ready = ready;
        SSD_CHECK_CUDA(cudaEventRecord(ready, ds->h2d));
        return AddFence(ds, &d->host_fences, ds->h2d);
      }();
      if (!s.ok()) {
        FreeStaging(*e);
        return s.With("read-ahead of tag '" + e->name() + "'");
      }
      staged_prefetches_++;
    }
    return Status::Ok();
  }

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
  MismatchSlot* mismatch_ = nullptr;
  MismatchSlot* mismatch_dev_ = nullptr;
  unsigned int reported_[kMismatchSlots] = {};
  CopyTracker tracker_;
  // Lazy host copies: never made (the entry died in staging), and forced by a staging reuse.
  uint64_t elided_bytes_ = 0, elided_tensors_ = 0, forced_d2h_ = 0;
};

// Lock held.
CudaModule* Module(Engine& eng) {
  if (!eng.hooks()) eng.SetHooks(std::make_unique<CudaModule>(&eng));
  return static_cast<CudaModule*>(eng.hooks());
}

Status LaunchWriteHandle(cudaStream_t stream, uint32_t* dst, const uint32_t h[2]) {
  WriteHandleKernel<<<1, 1, 0, stream>>>(dst, h[0], h[1]);
  SSD_CHECK_CUDA(cudaGetLastError());
  return Status::Ok();
}

// The calling thread's current device is made `dev` (XLA's device ordinal of the call): the
// staging, streams and events created below belong to it.
Status UseDevice(int dev) {
  int cur = -1;
  SSD_CHECK_CUDA(cudaGetDevice(&cur));
  if (cur != dev) SSD_CHECK_CUDA(cudaSetDevice(dev));
  return Status::Ok();
}

Status StoreCuda(int32_t dev, cudaStream_t stream, int64_t run_id, ffi::AnyBuffer x,
                 ffi::Result<ffi::Buffer<ffi::U32>> handle, int64_t site, int32_t tier,
                 std::string_view name, int64_t uses) {
  SSD_RETURN_IF_ERROR(CheckHandleShape(handle->element_count(), "store", name));
  Status st;
  auto eng = CurrentEngine(&st);
  if (!eng) return st;
  const uint64_t nbytes = x.size_bytes();
  const char* src = static_cast<const char*>(x.untyped_data());
  uint32_t* hdst = handle->typed_data();
  SSD_RETURN_IF_ERROR(UseDevice(dev));

  if (uses == 0) {  // nobody loads it: keep nothing, hand out the null handle
    uint32_t null_handle[2];
    Engine::MakeNullHandle(null_handle);
    eng->CountUnusedStore(nbytes, dev);
    return LaunchWriteHandle(stream, hdst, null_handle);
  }
  EntryPtr e;
  SSD_RETURN_IF_ERROR(eng->BeginStore(site, TierFromAttr(tier), nbytes, name, &e, dev, uses));
  uint32_t h[2];
  eng->MakeHandle(*e, h);

  Status s = [&]() -> Status {
    Lock lk = eng->LockState();
    CudaModule* mod = Module(*eng);
    SSD_RETURN_IF_ERROR(mod->TakeMismatch());
    DeviceState* ds = nullptr;
    SSD_RETURN_IF_ERROR(mod->Device(dev, &ds));
    e->set_run_id(run_id);
    auto* d = new DeviceEntry();
    d->device = dev;
    e->set_device_entry(d);
    if (nbytes == 0) return LaunchWriteHandle(stream, hdst, h);
    if (!e->host_ptr()) {
      // Larger than the host cache (or no room): synchronous write-through.
      SSD_RETURN_IF_ERROR(LaunchWriteHandle(stream, hdst, h));
      lk.unlock();
      return Status(-1, "");  // handled below
    }
    e->ZeroHostPadding();
    CopyTracker& tracker = mod->tracker();
    bool staged = false;
    // The compute stream may have to wait for the previous users of the staging room.
    CopyTracker::Mark wait;
    SSD_RETURN_IF_ERROR(tracker.Begin(dev, stream, &wait));
    int waits = 0;
    Status a = mod->AllocStaging(ds, e, stream, 0, &staged, &waits);
    if (a.ok() && waits > 0) {
      a = tracker.End(wait, stream, CopyOp::kComputeWait, 0, name);
    } else {
      tracker.Cancel(&wait);
    }
    SSD_RETURN_IF_ERROR(a);
    if (staged) {
      d->stage_from_store = true;
      ds->largest = std::max(ds->largest, d->stage_len);
      SSD_RETURN_IF_ERROR(mod->Tracked(dev, stream, CopyOp::kStageIn, nbytes, name, [&] {
        SSD_CHECK_CUDA(
            cudaMemcpyAsync(d->stage_ptr, src, nbytes, cudaMemcpyDeviceToDevice, stream));
        return Status::Ok();
      }));
      cudaEvent_t e1;
      SSD_RETURN_IF_ERROR(mod->NewEvent(ds, &e1));
      d->stage_ready = e1;
      SSD_CHECK_CUDA(cudaEventRecord(e1, stream));
      SSD_RETURN_IF_ERROR(LaunchWriteHandle(stream, hdst, h));
      // Host-tier copies are lazy (forwarding): the first loads of the backward pass take the
      // newest stores from staging, so their bytes need not cross the link at all.
      if (e->tier() == Tier::kHost && eng->config().forwarding) return mod->DeferD2H(ds, e);
      return mod->IssueD2H(ds, *e);
    }
    // No staging room (or bigger than the arena): D2H on the compute stream, waited for.
    CopyTracker::Mark m;
    SSD_RETURN_IF_ERROR(tracker.Begin(dev, stream, &m));
    lk.unlock();
    auto t0 = Clock::now();
    Status c = [&]() -> Status {
      SSD_CHECK_CUDA(cudaMemcpyAsync(e->host_ptr(), src, nbytes, cudaMemcpyDeviceToHost, stream));
      SSD_RETURN_IF_ERROR(LaunchWriteHandle(stream, hdst, h));
      SSD_CHECK_CUDA(cudaStreamSynchronize(stream));
      return Status::Ok();
    }();
    lk.lock();
    if (!c.ok()) {
      tracker.Cancel(&m);
      return c;
    }
    eng->AddStall(Since(t0));
    return tracker.End(m, stream, CopyOp::kD2H, nbytes, name);
  }();
  if (s.code() == -1) {
    return eng->WriteThrough(e, [&](void* dst, uint64_t off, uint64_t len) -> Status {
      SSD_CHECK_CUDA(cudaMemcpyAsync(dst, src + off, len, cudaMemcpyDeviceToHost, stream));
      SSD_CHECK_CUDA(cudaStreamSynchronize(stream));
      return Status::Ok();
    });
  }
  if (!s.ok()) {
    eng->AbortStore(e);
    return s.With("store of tag '" + std::string(name) + "'");
  }
  return eng->CommitStore(e);
}

thread_local uint32_t* t_handle_host = nullptr;

Status LoadCuda(int32_t dev, cudaStream_t stream, int64_t run_id, ffi::Buffer<ffi::U32> handle,
                ffi::Result<ffi::AnyBuffer> out, int64_t site, int32_t tier,
                std::string_view name) {
  SSD_RETURN_IF_ERROR(CheckHandleShape(handle.element_count(), "load", name));
  Status st;
  auto eng = CurrentEngine(&st);
  if (!eng) return st;
  const uint64_t nbytes = out->size_bytes();
  char* dst = static_cast<char*>(out->untyped_data());
  SSD_RETURN_IF_ERROR(UseDevice(dev));

  // Predict the handle (verified on the device below), else read it (a sync).
  uint32_t h[2];
  uint64_t left = 0;
  bool predicted = false;
  {
    Lock lk = eng->LockState();
    CudaModule* mod = Module(*eng);
    SSD_RETURN_IF_ERROR(mod->TakeMismatch());
    mod->ReclaimReleases(false);
    predicted = !eng->config().exact_loads && eng->PredictLoad(site, run_id, dev, nbytes, h, &left);
  }
  double sync_s = 0;
  if (!predicted) {
    if (!t_handle_host) {
      void* p = nullptr;
      SSD_CHECK_CUDA(cudaHostAlloc(&p, 64, cudaHostAllocPortable));
      t_handle_host = static_cast<uint32_t*>(p);
    }
    auto t0 = Clock::now();
    SSD_CHECK_CUDA(cudaMemcpyAsync(t_handle_host, handle.typed_data(), 2 * sizeof(uint32_t),
                                   cudaMemcpyDeviceToHost, stream));
    SSD_CHECK_CUDA(cudaStreamSynchronize(stream));
    h[0] = t_handle_host[0];
    h[1] = t_handle_host[1];
    sync_s = Since(t0);
  }

  Lock lk = eng->LockState();
  eng->AddHandleSync(sync_s);
  SSD_RETURN_IF_ERROR(eng->TakePendingError());
  EntryPtr e;
  SSD_RETURN_IF_ERROR(eng->LookupForLoad(lk, h, nbytes, site, name, &e, dev));
  // A concurrent store at this site must not release the entry while it is being loaded
  // (the lock is dropped around the bounce copy below); the guard ends under the lock.
  Entry::LoadingScope loading(*e);
  CudaModule* mod = Module(*eng);
  DeviceState* ds = nullptr;
  SSD_RETURN_IF_ERROR(mod->Device(dev, &ds));
  if (nbytes == 0) {
    eng->CountLoad(e);  // no copy to wait for
    return Status::Ok();
  }
  DeviceEntry* d = D(*e);
  if (!d) {
    d = new DeviceEntry();
    d->device = dev;
    e->set_device_entry(d);
  }
  if (d->staged && mod->StagingUsable(*e, *d) && d->device == dev && !e->filling() &&
      e->error().ok()) {
    // Forwarded from the store, or prefetched into staging (then the read-ahead's H2D may still
    // run: a wait of the compute stream).
    if (d->stage_from_store) {
      if (d->stage_ready) SSD_CHECK_CUDA(cudaStreamWaitEvent(stream, d->stage_ready, 0));
    } else {
      SSD_RETURN_IF_ERROR(mod->WaitTracked(dev, stream, d->stage_ready, name));
    }
    SSD_RETURN_IF_ERROR(mod->Tracked(dev, stream, CopyOp::kLoadStaged, nbytes, name, [&] {
      SSD_CHECK_CUDA(cudaMemcpyAsync(dst, d->stage_ptr, nbytes, cudaMemcpyDeviceToDevice, stream));
      return Status::Ok();
    }));
    SSD_RETURN_IF_ERROR(mod->AddFence(ds, &d->stage_fences, stream));
    eng->CountStagedLoad(*e, d->stage_from_store);
    if (!d->stage_from_store) eng->ConsumeRead(*e);  // the staging copy of a read-back host copy
    d->stage_unused = false;
  } else {
    // A deferred copy is staged, so it is served above; should it ever get here, its host copy
    // is made first (stream-ordered before the H2D below through host_ready).
    if (d->d2h_deferred) {
      auto it = mod->devices().find(d->device);
      if (it == mod->devices().end())
        return Status(EIO, "load of " + DescribeTag(e->name(), e->site(), e->id()) +
                               ": its deferred copy's GPU is gone");
      SSD_RETURN_IF_ERROR(mod->IssueD2H(it->second.get(), *e));
    }
    Engine::HostRef ref;
    Status s = eng->AcquireHost(lk, e, &ref);
    if (s.ok() && ref.bounce) {
      CopyTracker::Mark m;
      s = mod->tracker().Begin(dev, stream, &m);
      if (s.ok()) {
        lk.unlock();
        s = [&]() -> Status {
          SSD_CHECK_CUDA(cudaMemcpyAsync(dst, ref.ptr, nbytes, cudaMemcpyHostToDevice, stream));
          SSD_CHECK_CUDA(cudaStreamSynchronize(stream));
          return Status::Ok();
        }();
        lk.lock();
        if (s.ok()) {
          s = mod->tracker().End(m, stream, CopyOp::kLoadHost, nbytes, name);
        } else {
          mod->tracker().Cancel(&m);
        }
      }
    } else if (s.ok()) {
      s = [&]() -> Status {
        SSD_RETURN_IF_ERROR(mod->WaitTracked(dev, stream, d->host_ready, name));
        SSD_RETURN_IF_ERROR(mod->Tracked(dev, stream, CopyOp::kLoadHost, nbytes, name, [&] {
          SSD_CHECK_CUDA(cudaMemcpyAsync(dst, ref.ptr, nbytes, cudaMemcpyHostToDevice, stream));
          return Status::Ok();
        }));
        return mod->AddFence(ds, &d->host_fences, stream);
      }();
    }
    eng->ReleaseHost(lk, &ref);
    SSD_RETURN_IF_ERROR(s);
  }
  if (predicted) {
    eng->CountSpeculativeLoad();
    MismatchSlot* slots = nullptr;
    SSD_RETURN_IF_ERROR(mod->MismatchSlots(&slots));
    VerifyHandleKernel<<<256, 256, 0, stream>>>(
        handle.typed_data(), h[0], h[1], reinterpret_cast<unsigned char*>(dst), nbytes,
        slots + (static_cast<uint64_t>(run_id) % kMismatchSlots),
        static_cast<unsigned long long>(run_id));
    SSD_CHECK_CUDA(cudaGetLastError());
  }
  if (eng->CountLoad(e, /*defer=*/true)) SSD_RETURN_IF_ERROR(mod->DeferRelease(ds, e, stream));
  eng->SchedulePrefetch(lk, dev);
  SSD_RETURN_IF_ERROR(mod->StagePrefetch(ds));
  if (predicted && left == 0) {
    // The execution's last load on this device: its checks must fail this step.
    lk.unlock();
    auto t0 = Clock::now();
    SSD_CHECK_CUDA(cudaStreamSynchronize(stream));
    lk.lock();
    eng->AddHandleSync(Since(t0));
    SSD_RETURN_IF_ERROR(mod->TakeMismatch());
  }
  return Status::Ok();
}

ffi::Error StoreCudaImpl(int32_t dev, cudaStream_t stream, ffi::RunId run, ffi::AnyBuffer x,
                         ffi::Result<ffi::Buffer<ffi::U32>> handle, int64_t site, int32_t tier,
                         std::string_view name, int64_t uses) {
  return Guarded(
      [&] { return StoreCuda(dev, stream, run.run_id, x, handle, site, tier, name, uses); });
}

ffi::Error LoadCudaImpl(int32_t dev, cudaStream_t stream, ffi::RunId run,
                        ffi::Buffer<ffi::U32> handle, ffi::Result<ffi::AnyBuffer> out, int64_t site,
                        int32_t tier, std::string_view name) {
  return Guarded([&] { return LoadCuda(dev, stream, run.run_id, handle, out, site, tier, name); });
}

}  // namespace
}  // namespace ssdtrain

extern "C" SSD_EXPORT XLA_FFI_Error* SsdtrainStoreCuda(XLA_FFI_CallFrame* call_frame);
extern "C" SSD_EXPORT XLA_FFI_Error* SsdtrainLoadCuda(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SsdtrainStoreCuda, ssdtrain::StoreCudaImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::DeviceOrdinal>()                 // GPU of the call
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // compute stream of the call
        .Ctx<ffi::RunId>()                         // XLA execution (load prediction)
        .Arg<ffi::AnyBuffer>()                     // x: the activation to store (device)
        .Ret<ffi::Buffer<ffi::U32>>()              // handle: uint32[2] = {id, check word}
        .Attr<int64_t>("site")                     // tag site id (shared by store and load)
        .Attr<int32_t>("tier")                     // 0 = nvme via host cache, 1 = host tier
        .Attr<std::string_view>("name")            // tag name, for messages only
        .Attr<int64_t>("uses"));  // loads per entry in this execution, -1: uncounted

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SsdtrainLoadCuda, ssdtrain::LoadCudaImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::DeviceOrdinal>()                 // GPU of the call (must be the store's)
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // compute stream of the call
        .Ctx<ffi::RunId>()                         // XLA execution (load prediction)
        .Arg<ffi::Buffer<ffi::U32>>()              // handle: from the matching store (device)
        .Ret<ffi::AnyBuffer>()                     // out: receives the stored bytes (device)
        .Attr<int64_t>("site")                     // tag site id (must match the store)
        .Attr<int32_t>("tier")                     // tier of the matching store
        .Attr<std::string_view>("name"));          // tag name, for messages only
