// The staging arena (device_module.h): device memory of each GPU that stores copy into on the
// compute stream (forwarding: the first loads of the backward pass copy back from it) and
// read-ahead fills from host memory. A freed staging range keeps the events of its last users
// (copy in, D2H out, loads out); whichever stream allocates an overlapping range next waits on
// them. No host thread blocks on a staging range, so ranges whose copies are still queued can be
// evicted and stores never stall the host. A tensor larger than the room it finds gets a range
// for its first piece only (`partial`): the store and the load copy the rest between the
// tensor and the host buffer directly, so the compute stream spends the link's time on what
// the arena cannot hold and nothing more. Between programs the arena can be replaced by a
// larger one (GrowStaging: every staged copy evicted, the host waits for the old arena's users).
#include "device_module.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace ssdtrain {

void CudaModule::CollectPending(DeviceState* ds) {
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

Status CudaModule::OrderAfterPending(DeviceState* ds, uint64_t off, uint64_t len,
                                     cudaStream_t stream, int* waits) {
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

Status CudaModule::OrderStaging(DeviceState* ds, const Entry& e, cudaStream_t stream, int* waits) {
  const DeviceEntry* d = e.device_entry();
  if (!d || !d->staged) return Status::Ok();
  return OrderAfterPending(ds, d->stage_off, d->stage_len, stream, waits);
}

Status CudaModule::AllocStaging(DeviceState* ds, const EntryPtr& e, cudaStream_t stream,
                                uint64_t prefetch_seq, uint64_t want, bool partial, uint64_t* got,
                                int* waits) {
  *got = 0;
  *waits = 0;
  want = std::min(want, e->nbytes());
  uint64_t len = RoundUp(want, 256);
  if (!want || len > ds->staging_size) return Status::Ok();
  CollectPending(ds);
  for (;;) {
    uint64_t off;
    if (ds->alloc.Alloc(len, &off)) {
      DeviceEntry* d = D(*e);
      d->staged = true;
      d->stage_off = off;
      d->stage_len = len;
      d->stage_bytes = std::min(len, e->nbytes());
      d->stage_ptr = ds->staging + off;
      ds->staged[e.get()] = e;
      eng_->StagingAllocated(len);
      *got = d->stage_bytes;
      return stream ? OrderAfterPending(ds, off, len, stream, waits) : Status::Ok();
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
      // Read-ahead takes no room a load is more likely to need than its own entry: never that
      // of a newer entry not loaded yet (an activation), unless only a later execution loads it.
      if (prefetch_seq && !(raw->loaded() || raw->seq() < prefetch_seq || D(*raw)->later_in_order))
        continue;
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
    if (!victim) {
      // No more room to make: a first piece in the largest free range, if it is worth a copy.
      const uint64_t largest = ds->alloc.largest_free() / 256 * 256;
      if (!partial || largest >= len || largest < std::min(len, kMinStagePiece))
        return Status::Ok();
      len = largest;
      continue;
    }
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

void CudaModule::FreeStaging(Entry& e) {
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
  if (DeviceState* ds = FindDevice(d->device)) {
    ds->alloc.Free(d->stage_off, d->stage_len);
    ds->staged.erase(&e);
    eng_->StagingFreed(d->stage_len);
    if (!pf.events.empty()) ds->pending.push_back(std::move(pf));
  } else {
    for (cudaEvent_t ev : pf.events) {
      HostWait(ev, "cudaEventSynchronize of a freed staging range's fence");
      cudaEventDestroy(ev);
    }
  }
  d->staged = false;
  d->stage_unused = false;
  d->stage_ptr = nullptr;
  d->stage_bytes = 0;
}

Status CudaModule::GrowStaging(uint64_t bytes) {
  int prev = -1;
  SSD_CHECK_CUDA(cudaGetDevice(&prev));
  Status s = Status::Ok();
  for (auto& [dev, ds] : devices_) {
    if (RoundUp(bytes, 256) <= ds->staging_size) continue;
    s = UseDevice(dev);
    if (s.ok()) s = GrowArena(ds.get(), RoundUp(bytes, 256));
    if (!s.ok()) break;
  }
  if (prev >= 0) cudaSetDevice(prev);
  return s;
}

Status CudaModule::GrowArena(DeviceState* ds, uint64_t bytes) {
  for (const auto& [raw, ep] : ds->staged)
    if (raw->filling() || raw->pinned())
      return Status(EBUSY,
                    "the staging arena of GPU " + std::to_string(ds->device) +
                        " is not grown: " + DescribeTag(raw->name(), raw->site(), raw->id()) +
                        " has a copy in flight in it (grow it between programs)");
  std::vector<EntryPtr> staged;
  staged.reserve(ds->staged.size());
  for (const auto& [raw, ep] : ds->staged) staged.push_back(ep);
  for (const EntryPtr& e : staged) {  // as AllocStaging evicts
    if (D(*e)->d2h_deferred) {
      if (Dead(*e)) {
        ElideD2H(ds, *e);
      } else {
        SSD_RETURN_IF_ERROR(IssueD2H(ds, *e));
        forced_d2h_++;
      }
    }
    FreeStaging(*e);
  }
  // Every user of the old arena: the copies in and out of it on any stream, the D2H just issued.
  for (auto& pf : ds->pending) {
    for (cudaEvent_t ev : pf.events) {
      SSD_CHECK_CUDA(cudaEventSynchronize(ev));
      ds->free_events.push_back(ev);
    }
  }
  ds->pending.clear();
  SSD_CHECK_CUDA(cudaStreamSynchronize(ds->copy));
  SSD_CHECK_CUDA(cudaStreamSynchronize(ds->h2d));
  const uint64_t old = ds->staging_size;
  if (ds->staging) SSD_CHECK_CUDA(cudaFree(ds->staging));
  ds->staging = nullptr;
  ds->staging_size = 0;
  ds->alloc.Reset(0, 256);
  Status s = Status::Ok();
  uint64_t got = bytes;
  if (cudaMalloc(&ds->staging, bytes) != cudaSuccess) {
    cudaGetLastError();
    s = Status(ENOMEM, "cannot allocate " + std::to_string(bytes) +
                           " bytes of device staging on GPU " + std::to_string(ds->device) +
                           "; it keeps " + std::to_string(old));
    got = old;
    if (old && cudaMalloc(&ds->staging, old) != cudaSuccess) {
      cudaGetLastError();
      ds->staging = nullptr;
      got = 0;
    }
  }
  ds->staging_size = got;
  ds->alloc.Reset(got, 256);
  return s;
}

bool CudaModule::StagingUsable(const Entry& e, const DeviceEntry& d) const {
  return eng_->config().forwarding || e.tier() != Tier::kNvme || !d.stage_from_store;
}

}  // namespace ssdtrain
