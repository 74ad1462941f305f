// Read-ahead into device staging (device_module.h): after each load, the next predicted loads of
// the GPU whose bytes sit in host memory are copied into staging on the h2d stream, so that
// their loads are device-to-device copies. Predicted: the newest stores first (activations), or
// after an exact load the entries its execution stored after it (optimizer state), or after a
// streamed load each streamed site's next entries (a layer stack's), then within half the
// arena. It never evicts a read-ahead copy
// no load has used (it stops instead); a store takes one only when nothing else frees room,
// which costs that load a host-to-device copy, never a disk read: the host copy of a read stays
// until its load. A next load larger than the whole budget gets a first piece of the budget's
// size staged (its load copies the rest from the host), so a tensor larger than the arena still
// has part of its load served device-to-device; any other entry past the budget waits until it
// fits whole (a piece staged early would never grow).
#include "device_module.h"

#include <algorithm>

namespace ssdtrain {

Status CudaModule::StagePrefetch(DeviceState* ds, const Entry* after, bool stream) {
  const uint64_t budget = std::min<uint64_t>(eng_->config().prefetch_bytes,
                                             after ? ds->staging_size / 2 : ds->staging_size);
  if (!budget) return Status::Ok();
  // PredictNext's list within `budget`, and the entry that crosses it: looking past the budget
  // by the largest tensor this GPU stored shows that entry.
  uint64_t used = 0;
  for (const EntryPtr& e :
       eng_->PredictNext(budget + ds->largest_entry, ds->device, after, stream)) {
    if (used >= budget) break;
    const uint64_t room = budget - used;
    used += e->padded();
    if (e->filling() || e->reading() || !e->host_ptr() || !e->host_valid() || e->nbytes() == 0)
      continue;
    DeviceEntry* d = Attach(*e, ds->device);
    if (d->staged) continue;
    const uint64_t want = std::min(e->nbytes(), room);
    if (want < e->nbytes() && (room < budget || want < kMinStagePiece)) break;
    uint64_t got = 0;
    int waits = 0;
    SSD_RETURN_IF_ERROR(
        AllocStaging(ds, e, ds->h2d, e->seq(), want, /*partial=*/true, &got, &waits));
    if (!got) break;
    d->stage_from_store = false;
    d->stage_unused = true;
    Status s = [&]() -> Status {
      for (cudaEvent_t ev : {d->host_ready, d->host_direct})
        if (ev) SSD_CHECK_CUDA(cudaStreamWaitEvent(ds->h2d, ev, 0));
      SSD_RETURN_IF_ERROR(
          Tracked(ds->device, ds->h2d, CopyOp::kReadAhead, d->stage_bytes, e->name(), [&] {
            SSD_CHECK_CUDA(cudaMemcpyAsync(d->stage_ptr, e->host_ptr(), d->stage_bytes,
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
    if (got < e->nbytes()) break;  // a first piece: the arena (or the budget) is spent
  }
  return Status::Ok();
}

}  // namespace ssdtrain
