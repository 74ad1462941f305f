/* The test hooks of libssdtrain.so: functions that damage the store on purpose, so that the
 * engine's tests (tests/test_reliability.py) can check that every fault is found and reported.
 * Exported beside the C ABI (c_api.h, whose conventions they follow) and bound by
 * jax_ssdtrain/_src/native.py; no program needs them.
 */
#ifndef SSDTRAIN_TESTING_H_
#define SSDTRAIN_TESTING_H_

#include <stddef.h>
#include <stdint.h>

#include "ssdtrain/c_api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Cuts every store file to `size` bytes (data stored beyond is lost). EINVAL without a store. */
SSDTRAIN_API int ssdtrain_debug_truncate(uint64_t size, char* err, size_t errlen);

/* Flips one byte of the store at logical (striped) offset `offset`. EINVAL without a store. */
SSDTRAIN_API int ssdtrain_debug_corrupt(uint64_t offset, char* err, size_t errlen);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // SSDTRAIN_TESTING_H_
