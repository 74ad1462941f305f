// The load of an activation into device memory (store_load.h). The handle is predicted on the
// host (the newest unloaded entry of the site in this XLA execution) and checked on the device
// after the copy (handles.h): a mismatch fills the output with NaN and is reported by the next
// load; the execution's last load syncs and reports it itself, so a mismatch fails the step that
// made it. Without a prediction (or with exact_loads) the handle is read first (a sync). The
// copy: D2D from staging (forwarded from the store, or read ahead), else H2D from pinned host
// memory (after the store's D2H), else file -> pinned host -> H2D.
#include <string>

#include "device_module.h"
#include "store_load.h"

namespace ssdtrain {
namespace {
using Lock = Engine::Lock;
using Clock = Engine::Clock;
}  // namespace

Status LoadToDevice(Engine& engine, const DeviceLoad& load) {
  Engine* eng = &engine;
  const int dev = load.device;
  cudaStream_t stream = load.stream;
  const int64_t run_id = load.run_id, site = load.site;
  const std::string_view name = load.name;
  const uint64_t nbytes = load.nbytes;
  char* dst = static_cast<char*>(load.dst);
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
    SSD_RETURN_IF_ERROR(ReadHandle(stream, load.handle, h, &sync_s));
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
  DeviceEntry* d = mod->Attach(*e, dev);
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
      DeviceState* owner = mod->FindDevice(d->device);
      if (!owner)
        return Status(EIO, "load of " + DescribeTag(e->name(), e->site(), e->id()) +
                               ": its deferred copy's GPU is gone");
      SSD_RETURN_IF_ERROR(mod->IssueD2H(owner, *e));
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
    SSD_RETURN_IF_ERROR(
        mod->handle_checks().LaunchVerify(stream, load.handle, h, dst, nbytes, run_id));
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
    eng->AddHandleSync(SecondsSince(t0));
    SSD_RETURN_IF_ERROR(mod->TakeMismatch());
  }
  return Status::Ok();
}

}  // namespace ssdtrain
