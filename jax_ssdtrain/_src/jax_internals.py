"""Every JAX internal jax_ssdtrain relies on, each with the reason, in one place.

The library plugs into ``jax.checkpoint`` (remat), AD, batching, lowering and sharding. Where a
public module exports what is needed (``jax.extend.core``, ``jax.interpreters.*``) it is used;
what only ``jax._src`` has is named below. Differences between the supported JAX releases are
resolved here and nowhere else. Importing this module checks that every internal is where we
expect it and raises ImportError naming the one that moved (``tests/test_jax_layer.py``,
``test_internal_is_where_we_expect_it``, checks the same, one test per internal).

Supported (tested) JAX releases: see ``TESTED_JAX``; ``jax_ssdtrain/__init__.py`` refuses
others unless ``SSDTRAIN_ALLOW_UNTESTED_JAX=1``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as _ext_core
from jax.interpreters import ad as _ad_public
from jax.interpreters import batching as _batching_public
from jax.interpreters import mlir as _mlir_public

# The tested range: the lowest supported release, and the first release not tested.
TESTED_JAX = ((0, 10, 2), (0, 13, 0))
TESTED_JAX_TEXT = "jax>=0.10.2,<0.13"


def jax_version() -> tuple[int, ...]:
  """The running jax's release as a tuple of ints (``0.12.0.1`` -> ``(0, 12, 0, 1)``)."""
  parts = []
  for p in jax.__version__.split("."):
    digits = "".join(c for c in p if c.isdigit())
    if not digits:
      break
    parts.append(int(digits))
    if digits != p:
      break
  return tuple(parts)


class MissingInternal(ImportError):
  """A JAX internal jax_ssdtrain relies on is not where it was in the tested releases."""


def _get(module: Any, name: str, why: str) -> Any:
  obj = getattr(module, name, None)
  if obj is None:
    raise MissingInternal(
      f"jax_ssdtrain: jax {jax.__version__} has no {module.__name__}.{name} (needed for: "
      f"{why}); tested with {TESTED_JAX_TEXT}"
    )
  return obj


from jax._src import ad_checkpoint as _ad_checkpoint  # noqa: E402
from jax._src import config as _jax_config  # noqa: E402
from jax._src import dispatch as _dispatch  # noqa: E402
from jax._src import sharding_impls as _sharding_impls  # noqa: E402
from jax._src import util as _util  # noqa: E402
from jax._src.interpreters import partial_eval as _pe  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Primitives and their rule tables (public modules).

Primitive = _ext_core.Primitive
Var = _ext_core.Var
# checkpoint_name's primitive: the policies are asked about it, the tags are rewritten from it.
name_p = _ext_core.primitives.name_p
primitive_jvps = _ad_public.primitive_jvps
Zero = _ad_public.Zero  # a symbolic zero tangent
deflinear2 = _ad_public.deflinear2
primitive_batchers = _batching_public.primitive_batchers
register_lowering = _mlir_public.register_lowering
lower_fun = _mlir_public.lower_fun

# ---------------------------------------------------------------------------------------------
# Partial evaluation (jax._src): how jax.checkpoint splits its body.

# remat's split of a body into the forward (known) and backward (staged) jaxprs asks the policy
# about each equation here; wrapping it lets our policies rewrite the tags they send to the store.
PE_MODULE = _pe
PARTIAL_EVAL_CUSTOM_CACHED = "_partial_eval_jaxpr_custom_cached"
_get(_pe, PARTIAL_EVAL_CUSTOM_CACHED, "the remat partial-eval hook")
# The store/load split of a tag is this table's rule for our tag primitive.
partial_eval_jaxpr_custom_rules = _get(
  _pe, "partial_eval_jaxpr_custom_rules", "the tag primitive's partial-eval rule"
)
# A store whose handle nobody loads turns back into a plain tag; a consuming load runs though
# nothing reads its value (its entry's release) (DCE rules).
dce_rules = _get(_pe, "dce_rules", "the store's and the consuming load's dead-code rules")
# The partial-eval cache keys on (jaxpr, ..., policy); our wrapper caches the same way.
weakref_lru_cache = _get(_util, "weakref_lru_cache", "caching the tag rewrite per jaxpr")


def dce_rule(rule: Callable[[list[bool], Any], tuple[list[bool], Any]]) -> Callable:
  """Adapts ``rule(used_outputs, eqn)`` to the DCE-rule signature of the running JAX
  (jax >= 0.12 passes ``(used_outputs, live_inputs, eqn)``)."""

  @functools.wraps(rule)
  def adapted(used_outputs, *args):
    return rule(used_outputs, args[-1])

  return adapted


