// Handles on the device. A store writes its handle {id, check word} into its XLA output with a
// kernel on the compute stream. A load either reads its handle on the host (a copy and a sync of
// the compute stream) or, when the engine predicted it, checks the prediction on the device: a
// kernel after the load's copy compares the two and, on a mismatch, fills the load's output
// with 0xFF bytes (NaN in every float type) and records the mismatch in mapped host memory, one
// slot per XLA execution id modulo HandleChecks::kSlots, which TakeMismatch reports.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "engine.h"
#include "status.h"

namespace ssdtrain {

// Enqueues the write of `h` into the device handle `dst` on `stream`.
Status LaunchWriteHandle(cudaStream_t stream, uint32_t* dst, const uint32_t h[2]);

// Copies the device handle `handle` into `h` on `stream` (a kernel writing mapped host memory)
// and waits for it; `*seconds`: how long the copy and the wait took. The engine's lock is not
// held.
Status ReadHandle(cudaStream_t stream, const uint32_t* handle, uint32_t h[2], double* seconds);

// A predicted load's check, in mapped host memory. Written by the device only on a mismatch.
struct MismatchSlot {
  unsigned long long run_id;
  unsigned int count;
  unsigned int predicted, actual, actual_check;
};

// The mismatch slots and the check kernel's launch. Lock held.
class HandleChecks {
 public:
  static constexpr int kSlots = 64;

  HandleChecks() = default;
  ~HandleChecks() { Free(); }
  HandleChecks(const HandleChecks&) = delete;
  HandleChecks& operator=(const HandleChecks&) = delete;

  // Enqueues on `stream` the check that the device handle `handle` of a load of execution
  // `run_id` is `want`: on a mismatch the kernel fills `out` (nbytes) with 0xFF bytes and
  // records it.
  Status LaunchVerify(cudaStream_t stream, const uint32_t* handle, const uint32_t want[2],
                      void* out, uint64_t nbytes, int64_t run_id);
  // An error for every predicted load found wrong since the last call (counted in `eng`).
  Status TakeMismatch(Engine* eng);
  // Frees the slots (once no kernel can write them).
  void Free();

 private:
  // The slots' device address (allocated once; portable and mapped: one device address for
  // every GPU).
  Status Slots(MismatchSlot** dev_ptr);

  MismatchSlot* host_ = nullptr;
  MismatchSlot* dev_ = nullptr;
  unsigned int reported_[kSlots] = {};
};

}  // namespace ssdtrain
