// CUDA FFI handlers: the activation is in device memory, ordered by XLA's compute stream; the
// device module (cuda/) copies it out and back. Never marked kCmdBufferCompatible: the handlers
// do blocking host work that a CUDA graph cannot capture.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/store_load.h"
#include "ffi_common.h"

namespace ffi = xla::ffi;

namespace ssdtrain {
namespace {

ffi::Error StoreCudaImpl(int32_t device, cudaStream_t stream, ffi::RunId run, ffi::AnyBuffer x,
                         ffi::Result<ffi::Buffer<ffi::U32>> handle, int64_t site, int32_t tier,
                         std::string_view name, int64_t uses, int64_t stream_pass,
                         int32_t stream_dir) {
  return Guarded([&]() -> Status {
    SSD_RETURN_IF_ERROR(CheckStoreCall(handle->element_count(), stream_dir, name));
    Status st;
    auto engine = CurrentEngine(&st);
    if (!engine) return st;
    DeviceStore store;
    store.device = device;
    store.stream = stream;
    store.run_id = run.run_id;
    store.src = x.untyped_data();
    store.nbytes = x.size_bytes();
    store.handle = handle->typed_data();
    store.site = site;
    store.tier = TierFromAttr(tier);
    store.name = name;
    store.uses = uses;
    store.stream_pass = stream_pass;
    store.stream_dir = stream_dir;
    return StoreFromDevice(*engine, store);
  });
}

ffi::Error LoadCudaImpl(int32_t device, cudaStream_t stream, ffi::RunId run,
                        ffi::Buffer<ffi::U32> handle, ffi::Result<ffi::AnyBuffer> out, int64_t site,
                        int32_t tier, std::string_view name, int32_t exact, int32_t consume,
                        int64_t stream_pass, int32_t stream_dir) {
  return Guarded([&]() -> Status {
    SSD_RETURN_IF_ERROR(CheckLoadCall(handle.element_count(), exact, stream_dir, name));
    Status st;
    auto engine = CurrentEngine(&st);
    if (!engine) return st;
    DeviceLoad load;
    load.order = LoadOrderFromAttr(exact);
    load.stream_pass = stream_pass;
    load.stream_dir = stream_dir;
    load.consume = consume != 0;
    load.device = device;
    load.stream = stream;
    load.run_id = run.run_id;
    load.handle = handle.typed_data();
    load.dst = out->untyped_data();
    load.nbytes = out->size_bytes();
    load.site = site;
    load.name = name;
    return LoadToDevice(*engine, load);
  });
}

// Copies n bytes: 16 at a time where both pointers are 16-byte aligned (XLA's buffers are), the
// rest byte by byte. A kernel, not cudaMemcpyAsync: a device-to-device memcpy may run on the
// copy engines, behind the store's and the load's transfers over the link.
__global__ void CopyBytesKernel(const unsigned char* src, unsigned char* dst, size_t n) {
  size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  bool aligned =
      (reinterpret_cast<uintptr_t>(src) % 16 == 0) && (reinterpret_cast<uintptr_t>(dst) % 16 == 0);
  size_t wide = aligned ? n / 16 : 0;
  const uint4* s16 = reinterpret_cast<const uint4*>(src);
  uint4* d16 = reinterpret_cast<uint4*>(dst);
  for (size_t i = first; i < wide; i += stride) d16[i] = s16[i];
  for (size_t i = wide * 16 + first; i < n; i += stride) dst[i] = src[i];
}

// A device-to-device copy of x on the compute stream that XLA cannot see through, run after
// every further operand is computed (they are not read): see ffi_cpu.cc's CopyCpuImpl.
ffi::Error CopyCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::RemainingArgs after,
                        ffi::Result<ffi::AnyBuffer> out) {
  Status sizes = CheckCopySizes(x.size_bytes(), out->size_bytes());
  if (!sizes.ok()) return ToFfiError(sizes);
  size_t n = x.size_bytes();
  if (n == 0) return ffi::Error::Success();
  constexpr unsigned kThreads = 256;
  size_t units = (n + 15) / 16;
  unsigned blocks =
      static_cast<unsigned>(std::min<size_t>((units + kThreads - 1) / kThreads, 4096));
  CopyBytesKernel<<<blocks, kThreads, 0, stream>>>(
      static_cast<const unsigned char*>(x.untyped_data()),
      static_cast<unsigned char*>(out->untyped_data()), n);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("ssdtrain: copy: kernel launch: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace ssdtrain

// Exported (the library is built with -fvisibility=hidden).
extern "C" SSD_EXPORT XLA_FFI_Error* SsdtrainStoreCuda(XLA_FFI_CallFrame* call_frame);
extern "C" SSD_EXPORT XLA_FFI_Error* SsdtrainLoadCuda(XLA_FFI_CallFrame* call_frame);
extern "C" SSD_EXPORT XLA_FFI_Error* SsdtrainCopyCuda(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(SsdtrainCopyCuda, ssdtrain::CopyCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // compute stream
                                  .Arg<ffi::AnyBuffer>()                     // x (device)
                                  .RemainingArgs()          // after: ordering only, not read
                                  .Ret<ffi::AnyBuffer>());  // out: x's bytes (device)

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SsdtrainStoreCuda, ssdtrain::StoreCudaImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::DeviceOrdinal>()                 // GPU of the call
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // compute stream of the call
        .Ctx<ffi::RunId>()                         // XLA execution (load prediction)
        .Arg<ffi::AnyBuffer>()                     // x: the activation to store (device)
        .Ret<ffi::Buffer<ffi::U32>>()              // handle: uint32[2] = {id, check word}
        .Attr<int64_t>("site")                     // tag site id (shared by store and load)
        .Attr<int32_t>("tier")                     // 0 = nvme via host cache, 1 = host tier
        .Attr<std::string_view>("name")            // tag name, for messages only
        .Attr<int64_t>("uses")          // loads per entry in this execution, < 0: Entry::k*
        .Attr<int64_t>("stream_pass")   // a layer stack's store: the program's pass, else 0
        .Attr<int32_t>("stream_dir"));  // and its layer order: 1 up, -1 down, 0 not given

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SsdtrainLoadCuda, ssdtrain::LoadCudaImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::DeviceOrdinal>()                 // GPU of the call (must be the store's)
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // compute stream of the call
        .Ctx<ffi::RunId>()                         // XLA execution (load prediction)
        .Arg<ffi::Buffer<ffi::U32>>()              // handle: from the matching store (device)
        .Ret<ffi::AnyBuffer>()                     // out: receives the stored bytes (device)
        .Attr<int64_t>("site")                     // tag site id (must match the store)
        .Attr<int32_t>("tier")                     // tier of the matching store
        .Attr<std::string_view>("name")            // tag name, for messages only
        .Attr<int32_t>("exact")                    // LoadOrder (entry.h)
        .Attr<int32_t>("consume")       // 1: the entry's last load (state updated in place)
        .Attr<int64_t>("stream_pass")   // exact == 3: the program's pass of the load
        .Attr<int32_t>("stream_dir"));  // and its layer order: 1 up, -1 down, 0 not given
