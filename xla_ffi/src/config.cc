// Config::Parse (the "key=value" lines configure() sends: every option, no defaults here) and
// the SSDTRAIN_FAULT test hook.
#include "config.h"

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
namespace {

constexpr const char* kDirectoriesKey = "directories";

// An integer field of Config: its key, the range the engine accepts, how it is set and read.
struct IntField {
  const char* key;
  int64_t min, max;
  void (*set)(Config&, int64_t);
  int64_t (*get)(const Config&);
};

#define SSD_INT_FIELD(name, lo, hi)                                                         \
  IntField {                                                                                \
    #name, lo, hi, [](Config& c, int64_t v) { c.name = static_cast<decltype(c.name)>(v); }, \
        [](const Config& c) { return static_cast<int64_t>(c.name); }                        \
  }

// Every key but "directories", in the order Python sends them.
const IntField kIntFields[] = {
    SSD_INT_FIELD(capacity_bytes, static_cast<int64_t>(kAlign), INT64_MAX),
    SSD_INT_FIELD(host_cache_bytes, 1, INT64_MAX),
    SSD_INT_FIELD(host_tier_bytes, 0, INT64_MAX),
    SSD_INT_FIELD(staging_bytes, 0, INT64_MAX),
    SSD_INT_FIELD(io_threads, 1, 256),
    SSD_INT_FIELD(chunk_bytes, static_cast<int64_t>(kAlign), 1LL << 32),
    SSD_INT_FIELD(prefetch_bytes, 0, INT64_MAX),
    SSD_INT_FIELD(o_direct, 0, 2),
    SSD_INT_FIELD(gds, 0, 2),
    SSD_INT_FIELD(forwarding, 0, 1),
    SSD_INT_FIELD(on_full, 0, 1),
    SSD_INT_FIELD(verify, 0, 1),
    SSD_INT_FIELD(exact_loads, 0, 1),
    SSD_INT_FIELD(bandwidth_cap, 0, INT64_MAX),
    SSD_INT_FIELD(device_groups, 0, 4096),
};

#undef SSD_INT_FIELD

std::string Expected(const IntField& f) {
  if (f.max == INT64_MAX) {
    if (f.min == 0) return "a non-negative integer";
    if (f.min == 1) return "a positive integer";
    return "an integer >= " + std::to_string(f.min);
  }
  return "in [" + std::to_string(f.min) + ", " + std::to_string(f.max) + "]";
}

std::string KnownKeys() {
  std::string out = kDirectoriesKey;
  for (const auto& f : kIntFields) out += std::string(", ") + f.key;
  return out;
}

Status ParseDirectories(const std::string& val, std::vector<std::string>* out) {
  out->clear();
  size_t p = 0;
  while (p <= val.size()) {
    size_t q = val.find(':', p);
    if (q == std::string::npos) q = val.size();
    std::string d = Trim(val.substr(p, q - p));
    if (!d.empty()) {
      while (d.size() > 1 && d.back() == '/') d.pop_back();
      out->push_back(d);
    }
    p = q + 1;
  }
  if (out->empty()) return Status(EINVAL, "configure: 'directories' is empty");
  return Status::Ok();
}

}  // namespace

Status Config::Parse(std::string_view kv, Config* out) {
  Config c;
  std::vector<std::string> seen;
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
    for (const auto& k : seen)
      if (k == key) return Status(EINVAL, "configure: key '" + key + "' given twice");
    seen.push_back(key);
    if (key == kDirectoriesKey) {
      SSD_RETURN_IF_ERROR(ParseDirectories(val, &c.directories));
      continue;
    }
    const IntField* f = nullptr;
    for (const auto& cand : kIntFields)
      if (key == cand.key) f = &cand;
    if (!f)
      return Status(EINVAL, "configure: unknown key '" + key + "' (known: " + KnownKeys() + ")");
    int64_t x = 0;
    SSD_RETURN_IF_ERROR(ParseInt(key, val, &x));
    if (x < f->min || x > f->max)
      return Status(EINVAL, "configure: invalid value for '" + key + "': " + val + " (must be " +
                                Expected(*f) + ")");
    f->set(c, x);
  }
  // No defaults: the library and the Python package that configures it come together, and the
  // package sends every key.
  auto missing = [](const std::string& key) {
    return Status(EINVAL, "configure: missing key '" + key +
                              "' (jax_ssdtrain sends every option: is libssdtrain.so from "
                              "another version of the package?)");
  };
  auto given = [&](const char* key) {
    for (const auto& k : seen)
      if (k == key) return true;
    return false;
  };
  if (!given(kDirectoriesKey)) return missing(kDirectoriesKey);
  for (const auto& f : kIntFields)
    if (!given(f.key)) return missing(f.key);
  if (c.chunk_bytes % kAlign != 0)
    return Status(EINVAL, "configure: invalid value for 'chunk_bytes': " +
                              std::to_string(c.chunk_bytes) + " (must be a multiple of 4096)");
  *out = c;
  return Status::Ok();
}

std::string Config::ToString() const {
  std::string out = std::string(kDirectoriesKey) + "=";
  for (size_t i = 0; i < directories.size(); ++i) out += (i ? ":" : "") + directories[i];
  out += "\n";
  for (const auto& f : kIntFields)
    out += std::string(f.key) + "=" + std::to_string(f.get(*this)) + "\n";
  return out;
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