def check_partial_eval_call_site() -> None:
  """The cached partial-eval function hides its signature: check how JAX calls it instead."""
  caller = getattr(_pe, "partial_eval_jaxpr_stateful", None)
  try:
    source = inspect.getsource(caller) if caller is not None else ""
  except (OSError, TypeError):
    source = ""
  if f"{PARTIAL_EVAL_CUSTOM_CACHED}(" not in source or "saveable)" not in source:
    raise MissingInternal(
      "jax_ssdtrain: partial_eval.partial_eval_jaxpr_stateful no longer calls "
      f"{PARTIAL_EVAL_CUSTOM_CACHED}(jaxpr, in_unknowns, in_inst, ensure_out_unknowns, "
      f"ensure_out_inst, saveable); jax {jax.__version__} is not supported "
      f"(tested: {TESTED_JAX_TEXT})"
    )


# ---------------------------------------------------------------------------------------------
# Remat policies and jax_remat3 (jax._src.ad_checkpoint).

# jax.checkpoint_policies.save_from_both_policies returns a closure over the two policies; we
# recognise it by its code object to compose our policies with it (policies.as_offloading).
_probe = _ad_checkpoint.save_from_both_policies(lambda *a, **k: False, lambda *a, **k: False)
SAVE_FROM_BOTH_CODE = _probe.__code__


def save_from_both_parts(policy: Any) -> tuple[Any, Any] | None:
  """``(policy_1, policy_2)`` of a ``save_from_both_policies(policy_1, policy_2)`` result."""
  if getattr(policy, "__code__", None) is not SAVE_FROM_BOTH_CODE or policy.__closure__ is None:
    return None
  cells = dict(zip(SAVE_FROM_BOTH_CODE.co_freevars, (c.cell_contents for c in policy.__closure__)))
  try:
    return cells["policy_1"], cells["policy_2"]
  except KeyError:
    raise MissingInternal(
      "jax_ssdtrain: save_from_both_policies no longer closes over "
      f"policy_1/policy_2 (jax {jax.__version__}; got "
      f"{SAVE_FROM_BOTH_CODE.co_freevars})"
    ) from None


del _probe

# Under jax_remat3 checkpoint_name binds these "hi primitives" instead of name_p; their
# ``remat`` method decides save / offload / recompute, so ours wraps it (remat.py).
CHECKPOINT_NAME_CLASSES = tuple(
  c
  for c in (
    getattr(_ad_checkpoint, "CheckpointName", None),
    getattr(_ad_checkpoint, "CheckpointNameFwd", None),
  )
  if c is not None
)
# cuDNN's flash attention (jax.nn.dot_product_attention, implementation "cudnn") is a custom_vjp
# whose forward rule binds this primitive: its outputs are the attention output and the softmax
# statistics that the backward rule reads. A remat policy sees the primitive by its name (as
# jax.checkpoint_policies.dots_saveable sees cuDNN's "scaled_matmul_wrapper"): importing
# jax._src.cudnn for the object would load cuDNN's bindings. policies.flash_attention_saveable.
FLASH_ATTENTION_FORWARD = "dot_product_attention_fwd_wrapper"
# CheckpointNameFwd's rem ignores the recomputed value (no tangent flows through it).
CHECKPOINT_NAME_FWD = getattr(_ad_checkpoint, "CheckpointNameFwd", None)
# jax >= 0.12: remat(self, trace, x) -> (x, residuals, rem(residuals, x_recomputed));
# before:      remat(self, policy_or_trace, x) -> (x, rem(x_recomputed)).
REMAT3_RETURNS_RESIDUALS = jax_version() >= (0, 12)
# Primal from the saved value, tangent from the recomputed one (remat3's saved-tag rem).
primal_left_tangent_right = getattr(_ad_checkpoint, "primal_left_tangent_right", None)
if CHECKPOINT_NAME_CLASSES and primal_left_tangent_right is None:
  raise MissingInternal(
    "jax_ssdtrain: jax._src.ad_checkpoint.primal_left_tangent_right is "
    f"missing (jax {jax.__version__}); needed under jax_remat3"
  )


# jax_remat3's eager path (``interpreters.remat.remat_transform``, jax 0.10.2 to 0.12.0.1) never
# invalidates the DynamicJaxprTrace it builds the backward's jaxpr in, unlike ``_remat_jaxpr``
# (the jit path): each constant of that trace is registered with ``weakref.finalize`` holding
# the trace, whose frame holds the constant's tracer, so the trace and every constant in it
# (our handles, and the residuals JAX saves on the device) live until the process exits. For
# our policies remat.py wraps remat_transform (where ad_checkpoint imported it, and in its own
# module, which hijax calls) and invalidates that trace after its ``to_jaxpr``.
from jax._src import core as _core  # noqa: E402
from jax._src.interpreters import remat as _remat_src  # noqa: E402

