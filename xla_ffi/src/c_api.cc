// The C ABI (ssdtrain/c_api.h, which documents each function, and the test hooks of
// ssdtrain/testing.h) used by jax_ssdtrain/_src/native.py through ctypes. Nothing throws across
// it: every failure is an errno-like code plus a message.
#include "ssdtrain/c_api.h"
#include "ssdtrain/testing.h"

#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "engine.h"
#include "xla/ffi/api/c_api.h"
#ifdef SSDTRAIN_HAVE_CUDA
#include "cuda/link_probe.h"
#endif

using ssdtrain::Status;

namespace {

int CopyOut(const std::string& s, char* out, size_t len) {
  if (!out || len == 0) return ERANGE;
  size_t n = std::min(s.size(), len - 1);
  memcpy(out, s.data(), n);
  out[n] = '\0';
  return n < s.size() ? ERANGE : 0;
}

int Report(const Status& s, char* err, size_t errlen) {
  if (s.ok()) {
    if (err && errlen) err[0] = '\0';
    return 0;
  }
  CopyOut(s.message(), err, errlen);
  return s.code() ? s.code() : EIO;
}

template <typename F>
int Guard(char* err, size_t errlen, F&& f) {
  try {
    return Report(f(), err, errlen);
  } catch (const std::bad_alloc&) {
    return Report(Status(ENOMEM, "out of memory"), err, errlen);
  } catch (const std::exception& ex) {
    return Report(Status(EIO, std::string("internal error: ") + ex.what()), err, errlen);
  } catch (...) {
    return Report(Status(EIO, "internal error (unknown exception)"), err, errlen);
  }
}

}  // namespace

// Each function is documented where it is declared, in ssdtrain/c_api.h.
extern "C" {

SSDTRAIN_API int ssdtrain_configure(const char* kv, char* err, size_t errlen) {
  return Guard(err, errlen, [&]() -> Status {
    ssdtrain::Config cfg;
    SSD_RETURN_IF_ERROR(ssdtrain::Config::Parse(kv ? kv : "", &cfg));
    return ssdtrain::ReplaceEngine(&cfg);
  });
}

SSDTRAIN_API int ssdtrain_config(char* out, size_t outlen) {
  try {
    auto e = ssdtrain::PeekEngine();
    return CopyOut(e ? e->config().ToString() : std::string(), out, outlen);
  } catch (...) {
    return CopyOut("", out, outlen), EIO;
  }
}

SSDTRAIN_API int ssdtrain_stats(char* out, size_t outlen) {
  try {
    auto e = ssdtrain::PeekEngine();
    if (!e) return CopyOut("configured=0\n", out, outlen);
    return CopyOut("configured=1\n" + e->StatsString(), out, outlen);
  } catch (...) {
    return CopyOut("", out, outlen), EIO;
  }
}

SSDTRAIN_API int ssdtrain_timeline(char* out, size_t outlen) {
  try {
    auto e = ssdtrain::PeekEngine();
    return CopyOut(e ? e->TakeTimeline() : std::string(), out, outlen);
  } catch (...) {
    return CopyOut("", out, outlen), EIO;
  }
}

SSDTRAIN_API int ssdtrain_probe_link(int device, uint64_t bytes, int repeats, int host_kind,
                                     ssdtrain_ready_fn on_ready, double* out, char* err,
                                     size_t errlen) {
  return Guard(err, errlen, [&]() -> Status {
#ifdef SSDTRAIN_HAVE_CUDA
    return ssdtrain::ProbeLink(device, bytes, repeats, host_kind, on_ready, out);
#else
    (void)device, (void)bytes, (void)repeats, (void)host_kind, (void)on_ready, (void)out;
    return Status(ENOSYS, "this libssdtrain was built without CUDA handlers (no nvcc at build "
                          "time): the PCIe link cannot be probed");
#endif
  });
}

SSDTRAIN_API void ssdtrain_reset_stats(void) {
  try {
    if (auto e = ssdtrain::PeekEngine()) e->ResetStats();
  } catch (...) {
  }
}

SSDTRAIN_API int ssdtrain_flush(char* err, size_t errlen) {
  return Guard(err, errlen, [&]() -> Status {
    auto e = ssdtrain::PeekEngine();
    return e ? e->Flush() : Status::Ok();
  });
}

SSDTRAIN_API int ssdtrain_release_all(char* err, size_t errlen) {
  return Guard(err, errlen, [&]() -> Status {
    auto e = ssdtrain::PeekEngine();
    return e ? e->ReleaseAll() : Status::Ok();
  });
}

SSDTRAIN_API int ssdtrain_grow_staging(uint64_t bytes, char* err, size_t errlen) {
  return Guard(err, errlen, [&]() -> Status {
    auto e = ssdtrain::PeekEngine();
    return e ? e->GrowStaging(bytes) : Status::Ok();
  });
}

SSDTRAIN_API int ssdtrain_shutdown(char* err, size_t errlen) {
  return Guard(err, errlen, [&]() -> Status { return ssdtrain::ReplaceEngine(nullptr); });
}

SSDTRAIN_API int ssdtrain_build_info(char* out, size_t outlen) {
  std::string s;
#ifdef SSDTRAIN_HAVE_CUDA
  s += "cuda=1\n";
#else
  s += "cuda=0\n";
#endif
#ifdef SSDTRAIN_HAVE_KVIKIO
  s += "kvikio=1\n";
#else
  s += "kvikio=0\n";
#endif
  s += "ffi_api=" + std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR) +
       "\n";
  return CopyOut(s, out, outlen);
}

