// Where the GPU time of the offload goes: every copy the CUDA module issues (and every wait it
// puts on XLA's compute stream) is bracketed by two timing events. Completed brackets are
// harvested into per-operation bytes and busy seconds (ssd.stats(): achieved GB/s per link
// direction, the busy time of each copy stream, the time both directions overlapped) and into
// a bounded timeline of the latest operations (ssd.timeline()). CUDA sources only; every call
// is made with the engine's mutex held and the operation's device current.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <deque>
#include <map>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "status.h"

namespace ssdtrain {

enum class CopyOp : int {
  kStageIn = 0,  // store: device -> device staging, on the compute stream
  kD2H,          // store: staging -> pinned host, on the copy stream
  kReadAhead,    // read-ahead: pinned host -> staging, on the read-ahead stream
  kLoadStaged,   // load: staging -> device, on the compute stream
  kLoadHost,     // load: pinned host -> device, on the compute stream (read-ahead missed)
  kComputeWait,  // the compute stream waited for staging room (its previous user's copy)
  kStoreDirect,  // store: device -> pinned host past staging (what the arena could not hold),
                 // on the compute stream
  kCount
};

const char* CopyOpName(CopyOp op);

class CopyTracker {
 public:
  // An open bracket: the event recorded before the operation.
  struct Mark {
    int device = -1;
    cudaEvent_t begin = nullptr;
  };

  CopyTracker() = default;
  ~CopyTracker();
  CopyTracker(const CopyTracker&) = delete;
  CopyTracker& operator=(const CopyTracker&) = delete;

  // Records the opening event of an operation on `stream` of `device` (current).
  Status Begin(int device, cudaStream_t stream, Mark* mark);
  // Records the closing event; the bracket is harvested once both events completed.
  Status End(const Mark& mark, cudaStream_t stream, CopyOp op, uint64_t bytes,
             std::string_view name);
  // Drops an opened bracket whose operation was not issued.
  void Cancel(Mark* mark);

  // Folds completed brackets into the counters and the timeline (never waits).
  void Harvest();

  // "key=value" lines for ssd.stats(), after a harvest.
  void Append(std::ostream& o);
  void Reset();
  // The timeline (oldest first) as lines "op device bytes start_s end_s name", then cleared;
  // waits for the brackets already opened to close first.
  std::string TakeTimeline();

 private:
  struct Pending {
    CopyOp op;
    int device;
    uint64_t bytes;
    cudaEvent_t begin, end;
    std::string name;
    bool counted;  // false: issued before the last Reset()
  };
  struct Interval {
    double start, end;
  };
  struct DeviceClock {
    cudaEvent_t origin = nullptr;
    double host_origin = 0;  // steady-clock seconds when `origin` completed
    std::vector<cudaEvent_t> free_events;
    // Completed copies per link direction (0: device -> host, 1: host -> device), folded
    // into busy_/overlap_ when too many pile up.
    std::vector<Interval> link[2];
  };
  struct Record {
    CopyOp op;
    int device;
    uint64_t bytes;
    double start, end;
    std::string name;
  };
  static constexpr size_t kTimelineCapacity = 1 << 15;

  Status Clock(int device, DeviceClock** out);
  Status NewEvent(DeviceClock* c, cudaEvent_t* ev);
  void Recycle(int device, cudaEvent_t ev);
  bool Fold(Pending& p);  // false while p's events are not both complete
  // Busy time of each direction (the union of its copies, over all streams) and the time both
  // were busy, from c's intervals; `clear` folds them into the totals and drops them.
  void LinkTimes(DeviceClock* c, double busy[2], double* overlap, bool clear);

  std::map<int, DeviceClock> clocks_;
  std::deque<Pending> pending_;
  uint64_t bytes_[static_cast<int>(CopyOp::kCount)] = {};
  uint64_t count_[static_cast<int>(CopyOp::kCount)] = {};
  double seconds_[static_cast<int>(CopyOp::kCount)] = {};
  double link_busy_[2] = {}, link_overlap_ = 0;  // folded link times (see LinkTimes)
  double first_start_ = -1, last_end_ = 0;       // span of the harvested operations
  std::deque<Record> timeline_;
};

}  // namespace ssdtrain
