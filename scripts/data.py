"""Token batch sources: synthetic pattern, ``np.memmap`` shards with prefetch thread, DALI.

Every source yields ``int32`` numpy arrays of shape ``(batch, length)``. The synthetic and
memmap sources are deterministic functions of ``(seed, step)``, so a restored run sees the same
batches as an uninterrupted one.
"""

from __future__ import annotations

import glob
import os
import queue
import threading
from collections.abc import Iterator

import numpy as np


class DataError(ValueError):
  """Bad data flag or data file (message is meant for the user)."""


def synthetic_batches(
  batch: int, length: int, vocab_size: int, seed: int = 0, start_step: int = 0
) -> Iterator[np.ndarray]:
  """Arithmetic progressions ``(start + stride * i) mod m``, ``m = min(vocab - 1, 64)``, random
  start and stride in 1..7: learnable (first the small alphabet, then the progression), so the
  loss visibly falls within a few steps. Id vocab-1 is never produced (the BERT/T5 [MASK])."""
  m = min(vocab_size - 1, 64)
  step = start_step
  while True:
    rng = np.random.default_rng([seed, step])
    start = rng.integers(0, m, (batch, 1))
    stride = rng.integers(1, 8, (batch, 1))
    yield ((start + stride * np.arange(length)) % m).astype(np.int32)
    step += 1


def _shard_files(pattern: str) -> list[str]:
  files = sorted(glob.glob(os.path.expanduser(pattern)))
  if not files:
    raise DataError(f"no data files match {pattern!r} (expected pre-tokenized .npy shards)")
  return files


def _open_shards(files: list[str], length: int) -> list[np.ndarray]:
  shards = []
  for f in files:
    try:
      arr = np.load(f, mmap_mode="r")
    except (OSError, ValueError) as e:
      raise DataError(f"cannot read {f}: {e}") from e
    if not np.issubdtype(arr.dtype, np.integer):
      raise DataError(f"{f}: expected integer token ids, got dtype {arr.dtype}")
    shards.append(arr.reshape(-1))  # token stream; a view for C-contiguous arrays
  if not any(len(s) >= length for s in shards):
    raise DataError(f"no shard among {len(files)} file(s) holds a window of {length} tokens")
  return shards


class MemmapLoader:
  """Random ``length``-token windows from memory-mapped ``.npy`` shards (any shape, flattened
  to a token stream), produced ``prefetch`` batches ahead by a background thread."""

  def __init__(
    self,
    pattern: str,
    batch: int,
    length: int,
    seed: int = 0,
    start_step: int = 0,
    prefetch: int = 4,
    vocab_size: int | None = None,
  ):
    self.batch, self.length, self.seed, self.start_step = batch, length, seed, start_step
    self.shards = _open_shards(_shard_files(pattern), length)
    windows = np.array([max(len(s) - length + 1, 0) for s in self.shards])
    self._cum = np.cumsum(windows)
    self.vocab_size = vocab_size
    self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def batch_at(self, step: int) -> np.ndarray:
    rng = np.random.default_rng([self.seed, step])
    idx = rng.integers(0, self._cum[-1], self.batch)
    shard = np.searchsorted(self._cum, idx, side="right")
    offset = idx - np.concatenate([[0], self._cum])[shard]
    out = np.stack([self.shards[s][o : o + self.length] for s, o in zip(shard, offset)]).astype(
      np.int32
    )
    if self.vocab_size is not None and (out.min() < 0 or out.max() >= self.vocab_size):
      raise DataError(f"token id out of range [0, {self.vocab_size}) in batch {step}")
    return out

  def _produce(self):
    step = self.start_step
    while not self._stop.is_set():
      try:
        item = self.batch_at(step)
      except Exception as e:  # surfaced in the consumer
        item = e
      while not self._stop.is_set():
        try:
          self._queue.put(item, timeout=0.1)
          break
        except queue.Full:
          pass
      step += 1

  def __iter__(self) -> MemmapLoader:
    return self

  def __next__(self) -> np.ndarray:
    if self._thread is None:
      self._thread = threading.Thread(target=self._produce, daemon=True, name="memmap-prefetch")
      self._thread.start()
    item = self._queue.get()
    if isinstance(item, Exception):
      raise item
    return item

  def close(self):
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)


def dali_batches(
  pattern: str, batch: int, length: int, seed: int = 0, device: str = "auto", num_threads: int = 2
) -> Iterator[np.ndarray]:
  """Random windows read by DALI's ``fn.readers.numpy`` (ROI reads of 1-D token shards).

  ``device``: "gpu" (GDS where the platform has it), "cpu" (``device_id=None``) or "auto"
  (gpu when DALI sees a CUDA device). Windows start in ``[0, shortest shard - length]``; the
  order is DALI's, not a function of the step (restored runs see different batches)."""
  try:
    from nvidia.dali import fn, pipeline_def, types
  except ImportError as e:
    raise DataError(
      "--loader dali needs NVIDIA DALI: pip install nvidia-dali-cuda130 "
      f"(the [dali] extra); import failed: {e}"
    ) from e
  files = _shard_files(pattern)
  shards = _open_shards(files, length)
  if any(s.ndim != 1 for s in (np.load(f, mmap_mode="r") for f in files)):
    raise DataError("--loader dali needs 1-D token shards")
  min_len = min(len(s) for s in shards)
  if min_len < length:
    raise DataError(
      f"--loader dali needs every shard to hold >= {length} tokens (shortest: {min_len})"
    )
  if device == "auto":
    try:
      from nvidia.dali.backend import GetCUDADeviceCount

      device = "gpu" if GetCUDADeviceCount() > 0 else "cpu"
    except Exception:
      device = "cpu"

  @pipeline_def(
    batch_size=batch,
    num_threads=num_threads,
    device_id=0 if device == "gpu" else None,
    seed=seed,
    prefetch_queue_depth=2,
  )
  def pipe():
    start = fn.random.uniform(range=[0, min_len - length], dtype=types.INT32, shape=[1])
    return fn.readers.numpy(
      device=device,
      files=files,
      roi_start=start,
      roi_shape=[length],
      random_shuffle=True,
      seed=seed,
      name="reader",
    )

  p = pipe()
  p.build()

  def batches():
    while True:
      (out,) = p.run()
      yield np.asarray((out.as_cpu() if device == "gpu" else out).as_tensor()).astype(np.int32)

  return batches()


def make_batches(
  data: str,
  loader: str,
  batch: int,
  length: int,
  vocab_size: int,
  seed: int = 0,
  start_step: int = 0,
) -> Iterator[np.ndarray]:
  """``data``: "synthetic" or a glob of .npy shards; ``loader``: "memmap" or "dali"."""
  if data == "synthetic":
    return synthetic_batches(batch, length, vocab_size, seed, start_step)
  if loader == "memmap":
    return MemmapLoader(data, batch, length, seed, start_step, vocab_size=vocab_size)
  if loader == "dali":
    return dali_batches(data, batch, length, seed)
  raise DataError(f"unknown loader {loader!r}; use memmap or dali")
