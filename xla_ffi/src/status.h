// Error handling shared by all ssdtrain sources. Nothing in this library
// throws across the C ABI or into XLA: every failure is a Status carrying an
// errno-like code and a message with the failing call and file:line.
#pragma once

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#define SSD_EXPORT __attribute__((visibility("default")))

namespace ssdtrain {

class Status {
 public:
  Status() = default;
  Status(int code, std::string msg) : code_(code), msg_(std::move(msg)) {}
  static Status Ok() { return Status(); }
  bool ok() const { return code_ == 0; }
  int code() const { return code_; }
  const std::string& message() const { return msg_; }
  // Prepends context ("while ...: ") to the message.
  Status With(const std::string& ctx) const {
    if (ok()) return *this;
    return Status(code_, ctx + ": " + msg_);
  }

 private:
  int code_ = 0;
  std::string msg_;
};

inline std::string ErrnoString(int e) {
  char buf[256];
  // GNU strerror_r returns char*.
  const char* s = strerror_r(e, buf, sizeof(buf));
  return std::string(s ? s : "unknown error") + " (errno " + std::to_string(e) + ")";
}

inline Status SysError(int e, const std::string& what, const char* file, int line) {
  return Status(e ? e : EIO, what + " failed: " + ErrnoString(e) + " [" + file + ":" +
                                 std::to_string(line) + "]");
}

}  // namespace ssdtrain

#define SSD_STRINGIFY2(x) #x
#define SSD_STRINGIFY(x) SSD_STRINGIFY2(x)

// Returns an errno Status if `expr` evaluates to a negative value.
#define SSD_CHECK_SYS(expr, what)                                          \
  do {                                                                     \
    if ((expr) < 0) {                                                      \
      int ssd_errno_ = errno;                                              \
      return ::ssdtrain::SysError(ssd_errno_, (what), __FILE__, __LINE__); \
    }                                                                      \
  } while (0)

#define SSD_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::ssdtrain::Status ssd_status_ = (expr);   \
    if (!ssd_status_.ok()) return ssd_status_; \
  } while (0)
