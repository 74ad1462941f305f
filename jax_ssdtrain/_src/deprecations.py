"""The public names that one other way replaced: each still works, and warns once, naming it.

``jax_ssdtrain.__getattr__`` answers these names (they are not in the package's namespace nor
in ``__all__``), so that code written against them keeps working while ``__all__``, the docs and
the examples show one way per task.
"""

from __future__ import annotations

import warnings

# old public name -> the one way to use instead
DEPRECATED: dict[str, str] = {
  "apply_streamed_update": (
    "ssd.apply_gradients(tx, grad_sum, stack_state, stack, scale=..., clip_global_norm=..., "
    "global_norm=..., in_place=...): one call order whatever the parameters are"
  ),
  "apply_device_update": (
    "ssd.apply_gradients(tx, grad_sums, state, params, scale=..., clip_global_norm=..., "
    "global_norm=...): the same mean and clipping for parameters on the device"
  ),
  "choose_optimizer_location": (
    "ssd.choose_placement(step_bytes, budget_bytes, device=..., tx=..., params=...): one "
    "placement of every class under one budget (step_bytes a function of the locations; "
    ".on_device)"
  ),
  "choose_stack_location": (
    "ssd.choose_placement(step_bytes, budget_bytes, stack=stack, tx=tx, ...): one placement of "
    "every class under one budget (.locations)"
  ),
  "OptimizerPlacement": (
    "ssd.Placement, which ssd.choose_placement returns (.on_device, .locations)"
  ),
  "StackPlacement": "ssd.Placement, which ssd.choose_placement returns (.locations)",
}

_warned: set[str] = set()


def warn(name: str) -> None:
  """A DeprecationWarning (once per process and name) naming the way to use instead of the
  deprecated public ``name``."""
  if name in _warned:
    return
  _warned.add(name)
  warnings.warn(
    f"jax_ssdtrain.{name} is deprecated: use {DEPRECATED[name]}", DeprecationWarning, stacklevel=3
  )
