"""jax_ssdtrain.StreamedTrainer: a streamed model's optimizer step as one object (its equality
with the device reference and with optax is tested through it in test_layer_stream.py): one
version of the state in the store after a step, checkpoints through the trainer (a resumed run
equals one never stopped), the placement under a budget, bad input."""

import _checkpoint_common as ckpt
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_ssdtrain as ssd

MiB = 1 << 20
D, V, OUT, L = 8, 4, 3, 3  # width, input features, outputs, layers


@pytest.fixture
def store(tmp_path):
  with ssd.configured(tmp_path / "s", capacity_bytes=128 * MiB, host_tier_bytes=32 * MiB):
    yield


def _init_layer(key):
  k1, k2 = jax.random.split(key)
  return {"w": jax.random.normal(k1, (D, D)) / np.sqrt(D), "b": 0.1 * jax.random.normal(k2, (D,))}


def _block(p, x):
  return x + jnp.tanh(x @ p["w"]) + p["b"]


def _embed(ep, batch):
  return batch["x"] @ ep


def _head(hp, y, batch):
  return jnp.mean((y @ hp - batch["y"]) ** 2)


def _init_side(key, batch):
  k1, k2 = jax.random.split(key)
  return jax.random.normal(k1, (V, D)) / np.sqrt(V), jax.random.normal(k2, (D, OUT)) / np.sqrt(D)


def _batch(i, rows=4):
  return {
    "x": jax.random.normal(jax.random.key(10 + i), (rows, V)),
    "y": jax.random.normal(jax.random.key(20 + i), (rows, OUT)),
  }


_TX = optax.adamw(optax.linear_schedule(2e-2, 5e-3, 3), weight_decay=0.1)  # compiled once


def _trainer(**kw):
  kw = dict(init_layer=_init_layer, num_layers=L, init_side=_init_side, micro_batches=2) | kw
  return ssd.StreamedTrainer(_embed, _block, _head, _TX, **kw)


def _steps(trainer, state, first, last):
  for s in range(first, last):
    state, metrics = trainer.step(state, [_batch(2 * s), _batch(2 * s + 1)])
  return state, metrics


def _bytes(state):
  tree = jax.tree.map(
    lambda x: ssd.stack_to_tree(x) if isinstance(x, ssd.StreamedStack) else x,
    state,
    is_leaf=lambda x: isinstance(x, ssd.StreamedStack),
  )
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _live_entries():
  ssd.flush()
  return ssd.stats()["live_entries"]


def test_a_step_leaves_one_version_in_the_store(store):
  # After a step only the new parameters and the new state are stored (the old versions and the
  # gradients' sum released at once, as check_streamed_room's arithmetic counts): per layer and
  # leaf, the parameters and AdamW's two moments.
  trainer = _trainer(clip_global_norm=0.5)
  state = trainer.init(jax.random.key(0), _batch(0))
  assert _live_entries() == L * 2 * 3
  state, metrics = _steps(trainer, state, 0, 2)
  assert set(metrics) == {"loss", "grad_norm"} and np.isfinite(float(metrics["grad_norm"]))
  assert _live_entries() == L * 2 * 3
  assert isinstance(state, ssd.StreamedTrainState) and state.stack.location.value == "host"


def test_step_equals_the_device_reference(store):
  runs = {}
  for loc in ("device", "host"):
    trainer = _trainer(location=loc, clip_global_norm=0.5)
    runs[loc] = _bytes(_steps(trainer, trainer.init(jax.random.key(0), _batch(0)), 0, 2)[0])
  assert runs["host"] == runs["device"]


@pytest.mark.parametrize("location", ["host", "nvme"])
def test_resume_through_the_trainer_equals_never_stopping(store, tmp_path, location):
  trainer = _trainer(location=location)
  never_stopped = _bytes(_steps(trainer, trainer.init(jax.random.key(0), _batch(0)), 0, 3)[0])
  state = _steps(trainer, trainer.init(jax.random.key(0), _batch(0)), 0, 2)[0]
  manager = ckpt.manager(tmp_path / "ck")
  trainer.save(manager, 2, state)
  assert manager.latest_step() == 2
  del state
  fresh = trainer.init(jax.random.key(100), _batch(0))
  resumed, step = trainer.restore(manager, fresh)
  assert step == 2
  assert _bytes(resumed) != _bytes(trainer.init(jax.random.key(100), _batch(0)))  # restored
  assert _bytes(_steps(trainer, resumed, 2, 3)[0]) == never_stopped


