// The store and the load of an activation in device memory, as the CUDA handlers call them: the
// activation is an XLA buffer on GPU `device`, ordered by XLA's compute `stream`, and so is the
// handle {id, check word} (uint32[2]) that ties a load to its store.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string_view>

#include "engine.h"

namespace ssdtrain {

struct DeviceStore {
  int device = 0;                 // XLA device ordinal of the call
  cudaStream_t stream = nullptr;  // its compute stream
  int64_t run_id = 0;             // XLA execution of the call (load prediction)
  const void* src = nullptr;      // the activation (device)
  uint64_t nbytes = 0;
  uint32_t* handle = nullptr;  // receives the handle (device)
  int64_t site = 0;            // tag site id (shared by store and load)
  Tier tier = Tier::kNvme;
  std::string_view name;  // tag name, for messages only
  int64_t uses = -1;      // loads per entry in this execution; 0: nobody loads it, < 0: Entry::k*
};

// Stores `store.src`: copies it out (device staging, then pinned host memory and, for the nvme
// tier, the file) in order on the compute stream, and writes its handle.
Status StoreFromDevice(Engine& engine, const DeviceStore& store);

struct DeviceLoad {
  int device = 0;                    // XLA device ordinal of the call (the store's)
  cudaStream_t stream = nullptr;     // its compute stream
  int64_t run_id = 0;                // XLA execution of the call (load prediction)
  const uint32_t* handle = nullptr;  // the matching store's handle (device)
  void* dst = nullptr;               // receives the stored bytes (device)
  uint64_t nbytes = 0;
  int64_t site = 0;       // tag site id (must match the store)
  std::string_view name;  // tag name, for messages only
  bool exact = false;     // an entry of an earlier execution: read the handle, never predict it
  bool ordered = false;   // exact, and a site's entries come in store order: predicted after the
                          // execution's first exact load (Engine::PredictOrderedLoad), checked
  bool consume = false;   // the entry's last load: released once copied (state updated in place)
};

// Loads the entry `load.handle` names into `load.dst`, in order on the compute stream.
Status LoadToDevice(Engine& engine, const DeviceLoad& load);

}  // namespace ssdtrain
