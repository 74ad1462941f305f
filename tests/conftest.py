import pytest


def pytest_collection_modifyitems(config, items):
  from _common import gpus

  if gpus():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(autouse=True)
def _store_not_left_shut_down():
  """A test that ends with ``ssd.shutdown()`` leaves the process shut down, where nothing opens
  a store by itself: the next test starts as a fresh process does, never configured."""
  yield
  import sys

  config = sys.modules.get("jax_ssdtrain._src.config")
  if config is not None and config.is_shut_down():
    config.reset_to_unconfigured()
