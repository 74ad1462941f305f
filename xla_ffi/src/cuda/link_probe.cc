// The PCIe link of a GPU, measured: pinned host <-> device copies of one size, each direction
// alone and both at once (C ABI ssdtrain_probe_link; jax_ssdtrain.probe.measure_link caches it).
// The host buffers are cudaHostAlloc'ed, or mmap'ed and registered as the engine's arenas are
// (with or without transparent huge pages), so that the two can be compared.
// Self-contained: its own buffers and streams, freed before it returns; the engine is untouched.
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda_check.h"
#include "link_probe.h"
#include "status.h"

namespace ssdtrain {
namespace {

struct LinkBuffers {
  int device = -1;
  int host_kind = 0;  // 0 cudaHostAlloc, 1 mmap + cudaHostRegister, 2 the same with MADV_HUGEPAGE
  uint64_t size = 0;
  void* dev[2] = {nullptr, nullptr};
  void* host[2] = {nullptr, nullptr};
  bool registered[2] = {false, false};
  cudaStream_t stream[2] = {nullptr, nullptr};
  cudaEvent_t start[2] = {nullptr, nullptr}, stop[2] = {nullptr, nullptr};

  ~LinkBuffers() {
    for (int i = 0; i < 2; ++i) {
      if (stream[i]) cudaStreamSynchronize(stream[i]);
      if (dev[i]) cudaFree(dev[i]);
      if (host[i] && host_kind == 0) cudaFreeHost(host[i]);
      if (registered[i]) cudaHostUnregister(host[i]);
      if (host[i] && host_kind != 0) munmap(host[i], size);
      if (stream[i]) cudaStreamDestroy(stream[i]);
      if (start[i]) cudaEventDestroy(start[i]);
      if (stop[i]) cudaEventDestroy(stop[i]);
    }
    cudaGetLastError();
  }

  Status Init(int dev_ordinal, uint64_t bytes, int kind) {
    device = dev_ordinal;
    host_kind = kind;
    size = bytes;
    SSD_CHECK_CUDA(cudaSetDevice(device));
    for (int i = 0; i < 2; ++i) {
      SSD_CHECK_CUDA(cudaMalloc(&dev[i], bytes));
      if (kind == 0) {
        SSD_CHECK_CUDA(cudaHostAlloc(&host[i], bytes, cudaHostAllocPortable));
      } else {
        void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) return SysError(errno, "mmap of a probe buffer", __FILE__, __LINE__);
        host[i] = p;
        if (kind == 2 && madvise(p, bytes, MADV_HUGEPAGE) != 0)
          return SysError(errno, "madvise(MADV_HUGEPAGE)", __FILE__, __LINE__);
        SSD_CHECK_CUDA(cudaHostRegister(p, bytes, cudaHostRegisterPortable));
        registered[i] = true;
      }
      std::fill_n(static_cast<char*>(host[i]), bytes, static_cast<char>(0xa5));
      SSD_CHECK_CUDA(cudaStreamCreateWithFlags(&stream[i], cudaStreamNonBlocking));
      // On the probe's own stream: a cudaMemset on the legacy stream would wait for the
      // kernels another stream of the process (XLA's) is running.
      SSD_CHECK_CUDA(cudaMemsetAsync(dev[i], 0x5a, bytes, stream[i]));
      SSD_CHECK_CUDA(cudaStreamSynchronize(stream[i]));
      SSD_CHECK_CUDA(cudaEventCreate(&start[i]));
      SSD_CHECK_CUDA(cudaEventCreate(&stop[i]));
    }
    return Status::Ok();
  }

  // Direction 0: device -> host on stream 0; direction 1: host -> device on stream 1.
  Status Enqueue(int dir, uint64_t bytes) {
    SSD_CHECK_CUDA(cudaEventRecord(start[dir], stream[dir]));
    if (dir == 0)
      SSD_CHECK_CUDA(cudaMemcpyAsync(host[0], dev[0], bytes, cudaMemcpyDeviceToHost, stream[0]));
    else
      SSD_CHECK_CUDA(cudaMemcpyAsync(dev[1], host[1], bytes, cudaMemcpyHostToDevice, stream[1]));
    SSD_CHECK_CUDA(cudaEventRecord(stop[dir], stream[dir]));
    return Status::Ok();
  }

  Status Seconds(int dir, double* s) {
    SSD_CHECK_CUDA(cudaEventSynchronize(stop[dir]));
    float ms = 0;
    SSD_CHECK_CUDA(cudaEventElapsedTime(&ms, start[dir], stop[dir]));
    *s = ms * 1e-3;
    return Status::Ok();
  }
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

// out[0]: D2H GB/s alone, out[1]: H2D alone, out[2]/out[3]: D2H/H2D when both run at once
// (medians of `repeats` copies of `bytes`, after one untimed round), out[4]: seconds from the
// return of `on_ready` to the end of the last copy. `on_ready` (may be null) runs once the
// buffers are allocated and filled, before the first copy: a caller starts other GPU work
// there to measure the copies next to it (allocation and freeing may wait for that work).
Status ProbeLink(int device, uint64_t bytes, int repeats, int host_kind, void (*on_ready)(),
                 double out[5]) {
  if (host_kind < 0 || host_kind > 2)
    return Status(EINVAL,
                  "probe_link: host_kind must be 0 (cudaHostAlloc), 1 (registered mmap) "
                  "or 2 (registered mmap, huge pages), got " +
                      std::to_string(host_kind));
  if (bytes == 0 || repeats < 1)
    return Status(EINVAL, "probe_link: bytes and repeats must be positive (got " +
                              std::to_string(bytes) + ", " + std::to_string(repeats) + ")");
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status(ENODEV, std::string("measuring the PCIe link: no usable GPU (") +
                              cudaGetErrorName(err) + ": " + cudaGetErrorString(err) + ")");
  }
  if (device < 0 || device >= count)
    return Status(EINVAL, "probe_link: no GPU " + std::to_string(device) + " (this process sees " +
                              std::to_string(count) + ")");
  int prev = -1;
  SSD_CHECK_CUDA(cudaGetDevice(&prev));
  Status st = [&]() -> Status {
    LinkBuffers b;
    SSD_RETURN_IF_ERROR(b.Init(device, bytes, host_kind));
    if (on_ready) on_ready();
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<double> alone[2], both[2];
    for (int r = 0; r <= repeats; ++r) {
      for (int dir = 0; dir < 2; ++dir) {
        double s = 0;
        SSD_RETURN_IF_ERROR(b.Enqueue(dir, bytes));
        SSD_RETURN_IF_ERROR(b.Seconds(dir, &s));
        if (r > 0) alone[dir].push_back(bytes / s / 1e9);
      }
      SSD_RETURN_IF_ERROR(b.Enqueue(0, bytes));
      SSD_RETURN_IF_ERROR(b.Enqueue(1, bytes));
      for (int dir = 0; dir < 2; ++dir) {
        double s = 0;
        SSD_RETURN_IF_ERROR(b.Seconds(dir, &s));
        if (r > 0) both[dir].push_back(bytes / s / 1e9);
      }
    }
    out[0] = Median(alone[0]);
    out[1] = Median(alone[1]);
    out[2] = Median(both[0]);
    out[3] = Median(both[1]);
    out[4] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return Status::Ok();
  }();
  if (prev >= 0) cudaSetDevice(prev);
  return st.ok() ? st : st.With("measuring the PCIe link of GPU " + std::to_string(device));
}

}  // namespace ssdtrain
