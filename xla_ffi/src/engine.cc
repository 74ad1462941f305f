#include "ssdtrain/engine.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>

namespace ssdtrain {
namespace {

double Seconds(Engine::Clock::time_point a, Engine::Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::string Trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

Status ParseInt(const std::string& key, const std::string& v, int64_t* out) {
  if (v.empty()) return Status(EINVAL, "configure: empty value for key '" + key + "'");
  char* end = nullptr;
  errno = 0;
  long long x = strtoll(v.c_str(), &end, 10);
  if (errno != 0 || end == v.c_str() || *end != '\0') {
    // Accept integral floats such as "1e9" or "2.0".
    char* fend = nullptr;
    double d = strtod(v.c_str(), &fend);
    if (fend == v.c_str() || *fend != '\0' || d != static_cast<double>(static_cast<long long>(d)))
      return Status(EINVAL, "configure: value of '" + key + "' is not an integer: '" + v + "'");
    x = static_cast<long long>(d);
  }
  *out = x;
  return Status::Ok();
}

std::string HumanBytes(uint64_t n) {
  char buf[64];
  if (n >= kGiB) snprintf(buf, sizeof buf, "%.2f GiB", n / double(kGiB));
  else if (n >= kMiB) snprintf(buf, sizeof buf, "%.2f MiB", n / double(kMiB));
  else snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(n));
  return buf;
}

std::string Describe(std::string_view name, int64_t site, uint32_t id) {
  return "tag '" + std::string(name) + "' (site " + std::to_string(site) + ", id " +
         std::to_string(id) + ")";
}

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
        return Status(ENOTDIR, "store directory '" + dir + "': '" + cur +
                                   "' exists and is not a directory");
      continue;
    }
    if (errno != ENOENT)
      return SysError(errno, "stat('" + cur + "') for store directory '" + dir + "'", __FILE__,
                      __LINE__);
    if (mkdir(cur.c_str(), 0700) != 0 && errno != EEXIST)
      return SysError(errno, "mkdir('" + cur + "') for store directory '" + dir + "'",
                      __FILE__, __LINE__);
  }
  if (access(dir.c_str(), W_OK | X_OK) != 0)
    return SysError(errno, "store directory '" + dir + "' is not writable: access()", __FILE__,
                    __LINE__);
  return Status::Ok();
}

}  // namespace

// ---------------------------------------------------------------------------
// Config
// ---------------------------------------------------------------------------
Config Config::Defaults() {
  Config c;
  const char* env = getenv("SSDTRAIN_DIR");
  if (env && *env) {
    c.directories = {env};
  } else {
    const char* tmp = getenv("TMPDIR");
    std::string base = (tmp && *tmp) ? tmp : "/tmp";
    c.directories = {base + "/ssdtrain-" + std::to_string(getuid())};
  }
  return c;
}

Status Config::Parse(std::string_view kv, Config* out) {
  Config c = Defaults();
  std::string all(kv);
  std::istringstream in(all);
  std::string line;
  while (std::getline(in, line)) {
    std::string t = Trim(line);
    if (t.empty() || t[0] == '#') continue;
    size_t eq = t.find('=');
    if (eq == std::string::npos)
      return Status(EINVAL, "configure: expected key=value, got '" + t + "'");
    std::string key = Trim(t.substr(0, eq)), val = Trim(t.substr(eq + 1));
    if (key == "directories") {
      c.directories.clear();
      size_t p = 0;
      while (p <= val.size()) {
        size_t q = val.find(':', p);
        if (q == std::string::npos) q = val.size();
        std::string d = Trim(val.substr(p, q - p));
        if (!d.empty()) {
          while (d.size() > 1 && d.back() == '/') d.pop_back();
          c.directories.push_back(d);
        }
        p = q + 1;
      }
      if (c.directories.empty())
        return Status(EINVAL, "configure: 'directories' is empty");
      continue;
    }
    int64_t x = 0;
    struct IntKey {
      const char* name;
      int64_t min;
      int64_t max;
    };
    static const IntKey keys[] = {
        {"capacity_bytes", 1, INT64_MAX},   {"host_cache_bytes", 1, INT64_MAX},
        {"host_tier_bytes", 0, INT64_MAX},  {"staging_bytes", 0, INT64_MAX},
        {"io_threads", 1, 256},             {"chunk_bytes", 1, 1LL << 32},
        {"o_direct", 0, 2},                 {"gds", 0, 2},
        {"prefetch_bytes", 0, INT64_MAX},   {"forwarding", 0, 1},
        {"on_full", 0, 1},                  {"verify", 0, 1},
        {"exact_loads", 0, 1},
        {"bandwidth_cap", 0, INT64_MAX},    {"device_groups", 0, 4096},
    };
    const IntKey* k = nullptr;
    for (const auto& cand : keys)
      if (key == cand.name) k = &cand;
    if (!k) return Status(EINVAL, "configure: unknown key '" + key + "'");
    SSD_RETURN_IF_ERROR(ParseInt(key, val, &x));
    if (x < k->min || x > k->max) {
      std::string want = k->min == 1 ? "a positive integer" : k->min == 0 && k->max == INT64_MAX
                                                                  ? "a non-negative integer"
                                                                  : "in [" + std::to_string(k->min) + ", " + std::to_string(k->max) + "]";
      return Status(EINVAL, "configure: invalid value for '" + key + "': " + val + " (must be " +
                                want + ")");
    }
    if (key == "capacity_bytes") c.capacity_bytes = x;
    else if (key == "host_cache_bytes") c.host_cache_bytes = x;
    else if (key == "host_tier_bytes") c.host_tier_bytes = x;
    else if (key == "staging_bytes") c.staging_bytes = x;
    else if (key == "io_threads") c.io_threads = static_cast<int>(x);
    else if (key == "chunk_bytes") c.chunk_bytes = x;
    else if (key == "o_direct") c.o_direct = static_cast<int>(x);
    else if (key == "gds") c.gds = static_cast<int>(x);
    else if (key == "prefetch_bytes") c.prefetch_bytes = x;
    else if (key == "forwarding") c.forwarding = x != 0;
    else if (key == "on_full") c.on_full = static_cast<int>(x);
    else if (key == "verify") c.verify = x != 0;
    else if (key == "exact_loads") c.exact_loads = x != 0;
    else if (key == "bandwidth_cap") c.bandwidth_cap = x;
    else if (key == "device_groups") c.device_groups = static_cast<int>(x);
  }
  if (c.chunk_bytes % kAlign != 0)
    return Status(EINVAL, "configure: invalid value for 'chunk_bytes': " +
                              std::to_string(c.chunk_bytes) + " (must be a multiple of 4096)");
  if (c.capacity_bytes < kAlign)
    return Status(EINVAL, "configure: invalid value for 'capacity_bytes': " +
                              std::to_string(c.capacity_bytes) + " (must be >= 4096)");
  *out = c;
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// FaultSpec (test hook)
// ---------------------------------------------------------------------------
Status FaultSpec::Parse(const char* spec, FaultSpec* out) {
  out->op = kNone;
  if (!spec || !*spec) return Status::Ok();
  std::string s(spec);
  auto bad = [&](const std::string& why) {
    return Status(EINVAL, "SSDTRAIN_FAULT='" + s + "': " + why +
                              " (expected op:n:errno, op in write, read, shortwrite, shortread; "
                              "e.g. write:3:ENOSPC)");
  };
  size_t a = s.find(':'), b = a == std::string::npos ? a : s.find(':', a + 1);
  if (b == std::string::npos) return bad("expected three ':'-separated fields");
  std::string op = s.substr(0, a), n = s.substr(a + 1, b - a - 1), err = s.substr(b + 1);
  if (op == "write") out->op = kWrite;
  else if (op == "read") out->op = kRead;
  else if (op == "shortwrite") out->op = kShortWrite;
  else if (op == "shortread") out->op = kShortRead;
  else return bad("unknown op '" + op + "'");
  int64_t k = 0;
  if (!ParseInt("n", n, &k).ok() || k < 1) return bad("n must be a positive integer");
  out->n = static_cast<uint64_t>(k);
  static const struct { const char* name; int code; } names[] = {
      {"EIO", EIO},       {"ENOSPC", ENOSPC}, {"EDQUOT", EDQUOT}, {"EROFS", EROFS},
      {"EBADF", EBADF},   {"EFBIG", EFBIG},   {"EINTR", EINTR},   {"EAGAIN", EAGAIN},
      {"ENOMEM", ENOMEM}, {"EINVAL", EINVAL}, {"ENXIO", ENXIO},   {"EFAULT", EFAULT},
  };
  out->err = -1;
  for (const auto& nm : names)
    if (err == nm.name) out->err = nm.code;
  if (out->err < 0) {
    int64_t e = 0;
    if (!ParseInt("errno", err, &e).ok() || e < 0 || e > 4095)
      return bad("unknown errno '" + err + "'");
    out->err = static_cast<int>(e);
  }
  if ((out->op == kWrite || out->op == kRead) && out->err == 0)
    return bad("errno must be non-zero for op '" + op + "'");
  fprintf(stderr, "ssdtrain: fault injection armed: %s\n", s.c_str());
  return Status::Ok();
}

FaultSpec::Op FaultSpec::Next(bool write) {
  if (op == kNone) return kNone;
  bool mine = write ? (op == kWrite || op == kShortWrite) : (op == kRead || op == kShortRead);
  if (!mine) return kNone;
  uint64_t k = (write ? writes : reads).fetch_add(1) + 1;
  return k == n ? op : kNone;
}

// ---------------------------------------------------------------------------
// RangeAllocator / HostArena
// ---------------------------------------------------------------------------
void RangeAllocator::Reset(uint64_t capacity, uint64_t align) {
  align_ = align;
  capacity_ = capacity / align * align;
  free_.clear();
  if (capacity_) free_[0] = capacity_;
  in_use_ = peak_ = 0;
}

bool RangeAllocator::Alloc(uint64_t len, uint64_t* off) {
  len = RoundUp(len, align_);
  if (len == 0) len = align_;
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second >= len) {
      *off = it->first;
      uint64_t rest = it->second - len;
      uint64_t start = it->first + len;
      free_.erase(it);
      if (rest) free_[start] = rest;
      in_use_ += len;
      peak_ = std::max(peak_, in_use_);
      return true;
    }
  }
  return false;
}

