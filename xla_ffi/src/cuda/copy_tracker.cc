// CopyTracker: timing-event brackets around the CUDA module's copies (copy_tracker.h).
#include "copy_tracker.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>

#include "cuda_check.h"

namespace ssdtrain {
namespace {

constexpr int kOps = static_cast<int>(CopyOp::kCount);
// Intervals kept per device and direction before they are folded into the totals.
constexpr size_t kFoldAt = 1 << 16;

double HostNow() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

bool Complete(cudaEvent_t ev) {
  cudaError_t e = cudaEventQuery(ev);
  if (e == cudaSuccess) return true;
  cudaGetLastError();  // cudaErrorNotReady (or a sticky error the handlers report) is not ours
  return false;
}

// Direction of an operation over the PCIe link (-1: none).
int LinkDirection(CopyOp op) {
  switch (op) {
    case CopyOp::kD2H:
    case CopyOp::kStoreDirect:
      return 0;
    case CopyOp::kReadAhead:
    case CopyOp::kLoadHost:
      return 1;
    default:
      return -1;
  }
}

// Measure of the union of `v`'s intervals (sorted in place).
double UnionLength(std::vector<std::pair<double, double>>* v) {
  std::sort(v->begin(), v->end());
  double total = 0, start = 0, end = -1;
  for (const auto& [a, b] : *v) {
    if (a > end) {
      if (end > start) total += end - start;
      start = a;
      end = b;
    } else {
      end = std::max(end, b);
    }
  }
  if (end > start) total += end - start;
  return total;
}

// The union of `v`'s intervals as disjoint sorted intervals.
std::vector<std::pair<double, double>> Merge(std::vector<std::pair<double, double>> v) {
  std::sort(v.begin(), v.end());
  std::vector<std::pair<double, double>> out;
  for (const auto& iv : v) {
    if (!out.empty() && iv.first <= out.back().second)
      out.back().second = std::max(out.back().second, iv.second);
    else
      out.push_back(iv);
  }
  return out;
}

}  // namespace

const char* CopyOpName(CopyOp op) {
  static const char* const kNames[kOps] = {
      "stage_in", "d2h", "read_ahead", "load_staged", "load_host", "compute_wait", "store_direct"};
  int i = static_cast<int>(op);
  return i >= 0 && i < kOps ? kNames[i] : "?";
}

CopyTracker::~CopyTracker() {
  for (Pending& p : pending_) {
    cudaEventDestroy(p.begin);
    cudaEventDestroy(p.end);
  }
  for (auto& [dev, c] : clocks_) {
    for (cudaEvent_t ev : c.free_events) cudaEventDestroy(ev);
    if (c.origin) cudaEventDestroy(c.origin);
  }
  cudaGetLastError();
}

Status CopyTracker::Clock(int device, DeviceClock** out) {
  auto it = clocks_.find(device);
  if (it != clocks_.end()) {
    *out = &it->second;
    return Status::Ok();
  }
  // The origin is recorded on a private idle stream and waited for once, so that event times
  // convert to host time (and one device's timeline lines up with another's).
  DeviceClock c;
  cudaStream_t s = nullptr;
  SSD_CHECK_CUDA(cudaEventCreate(&c.origin));
  Status st = [&]() -> Status {
    SSD_CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    SSD_CHECK_CUDA(cudaEventRecord(c.origin, s));
    SSD_CHECK_CUDA(cudaEventSynchronize(c.origin));
    return Status::Ok();
  }();
  c.host_origin = HostNow();
  if (s) cudaStreamDestroy(s);
  if (!st.ok()) {
    cudaEventDestroy(c.origin);
    return st.With("starting the copy timeline of GPU " + std::to_string(device));
  }
  *out = &(clocks_[device] = std::move(c));
  return Status::Ok();
}

Status CopyTracker::NewEvent(DeviceClock* c, cudaEvent_t* ev) {
  if (!c->free_events.empty()) {
    *ev = c->free_events.back();
    c->free_events.pop_back();
    return Status::Ok();
  }
  SSD_CHECK_CUDA(cudaEventCreate(ev));  // timing enabled
  return Status::Ok();
}

void CopyTracker::Recycle(int device, cudaEvent_t ev) {
  auto it = clocks_.find(device);
  if (it == clocks_.end()) {
    cudaEventDestroy(ev);
    return;
  }
  it->second.free_events.push_back(ev);
}

Status CopyTracker::Begin(int device, cudaStream_t stream, Mark* mark) {
  DeviceClock* c = nullptr;
  SSD_RETURN_IF_ERROR(Clock(device, &c));
  cudaEvent_t ev;
  SSD_RETURN_IF_ERROR(NewEvent(c, &ev));
  cudaError_t err = cudaEventRecord(ev, stream);
  if (err != cudaSuccess) {
    c->free_events.push_back(ev);
    SSD_CHECK_CUDA(err);
  }
  mark->device = device;
  mark->begin = ev;
  return Status::Ok();
}

void CopyTracker::Cancel(Mark* mark) {
  if (mark->begin) Recycle(mark->device, mark->begin);
  mark->begin = nullptr;
}

Status CopyTracker::End(const Mark& mark, cudaStream_t stream, CopyOp op, uint64_t bytes,
                        std::string_view name) {
  DeviceClock* c = nullptr;
  SSD_RETURN_IF_ERROR(Clock(mark.device, &c));
  cudaEvent_t ev;
  SSD_RETURN_IF_ERROR(NewEvent(c, &ev));
  cudaError_t err = cudaEventRecord(ev, stream);
  if (err != cudaSuccess) {
    c->free_events.push_back(ev);
    Recycle(mark.device, mark.begin);
    SSD_CHECK_CUDA(err);
  }
  std::string label(name.substr(0, 64));  // one field of a timeline line
  for (char& ch : label)
    if (ch == ' ' || ch == '\n' || ch == '\t') ch = '_';
  pending_.push_back(Pending{op, mark.device, bytes, mark.begin, ev, std::move(label), true});
  return Status::Ok();
}

bool CopyTracker::Fold(Pending& p) {
  if (!Complete(p.end) || !Complete(p.begin)) return false;
  DeviceClock& c = clocks_[p.device];
  float t0 = 0, t1 = 0;
  bool timed = cudaEventElapsedTime(&t0, c.origin, p.begin) == cudaSuccess &&
               cudaEventElapsedTime(&t1, c.origin, p.end) == cudaSuccess;
  cudaGetLastError();
  Recycle(p.device, p.begin);
  Recycle(p.device, p.end);
  if (!timed || !p.counted) return true;  // counted nowhere rather than counted wrong
  const double start = c.host_origin + t0 * 1e-3, end = c.host_origin + std::max(t0, t1) * 1e-3;
  const int i = static_cast<int>(p.op);
  bytes_[i] += p.bytes;
  count_[i]++;
  seconds_[i] += end - start;
  if (first_start_ < 0 || start < first_start_) first_start_ = start;
  last_end_ = std::max(last_end_, end);
  const int dir = LinkDirection(p.op);
  if (dir >= 0) {
    c.link[dir].push_back(Interval{start, end});
    if (c.link[dir].size() >= kFoldAt) {
      double busy[2], overlap;
      LinkTimes(&c, busy, &overlap, /*clear=*/true);
    }
  }
  if (timeline_.size() == kTimelineCapacity) timeline_.pop_front();
  timeline_.push_back(Record{p.op, p.device, p.bytes, start, end, std::move(p.name)});
  return true;
}

void CopyTracker::Harvest() {
  // Brackets of different streams complete out of order: fold every complete one.
  std::deque<Pending> open;
  for (Pending& p : pending_)
    if (!Fold(p)) open.push_back(std::move(p));
  pending_.swap(open);
}

void CopyTracker::LinkTimes(DeviceClock* c, double busy[2], double* overlap, bool clear) {
  std::vector<std::pair<double, double>> dir[2];
  for (int d = 0; d < 2; ++d)
    for (const Interval& iv : c->link[d]) dir[d].emplace_back(iv.start, iv.end);
  for (int d = 0; d < 2; ++d) busy[d] = UnionLength(&dir[d]);
  const auto a = Merge(dir[0]), b = Merge(dir[1]);
  *overlap = 0;
  for (size_t i = 0, j = 0; i < a.size() && j < b.size();) {
    const double lo = std::max(a[i].first, b[j].first), hi = std::min(a[i].second, b[j].second);
    if (hi > lo) *overlap += hi - lo;
    (a[i].second < b[j].second) ? ++i : ++j;
  }
  if (clear) {
    for (int d = 0; d < 2; ++d) {
      link_busy_[d] += busy[d];
      c->link[d].clear();
    }
    link_overlap_ += *overlap;
  }
}

void CopyTracker::Append(std::ostream& o) {
  Harvest();
  auto u = [&](const std::string& k, uint64_t v) { o << k << '=' << v << '\n'; };
  auto d = [&](const std::string& k, double v) {
    char buf[64];
    snprintf(buf, sizeof buf, "%.6f", v);
    o << k << '=' << buf << '\n';
  };
  for (int i = 0; i < kOps; ++i) {
    const std::string k = std::string("gpu_") + CopyOpName(static_cast<CopyOp>(i));
    u(k + "_bytes", bytes_[i]);
    u(k + "_count", count_[i]);
    d(k + "_seconds", seconds_[i]);
  }
  double busy[2] = {link_busy_[0], link_busy_[1]}, overlap = link_overlap_;
  for (auto& [dev, c] : clocks_) {
    double b[2], ov;
    LinkTimes(&c, b, &ov, /*clear=*/false);
    busy[0] += b[0];
    busy[1] += b[1];
    overlap += ov;
  }
  const uint64_t bytes[2] = {
      bytes_[static_cast<int>(CopyOp::kD2H)] + bytes_[static_cast<int>(CopyOp::kStoreDirect)],
      bytes_[static_cast<int>(CopyOp::kReadAhead)] + bytes_[static_cast<int>(CopyOp::kLoadHost)]};
  const char* dir[2] = {"d2h", "h2d"};
  for (int i = 0; i < 2; ++i) {
    const std::string k = std::string("link_") + dir[i];
    u(k + "_bytes", bytes[i]);
    d(k + "_busy_seconds", busy[i]);
    d(k + "_GBps", busy[i] > 0 ? bytes[i] / busy[i] / 1e9 : 0.0);
  }
  d("link_overlap_seconds", overlap);
  d("gpu_span_seconds", first_start_ < 0 ? 0.0 : last_end_ - first_start_);
  u("gpu_pending_brackets", pending_.size());
}

void CopyTracker::Reset() {
  Harvest();
  for (int i = 0; i < kOps; ++i) {
    bytes_[i] = count_[i] = 0;
    seconds_[i] = 0;
  }
  link_busy_[0] = link_busy_[1] = link_overlap_ = 0;
  for (auto& [dev, c] : clocks_) c.link[0].clear(), c.link[1].clear();
  first_start_ = -1;
  last_end_ = 0;
  // Brackets still open belong to work before the reset: fold them away uncounted later.
  for (Pending& p : pending_) p.counted = false;
}

std::string CopyTracker::TakeTimeline() {
  // The copies already issued belong in it: wait for them (timelines are read between steps).
  for (Pending& p : pending_) cudaEventSynchronize(p.end);
  cudaGetLastError();
  Harvest();
  std::ostringstream o;
  char buf[96];
  for (const Record& r : timeline_) {
    snprintf(buf, sizeof buf, "%s %d %llu %.7f %.7f ", CopyOpName(r.op), r.device,
             static_cast<unsigned long long>(r.bytes), r.start, r.end);
    o << buf << (r.name.empty() ? "-" : r.name) << '\n';
  }
  timeline_.clear();
  return o.str();
}

}  // namespace ssdtrain
