// The store of an activation from device memory (store_load.h), step by step. Stream-ordered:
// a D2D copy of the activation into device staging on the compute stream (E1) and the handle
// written after it on the same stream; the D2H of the staging copy into pinned host memory on
// the copy stream after E1 (host_copies.cu); the I/O threads wait for it and write the file.
// Without staging room the D2H runs on the compute stream and is waited for; without a host
// buffer the tensor is written through a bounce buffer synchronously.
#include <algorithm>
#include <string>

#include "device_module.h"
#include "store_load.h"

namespace ssdtrain {
namespace {

using Lock = Engine::Lock;
using Clock = Engine::Clock;

// A store nobody loads keeps nothing: it hands out the null handle.
Status StoreNothing(Engine& eng, const DeviceStore& store) {
  uint32_t null_handle[2];
  Engine::MakeNullHandle(null_handle);
  eng.CountUnusedStore(store.nbytes, store.device);
  return LaunchWriteHandle(store.stream, store.handle, null_handle);
}

// Lock held. Reserves staging room for `e`; the compute stream may have to wait for the
// previous users of that room (a kComputeWait bracket when it does).
Status ReserveStaging(CudaModule* mod, DeviceState* ds, const EntryPtr& e, const DeviceStore& store,
                      bool* staged) {
  CopyTracker& tracker = mod->tracker();
  CopyTracker::Mark wait;
  SSD_RETURN_IF_ERROR(tracker.Begin(store.device, store.stream, &wait));
  int waits = 0;
  Status a = mod->AllocStaging(ds, e, store.stream, 0, staged, &waits);
  if (a.ok() && waits > 0) {
    a = tracker.End(wait, store.stream, CopyOp::kComputeWait, 0, store.name);
  } else {
    tracker.Cancel(&wait);
  }
  return a;
}

// Lock held. The D2D copy into staging on the compute stream (E1: stage_ready), the handle
// after it, then the host copy on the copy stream: issued now, or deferred (host tier with
// forwarding: the first loads of the backward pass take the newest stores from staging, so
// their bytes need not cross the link at all). Not an entry that later executions load in store
// order (uses == Entry::kLaterInOrder: the optimizer's state): its oldest entries are loaded
// first, so deferred it would only hold staging room until newer stores pushed it out, and the
// state's next loads would find no room to be read ahead on the h2d stream (they would cross
// the link on the compute stream, between the chunks' arithmetic). Once copied out, its
// staging room is read-ahead's to take (staging.cu).
Status CopyToStaging(Engine& eng, CudaModule* mod, DeviceState* ds, const EntryPtr& e,
                     DeviceEntry* d, const DeviceStore& store, const uint32_t h[2]) {
  cudaStream_t stream = store.stream;
  d->stage_from_store = true;
  d->later_in_order = store.uses == Entry::kLaterInOrder;
  ds->largest = std::max(ds->largest, d->stage_len);
  SSD_RETURN_IF_ERROR(
      mod->Tracked(store.device, stream, CopyOp::kStageIn, store.nbytes, store.name, [&] {
        SSD_CHECK_CUDA(cudaMemcpyAsync(d->stage_ptr, store.src, store.nbytes,
                                       cudaMemcpyDeviceToDevice, stream));
        return Status::Ok();
      }));
  cudaEvent_t e1;
  SSD_RETURN_IF_ERROR(mod->NewEvent(ds, &e1));
  d->stage_ready = e1;
  SSD_CHECK_CUDA(cudaEventRecord(e1, stream));
  SSD_RETURN_IF_ERROR(LaunchWriteHandle(stream, store.handle, h));
  if (e->tier() == Tier::kHost && eng.config().forwarding && !d->later_in_order)
    return mod->DeferD2H(ds, e);
  return mod->IssueD2H(ds, *e);
}

// Lock held (released while the copy runs). No staging room (or bigger than the arena): the
// D2H into the host buffer and the handle on the compute stream, waited for.
Status CopyToHostNow(Lock& lk, Engine& eng, CudaModule* mod, const EntryPtr& e,
                     const DeviceStore& store, const uint32_t h[2]) {
  cudaStream_t stream = store.stream;
  CopyTracker& tracker = mod->tracker();
  CopyTracker::Mark m;
  SSD_RETURN_IF_ERROR(tracker.Begin(store.device, stream, &m));
  lk.unlock();
  auto t0 = Clock::now();
  Status c = [&]() -> Status {
    SSD_CHECK_CUDA(
        cudaMemcpyAsync(e->host_ptr(), store.src, store.nbytes, cudaMemcpyDeviceToHost, stream));
    SSD_RETURN_IF_ERROR(LaunchWriteHandle(stream, store.handle, h));
    SSD_CHECK_CUDA(cudaStreamSynchronize(stream));
    return Status::Ok();
  }();
  lk.lock();
  if (!c.ok()) {
    tracker.Cancel(&m);
    return c;
  }
  eng.AddStall(SecondsSince(t0));
  return tracker.End(m, stream, CopyOp::kD2H, store.nbytes, store.name);
}

// Copies the bytes of `e` out of the activation and writes the handle `h`: into staging, else
// into the host buffer. `*write_through`: `e` has no host buffer (larger than the host cache,
// or no room), so only the handle was written: the caller writes the tensor through.
Status CopyOut(Engine& eng, const DeviceStore& store, const EntryPtr& e, const uint32_t h[2],
               bool* write_through) {
  Lock lk = eng.LockState();
  CudaModule* mod = Module(eng);
  SSD_RETURN_IF_ERROR(mod->TakeMismatch());
  DeviceState* ds = nullptr;
  SSD_RETURN_IF_ERROR(mod->Device(store.device, &ds));
  e->set_run_id(store.run_id);
  DeviceEntry* d = mod->Attach(*e, store.device);
  if (store.nbytes == 0) return LaunchWriteHandle(store.stream, store.handle, h);
  if (!e->host_ptr()) {
    SSD_RETURN_IF_ERROR(LaunchWriteHandle(store.stream, store.handle, h));
    *write_through = true;
    return Status::Ok();
  }
  e->ZeroHostPadding();
  bool staged = false;
  SSD_RETURN_IF_ERROR(ReserveStaging(mod, ds, e, store, &staged));
  if (staged) return CopyToStaging(eng, mod, ds, e, d, store, h);
  return CopyToHostNow(lk, eng, mod, e, store, h);
}

// Lock not held. The synchronous write of `e` through the engine's bounce buffer, each piece
// copied out of the activation on the compute stream and waited for.
Status WriteThrough(Engine& eng, const DeviceStore& store, const EntryPtr& e) {
  const char* src = static_cast<const char*>(store.src);
  cudaStream_t stream = store.stream;
  return eng.WriteThrough(e, [&](void* dst, uint64_t off, uint64_t len) -> Status {
    SSD_CHECK_CUDA(cudaMemcpyAsync(dst, src + off, len, cudaMemcpyDeviceToHost, stream));
    SSD_CHECK_CUDA(cudaStreamSynchronize(stream));
    return Status::Ok();
  });
}

}  // namespace

Status StoreFromDevice(Engine& eng, const DeviceStore& store) {
  SSD_RETURN_IF_ERROR(UseDevice(store.device));
  if (store.uses == 0) return StoreNothing(eng, store);
  EntryPtr e;
  SSD_RETURN_IF_ERROR(eng.BeginStore(store.site, store.tier, store.nbytes, store.name, &e,
                                     store.device, store.uses, -1, store.stream_pass,
                                     store.stream_dir));
  uint32_t h[2];
  eng.MakeHandle(*e, h);
  bool write_through = false;
  Status s = CopyOut(eng, store, e, h, &write_through);
  if (write_through) return WriteThrough(eng, store, e);
  if (!s.ok()) {
    eng.AbortStore(e);
    return s.With("store of tag '" + std::string(store.name) + "'");
  }
  return eng.CommitStore(e);
}

}  // namespace ssdtrain