DynamicJaxprTrace = _get(_pe, "DynamicJaxprTrace", "freeing the eager remat3 trace's constants")
for _method in ("to_jaxpr", "invalidate"):
  _get(DynamicJaxprTrace, _method, "freeing the eager remat3 trace's constants")
REMAT_TRANSFORM = "remat_transform"
REMAT_TRANSFORM_MODULES = tuple(
  m for m in (_remat_src, _ad_checkpoint) if getattr(m, REMAT_TRANSFORM, None) is not None
)
if CHECKPOINT_NAME_CLASSES and _remat_src not in REMAT_TRANSFORM_MODULES:
  raise MissingInternal(
    "jax_ssdtrain: jax._src.interpreters.remat.remat_transform is missing "
    f"(jax {jax.__version__}); needed under jax_remat3"
  )


# remat3 only keeps a loaded value's tangent path to the recomputation where a differentiation
# encloses the remat (remat.py): we look for a JVP or linearize trace among the current trace's
# ancestors (each trace names its parent_trace).
from jax._src.interpreters import ad as _ad_src  # noqa: E402

DIFFERENTIATING_TRACES = (
  _get(_ad_src, "JVPTrace", "detecting differentiation around a remat3 tag"),
  _get(_ad_src, "LinearizeTrace", "detecting differentiation around a remat3 tag"),
)


def under_differentiation() -> bool:
  """Is a JVP or linearize trace among the current trace and its ``parent_trace`` ancestors?
  (A trace without ``parent_trace`` ends the walk: then False, and a later forward-mode
  differentiation of an offloaded value is refused rather than wrong.)"""
  trace = _core.trace_ctx.trace
  for _ in range(1000):
    if trace is None:
      return False
    if isinstance(trace, DIFFERENTIATING_TRACES):
      return True
    trace = getattr(trace, "parent_trace", None)
  return False


# A jaxpr trace's frame makes the jaxpr when its tracing ends (``to_jaxpr(trace, ...)``): remat.py
# checks there what the policies of the program traced in it did.
JaxprStackFrame = _get(_pe, "JaxprStackFrame", "checking a traced program's policies")
_get(JaxprStackFrame, "to_jaxpr", "checking a traced program's policies")


def current_trace() -> Any:
  """The innermost trace now (its ``parent_trace`` chain leads out; remat.py finds the
  program being traced through it)."""
  return _core.trace_ctx.trace


# The jaxprs an equation calls (a scan's body, a cond's branches, a jit's), to find every tag
# of a checkpoint's body; remat's own primitive, whose body has its own policy.
_get(_core, "jaxprs_in_params", "finding the tags of a checkpoint's body")
REMAT_PRIMITIVE_NAMES = frozenset({_ad_checkpoint.remat_p.name})


def sub_jaxprs(eqn: Any) -> tuple[Any, ...]:
  """The jaxprs in an equation's params (bodies, branches)."""
  return tuple(_core.jaxprs_in_params(eqn.params))


def remat3_policy(policy_or_trace: Any) -> Any:
  """The policy of a remat3 ``remat`` call (jax 0.10 passes it, later releases the trace)."""
  return getattr(policy_or_trace, "policy", policy_or_trace)


@contextlib.contextmanager
def remat3(enabled: bool):
  """``jax_remat3`` switched on or off inside the block (a no-op where the flag is absent)."""
  flag = getattr(_jax_config, "remat3", None)
  if flag is None:
    yield
    return
  with flag(enabled):
    yield


# print_saved_residuals / saved_residuals describe residuals through this function; we name
# the tag and location of our handles there (remat.py).
SAVED_RESIDUALS_MODULE = _ad_checkpoint
SAVED_RESIDUALS_FN = "_saved_residuals"
_get(_ad_checkpoint, SAVED_RESIDUALS_FN, "naming offloaded residuals in saved_residuals")
# It describes a residual made by an equation other than a tag as f"output of {primitive} from
# {where}" (jit: "output of jitted function ..."), ``where`` being this summary of the
# equation's source_info; for a handle that a scan (or jit, ...) returns, remat.py finds the
# store inside and names it with this summary of the store's own source_info.
from jax._src import source_info_util as _source_info_util  # noqa: E402

