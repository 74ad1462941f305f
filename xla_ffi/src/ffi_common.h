// Shared helpers of the FFI handlers.
#pragma once

#include <string_view>

#include "engine.h"
#include "ssdtrain/attributes.h"
#include "xla/ffi/api/ffi.h"

namespace ssdtrain {

inline xla::ffi::Error ToFfiError(const Status& s) {
  namespace ffi = xla::ffi;
  if (s.ok()) return ffi::Error::Success();
  ffi::ErrorCode code = ffi::ErrorCode::kInternal;
  switch (s.code()) {
    case EINVAL:
      code = ffi::ErrorCode::kInvalidArgument;
      break;
    case ENOSPC:
    case ENOMEM:
      code = ffi::ErrorCode::kResourceExhausted;
      break;
    default:
      break;
  }
  std::string msg = "ssdtrain: " + s.message();
  if (s.code() != EINVAL) msg += " [" + ErrnoString(s.code()) + "]";
  return ffi::Error(code, msg);
}

// A handle is uint32[2] = {id, check}; `op` is "store" or "load" for the message.
inline Status CheckHandleShape(size_t element_count, std::string_view op, std::string_view name) {
  if (element_count == 2) return Status::Ok();
  return Status(EINVAL, std::string(op) + " of tag '" + std::string(name) +
                            "': the handle must have 2 uint32 elements, got " +
                            std::to_string(element_count));
}

// The load's "exact" attribute names a LoadOrder (enum ssdtrain_load_order, attributes.h).
inline Status CheckLoadOrder(int32_t exact, std::string_view name) {
  switch (exact) {
    case SSDTRAIN_LOAD_ACTIVATION:
    case SSDTRAIN_LOAD_READ:
    case SSDTRAIN_LOAD_STORE_ORDER:
    case SSDTRAIN_LOAD_STREAM:
      return Status::Ok();
    default:
      return Status(EINVAL, "load of tag '" + std::string(name) +
                                "': attribute exact=" + std::to_string(exact) +
                                " names no load order (enum ssdtrain_load_order, "
                                "ssdtrain/attributes.h)");
  }
}

// A layer order attribute (stream_dir, enum ssdtrain_stream_dir): up, down, or not given.
inline Status CheckStreamDir(int32_t dir, std::string_view what, std::string_view name) {
  switch (dir) {
    case SSDTRAIN_STREAM_UP:
    case SSDTRAIN_STREAM_DOWN:
    case SSDTRAIN_STREAM_NONE:
      return Status::Ok();
    default:
      return Status(EINVAL, std::string(what) + " of tag '" + std::string(name) +
                                "': attribute stream_dir=" + std::to_string(dir) + " names no " +
                                "layer order (" + std::to_string(SSDTRAIN_STREAM_UP) + " up, " +
                                std::to_string(SSDTRAIN_STREAM_DOWN) + " down, " +
                                std::to_string(SSDTRAIN_STREAM_NONE) + " not given)");
  }
}

// A store call's handle and attributes, checked alike by the CPU and the CUDA handler.
inline Status CheckStoreCall(size_t handle_elements, int32_t stream_dir, std::string_view name) {
  SSD_RETURN_IF_ERROR(CheckHandleShape(handle_elements, "store", name));
  return CheckStreamDir(stream_dir, "store", name);
}

// A load call's handle and attributes, checked alike by the CPU and the CUDA handler.
inline Status CheckLoadCall(size_t handle_elements, int32_t exact, int32_t stream_dir,
                            std::string_view name) {
  SSD_RETURN_IF_ERROR(CheckHandleShape(handle_elements, "load", name));
  SSD_RETURN_IF_ERROR(CheckLoadOrder(exact, name));
  return CheckStreamDir(stream_dir, "load", name);
}

// The copy handlers' one check: an output of the input's size.
inline Status CheckCopySizes(size_t in_bytes, size_t out_bytes) {
  if (in_bytes == out_bytes) return Status::Ok();
  return Status(EINVAL, "copy: input of " + std::to_string(in_bytes) + " bytes, output of " +
                            std::to_string(out_bytes));
}

// Runs f() -> Status, converting exceptions so nothing propagates into XLA.
template <typename F>
xla::ffi::Error Guarded(F&& f) {
  try {
    return ToFfiError(f());
  } catch (const std::bad_alloc&) {
    return ToFfiError(Status(ENOMEM, "out of memory"));
  } catch (const std::exception& ex) {
    return ToFfiError(Status(EIO, std::string("internal error: ") + ex.what()));
  } catch (...) {
    return ToFfiError(Status(EIO, "internal error (unknown exception)"));
  }
}

}  // namespace ssdtrain
