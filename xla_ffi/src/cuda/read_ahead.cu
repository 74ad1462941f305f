// Read-ahead into device staging (device_module.h): after each load, the next predicted loads of
// the GPU whose bytes sit in host memory are copied into staging on the h2d stream, so that
// their loads are device-to-device copies. Predicted: the newest stores first (activations), or
// after an exact load the entries its execution stored after it (optimizer state), or after a
// streamed load each streamed site's next entries (a layer stack's), then within half the
// arena. It never evicts a read-ahead copy
// no load has used (it stops instead); a store takes one only when nothing else frees room,
// which costs that load a host-to-device copy, never a disk read: the host copy of a read stays
// until its load.
#include "device_module.h"

#include <algorithm>

namespace ssdtrain {

Status CudaModule::StagePrefetch(DeviceState* ds, const Entry* after, bool stream) {
  const uint64_t budget = std::min<uint64_t>(eng_->config().prefetch_bytes,
                                             after ? ds->staging_size / 2 : ds->staging_size);
  if (!budget) return Status::Ok();
  // Only this device's entries: staging, streams and events belong to one device.
  for (const EntryPtr& e : eng_->PredictNext(budget, ds->device, after, stream)) {
    if (e->filling() || e->reading() || !e->host_ptr() || !e->host_valid() || e->nbytes() == 0)
      continue;
    DeviceEntry* d = Attach(*e, ds->device);
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

}  // namespace ssdtrain
