"""Offload planner: where each tagged tensor of a scan over L layers lives, from a profile, and
where each class of training state lives under a device budget (one planner: every
``location="auto"`` places by its rule).

    prof = ssd.profile(layer_fn, layer_params, x, num_layers=L)  # store bandwidth measured
    p = ssd.plan(prof)              # p.offload_layers, p.locations, print(p)
    y = p.scan(layer_fn, stacked_params, x)  # the stack as planned (p.policies() for your own)

The package's modules, one concern each:

- ``types``: ``TagProfile``, ``Profile``, ``Plan``, ``Placement`` (and the deprecated
  ``OptimizerPlacement``, ``StackPlacement``) and the defaults and location sets they share;
- ``time_model``: the timing model (its docstring states it), ``simulate`` and a plan's memory;
- ``search``: ``plan``, ``frontier``, ``plan_for_budget``;
- ``profiling``: ``profile``, ``measured_bandwidth``, ``measured_link_gbps`` (the programs it
  compiles on threads, its progress);
- ``placement``: ``choose_placement`` (the classes a model has under one device budget; the
  deprecated ``choose_optimizer_location`` and ``choose_stack_location`` call it) and the one
  weighing of a step's device memory against a budget;
- ``tiers``: ``choose_tiers``, the one rule for which tier of the store each class goes to
  (``offload_optimizer``'s ``location="auto"`` and ``choose_placement`` use it), and the share
  of the host tier it leaves to activations;
- ``split``: ``split_layers``, ``split_scan``;
- ``long_context``: ``plan_long_context`` (the chunk counts of the MLP and the loss with the
  plan), ``check_long_context`` (a sequence that cannot fit, refused with the arithmetic),
  ``long_context_bytes``;
- ``checks``: the argument checks they share.

``split_scan`` is the one split scan (the first ``k`` layers under one policy, the rest under
another): ``Plan.scan``, the models' ``Stack`` and ``scripts/bench_planner.py`` run it.
``choose_placement`` weighs the classes on the device against the store the same way
``plan_for_budget`` weighs a plan: the exact device memory of the step with them there, against
a budget.
"""

from jax_ssdtrain._src.planner.checks import _check_int, _check_number
from jax_ssdtrain._src.planner.long_context import (
  LongContextBytes,
  LongContextError,
  check_long_context,
  long_context_bytes,
  plan_long_context,
)
from jax_ssdtrain._src.planner.placement import (
  _HOTTEST_FIRST,
  _ON_DEVICE,
  _gib,
  _not_on_device,
  _stack_room,
  _weigh_step,
  _with_on_device,
  choose_optimizer_location,
  choose_placement,
  choose_stack_location,
)
from jax_ssdtrain._src.planner.profiling import (
  MIN_DIFFERENCE_S,
  _achieved_link_gbps,
  _compile_all,
  _flops,
  _in,
  _is_jaxpr,
  _layer_times,
  _pow2_ceil,
  _probe_sizes,
  _Progress,
  _tagged,
  _walk,
  measured_bandwidth,
  measured_link_gbps,
  profile,
)
from jax_ssdtrain._src.planner.search import (
  _candidates,
  _feasible,
  _rank,
  frontier,
  plan,
  plan_for_budget,
)
from jax_ssdtrain._src.planner.split import split_layers, split_scan
from jax_ssdtrain._src.planner.tiers import LEFT_FOR_ACTIVATIONS, choose_tiers, host_tier_share
from jax_ssdtrain._src.planner.time_model import (
  STAGING_TOLERANCE,
  _device_bytes,
  _evaluate,
  _staging_needed,
  simulate,
)
from jax_ssdtrain._src.planner.types import (
  _CLASS_NAMES,
  DEFAULT_HOST_CACHE_BYTES,
  DEFAULT_HOST_GBPS,
  DEFAULT_HOST_TIER_BYTES,
  DEFAULT_STAGING_BYTES,
  OFFLOADED,
  PLANNED,
  OptimizerPlacement,
  Placement,
  Plan,
  Profile,
  StackPlacement,
  TagProfile,
  _layers,
)

__all__ = [
  "DEFAULT_HOST_CACHE_BYTES",
  "DEFAULT_HOST_GBPS",
  "DEFAULT_HOST_TIER_BYTES",
  "DEFAULT_STAGING_BYTES",
  "MIN_DIFFERENCE_S",
  "LongContextBytes",
  "LongContextError",
  "OFFLOADED",
  "PLANNED",
  "STAGING_TOLERANCE",
  "LEFT_FOR_ACTIVATIONS",
  "Placement",
  "Plan",
  "Profile",
  "TagProfile",
  "check_long_context",
  "choose_placement",
  "choose_tiers",
  "frontier",
  "host_tier_share",
  "long_context_bytes",
  "measured_bandwidth",
  "measured_link_gbps",
  "plan",
  "plan_for_budget",
  "plan_long_context",
  "profile",
  "simulate",
  "split_layers",
  "split_scan",
]
