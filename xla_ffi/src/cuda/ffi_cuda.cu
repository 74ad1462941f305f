// CUDA FFI handlers: the activation is in device memory, ordered by XLA's compute stream; the
// device module (cuda/) copies it out and back. Never marked kCmdBufferCompatible: the handlers
// do blocking host work that a CUDA graph cannot capture.
#include <cuda_runtime.h>

#include <string>

#include "cuda/store_load.h"
#include "ffi_common.h"

namespace ffi = xla::ffi;

namespace ssdtrain {
namespace {

ffi::Error StoreCudaImpl(int32_t device, cudaStream_t stream, ffi::RunId run, ffi::AnyBuffer x,
                         ffi::Result<ffi::Buffer<ffi::U32>> handle, int64_t site, int32_t tier,
                         std::string_view name, int64_t uses) {
  return Guarded([&]() -> Status {
    SSD_RETURN_IF_ERROR(CheckHandleShape(handle->element_count(), "store", name));
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
    return StoreFromDevice(*engine, store);
  });
}

ffi::Error LoadCudaImpl(int32_t device, cudaStream_t stream, ffi::RunId run,
                        ffi::Buffer<ffi::U32> handle, ffi::Result<ffi::AnyBuffer> out, int64_t site,
                        int32_t tier, std::string_view name, int32_t exact, int32_t consume) {
  return Guarded([&]() -> Status {
    SSD_RETURN_IF_ERROR(CheckHandleShape(handle.element_count(), "load", name));
    Status st;
    auto engine = CurrentEngine(&st);
    if (!engine) return st;
    DeviceLoad load;
    load.exact = exact != 0;
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

// The optimizer's device reference (location="device"): a device-to-device copy on the compute
// stream that XLA cannot see through, where the store's programs have a store or a load.
ffi::Error CopyCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  if (x.size_bytes() != out->size_bytes())
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "ssdtrain: copy: input of " + std::to_string(x.size_bytes()) +
                          " bytes, output of " + std::to_string(out->size_bytes()));
  if (x.size_bytes() == 0) return ffi::Error::Success();
  cudaError_t err = cudaMemcpyAsync(out->untyped_data(), x.untyped_data(), x.size_bytes(),
                                    cudaMemcpyDeviceToDevice, stream);
  if (err != cudaSuccess)
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("ssdtrain: copy: cudaMemcpyAsync: ") + cudaGetErrorString(err));
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
        .Attr<int64_t>("uses"));  // loads per entry in this execution, -1: uncounted

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
        .Attr<int32_t>("exact")      // 1: read the handle, never predict (state from a past step)
        .Attr<int32_t>("consume"));  // 1: the entry's last load (state updated in place)
