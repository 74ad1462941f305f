"""Offload under explicit and auto mesh axis types (``jax.sharding.AxisType``) on 4 CPU devices:
DP, FSDP and TP grads bitwise equal to the same sharded program saving on the device, each
device storing exactly its local shard of the tag."""

import pytest
from _common import run_worker

F32, B, D, LAYERS = 4, 2, 64, 2


def _run(mode):
  return run_worker("_explicit_worker.py", mode, JAX_PLATFORMS="cpu")


@pytest.fixture(scope="module", params=["explicit", "auto"])
def result(request):
  return request.param, _run(request.param)


@pytest.mark.parametrize("layout", ["dp", "fsdp", "tp"])
def test_layout(result, layout):
  mode, r = result
  r = r[layout]
  assert r["bitwise_vs_device_saving"], r
  assert r["vs_unsharded"] < 1e-5, r
  assert r["bytes_written"] == r["bytes_read"], r
  # Each device holds its local shard of h, one per layer: the batch split over `data`, and,
  # under TP with explicit axes, the hidden dim split over `model` as the types say.
  local = B // 2 * D * F32 * LAYERS
  if layout == "tp" and mode == "explicit":
    local //= 2
  if mode == "explicit":
    assert r["bytes_written"] == [local] * 4, r
  else:  # auto: the partitioner picks h's layout (it matched the device-saving program above)
    assert all(0 < b <= B * D * F32 * LAYERS for b in r["bytes_written"]), r
