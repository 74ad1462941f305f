// The device module itself (device_module.h): the state of each GPU (copy streams, the staging
// arena; the host arenas registered as pinned memory with the first GPU), the device part of
// each entry, the DeviceHooks the engine calls, and teardown.
#include "device_module.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>

namespace ssdtrain {

CudaModule::~CudaModule() {
  for (Deferred& r : deferred_) {
    cudaEventSynchronize(r.done);
    cudaEventDestroy(r.done);
  }
  deferred_.clear();
  for (auto& [id, ds] : devices_) {
    int prev = -1;
    cudaGetDevice(&prev);
    cudaSetDevice(ds->device);
    if (ds->copy) cudaStreamSynchronize(ds->copy);
    if (ds->h2d) cudaStreamSynchronize(ds->h2d);
    for (cudaEvent_t ev : ds->free_events) cudaEventDestroy(ev);
    for (auto& pf : ds->pending)
      for (cudaEvent_t ev : pf.events) cudaEventDestroy(ev);
    if (ds->staging) cudaFree(ds->staging);
    if (ds->copy) cudaStreamDestroy(ds->copy);
    if (ds->h2d) cudaStreamDestroy(ds->h2d);
    if (prev >= 0) cudaSetDevice(prev);
  }
  for (void* p : registered_) cudaHostUnregister(p);
  checks_.Free();
  cudaGetLastError();
}

Status CudaModule::Device(int dev, DeviceState** out) {
  auto it = devices_.find(dev);
  if (it != devices_.end()) {
    *out = it->second.get();
    return Status::Ok();
  }
  auto ds = std::make_unique<DeviceState>();
  ds->device = dev;
  SSD_CHECK_CUDA(cudaStreamCreateWithFlags(&ds->copy, cudaStreamNonBlocking));
  SSD_CHECK_CUDA(cudaStreamCreateWithFlags(&ds->h2d, cudaStreamNonBlocking));
  uint64_t want = RoundUp(eng_->config().staging_bytes, 256);
  if (want) {
    cudaError_t err = cudaMalloc(&ds->staging, want);
    if (err != cudaSuccess) {
      cudaGetLastError();
      fprintf(stderr,
              "ssdtrain: cannot allocate %llu bytes of device staging on GPU %d (%s); "
              "stores go through the slow unstaged path\n",
              static_cast<unsigned long long>(want), dev, cudaGetErrorString(err));
      ds->staging = nullptr;
      want = 0;
    }
  }
  ds->staging_size = want;
  ds->alloc.Reset(want, 256);
  if (!host_registered_) {
    host_registered_ = true;
    for (Arena which : {Arena::kCache, Arena::kHostTier}) {
      const HostArena* a = &eng_->arena(which);
      if (!a->base || !a->size) continue;
      // cudaHostRegister faults in the pages not yet present from one thread: a 420 GiB tier
      // filled at about 1.2 GiB/s on a 4 x H200 host. Present pages it only pins.
      if (int failed =
              a->Populate(std::min(16u, std::max(1u, std::thread::hardware_concurrency()))))
        fprintf(stderr,
                "ssdtrain: populating %llu bytes of host memory from several threads failed "
                "(MADV_POPULATE_WRITE: %s); cudaHostRegister faults them in from one thread "
                "(slower, still correct)\n",
                static_cast<unsigned long long>(a->size), strerror(failed));
      cudaError_t err = cudaHostRegister(a->base, a->size, cudaHostRegisterPortable);
      if (err != cudaSuccess) {
        cudaGetLastError();
        fprintf(stderr,
                "ssdtrain: cudaHostRegister of %llu bytes failed (%s); host copies use "
                "pageable memory (slower, still correct)\n",
                static_cast<unsigned long long>(a->size), cudaGetErrorString(err));
      } else {
        registered_.push_back(a->base);
      }
    }
  }
  *out = ds.get();
  devices_[dev] = std::move(ds);
  return Status::Ok();
}

DeviceState* CudaModule::FindDevice(int dev) {
  auto it = devices_.find(dev);
  return it == devices_.end() ? nullptr : it->second.get();
}

DeviceEntry* CudaModule::Attach(Entry& e, int dev) {
  DeviceEntry* d = D(e);
  if (!d) {
    d = new DeviceEntry();
    d->device = dev;
    e.set_device_entry(d);
  }
  return d;
}

// ---- DeviceHooks ---------------------------------------------------------------------------

Status CudaModule::WaitHostReady(Entry& e) {
  DeviceEntry* d = D(e);
  if (d && d->d2h_deferred)  // only a load on the storing GPU can take a deferred copy
    return Status(EINVAL, "the bytes of " + DescribeTag(e.name(), e.site(), e.id()) +
                              " are in the device staging of GPU " + std::to_string(d->device) +
                              " (no host copy yet): load it there");
  if (d && d->host_direct) SSD_CHECK_CUDA(cudaEventSynchronize(d->host_direct));
  if (d && d->host_ready) SSD_CHECK_CUDA(cudaEventSynchronize(d->host_ready));
  return Status::Ok();
}

void CudaModule::BeforeHostFree(Entry& e) {
  DeviceEntry* d = D(e);
  if (!d) return;
  for (cudaEvent_t* ev : {&d->host_ready, &d->host_direct}) {
    if (!*ev) continue;
    HostWait(*ev, "cudaEventSynchronize before a host buffer is freed");
    PutEvent(d->device, *ev);
    *ev = nullptr;
  }
  SyncAndRecycle(d->device, &d->host_fences);
}

bool CudaModule::HasDeviceCopy(const Entry& e) {
  const DeviceEntry* d = e.device_entry();
  return d && d->staged && d->stage_bytes >= e.nbytes() && StagingUsable(e, *d);
}

void CudaModule::OnEntryFree(Entry& e) {
  DeviceEntry* d = D(e);
  if (!d) return;
  if (d->d2h_deferred) {
    if (DeviceState* ds = FindDevice(d->device)) ElideD2H(ds, e);
    d->d2h_deferred = false;
  }
  FreeStaging(e);
  BeforeHostFree(e);
  delete d;
  e.set_device_entry(nullptr);
}

void CudaModule::AppendStats(std::ostream& o) {
  tracker_.Append(o);
  uint64_t deferred = 0;
  for (const auto& [dev, ds] : devices_) {
    deferred += ds->deferred_bytes;
    o << "device" << dev << "_staging_bytes=" << ds->staging_size << '\n';  // its arena now
  }
  o << "d2h_elided_bytes=" << elided_bytes_ << '\n'
    << "d2h_elided_tensors=" << elided_tensors_ << '\n'
    << "d2h_forced=" << forced_d2h_ << '\n'
    << "d2h_deferred_bytes=" << deferred << '\n'
    << "staging_direct_stores=" << direct_stores_ << '\n'
    << "staging_direct_store_bytes=" << direct_store_bytes_ << '\n'
    << "staging_split_loads=" << split_loads_ << '\n'
    << "staging_split_load_host_bytes=" << split_load_host_bytes_ << '\n';
}

void CudaModule::ResetStats() {
  tracker_.Reset();
  elided_bytes_ = elided_tensors_ = forced_d2h_ = 0;
  direct_stores_ = direct_store_bytes_ = split_loads_ = split_load_host_bytes_ = 0;
}

CudaModule* Module(Engine& eng) {
  if (!eng.hooks()) eng.SetHooks(std::make_unique<CudaModule>(&eng));
  return static_cast<CudaModule*>(eng.hooks());
}

Status UseDevice(int dev) {
  int cur = -1;
  SSD_CHECK_CUDA(cudaGetDevice(&cur));
  if (cur != dev) SSD_CHECK_CUDA(cudaSetDevice(dev));
  return Status::Ok();
}

}  // namespace ssdtrain
