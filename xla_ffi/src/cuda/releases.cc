// Deferred releases (device_module.h): an entry's counted last load only enqueues its copy, so
// the entry is released once an event recorded after that copy fires. ReclaimReleases collects
// them: without waiting at each store and load, waiting when the engine runs out of room,
// flushes, sweeps or releases everything.
#include "device_module.h"

#include <utility>

namespace ssdtrain {

Status CudaModule::DeferRelease(DeviceState* ds, const EntryPtr& e, cudaStream_t stream) {
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

void CudaModule::ReclaimReleases(bool wait) {
  for (size_t i = 0; i < deferred_.size();) {
    Deferred& r = deferred_[i];
    if (!wait && !Done(r.done)) {
      ++i;
      continue;
    }
    if (wait) HostWait(r.done, "cudaEventSynchronize of a deferred release's load copy");
    EntryPtr e = std::move(r.e);
    PutEvent(r.device, r.done);
    r = std::move(deferred_.back());
    deferred_.pop_back();
    eng_->ReleaseLocked(e);
  }
}

}  // namespace ssdtrain
