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
  std::string_view name;    // tag name, for messages only
  int64_t uses = -1;        // loads per entry in this execution; 0: nobody loads it, < 0: Entry::k*
  int64_t stream_pass = 0;  // a layer stack's store: its pass (Engine::BeginStore)
  int stream_dir = 0;       // and the pass's layer order: +1 up, -1 down, 0 not given
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
  // How the handle is found (entry.h): kRead: an earlier execution's entry, the handle is read;
  // kStoreOrder: the same, predicted after the execution's first such load
  // (Engine::PredictOrderedLoad); kStream: a layer stack's, predicted from a pass's second load
  // of a site on where the layer orders are given, else from its third (Engine::NoteStreamLoad,
  // PredictStreamLoad); predictions are checked on the device.
  LoadOrder order = LoadOrder::kActivation;
  int64_t stream_pass = 0;  // kStream: the program's pass the load belongs to
  int stream_dir = 0;       // and its layer order: +1 up, -1 down, 0 not given
  bool exact() const { return order != LoadOrder::kActivation; }  // an earlier execution's entry
  bool consume = false;  // the entry's last load: released once copied (state updated in place)
};

// Loads the entry `load.handle` names into `load.dst`, in order on the compute stream.
Status LoadToDevice(Engine& engine, const DeviceLoad& load);

}  // namespace ssdtrain
