"""MaxText with SSD offload: its ``offload`` tensors go to the jax_ssdtrain store.

MaxText tags its decoder layers' activations with ``checkpoint_name`` and, under
``remat_policy: custom``, gives each tag ``remat | device | offload``, where ``offload`` means
JAX's pinned-host offload; the ``qkv_proj_offloaded`` / ``minimal_offloaded`` presets offload
fixed sets. After :func:`install`, every one of those offloads goes to our store instead
(``location``: ``"nvme"`` or ``"host"``, the engine's pinned host tier), ``device`` tags stay on
the device and the rest is recomputed, exactly as MaxText would otherwise decide:

    import jax_ssdtrain.maxtext
    jax_ssdtrain.maxtext.install(location="nvme")
    # ... MaxText as usual, e.g. maxtext.trainers.pre_train.train.main(argv)

or ``python -m jax_ssdtrain.maxtext [--ssd-location nvme|host] [--ssd-min-bytes N]
[--ssd-dir DIR] <MaxText's train arguments>``.

What is patched (checked when installing; a MaxText release that changed them fails here,
naming them): ``NNXDecoder.get_remat_policy`` (the decoder's policy: ours where MaxText would
offload), and ``maxtext_utils.get_save_and_offload_names`` as the layers that build their own
policy see it (Gemma4's and Qwen3-Next's global layers keep would-be-offloaded tags on the
device because pinned-host residuals cannot cross their one-trip scan; our handles can, so
they use the decoder's policy instead). The pipeline wraps the policy with
``save_from_both_policies``, which composes with ours (device saving wins).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

from jax_ssdtrain._src.config import configure
from jax_ssdtrain._src.location import Location
from jax_ssdtrain._src.policies import DEFAULT_MIN_BYTES, offload_policy

__all__ = ["DEFAULT_MIN_BYTES", "install", "uninstall", "installed", "MaxTextMissing"]

# (module, attribute path, the parameters we rely on)
_PATCHED = (
  ("maxtext.layers.nnx_decoders", "NNXDecoder.get_remat_policy", ("self",)),
  ("maxtext.utils.maxtext_utils", "get_save_and_offload_names", ("config",)),
)


class MaxTextMissing(ImportError):
  """MaxText is not installed (``pip install "jax_ssdtrain[maxtext]"``)."""


_state: dict[str, Any] = {}


def install(
  location: str | Location = Location.NVME,
  *,
  min_bytes: int = DEFAULT_MIN_BYTES,
  store: dict[str, Any] | None = None,
) -> None:
  """Routes MaxText's offloaded tags to our store (see the module doc). Idempotent; a second
  call with other arguments replaces the first. ``store``: options for
  :func:`jax_ssdtrain.configure` (e.g. ``{"directory": "/nvme/ssd", "host_tier_bytes":
  "64GiB"}``), applied now."""
  loc = Location.parse(location, what="location")
  if loc not in (Location.NVME, Location.HOST):
    raise ValueError(f"location: MaxText's offloaded tags go to 'nvme' or 'host', got {location!r}")
  offload_policy([], min_bytes=min_bytes)  # validates min_bytes
  targets = _targets()
  if store:
    configure(**store)
  uninstall()
  decoder_cls, get_policy = targets["NNXDecoder.get_remat_policy"]
  utils, get_names = targets["get_save_and_offload_names"]

  @functools.wraps(get_policy)
  def get_remat_policy(self):
    save, offload = get_names(self.config)
    if not offload:
      return get_policy(self)
    return offload_policy(offload, names_to_save=save, min_bytes=min_bytes, location=loc)

  @functools.wraps(get_names)
  def get_save_and_offload_names(config):
    # Layers that build their own policy from this split use the decoder's policy (ours).
    return [], []

  get_remat_policy._ssdtrain = get_save_and_offload_names._ssdtrain = True
  decoder_cls.get_remat_policy = get_remat_policy
  utils.get_save_and_offload_names = get_save_and_offload_names
  _state.update(
    decoder_cls=decoder_cls,
    get_policy=get_policy,
    utils=utils,
    get_names=get_names,
    location=loc,
    min_bytes=min_bytes,
  )


def uninstall() -> None:
  """Restores MaxText's own functions."""
  if not _state:
    return
  _state["decoder_cls"].get_remat_policy = _state["get_policy"]
  _state["utils"].get_save_and_offload_names = _state["get_names"]
  _state.clear()


def installed() -> dict[str, Any] | None:
  """``{"location", "min_bytes"}`` while installed, else None."""
  return {k: _state[k] for k in ("location", "min_bytes")} if _state else None


def _targets() -> dict[str, tuple[Any, Any]]:
  """{attribute path: (owner, original function)}, checked against what we rely on."""
  try:
    importlib.import_module("maxtext")
  except ImportError as e:
    raise MaxTextMissing(
      f"jax_ssdtrain.maxtext needs MaxText (pip install "
      f"'jax_ssdtrain[maxtext]', Python >= 3.12): {e}"
    ) from None
  out, problems = {}, []
  for module_name, path, params in _PATCHED:
    try:
      owner = importlib.import_module(module_name)
      *parents, name = path.split(".")
      for p in parents:
        owner = getattr(owner, p)
      fn = getattr(owner, name)
      fn = (
        _state.get("get_policy" if name == "get_remat_policy" else "get_names", fn)
        if getattr(fn, "_ssdtrain", False)
        else fn
      )
      got = tuple(inspect.signature(fn).parameters)
      if got != params:
        problems.append(
          f"{module_name}.{path}{inspect.signature(fn)} (expected ({', '.join(params)}))"
        )
        continue
      out[path] = (owner, fn)
    except (ImportError, AttributeError) as e:
      problems.append(f"{module_name}.{path} ({e})")
  if problems:
    import maxtext  # the optional, heavy MaxText: only for its version in this message

    version = getattr(maxtext, "__version__", "?")
    raise RuntimeError(
      f"jax_ssdtrain.maxtext: this MaxText ({version}) changed what the SSD "
      f"offload patches: {'; '.join(problems)}"
    )
  return out
