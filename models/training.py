"""Run config, optimizer, train state, the pure ``train_step`` and orbax checkpointing."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

from . import build_model, get_config, make_remat_policy, resolve_locations
from .common import ModelConfig


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything about a run that is not the model's shape."""

    model: str = "gpt"
    preset: str = "tiny"
    batch: int = 8
    seq_len: int | None = None  # model positions per example; default: the preset's max_len
    steps: int = 30
    lr: float = 3e-3
    warmup: int | None = None  # default: steps // 10
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    seed: int = 0
    remat_policy: str | None = None  # keep | remat | offload (shortcut, see models.common)
    locations: Mapping[str, str] | str | None = None  # {tag: remat|device|host|nvme} overrides
    min_bytes: int = 1 << 20
    dtype: str | None = None  # override ModelConfig.dtype
    model_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def model_config(self) -> ModelConfig:
        extra = dict(self.model_overrides)
        if self.dtype:
            extra["dtype"] = self.dtype
        return get_config(self.model, self.preset, **extra)

    def resolved_locations(self):
        return resolve_locations(self.remat_policy, self.locations)

    def example_length(self, cfg: ModelConfig) -> int:
        """Tokens per example drawn from the data (GPT needs one more for the shifted target)."""
        seq = self.seq_len or cfg.max_len
        return seq + 1 if self.model == "gpt" else seq


class TrainState(train_state.TrainState):
    pass


def make_optimizer(run: RunConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW, linear warm-up then cosine decay to lr/10, global-norm gradient clipping."""
    warmup = run.steps // 10 if run.warmup is None else run.warmup
    schedule = optax.warmup_cosine_decay_schedule(0.0, run.lr, max(warmup, 1), max(run.steps, warmup + 1),
                                                  end_value=run.lr / 10)
    mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # no decay on norms/biases
    tx = optax.chain(optax.clip_by_global_norm(run.clip_norm),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=run.weight_decay, mask=mask))
    return tx, schedule


def create_train_state(run: RunConfig, policy=None):
    """Returns (state, model, schedule). ``policy`` defaults to the run's locations."""
    cfg = run.model_config()
    if policy is None:
        policy = make_remat_policy(run.resolved_locations(), run.min_bytes)
    model = build_model(run.model, cfg, policy)
    tokens = jnp.zeros((run.batch, run.example_length(cfg)), jnp.int32)
    init_rng, loss_rng = jax.random.split(jax.random.key(run.seed))
    params = jax.jit(lambda r: model.init(r, tokens, loss_rng, method="loss")["params"])(init_rng)
    tx, schedule = make_optimizer(run)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    # Array step and committed arrays, like a restored state: one compilation for both.
    state = jax.device_put(state.replace(step=jnp.zeros((), jnp.int32)), jax.local_devices()[0])
    return state, model, schedule


def train_step(state: TrainState, tokens: jax.Array, rng: jax.Array):
    """One optimizer step on a (B, L) int32 batch; ``rng`` is folded with the step (for masking)."""
    rng = jax.random.fold_in(rng, state.step)

    def loss_fn(params):
        return state.apply_fn({"params": params}, tokens, rng, method="loss")

    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    metrics = dict(metrics, grad_norm=optax.tree.norm(grads) if hasattr(optax, "tree") else optax.global_norm(grads))
    return state.apply_gradients(grads=grads), metrics


def jit_train_step(state_shardings=None):
    """The jitted step; with ``state_shardings`` (see :func:`shard_train_state`) the new state
    keeps the sharding of the old one."""
    if state_shardings is None:
        return jax.jit(train_step, donate_argnums=0)
    return jax.jit(train_step, donate_argnums=0, out_shardings=(state_shardings, None))


def shard_train_state(state: TrainState, parallelism, mesh):
    """Places ``state`` on ``mesh`` (params and optimizer state per ``parallelism``, see
    models.parallel); returns (state, its shardings)."""
    shardings = parallelism.shardings(state, mesh)
    host = jax.tree.map(np.asarray, state)  # from the one device it was created on
    # Every process holds the whole state: each device takes its slice (works across hosts).
    placed = jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx]), host, shardings)
    return placed, shardings


def shard_batch(tokens, parallelism, mesh):
    """The global (B, L) batch on ``mesh``; every process passes the whole batch and contributes
    its own block of rows (process i: rows [i*B/n, (i+1)*B/n))."""
    tokens = np.asarray(tokens)
    n, i = jax.process_count(), jax.process_index()
    if tokens.shape[0] % parallelism.data or tokens.shape[0] % n:
        raise ValueError(f"batch {tokens.shape[0]} is not divisible by data={parallelism.data} "
                         f"and by the {n} process(es)")
    rows = tokens.shape[0] // n
    return jax.make_array_from_process_local_data(parallelism.batch_sharding(mesh),
                                                  tokens[i * rows:(i + 1) * rows])


# ----------------------------------------------------------------------------- checkpoints
def checkpoint_manager(directory: str, max_to_keep: int = 2):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(os.path.abspath(directory),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))


def save_checkpoint(manager, state: TrainState) -> None:
    import orbax.checkpoint as ocp

    manager.save(int(state.step), args=ocp.args.StandardSave(state))
    manager.wait_until_finished()


def restore_checkpoint(manager, state: TrainState, step: int | None = None) -> TrainState:
    """Restore ``step`` (default: the latest) into the structure of ``state``."""
    import orbax.checkpoint as ocp

    step = manager.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {manager.directory}")
    return manager.restore(step, args=ocp.args.StandardRestore(state))
