// Optional kvikio backend (built when find_package(kvikio) succeeds). Uses
// kvikio::FileHandle on the engine's (unlinked) store files, reopened through
// /proc/self/fd. With GDS usable (gds=1/2 and cuFile not in compat mode) kvikio
// talks to cuFile; otherwise it would run its POSIX compat path on the pinned
// host buffers, which the engine (gds=2) drops for its own POSIX backend. Only
// used when a CUDA device is present (kvikio needs libcuda even for host
// pointers).
#include <cuda_runtime.h>

#include <cstdlib>
#include <exception>
#include <kvikio/defaults.hpp>
#include <kvikio/file_handle.hpp>
#include <memory>
#include <string>
#include <vector>

#include "engine.h"

namespace ssdtrain {
namespace {

class KvikioBackend final : public IoBackend {
 public:
  KvikioBackend(const std::vector<StoreFile>* files,
                std::vector<std::unique_ptr<kvikio::FileHandle>> handles, bool gds)
      : files_(files), handles_(std::move(handles)), gds_(gds) {}
  const char* name() const override { return gds_ ? "kvikio-gds" : "kvikio-compat"; }
  bool gds() const override { return gds_; }

  Status Write(size_t file, const void* buf, uint64_t len, uint64_t off) override {
    try {
      std::size_t n = handles_[file]->pwrite(buf, len, off, len).get();
      if (n != len)
        return Status(EIO, "kvikio pwrite to the store file in '" + (*files_)[file].dir +
                               "' wrote " + std::to_string(n) + " of " + std::to_string(len) +
                               " bytes (short write)");
      return Status::Ok();
    } catch (const std::exception& e) {
      return Status(EIO, "kvikio pwrite(" + std::to_string(len) + " bytes at offset " +
                             std::to_string(off) + ") to the store file in '" +
                             (*files_)[file].dir + "' failed: " + e.what());
    }
  }

  Status Read(size_t file, void* buf, uint64_t len, uint64_t off) override {
    try {
      std::size_t n = handles_[file]->pread(buf, len, off, len).get();
      if (n != len)
        return Status(EIO, "kvikio pread from the store file in '" + (*files_)[file].dir +
                               "' returned " + std::to_string(n) + " of " + std::to_string(len) +
                               " bytes: file truncated");
      return Status::Ok();
    } catch (const std::exception& e) {
      return Status(EIO, "kvikio pread(" + std::to_string(len) + " bytes at offset " +
                             std::to_string(off) + ") from the store file in '" +
                             (*files_)[file].dir + "' failed: " + e.what());
    }
  }

 private:
  const std::vector<StoreFile>* files_;
  std::vector<std::unique_ptr<kvikio::FileHandle>> handles_;
  bool gds_;
};

}  // namespace

std::unique_ptr<IoBackend> MakeKvikioBackend(const std::vector<StoreFile>* files, int gds,
                                             bool o_direct, int io_threads, std::string* why_not) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    cudaGetLastError();
    *why_not = std::string("no usable CUDA device (") +
               (err != cudaSuccess ? cudaGetErrorString(err) : "0 devices") + ")";
    return nullptr;
  }
  try {
    // Each engine I/O thread hands kvikio one whole piece, which runs on kvikio's own pool:
    // one thread unless KVIKIO_NTHREADS says otherwise, and then every piece waits for it.
    if (std::getenv("KVIKIO_NTHREADS") == nullptr && io_threads > 0 &&
        kvikio::defaults::thread_pool_nthreads() < static_cast<unsigned>(io_threads))
      kvikio::defaults::set_thread_pool_nthreads(static_cast<unsigned>(io_threads));
    auto mode = gds == 1 ? kvikio::CompatMode::OFF : kvikio::CompatMode::AUTO;
    std::vector<std::unique_ptr<kvikio::FileHandle>> handles;
    bool all_gds = true;
    for (const StoreFile& f : *files) {
      std::string path = "/proc/self/fd/" + std::to_string(f.fd);
      auto h = std::make_unique<kvikio::FileHandle>(path, "r+", 0600, mode);
      all_gds = all_gds && !h->get_compat_mode_manager().is_compat_mode_preferred();
      handles.push_back(std::move(h));
    }
    (void)o_direct;
    return std::make_unique<KvikioBackend>(files, std::move(handles), all_gds);
  } catch (const std::exception& e) {
    *why_not = std::string("kvikio::FileHandle: ") + e.what();
    return nullptr;
  }
}

}  // namespace ssdtrain