SSDTRAIN_API int ssdtrain_file_paths(char* out, size_t outlen) {
  try {
    auto e = ssdtrain::PeekEngine();
    return CopyOut(e ? e->FilePaths() : std::string(), out, outlen);
  } catch (...) {
    return EIO;
  }
}

SSDTRAIN_API int ssdtrain_debug_truncate(uint64_t size, char* err, size_t errlen) {
  return Guard(err, errlen, [&]() -> Status {
    auto e = ssdtrain::PeekEngine();
    return e ? e->DebugTruncate(size) : Status(EINVAL, "the store is not configured");
  });
}

SSDTRAIN_API int ssdtrain_debug_corrupt(uint64_t offset, char* err, size_t errlen) {
  return Guard(err, errlen, [&]() -> Status {
    auto e = ssdtrain::PeekEngine();
    return e ? e->DebugCorrupt(offset) : Status(EINVAL, "the store is not configured");
  });
}

SSDTRAIN_API int ssdtrain_store_host(const void* src, uint64_t nbytes, int64_t site, int64_t uses,
                                     uint32_t* handle, char* err, size_t errlen) {
  return Guard(err, errlen, [&]() -> Status {
    Status st;
    auto e = ssdtrain::CurrentEngine(&st);
    if (!e) return st;
    return e->StoreFromHost(src, nbytes, site, ssdtrain::Tier::kNvme, "probe", handle, 0, uses);
  });
}

SSDTRAIN_API int ssdtrain_sweep(const uint32_t* pairs, uint64_t n_pairs, uint64_t seq_limit,
                                int retire, uint64_t* released, char* err, size_t errlen) {
  return Guard(err, errlen, [&]() -> Status {
    *released = 0;
    auto e = ssdtrain::PeekEngine();
    if (!e) return Status::Ok();
    return e->Sweep(pairs, n_pairs, seq_limit, released, retire != 0);
  });
}

SSDTRAIN_API int ssdtrain_sweep_requested(void) {
  try {
    auto e = ssdtrain::PeekEngine();
    return e && e->SweepRequested() ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

SSDTRAIN_API int ssdtrain_load_host(const uint32_t* handle, void* dst, uint64_t nbytes,
                                    int64_t site, char* err, size_t errlen) {
  return Guard(err, errlen, [&]() -> Status {
    Status st;
    auto e = ssdtrain::CurrentEngine(&st);
    if (!e) return st;
    return e->LoadToHost(handle, dst, nbytes, site, "probe");
  });
}

}  // extern "C"
