// Shared helpers of the FFI handlers.
#pragma once

#include <string_view>

#include "engine.h"
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

// The load's "exact" attribute names a LoadOrder (entry.h).
inline Status CheckLoadOrder(int32_t exact, std::string_view name) {
  if (exact >= 0 && exact <= static_cast<int32_t>(LoadOrder::kStream)) return Status::Ok();
  return Status(EINVAL, "load of tag '" + std::string(name) + "': attribute exact=" +
                            std::to_string(exact) + " names no load order (0 to 3)");
}

// A layer order attribute (stream_dir): 1 up, -1 down, 0 not given.
inline Status CheckStreamDir(int32_t dir, std::string_view what, std::string_view name) {
  if (dir >= -1 && dir <= 1) return Status::Ok();
  return Status(EINVAL, std::string(what) + " of tag '" + std::string(name) +
                            "': attribute stream_dir=" + std::to_string(dir) +
                            " names no layer order (1 up, -1 down, 0 not given)");
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