def test_restore_without_a_checkpoint_is_refused(store, tmp_path):
  trainer = _trainer(location="device")
  state = trainer.init(jax.random.key(0), _batch(0))
  with pytest.raises(FileNotFoundError, match="no checkpoint in .*StreamedTrainer.save"):
    trainer.restore(ckpt.manager(tmp_path / "empty"), state)


def test_choose_placement(store):
  # A budget the step fits with every class on the device keeps them there; one it cannot
  # puts them in the store (the host tier holds them); the choice is a trainer of its own.
  trainer = _trainer(location="nvme")
  batch = jax.ShapeDtypeStruct((4, V), jnp.float32)
  batch = {"x": batch, "y": jax.ShapeDtypeStruct((4, OUT), jnp.float32)}
  assert trainer.activation_bytes(batch) == (L - 1) * 4 * D * 4
  assert trainer.placed({"params": "device", "grad_sum": "device", "optimizer_state": "device"})
  roomy = trainer.choose_placement(batch, 1 << 30)
  assert isinstance(roomy, ssd.Placement) and roomy.on_device, roomy
  assert trainer.placed(roomy).location == "device"
  tight = trainer.choose_placement(batch, 1 << 10)
  assert tight.locations["params"] == "host", tight
  placed = trainer.placed(tight)
  assert (placed.location, placed.sum_location, placed.state_location) == ("host",) * 3
  assert trainer.location == "nvme"  # the trainer itself unchanged


@pytest.mark.parametrize(
  "kw, error, message",
  [
    (dict(micro_batches=0), ValueError, "micro_batches: expected an integer >= 1, got 0"),
    (dict(num_layers=2.0), ValueError, "num_layers: expected an integer >= 1, got 2.0"),
    (dict(location="remat"), ValueError, "location: expected 'device', 'host'"),
    (dict(location="ssd"), ValueError, "location: unknown location 'ssd'"),
    (dict(sum_location="auto"), ValueError, r"sum_location: 'auto' is the planner's choice"),
    (dict(sum_location="disk"), ValueError, "sum_location: unknown location 'disk'"),
    (dict(clip_global_norm=-1.0), ValueError, "clip_global_norm: expected a number > 0"),
    (dict(clip_global_norm="1"), TypeError, "clip_global_norm: expected a number > 0"),
    (dict(init_side=None), TypeError, "init_side: expected a function, got None"),
    (dict(save_inputs="remat"), ValueError, "save_inputs"),
  ],
)
def test_bad_input(kw, error, message):
  with pytest.raises(error, match=message):
    _trainer(**kw)


def test_bad_input_at_a_step(store):
  with pytest.raises(TypeError, match="tx: expected an optax GradientTransformation"):
    ssd.StreamedTrainer(
      _embed, _block, _head, optax.adam, init_layer=_init_layer, num_layers=L, init_side=_init_side
    )
  trainer = _trainer(location="device")
  state = trainer.init(jax.random.key(0), _batch(0))
  with pytest.raises(ValueError, match="batches: 1 given, micro_batches=2"):
    trainer.step(state, [_batch(0)])
  with pytest.raises(ValueError, match="locations: no grad_sum, optimizer_state in"):
    trainer.placed({"params": "host"})
  with pytest.raises(TypeError, match="state: expected a StreamedTrainState, got tuple"):
    trainer.save(None, 1, (state.stack, state.opt))
  bad = ssd.StreamedTrainer(
    _embed,
    _block,
    _head,
    _TX,
    init_layer=_init_layer,
    num_layers=L,
    init_side=lambda key, batch: (1.0, 2.0, 3.0),
  )
  with pytest.raises(ValueError, match=r"init_side: expected \(embed_params, head_params\)"):
    bad.init(jax.random.key(0), _batch(0))
