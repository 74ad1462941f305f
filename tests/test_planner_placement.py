"""Where each class of training state lives: the one rule for the store's tiers behind every
``"auto"`` (``planner/tiers.py``: ``offload_optimizer(location="auto")``'s ``init`` and
``choose_placement``'s classes), ``choose_placement`` for a dense model and for a streamed
stack, and the names it replaced (``choose_optimizer_location``, ``choose_stack_location``:
deprecated, the same answers)."""

import functools
import warnings

import jax
import jax.numpy as jnp
import pytest
from _common import init_layer

import jax_ssdtrain as ssd
from jax_ssdtrain import Location
from jax_ssdtrain._src import deprecations, planner
from jax_ssdtrain._src.planner.tiers import LEFT_FOR_ACTIVATIONS, choose_tiers, host_tier_share

optax = pytest.importorskip("optax")

MiB = 1 << 20


def _shape(layers, location, dtype=jnp.bfloat16, width=64):
  """The stack's structure (jax.eval_shape of init_streamed): nothing stored."""
  init = functools.partial(init_layer, dtype=dtype, width=width)
  return jax.eval_shape(
    lambda k: ssd.init_streamed(init, k, layers, location=location), jax.random.key(0)
  )


def _place(stack, tx, step_bytes=None, budget_bytes=None, **options):
  return ssd.choose_placement(step_bytes, budget_bytes, stack=stack, tx=tx, **options)


def _deprecated(name):
  """The deprecated public ``name``, its warning asserted."""
  deprecations._warned.discard(name)
  with pytest.warns(DeprecationWarning, match=rf"jax_ssdtrain\.{name} is deprecated: use ssd\."):
    return getattr(ssd, name)


# -- the one rule ------------------------------------------------------------------------------


def test_the_rule_weighs_the_host_tier_first_then_each_class_then_the_spill_then_the_files():
  # A fake store: each class's bytes, a host tier of 100 (its share for state: 75) and files
  # of 1000; the classes at "host" fit the share, the whole placement the store.
  size = dict(a=40, b=30, c=20)
  asked = []

  def weigh(placement):
    asked.append(dict(placement))
    host = sum(size[c] for c, loc in placement.items() if loc is Location.HOST)
    files = sum(size[c] for c, loc in placement.items() if loc is Location.NVME)
    spill = sum(size[c] for c, loc in placement.items() if loc is Location.HOST_NVME)
    fits = host <= 100 and files <= 1000 and host + files + spill <= 1100
    return host, fits, ("detail", host)

  assert host_tier_share(100) == 75 and LEFT_FOR_ACTIVATIONS == 0.25
  H, N, S = Location.HOST, Location.NVME, Location.HOST_NVME
  # 90 fits the tier but not its share: a and b (70) in the host tier, c (20 more) in the files
  placement, detail = choose_tiers(("a", "b", "c"), weigh, host_tier_bytes=100)
  assert placement == dict(a=H, b=H, c=N) and detail == ("detail", 70)
  assert asked[0] == dict(a=H, b=H, c=H)
  # one class over the share: the host tier spilling to the files, never the files alone
  asked.clear()
  size["a"] = 80
  assert choose_tiers(("a",), weigh, host_tier_bytes=100)[0] == dict(a=S)
  assert asked == [dict(a=H), dict(a=S)]
  # at the share exactly: the host tier
  size["a"] = 75
  assert choose_tiers(("a",), weigh, host_tier_bytes=100)[0] == dict(a=H)
  # no host tier: the files, weighed alone
  asked.clear()
  assert choose_tiers(("a", "b"), weigh, host_tier_bytes=0)[0] == dict(a=N, b=N)
  assert asked == [dict(a=N, b=N)]
  # nothing fits: None (the caller refuses, with its arithmetic)
  size["a"] = 2000
  assert choose_tiers(("a",), weigh, host_tier_bytes=100) is None


def _state_room(tmp_path):
  """The bytes of the store a dense model's Adam state takes (an update's two versions), and
  those of a streamed stack's optimizer state and master copy in the host tier with its
  parameters and sum on the device: the two rooms the rule weighs."""
  with ssd.configured(tmp_path / "r", capacity_bytes=256 * MiB, host_tier_bytes=64 * MiB):
    dense = ssd.choose_placement(tx=optax.adam(1e-3), params=_dense_params()).peak_bytes
    stack = ssd.check_streamed_room(
      _shape(8, "device"), optax.adamw(1e-3), sum_location="device", state_location="host"
    )["host_bytes"]
  return dense, stack


