"""The optimizer store's error: what every part of ``offload_optimizer`` raises for a
transformation or a state it cannot take. At the bottom of the optimizer's modules: it imports
none of them (the state type, ``state.py``, sits above the layout it carries)."""


class OptimizerOffloadError(ValueError):
  """A transformation or a state that the optimizer store cannot take (the message says why)."""
