// pread/pwrite backend (always built). Buffers, offsets and lengths are 4 KiB
// aligned by the engine, so the same calls work with O_DIRECT.
#include <unistd.h>

#include "ssdtrain/engine.h"

namespace ssdtrain {
namespace {

class PosixBackend final : public IoBackend {
 public:
  explicit PosixBackend(const std::vector<StoreFile>* files) : files_(files) {}
  const char* name() const override { return "posix"; }

  Status Write(size_t file, const void* buf, uint64_t len, uint64_t off) override {
    const StoreFile& f = (*files_)[file];
    const char* p = static_cast<const char*>(buf);
    uint64_t done = 0;
    while (done < len) {
      ssize_t n = pwrite(f.fd, p + done, len - done, static_cast<off_t>(off + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        int e = errno;
        return Status(e, "pwrite(" + std::to_string(len - done) + " bytes at offset " +
                             std::to_string(off + done) + ") to the store file in '" + f.dir +
                             "' failed: " + ErrnoString(e));
      }
      if (n == 0)
        return Status(EIO, "pwrite to the store file in '" + f.dir + "' wrote 0 bytes at offset " +
                               std::to_string(off + done) + " (short write)");
      done += static_cast<uint64_t>(n);
    }
    return Status::Ok();
  }

  Status Read(size_t file, void* buf, uint64_t len, uint64_t off) override {
    const StoreFile& f = (*files_)[file];
    char* p = static_cast<char*>(buf);
    uint64_t done = 0;
    while (done < len) {
      ssize_t n = pread(f.fd, p + done, len - done, static_cast<off_t>(off + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        int e = errno;
        return Status(e, "pread(" + std::to_string(len - done) + " bytes at offset " +
                             std::to_string(off + done) + ") from the store file in '" + f.dir +
                             "' failed: " + ErrnoString(e));
      }
      if (n == 0)
        return Status(EIO, "pread from the store file in '" + f.dir + "' returned 0 bytes at offset " +
                               std::to_string(off + done) + ": file truncated");
      done += static_cast<uint64_t>(n);
    }
    return Status::Ok();
  }

 private:
  const std::vector<StoreFile>* files_;
};

}  // namespace

std::unique_ptr<IoBackend> MakePosixBackend(const std::vector<StoreFile>* files) {
  return std::make_unique<PosixBackend>(files);
}

}  // namespace ssdtrain
