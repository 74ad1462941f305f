"""Measurement, in one private home: what the store's disk and the host tier's link move, and
what follows from it. One concern per module:

- ``disk``: a store directory through the engine (cached), raw O_DIRECT, read and write at once;
- ``worker``: the child process of ``disk.measure`` (the engine measurement itself);
- ``link``: the PCIe link of a GPU (pinned copies, cached);
- ``cache``: the measurements' on-disk cache (``$XDG_CACHE_HOME/jax_ssdtrain/probe.json``);
- ``recommend``: store settings from disk measurements;
- ``wear``: SSD wear of a plan (TB per day against the drive's rated endurance);
- ``timing``: the median time of a JAX function (the planner's profile and ``models``);
- ``checks``: argument checks the modules share.

The public door is ``jax_ssdtrain.probe`` (its CLI and the names it re-exports);
``jax_ssdtrain.measured_bandwidth`` is a shorthand for ``probe.measure``'s two rates.
Nothing here is imported by this package's ``__init__``: each module is imported on its own.
"""
