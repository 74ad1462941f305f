/* The C ABI of libssdtrain.so: the library's contract.
 *
 * Its public headers: this one (the functions a program calls), ssdtrain/attributes.h (the
 * FFI handlers' attributes and their codes) and ssdtrain/testing.h (the test hooks, exported
 * beside these functions for the engine's own tests; no program needs them).
 *
 * Implemented by xla_ffi/src/c_api.cc; jax_ssdtrain/_src/native.py binds every function here
 * and in testing.h through ctypes (its _C_API table mirrors the two headers, declaration for
 * declaration, and tests/test_build.py checks that they agree). A change here is a change of
 * both.
 *
 * Conventions. Nothing throws across this ABI. A function returning int returns 0 on success or
 * an errno-like code (EINVAL: a bad argument or state, which Python raises as ValueError; ENOSPC,
 * ENOMEM, EIO, ...: OSError). `err`/`errlen`: a caller buffer receiving the failure's message
 * (NUL-terminated, truncated to errlen - 1 bytes; an empty string on success). `out`/`outlen`: a
 * caller buffer receiving text, NUL-terminated; ERANGE when it was too small (what fits is kept
 * in it: the caller retries with a larger one). Handles are uint32[2] = {id, check word}.
 * Functions that act on "the engine" act on the process-wide store that ssdtrain_configure
 * opened; those that need one and find none fail with EINVAL, the others do nothing.
 *
 * Besides these functions the library exports the XLA FFI handlers (XLA_FFI_Handler, declared
 * in xla/ffi/api/c_api.h), registered by native.register_targets as the custom-call targets
 * ssdtrain_store, ssdtrain_load and ssdtrain_copy: SsdtrainStoreCpu, SsdtrainLoadCpu and
 * SsdtrainCopyCpu (xla_ffi/src/ffi_cpu.cc), and in CUDA builds SsdtrainStoreCuda,
 * SsdtrainLoadCuda and SsdtrainCopyCuda (xla_ffi/src/cuda/ffi_cuda.cu).
 */
#ifndef SSDTRAIN_C_API_H_
#define SSDTRAIN_C_API_H_

#include <stddef.h>
#include <stdint.h>

#define SSDTRAIN_API __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

/* ssdtrain_probe_link's `on_ready`. */
typedef void (*ssdtrain_ready_fn)(void);

/* ---- the store ------------------------------------------------------------------------- */

/* (Re)creates the process-wide engine from `kv`, "key=value" lines, one per option (every
 * option is required: a missing, unknown, repeated or bad key is EINVAL naming it). Drains the
 * previous engine's I/O and drops every activation it stored. Reads $SSDTRAIN_FAULT. */
SSDTRAIN_API int ssdtrain_configure(const char* kv, char* err, size_t errlen);

/* The configuration the engine runs with, as "key=value" lines in the order configure parses
 * them; empty when no store is open. */
SSDTRAIN_API int ssdtrain_config(char* out, size_t outlen);

/* Releases every activation and closes (so deletes) the store files; no store is open after
 * it. */
SSDTRAIN_API int ssdtrain_shutdown(char* err, size_t errlen);

/* Waits until no write or read is in flight; returns (and clears) a pending asynchronous I/O
 * error. 0 when no store is open. */
SSDTRAIN_API int ssdtrain_flush(char* err, size_t errlen);

/* Drains in-flight I/O and releases every stored activation. 0 when no store is open. */
SSDTRAIN_API int ssdtrain_release_all(char* err, size_t errlen);

/* Grows the device staging arena to `bytes` (the staging_bytes setting; a smaller or equal size
 * changes nothing). A GPU that has its arena already gets the larger one at once: every staged
 * copy leaves it first (a deferred host copy is issued), the host waits for every user of the
 * old arena, then it is freed and the new one allocated; so call it between programs. EBUSY,
 * that GPU unchanged, while a staged entry is being filled or a load holds its host buffer;
 * ENOMEM where the larger arena cannot be allocated (the old size is kept). 0 when no store is
 * open. */
