// CUDA error checking (only included by CUDA sources).
#pragma once

#include <cuda_runtime.h>

#include "status.h"

namespace ssdtrain {
inline Status CudaError(cudaError_t e, const char* call, const char* file, int line) {
  return Status(EIO, std::string(call) + " failed: " + cudaGetErrorName(e) + ": " +
                         cudaGetErrorString(e) + " [" + file + ":" + std::to_string(line) + "]");
}
}  // namespace ssdtrain

#define SSD_CHECK_CUDA(expr)                                                  \
  do {                                                                        \
    cudaError_t ssd_cuda_err_ = (expr);                                       \
    if (ssd_cuda_err_ != cudaSuccess) {                                       \
      (void)cudaGetLastError();                                               \
      return ::ssdtrain::CudaError(ssd_cuda_err_, #expr, __FILE__, __LINE__); \
    }                                                                         \
  } while (0)
