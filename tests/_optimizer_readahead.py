"""Adam's state in the store's files, read ahead in the order it was stored: one check run on a
given device, shared by test_readahead (the CPU backend) and test_gpu (the CUDA handlers)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_ssdtrain as ssd

MiB = 1 << 20


def check_state_read_ahead_in_store_order(tmp_path, device):
  """Three steps of Adam over 3 leaves of 8 MiB, the state in the files in 2 MiB chunks, every
  load read from the disk: in the last step each load but the first finds its chunk read ahead
  and no read is wasted; parameters and state bit for bit those of the same program with the
  state on the device."""
  import optax

  tx = optax.adam(1e-3)
  params = {
    f"w{i}": jax.device_put(jax.random.normal(jax.random.key(i), (1024, 2048)), device)
    for i in range(3)
  }
  grads = jax.tree.map(lambda p: 1e-3 * p, params)

  def run(location):
    otx = ssd.offload_optimizer(tx, location=location, chunk_bytes=2 * MiB, min_bytes=4096)
    step = jax.jit(functools.partial(ssd.apply_gradients, otx), donate_argnums=(1, 2))
    p, s = jax.tree.map(jnp.copy, params), otx.init(params)
    for _ in range(2):  # the first step loads what init stored
      p, s = step(grads, s, p)
      ssd.flush()
    ssd.reset_stats()
    p, s = step(grads, s, p)
    ssd.flush()
    stats = {k: v for k, v in ssd.stats().items() if "read" in k or "prefetch" in k or "load" in k}
    return p, ssd.optimizer_state(s), stats

  with ssd.configured(
    tmp_path / "s",
    capacity_bytes=256 * MiB,
    host_cache_bytes=64 * MiB,  # room for a step's new state and the read-ahead at once
    forwarding=False,  # a written chunk leaves the cache: every load reads the files
    prefetch_bytes=4 * MiB,
    io_threads=4,
  ):
    p, state, stats = run("nvme")
    want_p, want_state, _ = run("device")
  loads = 3 * 2 * 4  # 3 leaves, 2 moments, 8 MiB each in 2 MiB chunks
  assert stats["tensors_read"] == stats["disk_tensors_read"] == loads, stats  # none cached
  assert stats["prefetch_hits"] >= loads - 1, stats  # all but the first
  assert stats["disk_bytes_read"] == stats["disk_loaded_bytes"], stats  # no read wasted
  for got, want in zip(jax.tree.leaves((p, state)), jax.tree.leaves((want_p, want_state))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # the same program
