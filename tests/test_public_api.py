"""The public namespace: one way per task in ``__all__``; a name another way replaced still
answers, with a DeprecationWarning naming that way."""

import warnings

import pytest

import jax_ssdtrain as ssd
from jax_ssdtrain._src import deprecations, layer_stream, planner

# each replaced name: the package that defines it, and the one way its warning names
REPLACED = {
  "apply_streamed_update": (layer_stream, "apply_gradients"),
  "apply_device_update": (layer_stream, "apply_gradients"),
  "choose_optimizer_location": (planner, "choose_placement"),
  "choose_stack_location": (planner, "choose_placement"),
  "OptimizerPlacement": (planner, "Placement"),
  "StackPlacement": (planner, "Placement"),
}


def test_every_replaced_name_is_listed_here():
  assert set(REPLACED) == set(deprecations.DEPRECATED)


@pytest.mark.parametrize("name", sorted(deprecations.DEPRECATED))
def test_a_replaced_name_warns_once_naming_the_one_way(name):
  assert name not in ssd.__all__ and name not in vars(ssd)
  home, way = REPLACED[name]
  assert way in ssd.__all__
  deprecations._warned.discard(name)
  with pytest.warns(
    DeprecationWarning, match=rf"jax_ssdtrain\.{name} is deprecated: use ssd\.{way}\b"
  ):
    fn = getattr(ssd, name)
  assert fn is getattr(home, name)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert getattr(ssd, name) is fn  # once per process


def test_an_unknown_name_is_an_attribute_error():
  with pytest.raises(AttributeError, match="has no attribute 'apply_gradient'"):
    ssd.apply_gradient  # noqa: B018


def test_every_public_name_is_documented_where_it_is_defined():
  undocumented = [n for n in ssd.__all__ if not (getattr(ssd, n).__doc__ or "").strip()]
  assert not undocumented, undocumented


def test_the_api_page_names_every_public_name_by_task_before_the_reference():
  # docs/api.md reads without a Sphinx build: its summary (before the first reference section)
  # names each public name, and no replaced one.
  import re
  from pathlib import Path

  page = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
  summary = page.split("\n## ", 1)[0]
  named = set(re.findall(r"`([A-Za-z_][A-Za-z_0-9]*)", summary))
  assert set(ssd.__all__) <= named, sorted(set(ssd.__all__) - named)
  assert not named & set(deprecations.DEPRECATED)