SSDTRAIN_API int ssdtrain_grow_staging(uint64_t bytes, char* err, size_t errlen);

/* ---- statistics and introspection ----------------------------------------------------- */

/* Counters and gauges as "key=value" lines, the first "configured=0" or "configured=1". */
SSDTRAIN_API int ssdtrain_stats(char* out, size_t outlen);

/* Zeroes the counters and restarts the peaks. Nothing when no store is open. */
SSDTRAIN_API void ssdtrain_reset_stats(void);

/* The device copies of the latest steps, oldest first, one per line:
 * "op device bytes start_s end_s name" (steady-clock seconds); cleared once read. Empty without
 * CUDA handlers. */
SSDTRAIN_API int ssdtrain_timeline(char* out, size_t outlen);

/* One line per store file: its path, or "<dir>/(unlinked)". Empty when no store is open. */
SSDTRAIN_API int ssdtrain_file_paths(char* out, size_t outlen);

/* What was built, as "key=value" lines: cuda=0|1, kvikio=0|1, ffi_api=MAJOR.MINOR (the XLA FFI
 * API the handlers were compiled against). Needs no store. */
SSDTRAIN_API int ssdtrain_build_info(char* out, size_t outlen);

/* PCIe link of GPU `device`: out[0] D2H and out[1] H2D GB/s alone, out[2] / out[3] each while
 * both run (pinned buffers of `bytes`, median of `repeats`; host_kind 0: cudaHostAlloc, 1:
 * mmap + cudaHostRegister as the engine's arenas, 2: the same on huge pages), out[4] the seconds
 * the copies took after `on_ready` (nullable) returned: it runs once the buffers are ready,
 * before the first copy. `out`: double[5]. Needs no store; ENOSYS in builds without CUDA. */
SSDTRAIN_API int ssdtrain_probe_link(int device, uint64_t bytes, int repeats, int host_kind,
                                     ssdtrain_ready_fn on_ready, double* out, char* err,
                                     size_t errlen);

/* ---- stores and loads of host buffers (the probe, tests) ------------------------------ */

/* Stores `nbytes` at `src` in the nvme tier as the CPU store handler does (site `site`, tag
 * "probe", device 0) and writes its handle into `handle` (uint32[2]). `uses`: loads after which
 * the entry is released, as the store handler's attribute (attributes.h): -1
 * (SSDTRAIN_USES_UNCOUNTED): by a sweep; -2 (SSDTRAIN_USES_MANUAL): only by release_all; 0:
 * nothing is kept (the null handle {0, 0}). EINVAL when no store is open. */
SSDTRAIN_API int ssdtrain_store_host(const void* src, uint64_t nbytes, int64_t site, int64_t uses,
                                     uint32_t* handle, char* err, size_t errlen);

/* Loads the entry `handle` (uint32[2]) names into `nbytes` at `dst`, as the CPU load handler
 * does; `site` and `nbytes` must be the store's (EINVAL otherwise, or for a released entry). */
SSDTRAIN_API int ssdtrain_load_host(const uint32_t* handle, void* dst, uint64_t nbytes,
                                    int64_t site, char* err, size_t errlen);

/* ---- lifetimes (jax_ssdtrain/_src/lifetimes.py) --------------------------------------- */

/* Sweep: releases the entries older than `seq_limit` (store order) whose handle is not among
 * the `n_pairs` {id, check} pairs at `pairs` (uint32[2 * n_pairs]: the handles live arrays still
 * hold) and that no load is using; retire != 0 (the background sweeper): retires them instead
 * (a load still finds a retired entry; its room goes to the next store that needs it).
 * `*released`: how many. 0 (and *released = 0) when no store is open. */
SSDTRAIN_API int ssdtrain_sweep(const uint32_t* pairs, uint64_t n_pairs, uint64_t seq_limit,
                                int retire, uint64_t* released, char* err, size_t errlen);

/* 1 when a sweep is due (enough uncounted entries were stored since the last one), else 0. */
SSDTRAIN_API int ssdtrain_sweep_requested(void);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // SSDTRAIN_C_API_H_