def _dense_params():
  return {"w": jnp.ones((1024, 1024)), "b": jnp.ones((512, 1024))}


def _stack_state_location(tx):
  """Where choose_placement puts a stack's optimizer state with its parameters and sum on the
  device (the budget fits those two, not the state): the rule's choice for that class alone."""
  cost = dict(params=1, grad_sum=2, optimizer_state=6)  # MiB on the device, per class kept there

  def step_bytes(locations):
    return (4 + sum(cost[c] for c, loc in locations.items() if loc == "device")) * MiB

  where = _place(_shape(8, "device"), tx, step_bytes, 8 * MiB)
  assert (where.locations["params"], where.locations["grad_sum"]) == ("device", "device")
  return where.locations["optimizer_state"]


@pytest.mark.parametrize("regime", ["the share", "the tier", "no host tier"])
def test_the_rule_gives_the_optimizer_and_the_stack_the_same_tier_for_the_same_room(
  tmp_path, regime
):
  # Each class's room set against a host tier it fits the share of (three quarters: "host"),
  # the tier but not its share ("host,nvme"), or no host tier ("nvme"): offload_optimizer's
  # location="auto", choose_placement's dense state and a stack's state all answer alike.
  want = {"the share": "host", "the tier": "host,nvme", "no host tier": "nvme"}[regime]
  rooms = dict(zip(("dense", "stack"), _state_room(tmp_path)))
  for kind, room in rooms.items():
    least = -(-room * 4 // 3)  # the smallest host tier whose share holds the room
    assert host_tier_share(least) >= room > host_tier_share(least - 1)
    host = {"the share": least, "the tier": least - 1, "no host tier": 0}[regime]
    assert regime != "the tier" or host >= room  # the tier holds it: only the share does not
    with ssd.configured(
      tmp_path / f"{kind}-{regime}", capacity_bytes=256 * MiB, host_tier_bytes=host
    ):
      if kind == "dense":
        params = _dense_params()
        tx = ssd.offload_optimizer(optax.adam(1e-3), location="auto")
        assert tx.init(params).location == want
        where = ssd.choose_placement(tx=optax.adam(1e-3), params=params)
        assert where.locations == {"optimizer_state": want} and where.peak_bytes == room
        assert str(where).startswith(f"optimizer state: in the store, {want} (no step to weigh;")
      else:
        assert _stack_state_location(optax.adamw(1e-3)) == want


# -- a dense model ------------------------------------------------------------------------------


class _Device:  # what choose_placement reads of a device
  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    return self.stats


def test_dense_weighs_the_step_against_the_budget():
  where = ssd.choose_placement(1_500_000_000, 2_000_000_000)
  assert where.on_device and (where.step_bytes, where.budget_bytes) == (1.5e9, 2e9)
  assert where.locations == {"optimizer_state": "device"}
  assert str(where) == "optimizer state: on the device (the step takes 1.40 GiB of 1.86 GiB)"
  asked = []

  def step_bytes(locations):
    asked.append(locations)
    return 3_000_000_000

  where = ssd.choose_placement(step_bytes, 2_000_000_000)
  assert asked == [{"optimizer_state": "device"}]  # weighed with the state on the device
  assert not where.on_device and where.step_bytes == 3e9
  assert where.locations == {"optimizer_state": "auto"}  # no tx and params: init's choice
  assert str(where) == (
    "optimizer state: in the store (the step takes 2.79 GiB with it on the device, budget 1.86 GiB)"
  )

  def no_plan(locations):
    raise ValueError("no plan fits with it on the device")

  where = ssd.choose_placement(no_plan, 2_000_000_000)
  assert not where.on_device and where.step_bytes is None
  assert str(where) == (
    "optimizer state: in the store (no plan fits with it on the device, budget 1.86 GiB)"
  )
  # The budget defaults to the device's memory limit; without one the step is not measured.
  where = ssd.choose_placement(lambda _: 10**9, device=_Device({"bytes_limit": 4 * 10**9}))
  assert where.on_device and where.budget_bytes == 4 * 10**9

  def not_measured(locations):
    raise AssertionError("measured with nothing to weigh it against")

  for stats in (None, {}):
    where = ssd.choose_placement(not_measured, device=_Device(stats))
    assert not where.on_device and where.step_bytes is None and where.budget_bytes is None
    assert str(where) == (
      "optimizer state: in the store (no device memory limit to weigh it against)"
    )
  assert str(ssd.choose_placement()) == "optimizer state: in the store (no step to weigh)"
  with pytest.raises(ValueError, match="budget_bytes: expected an integer >= 1, got 0"):
    ssd.choose_placement(1, 0)


@pytest.mark.parametrize(
  "step_bytes, budget_bytes, stats",
  [
    (1_500_000_000, 2_000_000_000, None),
    (3_000_000_000, 2_000_000_000, None),
    ("no plan", 2_000_000_000, None),
    (10**9, None, {"bytes_limit": 4 * 10**9}),
    (10**9, None, {}),
  ],
)
def test_dense_choice_equals_the_deprecated_choose_optimizer_location(
  step_bytes, budget_bytes, stats
):
  def no_plan(*locations):
    raise ValueError("no plan fits with it on the device")

  device = _Device(stats) if stats is not None else None
  old_fn = _deprecated("choose_optimizer_location")
  if step_bytes == "no plan":
    old = old_fn(no_plan, budget_bytes, device=device)
    new = ssd.choose_placement(no_plan, budget_bytes, device=device)
  else:
    old = old_fn(lambda: step_bytes, budget_bytes, device=device)
    new = ssd.choose_placement(lambda _: step_bytes, budget_bytes, device=device)
  assert isinstance(old, planner.OptimizerPlacement) and isinstance(new, ssd.Placement)
  assert old.on_device == new.on_device
  assert (old.reason, old.step_bytes, old.budget_bytes) == (
    new.reason,
    new.step_bytes,
    new.budget_bytes,
  )
  assert str(old) == str(new)


def test_dense_arguments_are_checked():
  with pytest.raises(ValueError, match="params: a dense model's state tier is weighed from tx"):
    ssd.choose_placement(tx=optax.adam(1e-3))
  with pytest.raises(ValueError, match="tx: a dense model's state tier is weighed from tx"):
    ssd.choose_placement(params=_dense_params())
  with pytest.raises(ValueError, match="sum_dtype, activation_bytes: a streamed stack's"):
    ssd.choose_placement(sum_dtype=jnp.bfloat16, activation_bytes=1)
  with pytest.raises(ValueError, match="params: a dense model's parameters, given with stack="):
    ssd.choose_placement(stack=_shape(2, "device"), params=_dense_params())
  with pytest.raises(ValueError, match="in_place: expected True or False"):
    ssd.choose_placement(in_place=1)
  with pytest.raises(TypeError, match="tx: expected an optax GradientTransformation"):
    ssd.choose_placement(tx=object(), params=_dense_params())


def test_dense_tier_weighs_what_an_update_holds(tmp_path):
  # As offload_optimizer's init lays the state out (its default 64 MiB chunks: each leaf one
  # chunk): two versions of Adam's mu and nu; in place one version and three chunks in flight
  # of the largest shape's leaves (mu and nu of "w": 8 MiB).
  with ssd.configured(tmp_path / "s", capacity_bytes=256 * MiB, host_tier_bytes=64 * MiB):
    two = ssd.choose_placement(tx=optax.adam(1e-3), params=_dense_params())
    one = ssd.choose_placement(tx=optax.adam(1e-3), params=_dense_params(), in_place=True)
    assert two.peak_bytes == 2 * 2 * 6 * MiB and one.peak_bytes == 2 * 6 * MiB + 3 * 8 * MiB
    assert one.locations == two.locations == {"optimizer_state": "host"}
    assert two.reason == (
      "no step to weigh; an update holds 24.0 MiB of it in the store, which fits "
      "host_tier_bytes 67108864"
    )
    assert two.room_bytes == 64 * MiB


def test_dense_state_the_store_cannot_hold_is_refused_as_init_refuses_it(tmp_path):
  with ssd.configured(tmp_path / "s", capacity_bytes=MiB, host_tier_bytes=MiB):
    with pytest.raises(ssd.OptimizerOffloadError) as planned:
      ssd.choose_placement(tx=optax.adam(1e-3), params=_dense_params(), name="adam")
    with pytest.raises(ssd.OptimizerOffloadError) as init:
      ssd.offload_optimizer(optax.adam(1e-3), location="auto").init(_dense_params())
  assert "location='host,nvme' holds (host_tier_bytes + capacity_bytes" in str(planned.value)
  assert str(planned.value).split(": ", 1)[1] == str(init.value).split(": ", 1)[1]


# -- a streamed stack ---------------------------------------------------------------------------


def test_stack(tmp_path):
  import optax

  tx = optax.adamw(1e-3)
  shape = _shape(8, "device")

  def no_plan(locations):
    raise ValueError("no plan fits")

  with ssd.configured(tmp_path / "a", capacity_bytes=256 * MiB, host_tier_bytes=64 * MiB):
    peak = ssd.check_streamed_room(_shape(8, "host"), tx)["peak_bytes"]  # about 5 MB
    assert ssd.check_streamed_room(shape, tx)["peak_bytes"] == 0  # all on the device
    where = _place(shape, tx, 10 * MiB, 20 * MiB)
    assert where.locations["params"] == "device" and where.step_bytes == 10 * MiB
    assert where.locations == dict.fromkeys(["params", "grad_sum", "optimizer_state"], "device")
    assert (
      str(where)
      == "layer stack: device (the step takes 10.0 MiB of 20.0 MiB with it on the device)"
    )
    # a number weighs every class on the device, and nothing between
    where = _place(shape, tx, 30 * MiB, 20 * MiB)
    assert (where.locations["params"], where.peak_bytes, where.room_bytes) == (
      "host",
      peak,
      64 * MiB,
    )
    assert where.locations == dict.fromkeys(["params", "grad_sum", "optimizer_state"], "host")
    assert (where.step_bytes, where.budget_bytes) == (30 * MiB, 20 * MiB)
    assert "30.0 MiB with it on the device, budget 20.0 MiB" in where.reason
    assert "no plan fits" in _place(shape, tx, no_plan, 20 * MiB).reason
    assert _place(shape, tx).locations["params"] == "host"  # no step to weigh
    with pytest.raises(ValueError, match="expected the stack's structure on the device"):
      _place(_shape(8, "host"), tx)
  # the host tier too small for the whole stack: the parameters there (the hottest), the sum
  # and the state in the files; no host tier: the files
  with ssd.configured(tmp_path / "b", capacity_bytes=256 * MiB, host_tier_bytes=MiB):
    where = _place(shape, tx, 30 * MiB, 20 * MiB)
    assert where.locations == dict(params="host", grad_sum="nvme", optimizer_state="nvme")
    assert where.room_bytes == 257 * MiB
    assert str(where).startswith(
      "layer stack: parameters host, gradient sum nvme, optimizer state nvme (the step takes"
    )
  with ssd.configured(tmp_path / "c", capacity_bytes=256 * MiB, host_tier_bytes=0):
    assert _place(shape, tx).locations["params"] == "nvme"
  # nowhere: refused with the arithmetic and the ways out
  with ssd.configured(tmp_path / "d", capacity_bytes=MiB, host_tier_bytes=MiB):
    with pytest.raises(ssd.StreamedRoomError, match="fits neither the device") as info:
      _place(shape, tx, 30 * MiB, 20 * MiB, name="gpt")
    assert f"its peak is {peak} bytes" in str(info.value)
    assert "in_place=True; sum_dtype=bfloat16" in str(info.value)


def test_stack_per_class(tmp_path):
  # The device keeps the classes in the order that saves the most link traffic per byte: every
  # class, then the parameters and the sum, then the parameters; the function of the locations
  # is asked for each placement in that order, until one fits the budget.
  import optax

  tx = optax.adamw(1e-3)
  shape = _shape(8, "device")
  cost = dict(params=1, grad_sum=2, optimizer_state=6)  # MiB on the device, per class kept there
  asked = []

  def step_bytes(locations):
    asked.append(dict(locations))
    return (4 + sum(cost[c] for c, loc in locations.items() if loc == "device")) * MiB

  with ssd.configured(tmp_path / "a", capacity_bytes=256 * MiB, host_tier_bytes=64 * MiB):
    where = _place(shape, tx, step_bytes, 8 * MiB)
    assert where.locations == dict(params="device", grad_sum="device", optimizer_state="host")
    assert [sorted(c for c, v in a.items() if v == "device") for a in asked] == [
      ["grad_sum", "optimizer_state", "params"],
      ["grad_sum", "params"],
    ]
    assert asked[1] == where.locations  # weighed as placed
    assert where.step_bytes == 7 * MiB and where.budget_bytes == 8 * MiB
    state_only = ssd.check_streamed_room(_shape(8, "host"), tx, sum_location="device")
    assert where.peak_bytes < state_only["peak_bytes"]  # the parameters are not in the store
    assert str(where) == (
      "layer stack: parameters device, gradient sum device, optimizer state host (the step "
      "takes 7.0 MiB of 8.0 MiB with its parameters and gradient sum on the device; its peak "
      f"in the store, {where.peak_bytes / MiB:.1f} MiB, fits host_tier_bytes 67108864)"
    )
    asked.clear()
    where = _place(shape, tx, step_bytes, 5 * MiB)
    assert where.locations == dict(params="device", grad_sum="host", optimizer_state="host")
    assert len(asked) == 3
    where = _place(shape, tx, step_bytes, 4 * MiB)
    assert where.locations == dict.fromkeys(["params", "grad_sum", "optimizer_state"], "host")
    assert where.reason.startswith(
      "the step takes 13.0 MiB with it on the device, 7.0 MiB with its parameters and gradient "
      "sum on the device, 5.0 MiB with its parameters on the device, budget 4.0 MiB; its peak"
    )
  # what the device leaves must fit the store: 1 MiB of host tier holds neither the sum nor the
  # state (the float32 sum and its new version: 1.1 MiB), so both spill from it to the files
  with ssd.configured(tmp_path / "b", capacity_bytes=256 * MiB, host_tier_bytes=MiB):
    where = _place(shape, tx, step_bytes, 5 * MiB)
    assert where.locations == dict(
      params="device", grad_sum="host,nvme", optimizer_state="host,nvme"
    )
    # a bfloat16 sum in place fits the host tier, the state goes to the files
    where = _place(shape, tx, step_bytes, 5 * MiB, sum_dtype=jnp.bfloat16, in_place=True)
    assert where.locations == dict(params="device", grad_sum="host", optimizer_state="nvme")


def test_stack_compiles_no_placement_that_cannot_fit(tmp_path):
  # A placement whose classes alone hold more than the budget is refused by arithmetic: its
  # step is not compiled (XLA's scheduler logs errors for such programs), whatever it reports.
  import optax

  tx = optax.adamw(1e-3)
  shape = _shape(8, "device")
  asked = []

  def step_bytes(locations):
    asked.append(dict(locations))
    return MiB  # fits any budget: only the arithmetic refuses

  with ssd.configured(tmp_path / "a", capacity_bytes=256 * MiB, host_tier_bytes=64 * MiB):
    room = ssd.check_streamed_room(_shape(8, "host"), tx)
    layers, per_layer = room["num_layers"], room["layer_bytes"]
    every = layers * sum(per_layer.values())
    where = _place(shape, tx, step_bytes, every - 1)
    assert where.locations == dict(params="device", grad_sum="device", optimizer_state="host")
    assert asked == [where.locations]
    asked.clear()
    floor = layers * per_layer["params"]
    where = _place(shape, tx, step_bytes, floor - 1)
    assert where.locations == dict.fromkeys(["params", "grad_sum", "optimizer_state"], "host")
    assert asked == []
    assert where.reason.startswith(f"at least {every / MiB:.1f} MiB with it on the device, ")


def test_stack_places_the_layer_inputs(tmp_path):
  # With activation_bytes the saved layer inputs are a class too: kept on the device after the
  # parameters and before the sum (as many bytes in and out per byte as the sum, far fewer of
  # them), and, streamed, counted in the store during a micro-step.
  import optax

  tx = optax.adamw(1e-3)
  shape = _shape(8, "device")
  cost = dict(params=1, activations=1, grad_sum=2, optimizer_state=6)  # MiB on the device
  asked = []

  def step_bytes(locations):
    asked.append(dict(locations))
    return (4 + sum(cost[c] for c, loc in locations.items() if loc == "device")) * MiB

  with ssd.configured(tmp_path / "a", capacity_bytes=256 * MiB, host_tier_bytes=64 * MiB):
    where = _place(shape, tx, step_bytes, 6 * MiB, activation_bytes=MiB)
    assert where.locations == dict(
      params="device", grad_sum="host", optimizer_state="host", activations="device"
    )
    assert where.locations["activations"] == "device"
    on_device = [sorted(c for c, v in a.items() if v == "device") for a in asked]
    assert on_device == [
      ["activations", "grad_sum", "optimizer_state", "params"],
      ["activations", "grad_sum", "params"],
      ["activations", "params"],
    ]
    assert "with its parameters and layer inputs on the device" in where.reason
    # no room for the parameters: the inputs alone stay, then nothing
    asked.clear()
    where = _place(shape, tx, step_bytes, int(4.5 * MiB), activation_bytes=MiB)
    assert where.locations["params"] == where.locations["activations"] == "host"
    on_device = [sorted(c for c, v in a.items() if v == "device") for a in asked]
    assert on_device[-2:] == [["params"], ["activations"]]
    # streamed, the inputs count in the store during a micro-step
    placed = _place(shape, tx, activation_bytes=10 * MiB)
    bare = _place(shape, tx)
    assert placed.locations["activations"] == "host" and "activations" not in bare.locations
    assert placed.peak_bytes >= bare.peak_bytes
    assert "layer inputs" not in str(bare)
  # a tier too small for the inputs beside the rest: they go to the files, and the colder sum
  # and state, which still fit beside the parameters, stay in the host tier
  with ssd.configured(tmp_path / "b", capacity_bytes=256 * MiB, host_tier_bytes=12 * MiB):
    where = _place(shape, tx, activation_bytes=16 * MiB)
    assert where.locations == dict(
      params="host", grad_sum="host", optimizer_state="host", activations="nvme"
    )
  with pytest.raises(ValueError, match="activation_bytes"):
    _place(shape, tx, activation_bytes=-1)


def test_the_deprecated_choose_stack_location_gives_choose_placement_s_answer(tmp_path):
  tx = optax.adamw(1e-3)
  shape = _shape(8, "device")
  cost = dict(params=1, activations=1, grad_sum=2, optimizer_state=6)

  def step_bytes(locations):
    return (4 + sum(cost[c] for c, loc in locations.items() if loc == "device")) * MiB

  old_fn = _deprecated("choose_stack_location")
  with ssd.configured(tmp_path / "a", capacity_bytes=256 * MiB, host_tier_bytes=64 * MiB):
    for budget in (20, 8, 6, 5, 4):
      new = _place(shape, tx, step_bytes, budget * MiB, activation_bytes=MiB)
      old = old_fn(shape, tx, step_bytes, budget * MiB, activation_bytes=MiB)
      assert isinstance(old, planner.StackPlacement)
      assert old.locations == new.locations and str(old) == str(new)
      assert (old.location, old.sum_location, old.state_location, old.save_inputs) == tuple(
        new.locations[c] for c in ("params", "grad_sum", "optimizer_state", "activations")
      )
      assert (old.step_bytes, old.budget_bytes, old.peak_bytes, old.room_bytes) == (
        new.step_bytes,
        new.budget_bytes,
        new.peak_bytes,
        new.room_bytes,
      )


@pytest.mark.parametrize(
  "name",
  ["choose_optimizer_location", "choose_stack_location", "OptimizerPlacement", "StackPlacement"],
)
def test_the_replaced_names_warn_naming_choose_placement(name):
  assert name not in ssd.__all__
  deprecations._warned.discard(name)
  with pytest.warns(DeprecationWarning, match=r"use ssd\.(choose_placement|Placement)"):
    obj = getattr(ssd, name)
  assert obj is getattr(planner, name)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert getattr(ssd, name) is obj  # once per process
