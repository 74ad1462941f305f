// The PCIe link of a GPU, measured (link_probe.cc; C ABI ssdtrain_probe_link, which documents
// the arguments and out[0..4]).
#pragma once

#include <cstdint>

#include "status.h"

namespace ssdtrain {

Status ProbeLink(int device, uint64_t bytes, int repeats, int host_kind, void (*on_ready)(),
                 double out[5]);

}  // namespace ssdtrain