void RangeAllocator::Free(uint64_t off, uint64_t len) {
  len = RoundUp(len, align_);
  if (len == 0) len = align_;
  in_use_ -= len;
  auto it = free_.emplace(off, len).first;
  auto next = std::next(it);
  if (next != free_.end() && it->first + it->second == next->first) {
    it->second += next->second;
    free_.erase(next);
  }
  if (it != free_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      free_.erase(it);
    }
  }
}

uint64_t RangeAllocator::largest_free() const {
  uint64_t m = 0;
  for (const auto& [o, l] : free_) m = std::max(m, l);
  return m;
}

Status HostArena::Init(uint64_t bytes, const char* what) {
  size = RoundUp(bytes, kAlign);
  alloc.Reset(size, kAlign);
  if (size == 0) return Status::Ok();
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    return SysError(errno, std::string("mmap of ") + what + " (" + HumanBytes(size) + ")",
                    __FILE__, __LINE__);
  base = static_cast<char*>(p);
  return Status::Ok();
}

void HostArena::Destroy() {
  if (base) munmap(base, size);
  base = nullptr;
  size = 0;
}

// ---------------------------------------------------------------------------
// ThreadPool
// ---------------------------------------------------------------------------
ThreadPool::ThreadPool(int n) {
  for (int i = 0; i < n; ++i) threads_.emplace_back([this] { Run(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::Submit(std::function<void()> fn, bool high) {
  {
    std::lock_guard<std::mutex> g(mu_);
    (high ? high_ : normal_).push_back(std::move(fn));
  }
  cv_.notify_one();
}

void ThreadPool::Run() {
  for (;;) {
    std::function<void()> fn;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !high_.empty() || !normal_.empty(); });
      if (!high_.empty()) {
        fn = std::move(high_.front());
        high_.pop_front();
      } else if (!normal_.empty()) {
        fn = std::move(normal_.front());
        normal_.pop_front();
      } else {
        return;  // stop_ and drained
      }
    }
    fn();
  }
}

// ---------------------------------------------------------------------------
// Engine: setup / teardown
// ---------------------------------------------------------------------------
Status Engine::Create(const Config& cfg, std::shared_ptr<Engine>* out) {
  std::shared_ptr<Engine> e(new Engine());
  Status s = e->Init(cfg);
  if (!s.ok()) return s;
  *out = std::move(e);
  return Status::Ok();
}

Status Engine::Init(const Config& cfg) {
  cfg_ = cfg;
  std::random_device rd;
  salt_ = (static_cast<uint32_t>(rd()) ^ static_cast<uint32_t>(getpid() * 2654435761u)) | 1u;
  next_id_ = 1 + (rd() % 1024);
  SSD_RETURN_IF_ERROR(cache_.Init(cfg.host_cache_bytes, "host_cache_bytes"));
  SSD_RETURN_IF_ERROR(tier_.Init(cfg.host_tier_bytes, "host_tier_bytes"));
  {
    const size_t groups = std::max(1, cfg.device_groups);
    if (cfg.device_groups > 0 && (cfg.directories.empty() || cfg.directories.size() % groups))
      return Status(EINVAL, "configure: device_groups=" + std::to_string(groups) +
                                " does not divide the " + std::to_string(cfg.directories.size()) +
                                " store directories");
    const uint64_t per_group = std::max<uint64_t>(cfg.capacity_bytes / groups, kAlign);
    group_span_ = RoundUp(per_group, cfg.chunk_bytes);
    slots_.assign(groups, RangeAllocator());
    for (auto& a : slots_) a.Reset(per_group, kAlign);
  }
  SSD_RETURN_IF_ERROR(FaultSpec::Parse(getenv("SSDTRAIN_FAULT"), &fault_));
  SSD_RETURN_IF_ERROR(OpenFiles());
#ifdef SSDTRAIN_HAVE_KVIKIO
  if (cfg.gds != 0) {
    std::string why;
    backend_ = MakeKvikioBackend(&files_, cfg.gds, o_direct_, cfg.io_threads, &why);
    if (backend_) {
      gds_active = backend_->gds();
      // Without GPUDirect (compat mode) kvikio puts a second thread pool in front of the same
      // pread/pwrite: on the H100's store it read at 0.79-0.86x raw O_DIRECT where the POSIX
      // backend read at 0.97-1.02x. Auto keeps it for GDS only.
      if (!gds_active && cfg.gds == 2) backend_.reset();
    } else if (cfg.gds == 1) {
      fprintf(stderr, "ssdtrain: kvikio backend unavailable (%s); using POSIX I/O\n", why.c_str());
    }
  }
#endif
  if (!backend_) backend_ = MakePosixBackend(&files_, &fault_);
  if (cfg.bandwidth_cap)
    backend_ = MakeThrottledBackend(std::move(backend_), cfg.bandwidth_cap, &throttle_);
  pool_ = std::make_unique<ThreadPool>(cfg.io_threads);
  return Status::Ok();
}

Status Engine::OpenFiles() {
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
        Status s = SysError(errno, "creating the store file in '" + dir + "' (mkstemp)",
                            __FILE__, __LINE__);
        for (auto& g : files_) close(g.fd);
        files_.clear();
        return s;
      }
      f.fd = fd;
      if (fchmod(fd, 0600) != 0 || unlink(buf.data()) != 0) {
        Status s = SysError(errno, "making the store file '" + std::string(buf.data()) +
                                       "' private (fchmod/unlink)", __FILE__, __LINE__);
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
          Status s = SysError(err, "enabling O_DIRECT on the store file in '" + f.dir +
                                       "' (o_direct=1; use o_direct=2 to fall back)",
                              __FILE__, __LINE__);
          for (auto& g : files_) close(g.fd);
          files_.clear();
          return s;
        }
        fprintf(stderr,
                "ssdtrain: O_DIRECT not supported for '%s' (%s); using buffered I/O\n",
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

Engine::~Engine() {
  ReleaseAll();
  pool_.reset();  // joins the I/O threads
  hooks_.reset();
  backend_.reset();
  for (auto& f : files_)
    if (f.fd >= 0) close(f.fd);
  files_.clear();
  cache_.Destroy();
  tier_.Destroy();
}

// ---------------------------------------------------------------------------
// File space
// ---------------------------------------------------------------------------
size_t Engine::GroupOf(int device) const {
  return device > 0 ? static_cast<size_t>(device) % slots_.size() : 0;
}

bool Engine::SlotAlloc(int device, uint64_t len, uint64_t* off) {
  const size_t g = GroupOf(device);
  if (!slots_[g].Alloc(len, off)) return false;
  *off += g * group_span_;
  return true;
}

void Engine::SlotFree(uint64_t off, uint64_t len) {
  slots_[off / group_span_].Free(off % group_span_, len);
}

RangeAllocator& Engine::SlotGroup(int device) {
  return slots_[GroupOf(device)];
}

uint64_t Engine::SlotsInUse() const {
  uint64_t n = 0;
  for (const auto& a : slots_) n += a.in_use();
  return n;
}

uint64_t Engine::SlotsPeak() const {
  uint64_t n = 0;
  for (const auto& a : slots_) n += a.peak();
  return n;
}

// A logical extent (inside one device group) -> pieces of that group's files: chunks striped
// round-robin; the group's files are directories g, g + G, g + 2G, ...
template <typename F>
void Engine::ForEachPiece(uint64_t loff, uint64_t len, F&& f) const {
  const uint64_t chunk = cfg_.chunk_bytes;
  const uint64_t groups = slots_.size();
  const uint64_t n = files_.size() / groups;
  const uint64_t g = loff / group_span_;
  uint64_t done = 0;
  while (done < len) {
    uint64_t l = loff % group_span_ + done;
    uint64_t stripe = l / chunk, within = l % chunk;
    uint64_t plen = std::min(len - done, chunk - within);
    f(static_cast<size_t>(g + groups * (stripe % n)), (stripe / n) * chunk + within, done, plen);
    done += plen;
  }
}

Status Engine::EnsureFileSpace(uint64_t loff, uint64_t len) {
  std::vector<uint64_t> need(files_.size(), 0);
  ForEachPiece(loff, len, [&](size_t f, uint64_t foff, uint64_t, uint64_t plen) {
    need[f] = std::max(need[f], foff + plen);
  });
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
                             "': growing it to " + HumanBytes(target) + " failed: " +
                             ErrnoString(err));
    }
    f.size = target;
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Host buffers
// ---------------------------------------------------------------------------
bool Engine::AllocHost(int arena, uint64_t padded, uint64_t* off) {
  HostArena& a = arena == 0 ? cache_ : tier_;
  if (a.size == 0 || padded > a.size) return false;
  return a.alloc.Alloc(padded, off);
}

void Engine::FreeHostBuffer(Entry& e) {
  if (e.host_arena < 0) return;
  if (hooks_) hooks_->BeforeHostFree(e);
  HostArena& a = e.host_arena == 0 ? cache_ : tier_;
  a.alloc.Free(e.host_off, e.padded);
  e.host_arena = -1;
  e.host_ptr = nullptr;
  e.host_valid = false;
  e.read_unconsumed = false;
  e.host_from_store = false;
}

bool Engine::EvictOne(const Entry* exclude, uint64_t prefetch_seq) {
  Entry* best = nullptr;
  auto better = [](const Entry* a, const Entry* b) {
    // Loaded entries first (they are rarely needed again), then oldest.
    if (!b) return true;
    bool la = a->loads > 0, lb = b->loads > 0;
    if (la != lb) return la;
    return a->seq < b->seq;
  };
  for (auto& [id, ep] : entries_) {
    Entry* e = ep.get();
    if (e == exclude || e->tier != 0 || e->host_arena != 0 || !e->host_valid) continue;
    if (e->w != WState::kDone || e->pins > 0 || e->reading || e->filling) continue;
    if (e->read_unconsumed) continue;  // read ahead for a load still to come
    if (prefetch_seq && !(e->loads > 0 || e->seq < prefetch_seq)) continue;
    if (better(e, best)) best = e;
  }
  if (!best) return false;
  FreeHostBuffer(*best);
  return true;
}

bool Engine::WriteBackOne(const Entry* exclude) {
  EntryPtr best;
  bool draining = false;
  for (auto& [id, ep] : entries_) {
    const Entry* e = ep.get();
    if (e == exclude || e->tier != 0 || e->host_arena != 0 || !e->host_valid) continue;
    // kCancelled in the table means a load cancelled it.
    if (e->w != WState::kCancelled || !e->has_slot) continue;
    if (e->pins > 0 || e->loading > 0 || e->reading || e->filling) continue;
    if (e->w_pending > 0) {  // its cancelled pieces are still queued: eligible once they drain
      draining = true;
      continue;
    }
    if (!best || e->seq < best->seq) best = ep;
  }
  if (!best) return draining;
  // Written after all (saturating: the skip may predate a reset_stats()).
  stats.write_skipped_bytes -= std::min<uint64_t>(stats.write_skipped_bytes, best->nbytes);
  if (stats.write_skipped_tensors) stats.write_skipped_tensors--;
  EnqueueWrite(best);
  return true;
}

Status Engine::AcquireCacheBuffer(Lock& lk, Entry& e, bool may_block) {
  if (e.padded > cache_.size) return Status::Ok();  // too large: bounce
  auto t0 = Clock::now();
  bool stalled = false;
  for (;;) {
    if (e.host_ptr) break;  // someone else (read-ahead) gave it a buffer meanwhile
    uint64_t off;
    if (AllocHost(0, e.padded, &off)) {
      e.host_arena = 0;
      e.host_off = off;
      e.host_ptr = cache_.base + off;
      break;
    }
    if (EvictOne(&e, 0)) continue;
    // Loaded entries whose write forwarding skipped are only evictable once written: without
    // this, the entries of a program that does not run again hold the cache for good.
    const bool write_back = may_block && WriteBackOne(&e);
    if (may_block && (write_back || writes_inflight_ > 0 || reads_inflight_ > 0)) {
      stalled = true;
      cv.wait(lk);
      continue;
    }
    break;  // cannot make room: caller bounces
  }
  if (stalled) stats.stall_seconds += Seconds(t0, Clock::now());
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Bookkeeping
// ---------------------------------------------------------------------------
Status Engine::TakePendingError() {
  if (pending_error_.ok()) return Status::Ok();
  Status s = pending_error_;
  pending_error_ = Status();
  return s.With("an earlier asynchronous ssdtrain I/O failed");
}

uint32_t Engine::HandleCheck(uint32_t id) const {
  // A mixing hash of id and the engine's salt: a bit flipped in either word is detected.
  uint64_t z = (static_cast<uint64_t>(id) << 32 | salt_) + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<uint32_t>(z ^ (z >> 31));
}

void Engine::MakeHandle(const Entry& e, uint32_t h[2]) const {
  h[0] = e.id;
  h[1] = HandleCheck(e.id);
}

void Engine::Release(const EntryPtr& e) {
  if (e->released) return;
  e->released = true;
  entries_.erase(e->id);
  auto s = by_site_.find({e->device, e->site});
  if (s != by_site_.end()) {
    s->second.erase(e->id);
    if (s->second.empty()) by_site_.erase(s);
  }
  unloaded_.erase(e->seq);
  if (e->w == WState::kQueued) {
    e->w = WState::kCancelled;
    writes_inflight_--;
    stats.write_skipped_bytes += e->nbytes;
    stats.write_skipped_tensors++;
  }
  pending_free_++;
  MaybeFree(e);
}

void Engine::MaybeFree(const EntryPtr& e) {
  if (!e->released || e->freed || e->filling || e->pins > 0 || e->reading ||
      e->w == WState::kRunning)
    return;
  FreeHostBuffer(*e);
  if (e->has_slot) {
    SlotFree(e->file_off, e->padded);
    e->has_slot = false;
  }
  if (hooks_ && e->dev) hooks_->OnEntryFree(*e);
  e->freed = true;
  pending_free_--;
  cv.notify_all();
}

void Engine::BusyBegin(bool write) {
  if (active_[write]++ == 0) busy_since_[write] = Clock::now();
}

void Engine::CountFileIo(bool write, size_t file, uint64_t len) {
  auto& v = write ? file_bytes_written_ : file_bytes_read_;
  if (v.size() < files_.size()) v.resize(files_.size(), 0);
  v[file] += len;
}

void Engine::BusyEnd(bool write) {
  if (--active_[write] == 0) {
    double s = Seconds(busy_since_[write], Clock::now());
    (write ? stats.write_seconds : stats.read_seconds) += s;
  }
}

// ---------------------------------------------------------------------------
// Writes
// ---------------------------------------------------------------------------
std::vector<Engine::Piece> Engine::Pieces(const Entry& e) const {
  std::vector<Piece> pieces;
  ForEachPiece(e.file_off, e.padded, [&](size_t f, uint64_t foff, uint64_t boff, uint64_t len) {
    pieces.push_back(Piece{f, foff, boff, len});
  });
  return pieces;
}

void Engine::EnqueueWrite(const EntryPtr& e) {
  const std::vector<Piece> pieces = Pieces(*e);
  e->w = WState::kQueued;
  e->w_pending = static_cast<int>(pieces.size());
  e->w_io_left = static_cast<int>(pieces.size());
  writes_inflight_++;
  for (const Piece& p : pieces)
    pool_->Submit([this, e, p] { WritePiece(e, p.file, p.file_off, p.buf_off, p.len); }, false);
}

void Engine::WritePiece(const EntryPtr& e, size_t file, uint64_t foff, uint64_t boff,
                        uint64_t len) {
  {
    Lock lk(mu);
    if (e->w == WState::kCancelled) {
      if (--e->w_pending == 0) cv.notify_all();  // WriteBackOne may wait for this
      return;
    }
    if (e->w == WState::kQueued) e->w = WState::kRunning;
    BusyBegin(true);
  }
  Status s;
  if (hooks_ && e->dev) s = hooks_->WaitHostReady(*e);
  if (s.ok()) s = backend_->Write(file, e->host_ptr + boff, len, foff);
  // The last piece checksums the host copy (device stores: the bytes exist only now).
  if (e->w_io_left.fetch_sub(1) == 1 && cfg_.verify && !e->crc_set && s.ok()) {
    e->crc = Crc32c(0, e->host_ptr, e->nbytes);
    e->crc_set = true;
  }
  Lock lk(mu);
  BusyEnd(true);
  if (s.ok()) CountFileIo(true, file, len);
  if (!s.ok() && e->error.ok())
    e->error = s.With("asynchronous write of " + Describe(e->name, e->site, e->id));
  if (--e->w_pending == 0) FinishWrite(e);
}

void Engine::FinishWrite(const EntryPtr& e) {
  writes_inflight_--;
  if (!e->error.ok()) {
    e->w = WState::kFailed;
    if (pending_error_.ok()) pending_error_ = e->error;
    FreeHostBuffer(*e);
    if (e->has_slot) {
      SlotFree(e->file_off, e->padded);
      e->has_slot = false;
    }
  } else {
    e->w = WState::kDone;
    stats.disk_bytes_written += e->nbytes;
    stats.disk_tensors_written++;
    // Without forwarding, loads read the file: drop the store's copy once it is written.
    if (!cfg_.forwarding && e->tier == 0 && e->host_from_store && e->pins == 0)
      FreeHostBuffer(*e);
  }
  MaybeFree(e);
  cv.notify_all();
}

// ---------------------------------------------------------------------------
// Reads
// ---------------------------------------------------------------------------
void Engine::StartRead(const EntryPtr& e, bool demand) {
  const std::vector<Piece> pieces = Pieces(*e);
  e->reading = true;
  e->r_status = Status();
  e->r_pending = static_cast<int>(pieces.size());
  e->r_io_left = static_cast<int>(pieces.size());
  reads_inflight_++;
  for (const Piece& p : pieces)
    pool_->Submit([this, e, p] { ReadPiece(e, p.file, p.file_off, p.buf_off, p.len); }, demand);
}

void Engine::ReadPiece(const EntryPtr& e, size_t file, uint64_t foff, uint64_t boff,
                       uint64_t len) {
  {
    Lock lk(mu);
    BusyBegin(false);
  }
  Status s = backend_->Read(file, e->host_ptr + boff, len, foff);
  Status c;  // the last piece verifies the whole tensor
  if (e->r_io_left.fetch_sub(1) == 1) c = CheckCrc(*e, e->host_ptr);
  Lock lk(mu);
  BusyEnd(false);
  if (s.ok()) CountFileIo(false, file, len);
  if (!s.ok() && e->r_status.ok())
    e->r_status = s.With("read of " + Describe(e->name, e->site, e->id));
  if (!c.ok()) {
    stats.checksum_failures++;
    if (e->r_status.ok()) e->r_status = c;
  }
  if (--e->r_pending == 0) FinishRead(e);
}

void Engine::FinishRead(const EntryPtr& e) {
  e->reading = false;
  reads_inflight_--;
  if (e->r_status.ok()) {
    e->host_valid = true;
    e->host_from_store = false;
    e->read_unconsumed = true;
    stats.disk_bytes_read += e->nbytes;
    stats.disk_tensors_read++;
  } else {
    FreeHostBuffer(*e);
  }
  MaybeFree(e);
  cv.notify_all();
}

Status Engine::CheckCrc(const Entry& e, const char* buf) {
  if (!cfg_.verify || !e.crc_set || e.nbytes == 0) return Status::Ok();
  uint32_t got = Crc32c(0, buf, e.nbytes);
  if (got == e.crc) return Status::Ok();
  char hex[64];
  snprintf(hex, sizeof hex, "crc32c 0x%08x read, 0x%08x written", got, e.crc);
  return Status(EIO, "checksum mismatch reading " + Describe(e.name, e.site, e.id) + ": " + hex +
                         " (" + std::to_string(e.nbytes) + " bytes at store offset " +
                         std::to_string(e.file_off) + "); the store file was modified or the "
                         "disk returned bad data");
}

Status Engine::SyncIo(bool write, char* buf, uint64_t loff, uint64_t len) {
  struct Latch {
    std::mutex m;
    std::condition_variable c;
    int left = 0;
    Status st;
  };
  auto latch = std::make_shared<Latch>();
  std::vector<std::tuple<size_t, uint64_t, uint64_t, uint64_t>> pieces;
  ForEachPiece(loff, len, [&](size_t f, uint64_t foff, uint64_t boff, uint64_t plen) {
    pieces.emplace_back(f, foff, boff, plen);
  });
  latch->left = static_cast<int>(pieces.size());
  for (auto& [f, foff, boff, plen] : pieces) {
    pool_->Submit([this, latch, write, buf, f = f, foff = foff, boff = boff, plen = plen] {
      {
        Lock lk(mu);
        BusyBegin(write);
      }
      Status s = write ? backend_->Write(f, buf + boff, plen, foff)
                       : backend_->Read(f, buf + boff, plen, foff);
      {
        Lock lk(mu);
        BusyEnd(write);
        if (s.ok()) CountFileIo(write, f, plen);
      }
      std::lock_guard<std::mutex> g(latch->m);
      if (!s.ok() && latch->st.ok()) latch->st = s;
      if (--latch->left == 0) latch->c.notify_all();
    }, true);
  }
  std::unique_lock<std::mutex> g(latch->m);
  latch->c.wait(g, [&] { return latch->left == 0; });
  return latch->st;
}

// ---------------------------------------------------------------------------
// Store
// ---------------------------------------------------------------------------
Status Engine::BeginStore(int64_t site, int tier, uint64_t nbytes, std::string_view name,
                          EntryPtr* out, int device, int64_t uses) {
  if (tier != 0 && tier != 1)
    return Status(EINVAL, "store of tag '" + std::string(name) + "': invalid tier " +
                              std::to_string(tier) + " (0 = nvme, 1 = host)");
  if (uses == 0)
    return Status(EINVAL, "store of tag '" + std::string(name) + "': uses=0 keeps nothing "
                              "(write the null handle instead)");
  Lock lk(mu);
  SSD_RETURN_IF_ERROR(TakePendingError());
  if (hooks_) hooks_->ReclaimReleases(false);
  auto e = std::make_shared<Entry>();
  e->uses_left = uses == Entry::kManual ? Entry::kManual : uses < 0 ? Entry::kUncounted : uses;
  e->id = next_id_++;
  if (next_id_ == 0) next_id_ = 1;
  e->site = site;
  e->device = device;
  e->tier = tier;
  e->nbytes = nbytes;
  e->padded = RoundUp(nbytes, kAlign);
  e->seq = next_seq_++;
  e->name = std::string(name);
  if (nbytes == 0) {
    e->host_valid = true;
  } else if (tier == 1) {
    uint64_t off;
    bool got = AllocHost(1, e->padded, &off);
    if (!got && hooks_) {  // entries whose last load's copy is still running hold room
      hooks_->ReclaimReleases(true);
      got = AllocHost(1, e->padded, &off);
    }
    if (!got) {
      return Status(ENOMEM, "host tier full: " + std::to_string(e->padded) +
                                " bytes requested, " + std::to_string(tier_.alloc.free_bytes()) +
                                " free (host_tier_bytes=" + std::to_string(cfg_.host_tier_bytes) +
                                ") storing tag '" + e->name + "'");
    }
    e->host_arena = 1;
    e->host_off = off;
    e->host_ptr = tier_.base + off;
  } else {
    uint64_t off;
    Status full;
    bool got_slot = SlotAlloc(e->device, e->padded, &off);
    if (!got_slot && hooks_) {
      hooks_->ReclaimReleases(true);
      got_slot = SlotAlloc(e->device, e->padded, &off);
    }
    if (!got_slot) {
      const RangeAllocator& group = SlotGroup(e->device);
      full = Status(ENOSPC, "No space left in the ssdtrain store for tag '" + e->name +
                                "': " + std::to_string(e->padded) + " bytes requested, " +
                                std::to_string(group.free_bytes()) + " free (largest extent " +
                                std::to_string(group.largest_free()) + ", capacity_bytes=" +
                                std::to_string(cfg_.capacity_bytes) +
                                (slots_.size() > 1 ? ", split over " +
                                     std::to_string(slots_.size()) + " devices" : "") + ")");
    } else {
      Status s = EnsureFileSpace(off, e->padded);
      if (!s.ok()) {
        SlotFree(off, e->padded);
        full = s.With("storing tag '" + e->name + "'");
      }
    }
    if (full.ok()) {
      e->has_slot = true;
      e->file_off = off;
      Status a = AcquireCacheBuffer(lk, *e, true);
      if (!a.ok()) {
        SlotFree(off, e->padded);
        return a;
      }
    } else {
      bool fs_full = full.code() == ENOSPC || full.code() == EDQUOT || full.code() == EFBIG;
      if (cfg_.on_full != 1 || !fs_full) return full;
      // on_full=keep: hold the tensor in the host tier instead (never overwrites live data).
      if (!AllocHost(1, e->padded, &off))
        return Status(ENOSPC, full.message() + "; on_full=keep: the host tier has no room "
                                  "either (" + std::to_string(tier_.alloc.free_bytes()) +
                                  " bytes free, host_tier_bytes=" +
                                  std::to_string(cfg_.host_tier_bytes) + ")");
      e->tier = 1;
      e->kept_full = true;
      e->host_arena = 1;
      e->host_off = off;
      e->host_ptr = tier_.base + off;
      stats.full_kept_tensors++;
      stats.full_kept_bytes += nbytes;
      if (!warned_full_) {
        warned_full_ = true;
        fprintf(stderr,
                "ssdtrain: store full (capacity_bytes=%llu); on_full=keep: keeping tag '%s' "
                "and later overflow in host memory (host tier)\n",
                static_cast<unsigned long long>(cfg_.capacity_bytes), e->name.c_str());
      }
    }
  }
  entries_[e->id] = e;
  by_site_[{device, site}].insert(e->id);
  if (e->uses_left == Entry::kUncounted) {
    uncounted_since_sweep_++;
    uncounted_bytes_since_sweep_ += nbytes;
  }
  unloaded_[e->seq] = e;  // every tier: the LIFO read-ahead into device staging uses it
  stats.bytes_written += nbytes;
  stats.tensors_written++;
  DeviceStats& ds = device_stats_[device];
  ds.bytes_written += nbytes;
  ds.tensors_written++;
  *out = e;
  return Status::Ok();
}

Status Engine::CommitStore(const EntryPtr& e) {
  Lock lk(mu);
  e->filling = false;
  e->host_valid = true;
  e->host_from_store = true;
  if (e->released) {
    MaybeFree(e);
    return Status::Ok();
  }
  if (e->tier == 0 && e->nbytes > 0) EnqueueWrite(e);
  cv.notify_all();
  return Status::Ok();
}

Status Engine::WriteThrough(const EntryPtr& e,
                            const std::function<Status(void*, uint64_t, uint64_t)>& fill) {
  const uint64_t window =
      std::min<uint64_t>(e->padded, std::max<uint64_t>(cfg_.chunk_bytes * 8, 64 * kMiB));
  void* raw = nullptr;
  if (posix_memalign(&raw, kAlign, window) != 0)
    return Status(ENOMEM, "allocating a " + HumanBytes(window) + " bounce buffer for tag '" +
                              e->name + "'");
  char* bounce = static_cast<char*>(raw);
  auto t0 = Clock::now();
  Status s;
  uint32_t crc = 0;
  for (uint64_t off = 0; off < e->nbytes && s.ok(); off += window) {
    uint64_t len = std::min(window, e->nbytes - off);
    s = fill(bounce, off, len);
    if (!s.ok()) break;
    if (cfg_.verify) crc = Crc32c(crc, bounce, len);
    uint64_t plen = RoundUp(len, kAlign);
    if (plen > len) memset(bounce + len, 0, plen - len);
    s = SyncIo(true, bounce, e->file_off + off, plen);
  }
  free(bounce);
  Lock lk(mu);
  stats.stall_seconds += Seconds(t0, Clock::now());
  stats.bounce_writes++;
  e->filling = false;
  if (!s.ok()) {
    Release(e);
    return s.With("synchronous write of " + Describe(e->name, e->site, e->id));
  }
  e->w = WState::kDone;
  if (cfg_.verify) {
    e->crc = crc;
    e->crc_set = true;
  }
  stats.disk_bytes_written += e->nbytes;
  stats.disk_tensors_written++;
  MaybeFree(e);
  cv.notify_all();
  return Status::Ok();
}

void Engine::AbortStore(const EntryPtr& e) {
  Lock lk(mu);
  e->filling = false;
  Release(e);
}

void Engine::CountUnusedStore(uint64_t nbytes, int device) {
  Lock lk(mu);
  stats.unused_stores++;
  (void)nbytes;
  (void)device;
}

bool Engine::CountLoad(const EntryPtr& e, bool defer) {
  if (e->uses_left <= 0 || e->released) return false;
  if (--e->uses_left > 0) return false;
  stats.counted_releases++;
  if (defer) return true;
  Release(e);
  return false;
}

Status Engine::Sweep(const uint32_t* pairs, uint64_t n_pairs, uint64_t seq_limit,
                     uint64_t* released) {
  std::set<uint64_t> live;
  for (uint64_t i = 0; i < n_pairs; ++i)
    live.insert(static_cast<uint64_t>(pairs[2 * i]) << 32 | pairs[2 * i + 1]);
  Lock lk(mu);
  if (hooks_) hooks_->ReclaimReleases(true);
  std::vector<EntryPtr> dead;
  uint64_t survivors = 0, survivor_bytes = 0;
  for (auto& [id, e] : entries_) {
    const uint64_t key = static_cast<uint64_t>(id) << 32 | HandleCheck(id);
    if (e->uses_left == Entry::kManual) continue;
    if (e->seq >= seq_limit || e->loading > 0 || e->filling || live.count(key)) {
      if (e->uses_left == Entry::kUncounted) {
        survivors++;
        survivor_bytes += e->nbytes;
      }
      continue;
    }
    dead.push_back(e);
  }
  for (auto& e : dead) Release(e);
  stats.sweeps++;
  stats.swept_entries += dead.size();
  *released = dead.size();
  // The next sweep is due when the uncounted entries made since have doubled what survived
  // (at least 64 entries, or an eighth of the host tier / file space in bytes).
  uncounted_since_sweep_ = uncounted_bytes_since_sweep_ = 0;
  sweep_mark_entries_ = std::max<uint64_t>(64, survivors);
  const uint64_t room = std::min<uint64_t>(std::max<uint64_t>(cfg_.host_tier_bytes, kGiB),
                                           cfg_.capacity_bytes);
  sweep_mark_bytes_ = std::max<uint64_t>(room / 8, survivor_bytes);
  return Status::Ok();
}

bool Engine::SweepRequested() {
  Lock lk(mu);
  if (sweep_mark_bytes_ == 0) {
    const uint64_t room = std::min<uint64_t>(std::max<uint64_t>(cfg_.host_tier_bytes, kGiB),
                                             cfg_.capacity_bytes);
    sweep_mark_bytes_ = room / 8;
  }
  return uncounted_since_sweep_ >= sweep_mark_entries_ ||
         (uncounted_since_sweep_ > 0 && uncounted_bytes_since_sweep_ >= sweep_mark_bytes_);
}

Status Engine::StoreFromHost(const void* src, uint64_t nbytes, int64_t site, int tier,
                             std::string_view name, uint32_t handle[2], int device,
                             int64_t uses) {
  if (uses == 0) {
    CountUnusedStore(nbytes, device);
    MakeNullHandle(handle);
    return Status::Ok();
  }
  EntryPtr e;
  SSD_RETURN_IF_ERROR(BeginStore(site, tier, nbytes, name, &e, device, uses));
  MakeHandle(*e, handle);
  if (nbytes == 0 || e->host_ptr) {
    if (nbytes) {
      memcpy(e->host_ptr, src, nbytes);
      if (e->padded > nbytes) memset(e->host_ptr + nbytes, 0, e->padded - nbytes);
      if (cfg_.verify && e->tier == 0) {
        e->crc = Crc32c(0, e->host_ptr, nbytes);
        e->crc_set = true;
      }
    }
    return CommitStore(e);
  }
  return WriteThrough(e, [src](void* dst, uint64_t off, uint64_t len) {
    memcpy(dst, static_cast<const char*>(src) + off, len);
    return Status::Ok();
  });
}

// ---------------------------------------------------------------------------
// Load
// ---------------------------------------------------------------------------
Status Engine::LookupForLoad(Lock& lk, const uint32_t h[2], uint64_t nbytes, int64_t site,
                             std::string_view name, EntryPtr* out, int device) {
  if (h[0] == 0 || HandleCheck(h[0]) != h[1])
    return Status(EINVAL, "invalid or stale ssdtrain handle {" + std::to_string(h[0]) + ", " +
                              std::to_string(h[1]) + "} for tag '" + std::string(name) +
                              "' (site " + std::to_string(site) +
                              "): it does not come from a store of this engine "
                              "(corrupted, or the engine was reconfigured since)");
  auto it = entries_.find(h[0]);
  if (it == entries_.end())
    return Status(EINVAL, "activation was already released: " + Describe(name, site, h[0]) +
                              " (an entry is released after its last load in the execution that "
                              "stored it, or, when its handle left that execution, by a sweep "
                              "once no live jax.Array holds the handle; also by release_all() "
                              "and by reconfiguration)");
  EntryPtr e = it->second;
  if (e->site != site)
    return Status(EINVAL, "ssdtrain handle of " + Describe(e->name, e->site, e->id) +
                              " used by a load of tag '" + std::string(name) + "' at site " +
                              std::to_string(site));
  if (e->device != device)
    return Status(EINVAL, "ssdtrain handle of " + Describe(e->name, e->site, e->id) +
                              " stored by device " + std::to_string(e->device) +
                              " used by a load on device " + std::to_string(device) +
                              " (a handle never leaves the device that stored it)");
  if (e->nbytes != nbytes)
    return Status(EINVAL, "load of " + Describe(name, site, e->id) + ": output has " +
                              std::to_string(nbytes) + " bytes but " + std::to_string(e->nbytes) +
                              " bytes were stored");
  if (!e->error.ok()) return e->error.With("load of " + Describe(name, site, e->id));
  if (e->loads++ == 0) {
    unloaded_.erase(e->seq);
    if (cfg_.forwarding && e->w == WState::kQueued) {
      e->w = WState::kCancelled;
      writes_inflight_--;
      stats.write_skipped_bytes += e->nbytes;
      stats.write_skipped_tensors++;
      // Keep the slot: it is released with the entry.
      cv.notify_all();
    }
  }
  stats.bytes_read += nbytes;
  stats.tensors_read++;
  DeviceStats& ds = device_stats_[device];
  ds.bytes_read += nbytes;
  ds.tensors_read++;
  *out = e;
  return Status::Ok();
}

Status Engine::AcquireHost(Lock& lk, const EntryPtr& e, HostRef* ref) {
  ref->e = e;
  if (e->nbytes == 0) return Status::Ok();
  auto t0 = Clock::now();
  bool missed = false;
  for (;;) {
    if (e->reading || e->filling) {
      auto w0 = Clock::now();
      while (e->reading || e->filling) cv.wait(lk);
      stats.stall_seconds += Seconds(w0, Clock::now());
    }
    if (!e->error.ok()) return e->error.With("load of " + Describe(e->name, e->site, e->id));
    if (!cfg_.forwarding && e->tier == 0 && e->host_from_store &&
        (e->w == WState::kQueued || e->w == WState::kRunning)) {
      auto w0 = Clock::now();  // the write drops the store's copy (FinishWrite)
      cv.wait(lk, [&] { return e->w != WState::kQueued && e->w != WState::kRunning; });
      stats.stall_seconds += Seconds(w0, Clock::now());
      continue;
    }
    if (e->host_ptr && e->host_valid) {
      if (e->tier == 0 && !missed) {
        if (e->host_from_store) {
          stats.forwarded_tensors++;
          stats.forwarded_bytes += e->nbytes;
        } else {
          stats.prefetch_hits++;
        }
      }
      ConsumeRead(*e);
      e->pins++;
      ref->pinned = true;
      ref->ptr = e->host_ptr;
      return Status::Ok();
    }
    if (e->w != WState::kDone)
      return Status(EIO, "load of " + Describe(e->name, e->site, e->id) +
                             ": no copy of the data is available (write state " +
                             std::to_string(static_cast<int>(e->w)) + ")");
    if (!missed) {
      missed = true;
      stats.prefetch_misses++;
      t0 = Clock::now();
    }
    if (!e->host_ptr) {
      SSD_RETURN_IF_ERROR(AcquireCacheBuffer(lk, *e, true));
      if (e->reading || e->filling || e->host_valid) continue;  // raced with read-ahead
    }
    if (!e->host_ptr) break;  // no room: bounce below
    StartRead(e, true);
    auto w0 = Clock::now();
    while (e->reading) cv.wait(lk);
    stats.stall_seconds += Seconds(w0, Clock::now());
    if (!e->r_status.ok()) return e->r_status;
  }
  // Larger than the cache, or no room: read through a private bounce buffer.
  void* raw = nullptr;
  if (posix_memalign(&raw, kAlign, e->padded) != 0)
    return Status(ENOMEM, "allocating a " + HumanBytes(e->padded) + " bounce buffer to load " +
                              Describe(e->name, e->site, e->id));
  e->pins++;  // keeps the file slot alive
  ref->pinned = true;
  stats.bounce_reads++;
  lk.unlock();
  Status s = SyncIo(false, static_cast<char*>(raw), e->file_off, e->padded);
  Status c = s.ok() ? CheckCrc(*e, static_cast<char*>(raw)) : Status();
  lk.lock();
  if (!c.ok()) {
    stats.checksum_failures++;
    s = c;
  }
  stats.stall_seconds += Seconds(t0, Clock::now());
  (void)t0;
  if (!s.ok()) {
    free(raw);
    return c.ok() ? s.With("load of " + Describe(e->name, e->site, e->id)) : s;
  }
  stats.disk_bytes_read += e->nbytes;
  stats.disk_tensors_read++;
  stats.disk_loaded_bytes += e->nbytes;
  ref->bounce = static_cast<char*>(raw);
  ref->ptr = ref->bounce;
  return Status::Ok();
}

void Engine::ConsumeRead(Entry& e) {
  if (!e.read_unconsumed) return;
  e.read_unconsumed = false;
  stats.disk_loaded_bytes += e.nbytes;
}

void Engine::ReleaseHost(Lock& lk, HostRef* ref) {
  if (ref->bounce) {
    free(ref->bounce);
    ref->bounce = nullptr;
  }
  if (ref->pinned) {
    ref->e->pins--;
    ref->pinned = false;
    MaybeFree(ref->e);
    cv.notify_all();
  }
  ref->ptr = nullptr;
}

bool Engine::PredictLoad(int64_t site, int64_t run_id, int device, uint64_t nbytes,
                         uint32_t h[2], uint64_t* left) const {
  auto ids = by_site_.find({device, site});
  if (ids == by_site_.end()) return false;
  const Entry* best = nullptr;
  for (uint32_t id : ids->second) {
    auto it = entries_.find(id);
    if (it == entries_.end()) continue;
    const Entry* e = it->second.get();
    if (e->loads || e->run_id != run_id || e->nbytes != nbytes) continue;  // (device: by key)
    if (!best || e->seq > best->seq) best = e;
  }
  if (!best) return false;
  uint64_t n = 0;
  for (const auto& [seq, e] : unloaded_)
    if (e->run_id == run_id && e->device == device && e.get() != best) n++;
  *left = n;
  MakeHandle(*best, h);
  return true;
}

std::vector<EntryPtr> Engine::PredictNext(uint64_t budget, int device) {
  std::vector<EntryPtr> out;
  for (auto it = unloaded_.rbegin(); it != unloaded_.rend(); ++it) {
    const EntryPtr& e = it->second;
    if (device >= 0 && e->device != device) continue;
    if (e->padded > budget) break;
    budget -= e->padded;
    out.push_back(e);
  }
  return out;
}

void Engine::SchedulePrefetch(Lock& lk, int device) {
  if (cfg_.prefetch_bytes == 0) return;
  for (const EntryPtr& e : PredictNext(cfg_.prefetch_bytes, device)) {
    if (e->host_ptr || e->reading || e->filling || e->w != WState::kDone) continue;
    if (e->padded > cache_.size) continue;
    uint64_t off;
    bool ok = false;
    for (;;) {
      if (AllocHost(0, e->padded, &off)) {
        ok = true;
        break;
      }
      if (!EvictOne(e.get(), e->seq)) break;
    }
    if (!ok) break;
    e->host_arena = 0;
    e->host_off = off;
    e->host_ptr = cache_.base + off;
    stats.prefetch_issued++;
    StartRead(e, false);
  }
}

Status Engine::LoadToHost(const uint32_t handle[2], void* dst, uint64_t nbytes, int64_t site,
                          std::string_view name, int device) {
  Lock lk(mu);
  SSD_RETURN_IF_ERROR(TakePendingError());
  EntryPtr e;
  SSD_RETURN_IF_ERROR(LookupForLoad(lk, handle, nbytes, site, name, &e, device));
  e->loading++;
  HostRef ref;
  Status s = AcquireHost(lk, e, &ref);
  if (!s.ok()) {
    e->loading--;
    ReleaseHost(lk, &ref);
    return s;
  }
  if (nbytes) {
    lk.unlock();
    if (hooks_ && e->dev && !ref.bounce) s = hooks_->WaitHostReady(*e);
    if (s.ok()) memcpy(dst, ref.ptr, nbytes);
    lk.lock();
  }
  e->loading--;
  ReleaseHost(lk, &ref);
  if (s.ok()) CountLoad(e);
  SchedulePrefetch(lk, device);
  return s;
}

// ---------------------------------------------------------------------------
// Whole-engine operations
// ---------------------------------------------------------------------------
Status Engine::Flush() {
  Lock lk(mu);
  if (hooks_) hooks_->ReclaimReleases(true);
  cv.wait(lk, [&] { return reads_inflight_ == 0 && writes_inflight_ == 0; });
  return TakePendingError();
}

Status Engine::ReleaseAll() {
  Lock lk(mu);
  if (hooks_) hooks_->ReclaimReleases(true);
  std::vector<EntryPtr> all;
  all.reserve(entries_.size());
  for (auto& [id, e] : entries_) all.push_back(e);
  for (auto& e : all) Release(e);
  cv.wait(lk, [&] { return pending_free_ == 0 && reads_inflight_ == 0 && writes_inflight_ == 0; });
  return Status::Ok();
}

void Engine::ResetStats() {
  Lock lk(mu);
  uint64_t staging_in_use = stats.staging_in_use;
  stats = Stats();
  device_stats_.clear();
  file_bytes_written_.assign(files_.size(), 0);
  file_bytes_read_.assign(files_.size(), 0);
  stats.staging_in_use = stats.staging_peak = staging_in_use;
  throttle_.write_wait_ns = 0;
  throttle_.read_wait_ns = 0;
  cache_.alloc.ResetPeak();
  tier_.alloc.ResetPeak();
  for (auto& a : slots_) a.ResetPeak();
}

std::string Engine::StatsString() {
  Lock lk(mu);
  std::ostringstream o;
  auto u = [&](const char* k, uint64_t v) { o << k << '=' << v << '\n'; };
  auto d = [&](const char* k, double v) {
    char buf[64];
    snprintf(buf, sizeof buf, "%.6f", v);
    o << k << '=' << buf << '\n';
  };
  const Stats& s = stats;
  u("bytes_written", s.bytes_written);
  u("tensors_written", s.tensors_written);
  u("bytes_read", s.bytes_read);
  u("tensors_read", s.tensors_read);
  u("disk_bytes_written", s.disk_bytes_written);
  u("disk_bytes_read", s.disk_bytes_read);
  u("disk_tensors_written", s.disk_tensors_written);
  u("disk_tensors_read", s.disk_tensors_read);
  u("write_skipped_bytes", s.write_skipped_bytes);
  u("write_skipped_tensors", s.write_skipped_tensors);
  u("forwarded_tensors", s.forwarded_tensors);
  u("forwarded_bytes", s.forwarded_bytes);
  u("staging_forwarded_tensors", s.staging_forwarded_tensors);
  u("speculative_loads", s.speculative_loads);
  u("handle_mismatches", s.handle_mismatches);
  u("staging_waits", s.staging_waits);
  u("prefetch_hits", s.prefetch_hits);
  u("prefetch_misses", s.prefetch_misses);
  u("prefetch_issued", s.prefetch_issued);
  u("disk_loaded_bytes", s.disk_loaded_bytes);
  u("bounce_writes", s.bounce_writes);
  u("bounce_reads", s.bounce_reads);
  u("full_kept_tensors", s.full_kept_tensors);
  u("full_kept_bytes", s.full_kept_bytes);
  u("checksum_failures", s.checksum_failures);
  u("counted_releases", s.counted_releases);
  u("unused_stores", s.unused_stores);
  u("sweeps", s.sweeps);
  u("swept_entries", s.swept_entries);
  uint64_t uncounted = 0;
  for (const auto& [id, e] : entries_) uncounted += e->uses_left == Entry::kUncounted;
  u("uncounted_entries", uncounted);
  u("next_seq", next_seq_);
  d("stall_seconds", s.stall_seconds);
  d("handle_sync_seconds", s.handle_sync_seconds);
  d("write_seconds", s.write_seconds);
  d("read_seconds", s.read_seconds);
  u("host_tier_bytes_in_use", tier_.alloc.in_use());
  u("host_tier_bytes_peak", tier_.alloc.peak());
  u("host_cache_bytes_in_use", cache_.alloc.in_use());
  u("host_cache_bytes_peak", cache_.alloc.peak());
  u("staging_bytes_in_use", s.staging_in_use);
  u("staging_bytes_peak", s.staging_peak);
  u("file_bytes_in_use", SlotsInUse());
  u("file_bytes_peak", SlotsPeak());
  uint64_t file_size = 0;
  for (auto& f : files_) file_size += f.size;
  u("file_bytes_allocated", file_size);
  u("live_entries", entries_.size());
  u("writes_in_flight", writes_inflight_);
  u("reads_in_flight", reads_inflight_);
  u("o_direct", o_direct_ ? 1 : 0);
  u("gds", gds_active ? 1 : 0);
  u("io_threads", cfg_.io_threads);
  u("verify", cfg_.verify ? 1 : 0);
  u("on_full", cfg_.on_full);
  u("open_files", files_.size());
  u("chunk_bytes", cfg_.chunk_bytes);
  u("bandwidth_cap", cfg_.bandwidth_cap);
  d("throttle_write_seconds", throttle_.write_wait_ns.load() * 1e-9);
  d("throttle_read_seconds", throttle_.read_wait_ns.load() * 1e-9);
  u("directories", files_.size());
  for (size_t i = 0; i < files_.size(); ++i) {
    std::string k = "file" + std::to_string(i);
    u((k + "_bytes_written").c_str(), i < file_bytes_written_.size() ? file_bytes_written_[i] : 0);
    u((k + "_bytes_read").c_str(), i < file_bytes_read_.size() ? file_bytes_read_[i] : 0);
  }
  for (const auto& [dev, ds] : device_stats_) {
    std::string k = "device" + std::to_string(dev);
    u((k + "_bytes_written").c_str(), ds.bytes_written);
    u((k + "_tensors_written").c_str(), ds.tensors_written);
    u((k + "_bytes_read").c_str(), ds.bytes_read);
    u((k + "_tensors_read").c_str(), ds.tensors_read);
  }
  o << "backend=" << (backend_ ? backend_->name() : "none") << '\n';
  return o.str();
}

Status Engine::DebugTruncate(uint64_t size) {
  Lock lk(mu);
  for (auto& f : files_)
    SSD_CHECK_SYS(ftruncate(f.fd, static_cast<off_t>(size)),
                  "ftruncate of the store file in '" + f.dir + "'");
  return Status::Ok();
}

Status Engine::DebugCorrupt(uint64_t loff) {
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
              : Status(EIO, "debug_corrupt: offset " + std::to_string(loff) + " is past the end "
                                                                            "of the store file");
  } else {
    p[foff - base] ^= 0x5A;
    if (pwrite(f.fd, p, kAlign, static_cast<off_t>(base)) != static_cast<ssize_t>(kAlign))
      s = SysError(errno, "debug_corrupt pwrite", __FILE__, __LINE__);
  }
  free(raw);
  return s;
}

std::string Engine::FilePaths() {
  Lock lk(mu);
  std::string out;
  for (auto& f : files_) out += f.dir + "/(unlinked)\n";
  return out;
}

// ---------------------------------------------------------------------------
// Process-wide engine
// ---------------------------------------------------------------------------
namespace {
std::mutex g_engine_mu;
std::shared_ptr<Engine> g_engine;
}  // namespace

std::shared_ptr<Engine> CurrentEngine(Status* st) {
  std::lock_guard<std::mutex> g(g_engine_mu);
  if (!g_engine) {
    Status s = Engine::Create(Config::Defaults(), &g_engine);
    if (!s.ok()) {
      *st = s.With("creating the default ssdtrain engine (call configure() first)");
      return nullptr;
    }
  }
  *st = Status::Ok();
  return g_engine;
}

// Used by c_api.cc.
Status ReplaceEngine(const Config* cfg) {
  std::shared_ptr<Engine> old;
  {
    std::lock_guard<std::mutex> g(g_engine_mu);
    old = std::move(g_engine);
    g_engine.reset();
  }
  if (old) {
    old->ReleaseAll();
    old.reset();  // destroyed here unless a handler still holds it
  }
  if (!cfg) return Status::Ok();
  std::shared_ptr<Engine> fresh;
  SSD_RETURN_IF_ERROR(Engine::Create(*cfg, &fresh));
  std::lock_guard<std::mutex> g(g_engine_mu);
  g_engine = std::move(fresh);
  return Status::Ok();
}

std::shared_ptr<Engine> PeekEngine() {
  std::lock_guard<std::mutex> g(g_engine_mu);
  return g_engine;
}

}  // namespace ssdtrain
