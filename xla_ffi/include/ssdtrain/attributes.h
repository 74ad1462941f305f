/* The attributes of libssdtrain.so's XLA FFI handlers: the contract between the engine and the
 * programs that call it, and the one place their integer codes are written.
 *
 * The engine decodes every code below from these names (xla_ffi/src/detail/entry.h,
 * ffi_common.h); jax_ssdtrain reads them from this file (jax_ssdtrain/_src/attributes.py parses
 * its enums when the package is imported: the wheel ships it as
 * jax_ssdtrain/include/ssdtrain/attributes.h). Every enumerator has its value written out: a
 * code is never implied by its position. A change here is a change of both sides.
 *
 * The custom-call targets (registered by jax_ssdtrain/_src/native.py; the handler symbols are
 * listed in c_api.h) and their attributes, by name and type:
 *
 *   ssdtrain_store: x -> handle (uint32[2] = {id, check word}; {0, 0} when nothing was kept)
 *     site         int64   the tag's store site, shared with its loads (checked by each load)
 *     tier         int32   enum ssdtrain_tier: where the bytes go
 *     name         string  the tag, for messages only
 *     uses         int64   >= 0: loads of the entry in the execution that stores it (0: nothing
 *                          is kept); < 0: enum ssdtrain_uses
 *     stream_pass  int64   a layer stack's store: the program's pass that stores it, else 0
 *     stream_dir   int32   with stream_pass, enum ssdtrain_stream_dir: the pass's layer order
 *
 *   ssdtrain_load: handle -> x
 *     site, tier, name     as the matching store's
 *     exact        int32   enum ssdtrain_load_order: how the load finds its entry
 *     consume      int32   1: this load is the entry's last (released once its bytes are
 *                          copied out); 0: not
 *     stream_pass  int64   exact == SSDTRAIN_LOAD_STREAM: the program's pass of the load, else 0
 *     stream_dir   int32   with stream_pass, enum ssdtrain_stream_dir: the pass's layer order
 *
 *   ssdtrain_copy: (x, after...) -> x's bytes (a copy XLA cannot see through, run once every
 *     `after` operand is computed; they are not read). No attributes.
 *
 * The handlers refuse a store's tier, a load's exact and a stream_dir that no enum here names
 * (EINVAL, naming the tag); a negative uses that enum ssdtrain_uses does not name counts as
 * SSDTRAIN_USES_UNCOUNTED. A load's tier is its store's, for the program's reader: the engine
 * finds where the entry lives from the entry.
 */
#ifndef SSDTRAIN_ATTRIBUTES_H_
#define SSDTRAIN_ATTRIBUTES_H_

/* The store's and the load's `tier`: where a stored tensor's bytes live. */
enum ssdtrain_tier {
  SSDTRAIN_TIER_NVME = 0,           /* the store files, through the host cache */
  SSDTRAIN_TIER_HOST = 1,           /* the host tier (pinned host memory only) */
  SSDTRAIN_TIER_HOST_THEN_NVME = 2, /* the host tier while it has room, else the files */
};

/* The store's `uses` below zero (and ssdtrain_store_host's, c_api.h). */
enum ssdtrain_uses {
  /* Released by a sweep only: the handle leaves the execution, or the count is not known. */
  SSDTRAIN_USES_UNCOUNTED = -1,
  /* Released by ssdtrain_release_all only: never counted, never swept (c_api.h's host stores). */
  SSDTRAIN_USES_MANUAL = -2,
  /* As SSDTRAIN_USES_UNCOUNTED, and only later executions load the entry, in store order (an
   * optimizer's state): the engine makes its host copy at once. */
  SSDTRAIN_USES_LATER_IN_ORDER = -3,
};

/* The load's `exact`: how a load finds its entry. */
enum ssdtrain_load_order {
  /* Stored by this execution: predicted among its entries of the site (newest first). */
  SSDTRAIN_LOAD_ACTIVATION = 0,
  /* Stored by an earlier execution: the handle is read (on a GPU, a sync). */
  SSDTRAIN_LOAD_READ = 1,
  /* An earlier execution's, a site's entries loaded in its store order (an optimizer's chunks):
   * predicted after the execution's first such load, which reads its handle. */
  SSDTRAIN_LOAD_STORE_ORDER = 2,
  /* A layer stack's: in each pass (stream_pass), each site steps through one execution's
   * entries in one direction of store order. */
  SSDTRAIN_LOAD_STREAM = 3,
};

/* The store's and the load's `stream_dir`: a pass's layer order (with a stream_pass). The
 * product of a load's and its store's says the loads' direction in store order. */
enum ssdtrain_stream_dir {
  SSDTRAIN_STREAM_DOWN = -1, /* layers from the last to the first */
  SSDTRAIN_STREAM_NONE = 0,  /* not given (or no stream_pass) */
  SSDTRAIN_STREAM_UP = 1,    /* layers from the first to the last */
};

#endif /* SSDTRAIN_ATTRIBUTES_H_ */
