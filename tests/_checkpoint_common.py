"""Orbax managers for the checkpoint tests (test_checkpointing, test_layer_stream_checkpoint)."""

import orbax.checkpoint as ocp

from jax_ssdtrain import checkpointing


def manager(path):
  """A CheckpointManager at ``path`` (created)."""
  return ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(create=True))


def saved(path, step, tree):
  """A manager at ``path`` that has saved ``tree`` (checkpointing.save_args) at ``step``."""
  m = manager(path)
  m.save(step, args=checkpointing.save_args(tree))
  m.wait_until_finished()
  return m
