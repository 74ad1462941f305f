// The load of an activation into device memory (store_load.h), step by step. The handle is
// predicted on the host (the newest unloaded entry of the site in this XLA execution; for an
// ordered exact load, the oldest of the execution that stored the state) and checked on the
// device after the copy (handles.h): a mismatch fills the output with NaN and is reported by the
// next load; the execution's last load syncs and reports it itself, so a mismatch fails the step
// that made it. Without a prediction (or with exact_loads) the handle is read first: a sync of
// the compute stream, which stops the host enqueueing work until the GPU has caught up. The copy:
// D2D from staging (forwarded from the store, or read ahead), else H2D from pinned host memory
// (after the store's D2H), else file -> pinned host -> H2D. A tensor whose staging copy is only
// its first piece (larger than the room it found) takes that piece D2D and the rest H2D from the
// host buffer: the compute stream spends the link's time on the rest only.
#include <algorithm>
#include <string>

#include "device_module.h"
#include "store_load.h"

namespace ssdtrain {
namespace {

using Lock = Engine::Lock;
using Clock = Engine::Clock;

// The handle of a load: predicted (checked on the device after the copy) or read.
struct LoadHandle {
  uint32_t h[2] = {0, 0};
  bool predicted = false;
  uint64_t left = 0;  // predicted: unloaded entries of the execution besides this one
};

// Reports a mismatch found since the last load, collects finished releases, and predicts the
// handle unless exact_loads is set: an activation among this execution's entries; an ordered
// exact load (optimizer state of an earlier step, a site's chunks in store order) among the
// entries of the execution the first exact load read; a streamed load (a layer stack's) the
// site's next entry in its direction. Other exact loads read their handle.
Status PredictHandle(Engine& eng, const DeviceLoad& load, LoadHandle* handle) {
  Lock lk = eng.LockState();
  CudaModule* mod = Module(eng);
  SSD_RETURN_IF_ERROR(mod->TakeMismatch());
  mod->ReclaimReleases(false);
  if (eng.config().exact_loads) return Status::Ok();
  switch (load.order) {
    case LoadOrder::kActivation:
      handle->predicted = eng.PredictLoad(load.site, load.run_id, load.device, load.nbytes,
                                          handle->h, &handle->left);
      break;
    case LoadOrder::kStoreOrder:
      handle->predicted = eng.PredictOrderedLoad(load.site, load.run_id, load.device, load.nbytes,
                                                 handle->h, &handle->left);
      break;
    case LoadOrder::kStream:
      handle->predicted = eng.PredictStreamLoad(load.site, load.stream_pass, load.run_id,
                                                load.device, load.nbytes, handle->h, &handle->left);
      break;
    case LoadOrder::kRead:
      break;
  }
  return Status::Ok();
}

// Lock held. The staging copy of `e` serves the load: forwarded from its store, or read ahead,
// on this GPU, complete and sound.
bool StagingServes(const CudaModule& mod, const Entry& e, const DeviceEntry& d, int device) {
  return d.staged && mod.StagingUsable(e, d) && d.device == device && !e.filling() &&
         e.error().ok();
}

// Lock held. D2D of the first `bytes` of `e` from staging on the compute stream, after the copy
// into staging (a read-ahead's H2D may still run: a wait of the compute stream); the copy is a
// fence of the staging range. `bytes` < the load's: a split load (the caller copies the rest
// from the host and counts it).
Status CopyFromStaging(Engine& eng, CudaModule* mod, DeviceState* ds, Entry& e, DeviceEntry* d,
                       const DeviceLoad& load, uint64_t bytes) {
  cudaStream_t stream = load.stream;
  if (d->stage_from_store) {
    if (d->stage_ready) SSD_CHECK_CUDA(cudaStreamWaitEvent(stream, d->stage_ready, 0));
  } else {
    SSD_RETURN_IF_ERROR(mod->WaitTracked(load.device, stream, d->stage_ready, load.name));
  }
  SSD_RETURN_IF_ERROR(mod->Tracked(load.device, stream, CopyOp::kLoadStaged, bytes, load.name, [&] {
    SSD_CHECK_CUDA(
        cudaMemcpyAsync(load.dst, d->stage_ptr, bytes, cudaMemcpyDeviceToDevice, stream));
    return Status::Ok();
  }));
  SSD_RETURN_IF_ERROR(mod->AddFence(ds, &d->stage_fences, stream));
  if (bytes >= load.nbytes) eng.CountStagedLoad(e, d->stage_from_store);
  if (!d->stage_from_store) eng.ConsumeRead(e);  // the staging copy of a read-back host copy
  d->stage_unused = false;
  return Status::Ok();
}

// Lock held. A deferred copy is staged, so CopyFromStaging serves it; should one ever get to a
// host copy, its D2H is issued first (stream-ordered before the H2D through host_ready).
Status MakeDeferredHostCopy(CudaModule* mod, Entry& e, DeviceEntry* d) {
  if (!d->d2h_deferred) return Status::Ok();
  DeviceState* owner = mod->FindDevice(d->device);
  if (!owner)
    return Status(EIO, "load of " + DescribeTag(e.name(), e.site(), e.id()) +
                           ": its deferred copy's GPU is gone");
  return mod->IssueD2H(owner, e);
}

// Lock held. H2D of the bytes [from, nbytes) from the pinned host buffer on the compute stream,
// after the store's copies into them: host_ready (all of them) and host_direct (a split store's
// direct part), or only host_direct where the rest of a split store's own staged piece is
// copied (its host copy, host_ready, holds the bytes before `from`); the copy is a fence of the
// host buffer.
Status CopyFromPinnedHost(CudaModule* mod, DeviceState* ds, DeviceEntry* d,
                          const Engine::HostRef& ref, const DeviceLoad& load, uint64_t from) {
  cudaStream_t stream = load.stream;
  const uint64_t len = load.nbytes - from;
  if (!(from > 0 && d->stage_from_store))
    SSD_RETURN_IF_ERROR(mod->WaitTracked(load.device, stream, d->host_ready, load.name));
  SSD_RETURN_IF_ERROR(mod->WaitTracked(load.device, stream, d->host_direct, load.name));
  SSD_RETURN_IF_ERROR(mod->Tracked(load.device, stream, CopyOp::kLoadHost, len, load.name, [&] {
    SSD_CHECK_CUDA(cudaMemcpyAsync(static_cast<char*>(load.dst) + from, ref.ptr + from, len,
                                   cudaMemcpyHostToDevice, stream));
    return Status::Ok();
  }));
  return mod->AddFence(ds, &d->host_fences, stream);
}

// Lock held (released while the copy runs). H2D of the bytes [from, nbytes) from the engine's
// bounce buffer (read from the file for this load only) on the compute stream, waited for
// before the buffer is freed.
Status CopyFromBounce(Lock& lk, CudaModule* mod, const Engine::HostRef& ref, const DeviceLoad& load,
                      uint64_t from) {
  cudaStream_t stream = load.stream;
  const uint64_t len = load.nbytes - from;
  CopyTracker::Mark m;
  Status s = mod->tracker().Begin(load.device, stream, &m);
  if (!s.ok()) return s;
  lk.unlock();
  s = [&]() -> Status {
    SSD_CHECK_CUDA(cudaMemcpyAsync(static_cast<char*>(load.dst) + from, ref.ptr + from, len,
                                   cudaMemcpyHostToDevice, stream));
    SSD_CHECK_CUDA(cudaStreamSynchronize(stream));
    return Status::Ok();
  }();
  lk.lock();
  if (s.ok()) {
    s = mod->tracker().End(m, stream, CopyOp::kLoadHost, len, load.name);
  } else {
    mod->tracker().Cancel(&m);
  }
  return s;
}

// Lock held (may be released while waiting). The bytes of `e` made available in host memory
// (the engine waits for a running read, or reads the file), then copied to the device: where
// staging holds a first piece of `e` (checked once the host copy is there: the lock may have
// been dropped), that piece D2D and the rest from the host, else all of it from the host.
Status CopyFromHost(Lock& lk, Engine& eng, CudaModule* mod, DeviceState* ds, const EntryPtr& e,
                    DeviceEntry* d, const DeviceLoad& load) {
  Engine::HostRef ref;
  Status s = eng.AcquireHost(lk, e, &ref);
  if (s.ok()) {
    const uint64_t first = StagingServes(*mod, *e, *d, load.device)
                               ? std::min<uint64_t>(d->stage_bytes, load.nbytes)
                               : 0;
    if (first) s = CopyFromStaging(eng, mod, ds, *e, d, load, first);
    if (s.ok() && first < load.nbytes) {
      if (!first) s = MakeDeferredHostCopy(mod, *e, d);
      if (s.ok())
        s = ref.bounce ? CopyFromBounce(lk, mod, ref, load, first)
                       : CopyFromPinnedHost(mod, ds, d, ref, load, first);
      if (s.ok() && first) mod->CountSplitLoad(load.nbytes - first);
    }
  }
  eng.ReleaseHost(lk, &ref);
  return s;
}

// Lock held. Enqueues the check of a predicted handle after the copy.
Status VerifyHandle(Engine& eng, CudaModule* mod, const DeviceLoad& load,
                    const LoadHandle& handle) {
  eng.CountSpeculativeLoad();
  return mod->handle_checks().LaunchVerify(load.stream, load.handle, handle.h, load.dst,
                                           load.nbytes, load.run_id);
}

// Lock held. One load of `e` done: at its counted last load the release waits for the copy.
Status CountLoadAndRelease(Engine& eng, CudaModule* mod, DeviceState* ds, const EntryPtr& e,
                           cudaStream_t stream) {
  if (eng.CountLoad(e, /*defer=*/true)) return mod->DeferRelease(ds, e, stream);
  return Status::Ok();
}

// Lock held. Read-ahead of the GPU's next predicted loads: file -> host, then host -> staging.
// After an exact load (state of an earlier execution, loaded in its store order) the entries
// stored after `e` by the same execution; after a streamed one each streamed site's next ones
// in its direction; else the newest (activations: reverse order).
Status ReadAhead(Lock& lk, Engine& eng, CudaModule* mod, DeviceState* ds, const Entry& e,
                 const DeviceLoad& load) {
  const Entry* after = load.exact() ? &e : nullptr;
  const bool stream = load.order == LoadOrder::kStream;
  eng.SchedulePrefetch(lk, load.device, after, stream);
  return mod->StagePrefetch(ds, after, stream);
}

// Lock held (released while waiting). The execution's last load on this GPU waits for the
// compute stream, so that its predicted loads' checks fail this step.
Status SyncLastLoad(Lock& lk, Engine& eng, CudaModule* mod, cudaStream_t stream) {
  lk.unlock();
  auto t0 = Clock::now();
  Status synced = [&]() -> Status {
    SSD_CHECK_CUDA(cudaStreamSynchronize(stream));
    return Status::Ok();
  }();
  lk.lock();
  SSD_RETURN_IF_ERROR(synced);
  eng.AddHandleSync(SecondsSince(t0));
  return mod->TakeMismatch();
}

}  // namespace

Status LoadToDevice(Engine& eng, const DeviceLoad& load) {
  SSD_RETURN_IF_ERROR(UseDevice(load.device));
  LoadHandle handle;
  SSD_RETURN_IF_ERROR(PredictHandle(eng, load, &handle));
  double sync_s = 0;
  if (!handle.predicted)
    SSD_RETURN_IF_ERROR(ReadHandle(load.stream, load.handle, handle.h, &sync_s));

  Lock lk = eng.LockState();
  eng.AddHandleSync(sync_s);
  SSD_RETURN_IF_ERROR(eng.TakePendingError());
  EntryPtr e;
  SSD_RETURN_IF_ERROR(eng.LookupForLoad(lk, handle.h, load.nbytes, load.site, load.name, &e,
                                        load.device, load.consume));
  if (load.order == LoadOrder::kStream)
    eng.NoteStreamLoad(load.run_id, load.device, load.stream_pass, load.stream_dir, *e);
  else if (load.exact())
    eng.NoteExactLoad(load.run_id, load.device, *e);
  // The entry counts as being loaded until this function returns, although the lock is dropped
  // while its bytes are read or copied through a bounce buffer (the scope ends under the lock).
  Entry::LoadingScope loading(*e);
  CudaModule* mod = Module(eng);
  DeviceState* ds = nullptr;
  SSD_RETURN_IF_ERROR(mod->Device(load.device, &ds));
  if (load.nbytes == 0) {
    eng.CountLoad(e);  // no copy to wait for
    return Status::Ok();
  }
  DeviceEntry* d = mod->Attach(*e, load.device);
  if (StagingServes(*mod, *e, *d, load.device) && d->stage_bytes >= load.nbytes) {
    SSD_RETURN_IF_ERROR(CopyFromStaging(eng, mod, ds, *e, d, load, load.nbytes));
  } else {
    SSD_RETURN_IF_ERROR(CopyFromHost(lk, eng, mod, ds, e, d, load));
  }
  if (handle.predicted) SSD_RETURN_IF_ERROR(VerifyHandle(eng, mod, load, handle));
  SSD_RETURN_IF_ERROR(CountLoadAndRelease(eng, mod, ds, e, load.stream));
  SSD_RETURN_IF_ERROR(ReadAhead(lk, eng, mod, ds, *e, load));
  if (handle.predicted && handle.left == 0)
    SSD_RETURN_IF_ERROR(SyncLastLoad(lk, eng, mod, load.stream));
  return Status::Ok();
}

}  // namespace ssdtrain
