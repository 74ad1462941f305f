// The store of an activation from device memory (store_load.h). Stream-ordered: a D2D copy of
// the activation into device staging on the compute stream (E1) and the handle written after it
// on the same stream; the D2H of the staging copy into pinned host memory on the copy stream
// after E1 (host_copies.cu); the I/O threads wait for it and write the file. Without staging
// room the D2H runs on the compute stream and is waited for; without a host buffer the tensor is
// written through a bounce buffer synchronously.
#include <algorithm>
#include <string>

#include "device_module.h"
#include "store_load.h"

namespace ssdtrain {
namespace {
using Lock = Engine::Lock;
using Clock = Engine::Clock;
}  // namespace

Status StoreFromDevice(Engine& engine, const DeviceStore& store) {
  Engine* eng = &engine;
  const int dev = store.device;
  cudaStream_t stream = store.stream;
  const int64_t run_id = store.run_id;
  const int64_t site = store.site, uses = store.uses;
  const std::string_view name = store.name;
  const uint64_t nbytes = store.nbytes;
  const char* src = static_cast<const char*>(store.src);
  uint32_t* hdst = store.handle;
  SSD_RETURN_IF_ERROR(UseDevice(dev));

  if (uses == 0) {  // nobody loads it: keep nothing, hand out the null handle
    uint32_t null_handle[2];
    Engine::MakeNullHandle(null_handle);
    eng->CountUnusedStore(nbytes, dev);
    return LaunchWriteHandle(stream, hdst, null_handle);
  }
  EntryPtr e;
  SSD_RETURN_IF_ERROR(eng->BeginStore(site, store.tier, nbytes, name, &e, dev, uses));
  uint32_t h[2];
  eng->MakeHandle(*e, h);

  Status s = [&]() -> Status {
    Lock lk = eng->LockState();
    CudaModule* mod = Module(*eng);
    SSD_RETURN_IF_ERROR(mod->TakeMismatch());
    DeviceState* ds = nullptr;
    SSD_RETURN_IF_ERROR(mod->Device(dev, &ds));
    e->set_run_id(run_id);
    DeviceEntry* d = mod->Attach(*e, dev);
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
    eng->AddStall(SecondsSince(t0));
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

}  // namespace ssdtrain
