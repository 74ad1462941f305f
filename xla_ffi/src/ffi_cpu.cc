// CPU FFI handlers: the activation is in host memory; no CUDA anywhere here.
#include <cstring>
#include <string>

#include "ffi_common.h"

namespace ffi = xla::ffi;

namespace ssdtrain {
namespace {

ffi::Error StoreCpuImpl(int32_t device, ffi::RunId run, ffi::AnyBuffer x,
                        ffi::Result<ffi::Buffer<ffi::U32>> handle, int64_t site, int32_t tier,
                        std::string_view name, int64_t uses, int64_t stream_pass,
                        int32_t stream_dir) {
  return Guarded([&]() -> Status {
    SSD_RETURN_IF_ERROR(CheckStoreCall(handle->element_count(), stream_dir, name));
    Status st;
    auto engine = CurrentEngine(&st);
    if (!engine) return st;
    return engine->StoreFromHost(x.untyped_data(), x.size_bytes(), site, TierFromAttr(tier), name,
                                 handle->typed_data(), device, uses, run.run_id, stream_pass,
                                 stream_dir);
  });
}

ffi::Error LoadCpuImpl(int32_t device, ffi::RunId run, ffi::Buffer<ffi::U32> handle,
                       ffi::Result<ffi::AnyBuffer> out, int64_t site, int32_t tier,
                       std::string_view name, int32_t exact, int32_t consume, int64_t stream_pass,
                       int32_t stream_dir) {
  // The host reads every handle: nothing depends on a prediction on the CPU (an ordered or
  // streamed load's is made and checked, for the counters). `exact` (state an earlier execution
  // stored) orders the read-ahead of the files.
  return Guarded([&]() -> Status {
    SSD_RETURN_IF_ERROR(CheckLoadCall(handle.element_count(), exact, stream_dir, name));
    Status st;
    auto engine = CurrentEngine(&st);
    if (!engine) return st;
    return engine->LoadToHost(handle.typed_data(), out->untyped_data(), out->size_bytes(), site,
                              name, device, consume != 0, LoadOrderFromAttr(exact), run.run_id,
                              stream_pass, stream_dir);
  });
}

// A copy of x that XLA cannot see through, run after every further operand is computed (they
// are not read): the optimizer's device reference has one where the store's programs have a
// store or a load, so that both compile their arithmetic alike; and a handle passes one to
// order its load after other stores and loads (an optimization barrier does not hold).
ffi::Error CopyCpuImpl(ffi::AnyBuffer x, ffi::RemainingArgs after,
                       ffi::Result<ffi::AnyBuffer> out) {
  Status sizes = CheckCopySizes(x.size_bytes(), out->size_bytes());
  if (!sizes.ok()) return ToFfiError(sizes);
  if (x.size_bytes() != 0) std::memcpy(out->untyped_data(), x.untyped_data(), x.size_bytes());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace ssdtrain

// Exported (the library is built with -fvisibility=hidden).
extern "C" SSD_EXPORT XLA_FFI_Error* SsdtrainStoreCpu(XLA_FFI_CallFrame* call_frame);
extern "C" SSD_EXPORT XLA_FFI_Error* SsdtrainLoadCpu(XLA_FFI_CallFrame* call_frame);
extern "C" SSD_EXPORT XLA_FFI_Error* SsdtrainCopyCpu(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(SsdtrainCopyCpu, ssdtrain::CopyCpuImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()    // x
                                  .RemainingArgs()          // after: ordering only, not read
                                  .Ret<ffi::AnyBuffer>());  // out: x's bytes

// The store's and the load's attributes: ssdtrain/attributes.h (their codes and meaning).
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SsdtrainStoreCpu, ssdtrain::StoreCpuImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::DeviceOrdinal>()       // device of the call (per-device sites, stats)
        .Ctx<ffi::RunId>()               // XLA execution (the read-ahead of exact loads)
        .Arg<ffi::AnyBuffer>()           // x: the activation to store
        .Ret<ffi::Buffer<ffi::U32>>()    // handle: uint32[2] = {id, check word}
        .Attr<int64_t>("site")           // tag site id (shared by store and load)
        .Attr<int32_t>("tier")           // enum ssdtrain_tier
        .Attr<std::string_view>("name")  // tag name, for messages only
        .Attr<int64_t>("uses")           // loads per entry in this execution, < 0: ssdtrain_uses
        .Attr<int64_t>("stream_pass")    // a layer stack's store: the program's pass, else 0
        .Attr<int32_t>("stream_dir"));   // and its layer order: enum ssdtrain_stream_dir

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SsdtrainLoadCpu, ssdtrain::LoadCpuImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::DeviceOrdinal>()       // device of the call (must be the store's)
        .Ctx<ffi::RunId>()               // XLA execution (streamed loads' prediction)
        .Arg<ffi::Buffer<ffi::U32>>()    // handle: from the matching store
        .Ret<ffi::AnyBuffer>()           // out: receives the stored bytes
        .Attr<int64_t>("site")           // tag site id (must match the store)
        .Attr<int32_t>("tier")           // tier of the matching store
        .Attr<std::string_view>("name")  // tag name, for messages only
        .Attr<int32_t>("exact")          // enum ssdtrain_load_order
        .Attr<int32_t>("consume")        // 1: the entry's last load (released after it)
        .Attr<int64_t>("stream_pass")    // exact == SSDTRAIN_LOAD_STREAM: the load's pass
        .Attr<int32_t>("stream_dir"));   // and its layer order: enum ssdtrain_stream_dir
