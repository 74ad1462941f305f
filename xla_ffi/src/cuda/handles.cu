// Handles on the device: the kernels that write a store's handle and check a predicted load's,
// the mapped slots the check reports mismatches in, and reading a load's handle on the host
// (handles.h).
#include "handles.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>

#include "cuda_check.h"

namespace ssdtrain {
namespace {

__global__ void WriteHandleKernel(uint32_t* h, uint32_t a, uint32_t b) {
  h[0] = a;
  h[1] = b;
}

__global__ void VerifyHandleKernel(const uint32_t* handle, uint32_t want0, uint32_t want1,
                                   unsigned char* out, uint64_t nbytes, MismatchSlot* slot,
                                   unsigned long long run_id) {
  const uint32_t a = handle[0], b = handle[1];
  if (a == want0 && b == want1) return;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nbytes;
       i += stride)
    out[i] = 0xFF;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    volatile MismatchSlot* s = slot;
    s->run_id = run_id;
    s->predicted = want0;
    s->actual = a;
    s->actual_check = b;
    __threadfence_system();
    s->count = s->count + 1;
    __threadfence_system();
  }
}

// Copies a handle into mapped host memory. A kernel, not a cudaMemcpy: a D2H copy on the compute
// stream would queue on the copy engine behind the D2H of the stores before it (the copy
// stream's), so every read load would wait for them and no load's H2D would overlap a store's
// D2H (measured on the H100: the optimizer state's two directions then took turns).
__global__ void ReadHandleKernel(const uint32_t* handle, volatile uint32_t* out) {
  out[0] = handle[0];
  out[1] = handle[1];
  __threadfence_system();
}

// Mapped pinned host memory a thread reads load handles into (host and device addresses).
thread_local uint32_t* t_handle_host = nullptr;
thread_local uint32_t* t_handle_dev = nullptr;

}  // namespace

Status LaunchWriteHandle(cudaStream_t stream, uint32_t* dst, const uint32_t h[2]) {
  WriteHandleKernel<<<1, 1, 0, stream>>>(dst, h[0], h[1]);
  SSD_CHECK_CUDA(cudaGetLastError());
  return Status::Ok();
}

Status ReadHandle(cudaStream_t stream, const uint32_t* handle, uint32_t h[2], double* seconds) {
  if (!t_handle_host) {
    void* p = nullptr;
    SSD_CHECK_CUDA(cudaHostAlloc(&p, 64, cudaHostAllocMapped | cudaHostAllocPortable));
    void* d = nullptr;
    cudaError_t err = cudaHostGetDevicePointer(&d, p, 0);
    if (err != cudaSuccess) cudaFreeHost(p);
    SSD_CHECK_CUDA(err);
    t_handle_host = static_cast<uint32_t*>(p);
    t_handle_dev = static_cast<uint32_t*>(d);  // unified addressing: valid on every GPU
  }
  auto t0 = Engine::Clock::now();
  ReadHandleKernel<<<1, 1, 0, stream>>>(handle, t_handle_dev);
  SSD_CHECK_CUDA(cudaGetLastError());
  SSD_CHECK_CUDA(cudaStreamSynchronize(stream));
  volatile const uint32_t* got = t_handle_host;
  h[0] = got[0];
  h[1] = got[1];
  *seconds = std::chrono::duration<double>(Engine::Clock::now() - t0).count();
  return Status::Ok();
}

Status HandleChecks::Slots(MismatchSlot** dev_ptr) {
  if (!host_) {
    void* p = nullptr;
    SSD_CHECK_CUDA(cudaHostAlloc(&p, kSlots * sizeof(MismatchSlot),
                                 cudaHostAllocMapped | cudaHostAllocPortable));
    memset(p, 0, kSlots * sizeof(MismatchSlot));
    void* d = nullptr;
    cudaError_t err = cudaHostGetDevicePointer(&d, p, 0);
    if (err != cudaSuccess) cudaFreeHost(p);
    SSD_CHECK_CUDA(err);
    host_ = static_cast<MismatchSlot*>(p);
    dev_ = static_cast<MismatchSlot*>(d);
  }
  *dev_ptr = dev_;
  return Status::Ok();
}

Status HandleChecks::LaunchVerify(cudaStream_t stream, const uint32_t* handle,
                                  const uint32_t want[2], void* out, uint64_t nbytes,
                                  int64_t run_id) {
  MismatchSlot* slots = nullptr;
  SSD_RETURN_IF_ERROR(Slots(&slots));
  VerifyHandleKernel<<<256, 256, 0, stream>>>(
      handle, want[0], want[1], static_cast<unsigned char*>(out), nbytes,
      slots + (static_cast<uint64_t>(run_id) % kSlots), static_cast<unsigned long long>(run_id));
  SSD_CHECK_CUDA(cudaGetLastError());
  return Status::Ok();
}

Status HandleChecks::TakeMismatch(Engine* eng) {
  if (!host_) return Status::Ok();
  for (int i = 0; i < kSlots; ++i) {
    volatile MismatchSlot* s = &host_[i];
    unsigned int count = s->count;
    if (count == reported_[i]) continue;
    std::atomic_thread_fence(std::memory_order_acquire);
    const unsigned int n = count - reported_[i];
    reported_[i] = count;
    eng->CountHandleMismatches(n);
    return Status(EIO, "a predicted load got the handle {" + std::to_string(s->actual) + ", " +
                           std::to_string(s->actual_check) + "} instead of entry " +
                           std::to_string(s->predicted) + " (XLA execution " +
                           std::to_string(s->run_id) +
                           "): this program loads a tag out of store order; its output was "
                           "filled with NaN and this step failed. Configure exact_loads=True "
                           "(SSDTRAIN_EXACT_LOADS=1) for such programs");
  }
  return Status::Ok();
}

void HandleChecks::Free() {
  if (host_) cudaFreeHost(host_);
  host_ = dev_ = nullptr;
}

}  // namespace ssdtrain
