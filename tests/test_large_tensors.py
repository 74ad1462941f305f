"""Tensors larger than the engine's buffers: the device staging arena, the host cache, the host
tier, the read-ahead budget and the bounce window. Each round-trips bit for bit through the raw
store and load handlers in every location; on a GPU (``-m gpu``) a tensor larger than the
staging room it finds streams through the arena in pieces, and the step pays the link's time
for the part the arena cannot hold, with no host stall."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _common import gpus
from _ffi_common import chain, random_bytes, same, settled_stats
from _ffi_common import raw_load as load
from _ffi_common import raw_store as store

from jax_ssdtrain._src import native, options

KiB = 1 << 10
MiB = 1 << 20
# Location codes of the raw handlers: nvme, host, host spilling to nvme.
NVME, HOST, HOST_NVME = 0, 1, 2


@pytest.fixture(scope="module", autouse=True)
def _targets():
  native.register_targets()
  yield
  native.shutdown()


def configure(tmp_path, **kw):
  """Small buffers (1 MiB of host cache, staging and read-ahead), the store in tmp_path; ``kw``
  (StoreConfig fields) over them."""
  fields = dict(
    directories=[str(tmp_path / "store")],
    capacity_bytes=512 * MiB,
    host_cache_bytes=1 * MiB,
    host_tier_bytes=1 * MiB,
    staging_bytes=1 * MiB,
    io_threads=4,
    chunk_bytes=64 * KiB,
    o_direct=None,
    prefetch_bytes=1 * MiB,
    forwarding=True,
  )
  fields.update(kw)
  config = options.check(options.StoreConfig(**options.read_changes(fields)))
  native.configure(options.engine_options(config, config.directories))
  native.reset_stats()


def _cpu():
  return jax.devices("cpu")[0]


# ---------------------------------------------------------------------------------------------
# CPU handlers


@pytest.mark.parametrize(
  "tier, verify",
  [(NVME, False), (NVME, True), (HOST, False), (HOST_NVME, False)],
  ids=["nvme", "nvme-verify", "host", "host,nvme"],
)
def test_tensor_far_larger_than_every_buffer_round_trips(tmp_path, tier, verify):
  """72 MiB (and an odd tail) against 1 MiB of staging, host cache and read-ahead, and a
  bounce window of 64 MiB: written through and read back in windows (nvme), held in a host tier
  sized for it (host), or spilled past a 1 MiB host tier to the files (host,nvme)."""
  nbytes = 72 * MiB + 13
  configure(tmp_path, host_tier_bytes=80 * MiB if tier == HOST else 1 * MiB, verify=verify)
  x = random_bytes(nbytes, seed=tier, device=_cpu())
  small = random_bytes(3 * KiB + 1, seed=9, device=_cpu())
  h = store(x, site=1, tier=tier, name="big")
  hs = store(small, site=2, tier=tier, name="small")
  same(load(hs, small, site=2, tier=tier, name="small"), small)
  same(load(h, x, site=1, tier=tier, name="big"), x)
  same(load(h, x, site=1, tier=tier, name="big"), x)  # uncounted: a second load reads it again
  s = native.stats()
  assert s["bytes_written"] == nbytes + small.size
  if tier == HOST:
    assert s["disk_bytes_written"] == 0 and s["host_tier_bytes_peak"] >= nbytes
  else:
    assert s["disk_bytes_written"] >= nbytes
    assert s["bounce_writes"] >= 1 and s["bounce_reads"] >= 2, s
  if tier == HOST_NVME:
    assert s["spilled_tensors"] >= 1 and s["spilled_bytes"] >= nbytes
  if verify:
    assert s["checksum_failures"] == 0
  native.release_all()
  assert native.stats()["live_entries"] == 0


@pytest.mark.parametrize("tier", [NVME, HOST, HOST_NVME], ids=["nvme", "host", "host,nvme"])
def test_tensors_larger_than_the_cache_among_small_ones_in_one_program(tmp_path, tier):
  """Stored by one jitted program and loaded in reverse by another: 5 MiB tensors (five times
  the host cache, staging and read-ahead budget) between small ones, each loaded once."""
  # The host tier holds all of them (host), or two of the three large ones (host,nvme).
  configure(tmp_path, host_tier_bytes=(24 if tier == HOST else 12) * MiB, host_cache_bytes=2 * MiB)
  sizes = [5 * MiB + 7, 4 * KiB, 5 * MiB + 4096, 100, 5 * MiB - 3, 64 * KiB + 1]
  xs = [random_bytes(n, seed=i, device=_cpu()) for i, n in enumerate(sizes)]

  @jax.jit
  def fwd(xs):
    return [store(x, site=10 + i, tier=tier, name=f"t{i}", uses=1) for i, x in enumerate(xs)]

  @jax.jit
  def bwd(hs):
    return [
      load(hs[i], xs[i], site=10 + i, tier=tier, name=f"t{i}") for i in reversed(range(len(xs)))
    ]

  for g, x in zip(bwd(fwd(xs)), reversed(xs)):
    same(g, x)
  s = native.stats()
  assert s["live_entries"] == 0 and s["counted_releases"] == len(xs)
  if tier == HOST_NVME:
    assert s["spilled_tensors"] >= 1


# ---------------------------------------------------------------------------------------------
# CUDA handlers: a tensor larger than the staging room it finds


def _fragment_the_host_tier(site: int):
  """Stores 2, 1 and 1 MiB "host,nvme" entries (sites ``site`` to ``site + 2``, names ``t0`` to
  ``t2``) into a 4 MiB host tier and loads the first and last once, releasing them: 3 MiB free
  in extents of 2 and 1 MiB, the middle entry live. Returns the values and the handles."""
  sizes = [2 * MiB, 1 * MiB, 1 * MiB]
  xs = [random_bytes(n, seed=i, device=_cpu()) for i, n in enumerate(sizes)]
  hs = [store(x, site=site + i, tier=HOST_NVME, name=f"t{i}", uses=1) for i, x in enumerate(xs)]
  for i in (0, 2):  # each entry's one counted load releases it
    same(load(hs[i], xs[i], site=site + i, tier=HOST_NVME, name=f"t{i}"), xs[i])
  return xs, hs


def test_a_store_neither_tier_holds_in_one_extent_names_both_tiers_room(tmp_path):
  """An entry takes one extent of one tier. A 4 MiB host tier holding 2, 1 and 1 MiB entries,
  the first and last released, has 3 MiB free in extents of 2 and 1 MiB: a 3 MiB "host,nvme"
  store goes to the files, and where the files are too small for it as well, the message names
  the host tier's free room and largest extent (the cause: fragmentation), as the statistics do."""
  configure(tmp_path, host_tier_bytes=4 * MiB, capacity_bytes=2 * MiB)
  xs, hs = _fragment_the_host_tier(site=20)
  s = native.stats()
  assert s["host_tier_bytes_in_use"] == 1 * MiB and s["host_tier_largest_free"] == 2 * MiB, s
  assert s["file_largest_free"] == 2 * MiB and s["spilled_tensors"] == 0, s
  big = random_bytes(3 * MiB, seed=7, device=_cpu())
  with pytest.raises(Exception, match="No space left in the ssdtrain store") as err:
    jax.block_until_ready(store(big, site=30, tier=HOST_NVME, name="big"))
  msg = str(err.value)
  assert "capacity_bytes=2097152" in msg, msg
  assert f"the host tier, which has {3 * MiB} bytes free, largest extent {2 * MiB}" in msg, msg
  assert f"host_tier_bytes={4 * MiB}" in msg, msg
  same(load(hs[1], xs[1], site=21, tier=HOST_NVME, name="t1"), xs[1])  # the store is intact
  native.release_all()
  assert native.stats()["live_entries"] == 0


