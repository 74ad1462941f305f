// The store's files, their slots and striping (see detail/file_space.h).
#include "detail/file_space.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ssdtrain {
namespace {

// mkdir -p with mode 0700 for created components; checks the result is a
// writable directory.
Status PrepareDirectory(const std::string& dir) {
  if (dir.empty()) return Status(EINVAL, "configure: empty directory in 'directories'");
  std::string cur;
  size_t pos = 0;
  while (pos <= dir.size()) {
    size_t next = dir.find('/', pos);
    if (next == std::string::npos) next = dir.size();
    cur = dir.substr(0, next);
    pos = next + 1;
    if (cur.empty()) continue;
    struct stat st;
    if (stat(cur.c_str(), &st) == 0) {
      if (!S_ISDIR(st.st_mode))
        return Status(ENOTDIR,
                      "store directory '" + dir + "': '" + cur + "' exists and is not a directory");
      continue;
    }
    if (errno != ENOENT)
      return SysError(errno, "stat('" + cur + "') for store directory '" + dir + "'", __FILE__,
                      __LINE__);
    if (mkdir(cur.c_str(), 0700) != 0 && errno != EEXIST)
      return SysError(errno, "mkdir('" + cur + "') for store directory '" + dir + "'", __FILE__,
                      __LINE__);
  }
  if (access(dir.c_str(), W_OK | X_OK) != 0)
    return SysError(errno, "store directory '" + dir + "' is not writable: access()", __FILE__,
                    __LINE__);
  return Status::Ok();
}

}  // namespace

Status FileSpace::Open(const Config& cfg) {
  Close();
  cfg_ = cfg;
  const size_t groups = std::max(1, cfg.device_groups);
  if (cfg.device_groups > 0 && (cfg.directories.empty() || cfg.directories.size() % groups))
    return Status(EINVAL, "configure: device_groups=" + std::to_string(groups) +
                              " does not divide the " + std::to_string(cfg.directories.size()) +
                              " store directories");
  const uint64_t per_group = std::max<uint64_t>(cfg.capacity_bytes / groups, kAlign);
  group_span_ = RoundUp(per_group, cfg.chunk_bytes);
  slots_.assign(groups, RangeAllocator());
  for (auto& a : slots_) a.Reset(per_group, kAlign);
  SSD_RETURN_IF_ERROR(OpenFiles());
  ResetCounters();
  return Status::Ok();
}

void FileSpace::Close() {
  for (auto& f : files_)
    if (f.fd >= 0) close(f.fd);
  files_.clear();
}

Status FileSpace::OpenFiles() {
  const size_t n = cfg_.directories.size() / slots_.size();  // files per device group
  uint64_t stripes = group_span_ / cfg_.chunk_bytes;
  uint64_t per_file = (stripes + n - 1) / n * cfg_.chunk_bytes;
  bool want_direct = cfg_.o_direct != 0;
  bool direct_ok = want_direct;
  for (const std::string& dir : cfg_.directories) {
    SSD_RETURN_IF_ERROR(PrepareDirectory(dir));
    StoreFile f;
    f.dir = dir;
    f.max_size = per_file;
#ifdef O_TMPFILE
    f.fd = open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
#endif
    if (f.fd < 0) {
      std::string tmpl = dir + "/.ssdtrain-XXXXXX";
      std::vector<char> buf(tmpl.begin(), tmpl.end());
      buf.push_back('\0');
      int fd = mkostemp(buf.data(), O_CLOEXEC);
      if (fd < 0) {
        Status s = SysError(errno, "creating the store file in '" + dir + "' (mkstemp)", __FILE__,
                            __LINE__);
        for (auto& g : files_) close(g.fd);
        files_.clear();
        return s;
      }
      f.fd = fd;
      if (fchmod(fd, 0600) != 0 || unlink(buf.data()) != 0) {
        Status s = SysError(
            errno,
            "making the store file '" + std::string(buf.data()) + "' private (fchmod/unlink)",
            __FILE__, __LINE__);
        unlink(buf.data());
        close(fd);
        for (auto& g : files_) close(g.fd);
        files_.clear();
        return s;
      }
    }
    files_.push_back(f);
  }
  if (want_direct) {
    for (auto& f : files_) {
      int fl = fcntl(f.fd, F_GETFL);
      if (fl < 0 || fcntl(f.fd, F_SETFL, fl | O_DIRECT) < 0) {
        int err = errno;
        if (cfg_.o_direct == 1) {
          Status s = SysError(err,
                              "enabling O_DIRECT on the store file in '" + f.dir +
                                  "' (o_direct=1; use o_direct=2 to fall back)",
                              __FILE__, __LINE__);
          for (auto& g : files_) close(g.fd);
          files_.clear();
          return s;
        }
        fprintf(stderr, "ssdtrain: O_DIRECT not supported for '%s' (%s); using buffered I/O\n",
                f.dir.c_str(), strerror(err));
        direct_ok = false;
        break;
      }
    }
    if (!direct_ok) {
      for (auto& f : files_) {
        int fl = fcntl(f.fd, F_GETFL);
        if (fl < 0 || fcntl(f.fd, F_SETFL, fl & ~O_DIRECT) < 0) {
          Status s = SysError(errno, "clearing O_DIRECT on the store file in '" + f.dir + "'",
                              __FILE__, __LINE__);
          for (auto& g : files_) close(g.fd);
          files_.clear();
          return s;
        }
      }
    }
  }
  o_direct_ = want_direct && direct_ok;
  return Status::Ok();
}

