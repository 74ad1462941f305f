// Shared helpers of the FFI handlers.
#pragma once

#include <string_view>

#include "ssdtrain/engine.h"
#include "xla/ffi/api/ffi.h"

namespace ssdtrain {

inline xla::ffi::Error ToFfiError(const Status& s) {
  namespace ffi = xla::ffi;
  if (s.ok()) return ffi::Error::Success();
  ffi::ErrorCode code = ffi::ErrorCode::kInternal;
  switch (s.code()) {
    case EINVAL: code = ffi::ErrorCode::kInvalidArgument; break;
    case ENOSPC:
    case ENOMEM: code = ffi::ErrorCode::kResourceExhausted; break;
    default: break;
  }
  std::string msg = "ssdtrain: " + s.message();
  if (s.code() != EINVAL) msg += " [" + ErrnoString(s.code()) + "]";
  return ffi::Error(code, msg);
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