def test_a_spill_for_fragmentation_is_counted_and_said_once(tmp_path, capfd):
  """The host tier of the test above, 3 MiB free in extents of 2 and 1 MiB, and files with
  room: a 3 MiB "host,nvme" store spills to the files although the tier has its bytes free, and
  so does a second; both are counted as fragmented spills, the first one said on stderr. A
  spill of a tensor larger than the tier's free bytes is not counted; a "host" store the tier
  cannot take in one extent names its largest extent."""
  configure(tmp_path, host_tier_bytes=4 * MiB)
  xs, hs = _fragment_the_host_tier(site=40)
  capfd.readouterr()
  bigs = [random_bytes(3 * MiB, seed=8 + i, device=_cpu()) for i in range(2)]
  big_hs = [store(b, site=50 + i, tier=HOST_NVME, name="big", uses=1) for i, b in enumerate(bigs)]
  jax.block_until_ready(big_hs)
  s = native.stats()
  assert s["spilled_tensors"] == 2 and s["fragmented_spills"] == 2, s
  assert s["fragmented_spill_bytes"] == 6 * MiB, s
  err = capfd.readouterr().err
  assert err.count("spilled to the files although the host tier has") == 1, err
  assert f"has {3 * MiB} bytes free: its largest free extent is {2 * MiB}" in err, err
  huge = random_bytes(5 * MiB, seed=11, device=_cpu())  # more than the tier's free bytes
  huge_h = store(huge, site=60, tier=HOST_NVME, name="huge", uses=1)
  s = native.stats()
  assert s["spilled_tensors"] == 3 and s["fragmented_spills"] == 2, s
  with pytest.raises(Exception, match=f"{3 * MiB} free \\(largest extent {2 * MiB}, host_tier"):
    jax.block_until_ready(store(bigs[0], site=61, tier=HOST, name="host_big"))
  for h, x, site in [(big_hs[0], bigs[0], 50), (big_hs[1], bigs[1], 51), (huge_h, huge, 60)]:
    same(load(h, x, site=site, tier=HOST_NVME, name="big" if site < 60 else "huge"), x)
  same(load(hs[1], xs[1], site=41, tier=HOST_NVME, name="t1"), xs[1])
  native.release_all()
  assert native.stats()["live_entries"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("tier", [NVME, HOST, HOST_NVME], ids=["nvme", "host", "host,nvme"])
def test_gpu_tensor_larger_than_staging_streams_through_it(tmp_path, tier):
  """10 MiB against a 4 MiB arena: the first 4 MiB go into staging (D2D), the rest D2H on the
  compute stream, and the store never blocks the host; the load takes the staged piece D2D
  and the rest from the host buffer."""
  staging, nbytes = 4 * MiB, 10 * MiB + 12
  configure(
    tmp_path,
    staging_bytes=staging,
    host_cache_bytes=64 * MiB,
    host_tier_bytes=2 * MiB if tier == HOST_NVME else 64 * MiB,
    prefetch_bytes=4 * MiB,
  )
  x = random_bytes(nbytes, seed=tier, device=gpus()[0])
  h = store(x, site=1, tier=tier, name="big", uses=1)
  same(load(h, x, site=1, tier=tier, name="big"), x)
  native.release_all()
  s = settled_stats()
  assert s["staging_direct_stores"] == 1 and s["staging_direct_store_bytes"] == nbytes - staging
  assert s["gpu_store_direct_bytes"] == nbytes - staging
  assert s["gpu_stage_in_bytes"] == staging
  assert s["staging_split_loads"] == 1, s
  assert s["staging_split_load_host_bytes"] == nbytes - staging
  assert s["gpu_load_staged_bytes"] == staging and s["gpu_load_host_bytes"] == nbytes - staging
  # Nothing waited on the host: the direct part is the compute stream's, timed there.
  assert s["stall_seconds"] == 0 and s["bounce_writes"] == 0, s
  assert s["gpu_store_direct_seconds"] > 0
  assert s["live_entries"] == 0 and s["staging_bytes_in_use"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("staging", [0, 4 * MiB, 16 * MiB])
@pytest.mark.parametrize("tier", [NVME, HOST], ids=["nvme", "host"])
def test_gpu_large_stores_capture_their_value_under_buffer_reuse(tmp_path, staging, tier):
  """Intermediates of one program (10 MiB each, sharing buffers) stored into an arena that
  earlier small stores partly occupy (their deferred host copies forced out): each store copies
  the value at its point in the stream, the staged piece and the direct part alike, and every
  load (from staging and the host, or read ahead) returns it."""
  configure(
    tmp_path,
    staging_bytes=staging,
    host_cache_bytes=128 * MiB,
    host_tier_bytes=128 * MiB,
    prefetch_bytes=16 * MiB,
  )
  n, shape = 6, (2560, 1024)  # float32: 10 MiB each
  dev = gpus()[0]
  smalls = [jax.device_put(jnp.full((64, 1024), i, jnp.float32), dev) for i in range(3)]

  @jax.jit
  def fwd(x, smalls):
    hs = [store(s, site=50 + i, tier=tier, name=f"small{i}") for i, s in enumerate(smalls)]
    for i in range(n):
      x = jnp.sin(x) * 1.5 + i
      hs.append(store(x, site=60 + i, tier=tier, name=f"big{i}"))
    return hs

  x0 = jax.device_put(
    jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32), dev
  )
  want = jax.jit(lambda x: chain(x, n))(x0)
  for _ in range(2):
    hs = fwd(x0, smalls)

    @jax.jit
    def bwd(hs):
      big = [
        load(hs[3 + i], want[i], site=60 + i, tier=tier, name=f"big{i}") for i in reversed(range(n))
      ]
      small = [
        load(hs[i], smalls[i], site=50 + i, tier=tier, name=f"small{i}") for i in reversed(range(3))
      ]
      return big, small

    big, small = bwd(hs)
    for g, w in zip(big, reversed(want)):
      same(g, w)
    for g, w in zip(small, reversed(smalls)):
      same(g, w)
  native.release_all()
  s = settled_stats()
  nbytes = 4 * shape[0] * shape[1]
  assert s["tensors_written"] == 2 * (n + 3) and s["tensors_read"] == 2 * (n + 3)
  assert s["stall_seconds"] == 0 or tier == NVME, s  # nvme: the write-behind may wait for room
  if staging == 0:  # no arena: every store is direct
    assert s["staging_direct_stores"] == 2 * (n + 3)
    assert s["staging_direct_store_bytes"] == 2 * (n * nbytes + 3 * smalls[0].nbytes)
  elif staging < nbytes:  # the arena's worth staged, the rest direct
    assert s["staging_direct_stores"] == 2 * n
    assert s["staging_direct_store_bytes"] == 2 * n * (nbytes - staging), s
  else:
    assert s["staging_direct_stores"] == 0
  assert s["live_entries"] == 0 and s["staging_bytes_in_use"] == 0


@pytest.mark.gpu
def test_gpu_read_ahead_stages_a_first_piece_of_a_large_tensor(tmp_path):
  """A 12 MiB tensor whose staging copy later stores took: read-ahead after the loads of those
  stores stages its first piece within the budget, and its load takes that piece D2D and the
  rest from the host tier."""
  configure(
    tmp_path,
    staging_bytes=4 * MiB,
    host_tier_bytes=64 * MiB,
    prefetch_bytes=4 * MiB,
    forwarding=False,
  )
  dev = gpus()[0]
  big = random_bytes(12 * MiB + 100, seed=1, device=dev)
  smalls = [random_bytes(1 * MiB, seed=10 + i, device=dev) for i in range(4)]
  hb = store(big, site=1, tier=HOST, name="big", uses=1)
  hs = [store(x, site=2 + i, tier=HOST, name=f"s{i}", uses=1) for i, x in enumerate(smalls)]
  for i in reversed(range(4)):
    same(load(hs[i], smalls[i], site=2 + i, tier=HOST, name=f"s{i}"), smalls[i])
  same(load(hb, big, site=1, tier=HOST, name="big"), big)
  native.release_all()
  s = settled_stats()
  assert s["gpu_read_ahead_bytes"] >= 1 * MiB, s
  assert s["staging_split_loads"] == 1, s
  assert s["live_entries"] == 0 and s["staging_bytes_in_use"] == 0