summarize_source_info = _get(
  _source_info_util, "summarize", "naming where an offloaded residual inside a scan was tagged"
)
# Equations whose outputs are their body's outputs, one to one (a scan's stacked over its
# iterations): the parameter holding that body. saved_residuals names a handle made inside a
# scan, jit, ... ``output of scan``; we follow the output into the body to find its store.
OUTPUT_BODY_PARAMS = {
  "scan": "jaxpr",
  "jit": "jaxpr",
  "pjit": "jaxpr",
  "closed_call": "call_jaxpr",
  "core_call": "call_jaxpr",
  "checkpoint": "jaxpr",
  "remat": "jaxpr",
  "custom_jvp_call": "call_jaxpr",
  "custom_vjp_call": "call_jaxpr",
}


def output_body(eqn: Any) -> Any | None:
  """The open jaxpr whose ``outvars[i]`` makes ``eqn.outvars[i]`` (see OUTPUT_BODY_PARAMS), or
  None where the equation is not one of those or its body does not line up."""
  key = OUTPUT_BODY_PARAMS.get(eqn.primitive.name)
  body = eqn.params.get(key) if key is not None else None
  if body is None:
    return None
  body = open_jaxpr(body)
  if not hasattr(body, "outvars") or len(body.outvars) != len(eqn.outvars):
    return None
  return body


# ---------------------------------------------------------------------------------------------
# Lowering, dispatch and sharding (jax._src).

# Eager store/load run through JAX's op-by-op dispatch.
apply_primitive = _get(_dispatch, "apply_primitive", "eager store/load")
# The partitioned lowering (custom_partitioning) needs the device assignment while lowering.
prim_requires_devices_during_lowering = _get(
  _dispatch, "prim_requires_devices_during_lowering", "partitioned store/load lowering"
)
# Is the program being lowered partitioned over several devices (jit) or manual (shard_map)?
SPMDAxisContext = _get(_sharding_impls, "SPMDAxisContext", "detecting shard_map lowering")
ShardingContext = _get(_sharding_impls, "ShardingContext", "detecting partitioned jit lowering")
GSPMDSharding = _get(_sharding_impls, "GSPMDSharding", "the handle's replicated sharding")
# Compile-time load counts (lifetimes.py) see the whole top-level program here (JAX calls it
# through jax._src.interpreters.mlir's global, which is what gets wrapped).
from jax._src.interpreters import mlir as _mlir_src  # noqa: E402

MLIR_MODULE = _mlir_src
LOWER_JAXPR_TO_MODULE = "lower_jaxpr_to_module"
_get(_mlir_src, LOWER_JAXPR_TO_MODULE, "counting each stored tensor's loads per program")


# The store opens when a program that uses it first runs (config.py), not when it is lowered or
# compiled: JAX runs an executable's first execution (and every one without its C++ fast path)
# through ExecuteReplicated.__call__, and the executable keeps its lowering's keepalives
# (ModuleContext.keepalives, added to by ModuleContext.add_keepalive) as ``keepalive``, where the
# store's lowering leaves its mark.
from jax._src.interpreters import pxla as _pxla  # noqa: E402

EXECUTE_REPLICATED = _get(_pxla, "ExecuteReplicated", "opening the store when a program first runs")
if "keepalive" not in getattr(EXECUTE_REPLICATED, "__slots__", ("keepalive",)):
  raise MissingInternal(
    f"jax_ssdtrain: jax {jax.__version__}'s ExecuteReplicated keeps no 'keepalive' (needed for: "
    f"opening the store when a program first runs); tested with {TESTED_JAX_TEXT}"
  )


def module_keepalives(module_context: Any) -> list[Any]:
  """The keepalives of the module being lowered (its executable will hold them)."""
  return module_context.keepalives


# The distributed client's state: the process index without starting backends.
from jax._src import distributed as _distributed  # noqa: E402


def process_index_without_backends() -> int:
  """This process's index after jax.distributed.initialize(), without starting backends
  (``jax.process_index()`` would; the store is configured before devices are used)."""
  return int(_distributed.global_state.process_id)


# What a remat policy may answer besides a bool: JAX's saveable / recompute markers and its
# pinned-host offload decision (composition ranks them, see policies.ComposedPolicy).
SaveableType = _get(_pe, "SaveableType", "ranking composed policies' answers")
RecomputeType = _get(_pe, "RecomputeType", "ranking composed policies' answers")
Offloadable = _get(_pe, "Offloadable", "ranking composed policies' answers")


def open_jaxpr(jaxpr: Any) -> Any:
  """The jaxpr with its equations (a ClosedJaxpr's ``.jaxpr`` in jax <= 0.11; in jax 0.12
  Jaxpr and ClosedJaxpr are one class whose ``.jaxpr`` is itself)."""
  inner = getattr(jaxpr, "jaxpr", jaxpr)
  return inner if hasattr(inner, "eqns") else jaxpr