size_t FileSpace::GroupOf(int device) const {
  return device > 0 ? static_cast<size_t>(device) % slots_.size() : 0;
}

bool FileSpace::Alloc(int device, uint64_t len, uint64_t* off) {
  const size_t g = GroupOf(device);
  if (!slots_[g].Alloc(len, off)) return false;
  *off += g * group_span_;
  return true;
}

void FileSpace::Free(uint64_t off, uint64_t len) {
  slots_[off / group_span_].Free(off % group_span_, len);
}

uint64_t FileSpace::InUse() const {
  uint64_t n = 0;
  for (const auto& a : slots_) n += a.in_use();
  return n;
}

uint64_t FileSpace::LargestFree() const {
  uint64_t n = 0;
  for (const auto& a : slots_) n = std::max(n, a.largest_free());
  return n;
}

uint64_t FileSpace::Peak() const {
  uint64_t n = 0;
  for (const auto& a : slots_) n += a.peak();
  return n;
}

void FileSpace::ResetPeak() {
  for (auto& a : slots_) a.ResetPeak();
}

// A logical extent (inside one device group) -> pieces of that group's files: chunks striped
// round-robin; the group's files are directories g, g + G, g + 2G, ...
std::vector<FileSpace::Piece> FileSpace::Pieces(uint64_t loff, uint64_t len) const {
  std::vector<Piece> pieces;
  const uint64_t chunk = cfg_.chunk_bytes;
  const uint64_t groups = slots_.size();
  const uint64_t n = files_.size() / groups;
  const uint64_t g = loff / group_span_;
  uint64_t done = 0;
  while (done < len) {
    uint64_t l = loff % group_span_ + done;
    uint64_t stripe = l / chunk, within = l % chunk;
    uint64_t plen = std::min(len - done, chunk - within);
    pieces.push_back(Piece{static_cast<size_t>(g + groups * (stripe % n)),
                           (stripe / n) * chunk + within, done, plen});
    done += plen;
  }
  return pieces;
}

Status FileSpace::Reserve(uint64_t loff, uint64_t len) {
  std::vector<uint64_t> need(files_.size(), 0);
  for (const Piece& p : Pieces(loff, len))
    need[p.file] = std::max(need[p.file], p.file_off + p.len);
  for (size_t i = 0; i < files_.size(); ++i) {
    StoreFile& f = files_[i];
    if (need[i] <= f.size) continue;
    uint64_t target = std::min(f.max_size, std::max(need[i], f.size + 1 * kGiB));
    target = std::max(target, need[i]);
    int rc = fallocate(f.fd, 0, f.size, target - f.size);
    if (rc != 0 && (errno == EOPNOTSUPP || errno == ENOSYS)) {
      rc = ftruncate(f.fd, target);
    }
    if (rc != 0) {
      int err = errno;
      return Status(err, "No space left for ssdtrain store file in '" + f.dir +
                             "': growing it to " + HumanBytes(target) +
                             " failed: " + ErrnoString(err));
    }
    f.size = target;
  }
  return Status::Ok();
}

void FileSpace::CountIo(bool write, size_t file, uint64_t len) {
  auto& v = write ? written_ : read_;
  if (v.size() < files_.size()) v.resize(files_.size(), 0);
  v[file] += len;
}

void FileSpace::ResetCounters() {
  written_.assign(files_.size(), 0);
  read_.assign(files_.size(), 0);
}

uint64_t FileSpace::AllocatedBytes() const {
  uint64_t n = 0;
  for (const auto& f : files_) n += f.size;
  return n;
}

Status FileSpace::DebugTruncate(uint64_t size) {
  for (auto& f : files_)
    SSD_CHECK_SYS(ftruncate(f.fd, static_cast<off_t>(size)),
                  "ftruncate of the store file in '" + f.dir + "'");
  return Status::Ok();
}

Status FileSpace::DebugCorrupt(uint64_t loff) {
  if (files_.empty()) return Status(EINVAL, "no store file");
  const uint64_t chunk = cfg_.chunk_bytes, n = files_.size();
  uint64_t stripe = loff / chunk, within = loff % chunk;
  const StoreFile& f = files_[stripe % n];
  uint64_t foff = (stripe / n) * chunk + within;
  uint64_t base = foff / kAlign * kAlign;
  void* raw = nullptr;
  if (posix_memalign(&raw, kAlign, kAlign) != 0) return Status(ENOMEM, "debug_corrupt buffer");
  char* p = static_cast<char*>(raw);
  // Aligned block read-modify-write: works with and without O_DIRECT.
  ssize_t r = pread(f.fd, p, kAlign, static_cast<off_t>(base));
  Status s;
  if (r != static_cast<ssize_t>(kAlign)) {
    s = r < 0 ? SysError(errno, "debug_corrupt pread", __FILE__, __LINE__)
              : Status(EIO, "debug_corrupt: offset " + std::to_string(loff) +
                                " is past the end "
                                "of the store file");
  } else {
    p[foff - base] ^= 0x5A;
    if (pwrite(f.fd, p, kAlign, static_cast<off_t>(base)) != static_cast<ssize_t>(kAlign))
      s = SysError(errno, "debug_corrupt pwrite", __FILE__, __LINE__);
  }
  free(raw);
  return s;
}

std::string FileSpace::Paths() const {
  std::string out;
  for (auto& f : files_) out += f.dir + "/(unlinked)\n";
  return out;
}

}  // namespace ssdtrain
