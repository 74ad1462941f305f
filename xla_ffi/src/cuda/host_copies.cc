// Host copies of staged stores (device_module.h): the D2H of a store's staging copy into its
// pinned host buffer on the copy stream, after the copy into staging (E1); its end (E2,
// host_ready) is what the I/O threads wait for before writing the file. Host-tier copies (with
// forwarding) are lazy: the newest stores stay in staging without a host copy (up to the staging
// arena less room for two of the largest tensors); the D2H of the oldest is issued as new stores
// push past that, or when its staging range must be reused, and never made for an entry no load
// will take. The first loads of the backward pass take the newest stores, so their bytes never
// cross the PCIe link in either direction.
#include "device_module.h"

#include <algorithm>

namespace ssdtrain {

Status CudaModule::IssueD2H(DeviceState* ds, Entry& e) {
  DeviceEntry* d = D(e);
  if (d->d2h_deferred) {
    d->d2h_deferred = false;
    ds->deferred_bytes -= d->stage_len;
  }
  if (d->stage_ready) SSD_CHECK_CUDA(cudaStreamWaitEvent(ds->copy, d->stage_ready, 0));
  // The staged piece (a store's first piece: its direct part went to the host before
  // stage_ready, so host_ready covers the whole host copy).
  SSD_RETURN_IF_ERROR(Tracked(ds->device, ds->copy, CopyOp::kD2H, d->stage_bytes, e.name(), [&] {
    SSD_CHECK_CUDA(cudaMemcpyAsync(e.host_ptr(), d->stage_ptr, d->stage_bytes,
                                   cudaMemcpyDeviceToHost, ds->copy));
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

void CudaModule::ElideD2H(DeviceState* ds, Entry& e) {
  DeviceEntry* d = D(e);
  d->d2h_deferred = false;
  ds->deferred_bytes -= d->stage_len;
  elided_bytes_ += d->stage_bytes;
  elided_tensors_++;
}

Status CudaModule::DeferD2H(DeviceState* ds, const EntryPtr& e) {
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

}  // namespace ssdtrain
