// Events (device_module.h): the per-GPU pool of events, fences (the events of a buffer's
// asynchronous users, which its next user waits for or the host syncs on before reusing it),
// and waits of a stream inside the copy tracker's timing brackets.
#include "device_module.h"

namespace ssdtrain {

Status CudaModule::NewEvent(DeviceState* ds, cudaEvent_t* ev) {
  if (!ds->free_events.empty()) {
    *ev = ds->free_events.back();
    ds->free_events.pop_back();
    return Status::Ok();
  }
  SSD_CHECK_CUDA(cudaEventCreateWithFlags(ev, cudaEventDisableTiming));
  return Status::Ok();
}

void CudaModule::PutEvent(int dev, cudaEvent_t ev) {
  if (!ev) return;
  auto it = devices_.find(dev);
  if (it == devices_.end()) {
    cudaEventDestroy(ev);
    return;
  }
  it->second->free_events.push_back(ev);
}

Status CudaModule::AddFence(DeviceState* ds, std::vector<cudaEvent_t>* fences,
                            cudaStream_t stream) {
  for (size_t i = 0; i < fences->size();) {
    if (cudaEventQuery((*fences)[i]) == cudaSuccess) {
      ds->free_events.push_back((*fences)[i]);
      (*fences)[i] = fences->back();
      fences->pop_back();
    } else {
      cudaGetLastError();
      ++i;
    }
  }
  cudaEvent_t ev;
  SSD_RETURN_IF_ERROR(NewEvent(ds, &ev));
  cudaError_t err = cudaEventRecord(ev, stream);
  if (err != cudaSuccess) {
    ds->free_events.push_back(ev);
    SSD_CHECK_CUDA(err);
  }
  fences->push_back(ev);
  return Status::Ok();
}

void CudaModule::SyncAndRecycle(int dev, std::vector<cudaEvent_t>* fences) {
  for (cudaEvent_t ev : *fences) {
    HostWait(ev, "cudaEventSynchronize of a host buffer's fence");
    PutEvent(dev, ev);
  }
  fences->clear();
}

void CudaModule::HostWait(cudaEvent_t ev, const char* what) {
  if (!ev) return;
  cudaError_t err = cudaEventSynchronize(ev);
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();
  eng_->FailLater(CudaError(err, what, __FILE__, __LINE__));
}

bool CudaModule::Done(cudaEvent_t ev) {
  if (!ev) return true;
  cudaError_t e = cudaEventQuery(ev);
  if (e != cudaSuccess) cudaGetLastError();
  return e == cudaSuccess;
}

bool CudaModule::Idle(DeviceEntry* d) {
  if (!Done(d->stage_ready) || !Done(d->stage_d2h)) return false;
  for (cudaEvent_t ev : d->stage_fences)
    if (!Done(ev)) return false;
  return true;
}

Status CudaModule::WaitTracked(int dev, cudaStream_t stream, cudaEvent_t ev,
                               std::string_view name) {
  if (!ev || Done(ev)) return Status::Ok();
  return Tracked(dev, stream, CopyOp::kComputeWait, 0, name, [&] {
    SSD_CHECK_CUDA(cudaStreamWaitEvent(stream, ev, 0));
    return Status::Ok();
  });
}

}  // namespace ssdtrain
