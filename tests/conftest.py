import pytest


def _has_gpu() -> bool:
  import jax

  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
