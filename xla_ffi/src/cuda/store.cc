// The store of an activation from device memory (store_load.h), step by step. Stream-ordered:
// a D2D copy of the activation into device staging on the compute stream (E1) and the handle
// written after it on the same stream; the D2H of the staging copy into pinned host memory on
// the copy stream after E1 (host_copies.cc); the I/O threads wait for it and write the file.
// A tensor larger than the staging room it finds (or than the arena) is split: what does not
// fit is copied D2H into the host buffer directly on the compute stream first (the link's time
// for those bytes is what the step pays), then the first piece into staging as above; without
// any staging room the whole tensor goes that direct way. No store blocks the host on the GPU:
// host_ready (or host_direct) marks when the host buffer holds the bytes. Without a host buffer
// the tensor is written through a bounce buffer synchronously.
#include <algorithm>
#include <string>

#include "device_module.h"
#include "store_load.h"

namespace ssdtrain {
namespace {

using Lock = Engine::Lock;

// A store nobody loads keeps nothing: it hands out the null handle.
Status StoreNothing(Engine& eng, const DeviceStore& store) {
  uint32_t null_handle[2];
  Engine::MakeNullHandle(null_handle);
  eng.CountUnusedStore(store.nbytes, store.device);
  return LaunchWriteHandle(store.stream, store.handle, null_handle);
}

// Lock held. Reserves staging for as much of `e` as the arena can hold (all of it, else a first
// piece: AllocStaging's `partial`); the stream is ordered after the room's previous users later
// (OrderRoom), once the direct part is queued. `*staged`: the tensor bytes reserved.
Status ReserveStaging(CudaModule* mod, DeviceState* ds, const EntryPtr& e, const DeviceStore& store,
                      uint64_t* staged) {
  int waits = 0;
  return mod->AllocStaging(ds, e, nullptr, 0, std::min(store.nbytes, ds->staging_size),
                           /*partial=*/true, staged, &waits);
}

// Lock held. Orders the compute stream after the previous users of `e`'s staging range (a
// kComputeWait bracket when it has to wait).
Status OrderRoom(CudaModule* mod, DeviceState* ds, const Entry& e, const DeviceStore& store) {
  CopyTracker& tracker = mod->tracker();
  CopyTracker::Mark wait;
  SSD_RETURN_IF_ERROR(tracker.Begin(store.device, store.stream, &wait));
  int waits = 0;
  Status a = mod->OrderStaging(ds, e, store.stream, &waits);
  if (a.ok() && waits > 0)
    return tracker.End(wait, store.stream, CopyOp::kComputeWait, 0, store.name);
  tracker.Cancel(&wait);
  return a;
}

// Lock held. The bytes [from, nbytes) of the activation D2H into the host buffer on the compute
// stream (what staging cannot hold), then `*done` recorded after them. Nothing waits on the
// host: the compute stream carries the copy, so XLA's later work on the buffer follows it.
Status CopyDirect(CudaModule* mod, DeviceState* ds, const EntryPtr& e, const DeviceStore& store,
                  uint64_t from, cudaEvent_t* done) {
  cudaStream_t stream = store.stream;
  const uint64_t len = store.nbytes - from;
  SSD_RETURN_IF_ERROR(
      mod->Tracked(store.device, stream, CopyOp::kStoreDirect, len, store.name, [&] {
        SSD_CHECK_CUDA(cudaMemcpyAsync(e->host_ptr() + from,
                                       static_cast<const char*>(store.src) + from, len,
                                       cudaMemcpyDeviceToHost, stream));
        return Status::Ok();
      }));
  cudaEvent_t ev;
  SSD_RETURN_IF_ERROR(mod->NewEvent(ds, &ev));
  cudaError_t err = cudaEventRecord(ev, stream);
  if (err != cudaSuccess) {
    mod->PutEvent(ds->device, ev);
    SSD_CHECK_CUDA(err);
  }
  *done = ev;
  mod->CountDirectStore(len);
  return Status::Ok();
}

// Lock held. The D2D copy of the staged piece into staging on the compute stream (E1:
// stage_ready; after the direct part, if any), the handle after it, then the host copy of the
// piece on the copy stream: issued now, or deferred (host tier with forwarding: the first loads
// of the backward pass take the newest stores from staging, so their bytes need not cross the
// link at all). Not an entry that later executions load in store order (uses ==
// Entry::kLaterInOrder: the optimizer's state): its oldest entries are loaded first, so
// deferred it would only hold staging room until newer stores pushed it out, and the state's
// next loads would find no room to be read ahead on the h2d stream (they would cross the link
// on the compute stream, between the chunks' arithmetic). Once copied out, its staging room is
// read-ahead's to take (staging.cc).
Status CopyToStaging(Engine& eng, CudaModule* mod, DeviceState* ds, const EntryPtr& e,
                     DeviceEntry* d, const DeviceStore& store, const uint32_t h[2]) {
  cudaStream_t stream = store.stream;
  d->stage_from_store = true;
  d->later_in_order = store.uses == Entry::kLaterInOrder;
  if (d->stage_bytes == store.nbytes) ds->largest = std::max(ds->largest, d->stage_len);
  SSD_RETURN_IF_ERROR(
      mod->Tracked(store.device, stream, CopyOp::kStageIn, d->stage_bytes, store.name, [&] {
        SSD_CHECK_CUDA(cudaMemcpyAsync(d->stage_ptr, store.src, d->stage_bytes,
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

// Copies the bytes of `e` out of the activation and writes the handle `h`: the part staging
// cannot hold D2H into the host buffer, the rest into staging. `*write_through`: `e` has no
// host buffer (larger than the host cache, or no room), so only the handle was written: the
// caller writes the tensor through.
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
  ds->largest_entry = std::max(ds->largest_entry, e->padded());
  uint64_t staged = 0;
  SSD_RETURN_IF_ERROR(ReserveStaging(mod, ds, e, store, &staged));
  if (staged == 0) {  // all of it direct: host_ready marks the whole host copy
    SSD_RETURN_IF_ERROR(CopyDirect(mod, ds, e, store, 0, &d->host_ready));
    return LaunchWriteHandle(store.stream, store.handle, h);
  }
  if (staged < store.nbytes)
    SSD_RETURN_IF_ERROR(CopyDirect(mod, ds, e, store, staged, &d->host_direct));
  SSD_RETURN_IF_ERROR(OrderRoom(mod, ds, *e, store));
  return CopyToStaging(eng, mod, ds, e, d, store, h);
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
