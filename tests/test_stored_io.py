"""One stored-I/O seam (``jax_ssdtrain/_src/stored_io.py``) for a streamed stack's layers and
the optimizer's chunks: no other module of the two wings binds the store's primitives; one type
describes a stored leaf in both, with the sites they had; and the binds carry the attributes
each wing asks for (read from the traced programs, nothing runs)."""

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_ssdtrain._src import primitives, stored_io
from jax_ssdtrain._src.location import TIER_CODES, Location

ROOT = Path(__file__).resolve().parents[1] / "jax_ssdtrain" / "_src"
WINGS = [
  *sorted((ROOT / "layer_stream").glob("*.py")),
  *sorted((ROOT / "optimizer").glob("*.py")),
  ROOT / "stream_scan.py",
  ROOT / "stream_scan_passes.py",
]


def _binds(path: Path) -> list[str]:
  """``name.bind(...)`` calls of the store's primitives in ``path``."""
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    f = getattr(node, "func", None)
    if (
      isinstance(node, ast.Call)
      and isinstance(f, ast.Attribute)
      and f.attr == "bind"
      and isinstance(f.value, ast.Name)
      and f.value.id in ("load_p", "store_p", "reload_p")
    ):
      found.append(f"{path.name}:{node.lineno}: {f.value.id}.bind")
  return found


def test_no_module_of_the_two_wings_binds_the_store_primitives():
  binds = [b for path in WINGS for b in _binds(path)]
  assert not binds, "bound outside stored_io.py:\n" + "\n".join(binds)
  assert _binds(ROOT / "stored_io.py")  # the scan sees the seam's own


def test_one_type_for_a_stored_leaf_with_the_sites_it_had():
  from jax_ssdtrain._src.layer_stream import _make_layout
  from jax_ssdtrain._src.optimizer.layout import LeafLayout

  layer = {
    "w": jax.ShapeDtypeStruct((16, 8), jnp.bfloat16),
    "b": [jax.ShapeDtypeStruct((8,), jnp.float32)],
  }
  lay = _make_layout(layer, 4, Location.HOST, "params", "stack")
  assert all(type(leaf) is stored_io.StoredLeaf for leaf in lay.leaves)
  assert issubclass(LeafLayout, stored_io.StoredLeaf)
  assert lay.paths == ("['b'][0]", "['w']") and lay.shapes == ((8,), (16, 8))
  assert lay.dtypes == (np.dtype(np.float32), np.dtype(jnp.bfloat16))
  # the sites derived as before the seam (checkpoints and the engine's predictions hold them)
  assert lay.sites == (-1297865480679028682, -3329046212248016593)


def _eqns(fn, *args):
  return jax.make_jaxpr(fn)(*args).jaxpr.eqns


LEAF = stored_io.StoredLeaf("['w']", (4, 8), np.dtype(np.float32), site=12345)


def test_a_load_carries_its_wings_attributes():
  h = jnp.zeros((2,), jnp.uint32)
  one = stored_io.new_pass(-1)

  def streamed(h):
    return stored_io.load(h, LEAF, Location.HOST, "layer_stream.params", stream=one, consume=True)

  (eqn,) = _eqns(streamed, h)
  assert eqn.primitive is primitives.load_p
  p = eqn.params
  want = (12345, TIER_CODES[Location.HOST], "layer_stream.params['w']")
  assert (p["site"], p["tier"], p["name"]) == want
  assert (p["exact"], p["stream_pass"], p["stream_dir"], p["consume"]) == (
    "stream",
    one.number,
    -1,
    True,
  )
  assert p["aval"].shape == (4, 8)

  def chunk(h):
    return stored_io.load(h, LEAF, Location.NVME, "opt_state", shape=(2, 8), exact="ordered")

  (eqn,) = _eqns(chunk, h)
  assert eqn.params["exact"] == "ordered" and eqn.params["name"] == "opt_state['w']"
  assert "consume" not in eqn.params and "stream_pass" not in eqn.params
  assert eqn.params["aval"].shape == (2, 8)

  def activation(h):  # the scan's saved inputs: exact left unset
    return stored_io.load(h, LEAF, Location.HOST, "layer_stream.input", exact=False)

  (eqn,) = _eqns(activation, h)
  assert "exact" not in eqn.params


def test_a_store_carries_its_wings_attributes():
  x = jnp.zeros((4, 8), jnp.float32)
  one = stored_io.new_pass(1)
  (eqn,) = _eqns(
    lambda x: stored_io.store(x, LEAF, Location.HOST, "layer_stream.grad_sum", uses=3, stream=one),
    x,
  )
  assert eqn.primitive is primitives.store_p
  assert (eqn.params["stream_pass"], eqn.params["stream_dir"], eqn.params["uses"]) == (
    one.number,
    1,
    3,
  )
  (eqn,) = _eqns(lambda x: stored_io.store(x, LEAF, Location.HOST, "opt_state", uses=3), x)
  assert "stream_pass" not in eqn.params and eqn.params["name"] == "opt_state['w']"


def test_the_device_reference_is_a_copy_where_the_store_has_a_load_or_a_store():
  x = jnp.ones((4, 8), jnp.float32)
  for fn in (
    lambda x: stored_io.load(x, LEAF, Location.DEVICE, "opt_state", after=[x[0]]),
    lambda x: stored_io.store(x, LEAF, Location.DEVICE, "opt_state", uses=1),
  ):
    prims = [e.primitive for e in _eqns(fn, x)]
    assert primitives.copy_p in prims
    assert primitives.load_p not in prims and primitives.store_p not in prims


def test_a_sequence_of_loads_is_chained_on_the_cpu():
  # XLA:CPU runs independent custom calls in any order: each load waits for one element of the
  # one before (its handle passes an ordering copy), the first for what the sequence waits for
  assert stored_io.chain_loads() == (jax.default_backend() == "cpu")
  hs = jnp.zeros((2, 2), jnp.uint32)
  given = jnp.ones((1,), jnp.float32)

  def two(hs, given):
    a, after = stored_io.load_next(hs[0], LEAF, Location.HOST, "x", after=[given], given=[given])
    b, _ = stored_io.load_next(hs[1], LEAF, Location.HOST, "x", after=after, given=[given])
    return a, b

  jaxpr = jax.make_jaxpr(two)(hs, given).jaxpr
  loads = [e for e in jaxpr.eqns if e.primitive is primitives.load_p]
  copies = [e for e in jaxpr.eqns if e.primitive is primitives.copy_p]
  assert len(loads) == 2 and len(copies) == 2
  assert copies[0].invars[1] is jaxpr.invars[1]  # the first after `given`
  if not stored_io.chain_loads():  # a GPU: each after `given` alone
    assert copies[1].invars[1] is jaxpr.invars[1]
    return
  first_out = loads[0].outvars[0]
  # the second's ordering copy reads a slice of the first load's value
  slices = {e.outvars[0] for e in jaxpr.eqns if first_out in e.invars}
  tokens = {v for e in jaxpr.eqns if set(e.invars) & slices for v in e.outvars} | slices
  assert set(copies[1].invars[1:]) & tokens
