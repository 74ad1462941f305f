// pread/pwrite backend (always built). Buffers, offsets and lengths are 4 KiB
// aligned by the engine, so the same calls work with O_DIRECT.
#include <unistd.h>

#include "engine.h"

namespace ssdtrain {
namespace {

class PosixBackend final : public IoBackend {
 public:
  PosixBackend(const std::vector<StoreFile>* files, FaultSpec* fault)
      : files_(files), fault_(fault) {}
  const char* name() const override { return "posix"; }

  Status Write(size_t file, const void* buf, uint64_t len, uint64_t off) override {
    return Transfer(true, file, const_cast<char*>(static_cast<const char*>(buf)), len, off);
  }

  Status Read(size_t file, void* buf, uint64_t len, uint64_t off) override {
    return Transfer(false, file, static_cast<char*>(buf), len, off);
  }

 private:
  // pwrite/pread until all `len` bytes moved: retries EINTR and short transfers; a 0-byte
  // transfer is an error (a read of 0 bytes means the file was truncated).
  Status Transfer(bool write, size_t file, char* p, uint64_t len, uint64_t off) {
    const StoreFile& f = (*files_)[file];
    const char* call = write ? "pwrite" : "pread";
    const char* dir = write ? ") to" : ") from";
    uint64_t done = 0;
    while (done < len) {
      ssize_t n = Call(write, f.fd, p + done, len - done, off + done);
      if (n < 0) {
        if (errno == EINTR) continue;
        int e = errno;
        return Status(e, std::string(call) + "(" + std::to_string(len - done) +
                             " bytes at offset " + std::to_string(off + done) + dir +
                             " the store file in '" + f.dir + "' failed: " + ErrnoString(e));
      }
      if (n == 0)
        return write ? Status(EIO, "pwrite to the store file in '" + f.dir +
                                       "' wrote 0 bytes at offset " + std::to_string(off + done) +
                                       " (short write)")
                     : Status(EIO, "pread from the store file in '" + f.dir +
                                       "' returned 0 bytes at offset " +
                                       std::to_string(off + done) + ": file truncated");
      done += static_cast<uint64_t>(n);
    }
    return Status::Ok();
  }

  // One pread/pwrite, or the fault injected in its place (SSDTRAIN_FAULT).
  ssize_t Call(bool write, int fd, char* p, uint64_t len, uint64_t off) {
    FaultSpec::Op op = fault_ ? fault_->Next(write) : FaultSpec::kNone;
    if (op == FaultSpec::kWrite || op == FaultSpec::kRead) {
      errno = fault_->err;
      return -1;
    }
    if (op == FaultSpec::kShortWrite || op == FaultSpec::kShortRead) {
      // Half the bytes, kept 4 KiB aligned so that O_DIRECT accepts the call.
      uint64_t half = len / 2 / kAlign * kAlign;
      if (half > 0) len = half;
    }
    return write ? pwrite(fd, p, len, static_cast<off_t>(off))
                 : pread(fd, p, len, static_cast<off_t>(off));
  }

  const std::vector<StoreFile>* files_;
  FaultSpec* fault_;
};

}  // namespace

std::unique_ptr<IoBackend> MakePosixBackend(const std::vector<StoreFile>* files, FaultSpec* fault) {
  return std::make_unique<PosixBackend>(files, fault);
}

}  // namespace ssdtrain
