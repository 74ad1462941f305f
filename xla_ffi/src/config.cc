// Config::Parse (the "key=value" lines configure() sends) and the SSDTRAIN_FAULT test hook.
#include "ssdtrain/config.h"

#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace ssdtrain {
namespace {

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

}  // namespace

std::string HumanBytes(uint64_t n) {
  char buf[64];
  if (n >= kGiB)
    snprintf(buf, sizeof buf, "%.2f GiB", n / double(kGiB));
  else if (n >= kMiB)
    snprintf(buf, sizeof buf, "%.2f MiB", n / double(kMiB));
  else
    snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(n));
  return buf;
}

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
      if (c.directories.empty()) return Status(EINVAL, "configure: 'directories' is empty");
      continue;
    }
    int64_t x = 0;
    struct IntKey {
      const char* name;
      int64_t min;
      int64_t max;
    };
    static const IntKey keys[] = {
        {"capacity_bytes", 1, INT64_MAX},
        {"host_cache_bytes", 1, INT64_MAX},
        {"host_tier_bytes", 0, INT64_MAX},
        {"staging_bytes", 0, INT64_MAX},
        {"io_threads", 1, 256},
        {"chunk_bytes", 1, 1LL << 32},
        {"o_direct", 0, 2},
        {"gds", 0, 2},
        {"prefetch_bytes", 0, INT64_MAX},
        {"forwarding", 0, 1},
        {"on_full", 0, 1},
        {"verify", 0, 1},
        {"exact_loads", 0, 1},
        {"bandwidth_cap", 0, INT64_MAX},
        {"device_groups", 0, 4096},
    };
    const IntKey* k = nullptr;
    for (const auto& cand : keys)
      if (key == cand.name) k = &cand;
    if (!k) return Status(EINVAL, "configure: unknown key '" + key + "'");
    SSD_RETURN_IF_ERROR(ParseInt(key, val, &x));
    if (x < k->min || x > k->max) {
      std::string want =
          k->min == 1 ? "a positive integer"
          : k->min == 0 && k->max == INT64_MAX
              ? "a non-negative integer"
              : "in [" + std::to_string(k->min) + ", " + std::to_string(k->max) + "]";
      return Status(
          EINVAL, "configure: invalid value for '" + key + "': " + val + " (must be " + want + ")");
    }
    if (key == "capacity_bytes")
      c.capacity_bytes = x;
    else if (key == "host_cache_bytes")
      c.host_cache_bytes = x;
    else if (key == "host_tier_bytes")
      c.host_tier_bytes = x;
    else if (key == "staging_bytes")
      c.staging_bytes = x;
    else if (key == "io_threads")
      c.io_threads = static_cast<int>(x);
    else if (key == "chunk_bytes")
      c.chunk_bytes = x;
    else if (key == "o_direct")
      c.o_direct = static_cast<int>(x);
    else if (key == "gds")
      c.gds = static_cast<int>(x);
    else if (key == "prefetch_bytes")
      c.prefetch_bytes = x;
    else if (key == "forwarding")
      c.forwarding = x != 0;
    else if (key == "on_full")
      c.on_full = static_cast<int>(x);
    else if (key == "verify")
      c.verify = x != 0;
    else if (key == "exact_loads")
      c.exact_loads = x != 0;
    else if (key == "bandwidth_cap")
      c.bandwidth_cap = x;
    else if (key == "device_groups")
      c.device_groups = static_cast<int>(x);
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
  if (op == "write")
    out->op = kWrite;
  else if (op == "read")
    out->op = kRead;
  else if (op == "shortwrite")
    out->op = kShortWrite;
  else if (op == "shortread")
    out->op = kShortRead;
  else
    return bad("unknown op '" + op + "'");
  int64_t k = 0;
  if (!ParseInt("n", n, &k).ok() || k < 1) return bad("n must be a positive integer");
  out->n = static_cast<uint64_t>(k);
  static const struct {
    const char* name;
    int code;
  } names[] = {
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

}  // namespace ssdtrain