def scan_layout(eqn: Any) -> tuple[int, int]:
  """``(num_consts, num_carry)`` of a scan equation: params ``num_consts``/``num_carry`` in jax
  <= 0.11, a flat-tree ``ft_in`` (consts, carry, xs) in jax 0.12."""
  params = eqn.params
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].update(list(eqn.invars)).unpack()
  return len(list(consts)), len(list(carry))


# ---------------------------------------------------------------------------------------------
# The optimizer store (the package optimizer/: trace.py, plan.py) splits an optax update's jaxpr
# into a device part and per-state groups, and evaluates its equations itself.

Literal = _ext_core.Literal
DropVar = _ext_core.DropVar

# Call primitives whose body optimizer/trace.py expands in place, and the param holding that body
# (a ClosedJaxpr). "pjit" is the name older releases give "jit"; custom-derivative calls run their primal body
# (the update is never differentiated).
CALL_BODY_PARAMS = {
  "jit": "jaxpr",
  "pjit": "jaxpr",
  "closed_call": "call_jaxpr",
  "core_call": "call_jaxpr",
  "custom_jvp_call": "call_jaxpr",
  "custom_vjp_call": "call_jaxpr",
  "custom_vjp_call_jaxpr": "fun_jaxpr",
}


def called_jaxpr(eqn: Any) -> Any | None:
  """The ClosedJaxpr a call equation runs, or None for any other equation."""
  key = CALL_BODY_PARAMS.get(eqn.primitive.name)
  if key is None:
    return None
  body = eqn.params.get(key)
  if body is None or not hasattr(body, "jaxpr"):
    raise ImportError(
      f"jax_ssdtrain: the {eqn.primitive.name!r} equation of this JAX ({jax.__version__}) has no "
      f"ClosedJaxpr under {key!r} (params: {sorted(eqn.params)}); optimizer/trace.py needs it"
    )
  return body


# A conditional whose branches the optimizer store may evaluate both of and select between (the
# predicate decided before any stored state is read): "cond" holds its branches as ClosedJaxprs
# under "branches", its operands after the index.
COND_PRIMITIVE = "cond"
select_n_p = jax.lax.select_n_p  # public, but named here with the cond it replaces


def cond_branches(eqn: Any) -> tuple[Any, ...] | None:
  """The branches (ClosedJaxprs) of a ``cond`` equation, or None for any other equation."""
  if eqn.primitive.name != COND_PRIMITIVE:
    return None
  branches = eqn.params.get("branches")
  if not branches or not all(hasattr(b, "jaxpr") for b in branches):
    raise ImportError(
      f"jax_ssdtrain: the 'cond' equation of this JAX ({jax.__version__}) has no ClosedJaxprs "
      f"under 'branches' (params: {sorted(eqn.params)}); optimizer/trace.py needs them"
    )
  return tuple(branches)


def equation_origin(eqn: Any) -> str | None:
  """Where an equation was traced, as ``"function (file:line)"``: the innermost frame of an
  optax-style ``update`` (a qualified name with ``.<locals>.update``, e.g. ``scale_by_prodigy.
  <locals>.update_fn``), else the innermost frame outside JAX and jax_ssdtrain; None without a
  traceback. From ``eqn.source_info.traceback`` (jaxlib frames, innermost first)."""
  tb = getattr(getattr(eqn, "source_info", None), "traceback", None)
  outside = []
  for frame in getattr(tb, "frames", ()) or ():
    path = frame.file_name.replace("\\", "/")
    if "/jax/" in path or "/jaxlib/" in path or "/jax_ssdtrain/" in path:
      continue
    where = f"{frame.function_name} ({path.split('site-packages/')[-1]}:{frame.line_num})"
    if ".<locals>.update" in frame.function_name:
      return where
    outside.append(where)
  return outside[0] if outside else None


def bind_equation(primitive: Any, params: dict, invals: list[Any]) -> list[Any]:
  """Runs one jaxpr equation as ``jax.core.eval_jaxpr`` does: ``get_bind_params`` returns the
  params (jax >= 0.10) or, in older releases, ``(subfuns, params)``."""
  bound = primitive.get_bind_params(params)
  subfuns: list[Any] = []
  if isinstance(bound, tuple) and len(bound) == 2 and isinstance(bound[1], dict):
    subfuns, bound = bound
  outs = primitive.bind(*subfuns, *invals, **bound)
  return list(outs) if primitive.multiple_results else [outs]
