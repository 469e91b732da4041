"""The train program, built once: jitted step, every sharding and the abstract arguments.

``build_program`` is the one place that assembles the sharded train step. The training
loop runs it on real arrays, the planner (``pipelines/plan.py``) lowers and compiles it on
its abstract arguments, and the tests call it too, so all three see the same program::

    program.step(state, frozen, target_params, batch) -> (state, metrics)   # state donated

    state          TrainState: step int32 [], fp32 trainable params, optax state, rng uint32 [2]
    frozen         the drafter's declared-frozen leaves: {"embed_tokens", "lm_head"} (shared with
                   the target), plus any declared-frozen buffers (e.g. {"layers": {"layer_scalar"}})
    target_params  the frozen target's params (online mode) or None (cache mode)
    batch          input_ids int32 [A, Bm, S], loss_mask float32 [A, Bm, S]; cache mode also
                   features [A, Bm, S, n*H] and last_hidden [A, Bm, S, H]
                   (A = grad_accum, Bm = batch_size / A global rows, S = max_length)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from dspark_jax import families
from dspark_jax import params as params_lib
from dspark_jax import sharding as shard_lib
from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.errors import ConfigError
from dspark_jax.train import optim, step as step_lib
from dspark_jax.train.config import TrainConfig

# Lower XLA backend optimisation: quicker compiles, slower steps (CPU smoke runs and tests).
FAST_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@dataclasses.dataclass(frozen=True)
class Program:
    """A built train program. ``*_sharding`` are NamedSharding trees; ``state``, ``frozen``,
    ``target`` and ``batch`` are ShapeDtypeStruct trees carrying those shardings (``target``
    and ``target_sharding`` are None in cache mode)."""

    step: Callable
    init_state: Callable
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    mesh: Mesh
    state_sharding: step_lib.TrainState
    frozen_sharding: dict
    target_sharding: Any
    batch_sharding: dict
    state: step_lib.TrainState
    frozen: dict
    target: Any
    batch: dict

    @property
    def online(self) -> bool:
        return self.target is not None

    @property
    def abstract_args(self) -> tuple:
        """(state, frozen, target, batch): the step's arguments as ShapeDtypeStructs."""
        return self.state, self.frozen, self.target, self.batch


def compute_dtype(cfg: TrainConfig):
    return jnp.bfloat16 if cfg.compute_dtype == "bfloat16" else jnp.float32


def make_train_mesh(cfg: TrainConfig) -> Mesh:
    """The run's mesh over all devices, or the first ``cfg.num_devices`` (single process only)."""
    devices = jax.devices()
    if cfg.num_devices:
        if jax.process_count() > 1:
            raise ConfigError("num_devices cannot be used with several processes (all devices take part)")
        if cfg.num_devices > len(devices):
            raise ConfigError(f"num_devices={cfg.num_devices} but only {len(devices)} devices exist")
        devices = devices[:cfg.num_devices]
    try:
        return shard_lib.make_mesh(cfg.mesh, devices)
    except ValueError as e:
        raise ConfigError(f"TrainConfig.mesh={cfg.mesh!r}: {e}") from None


def abstract(tree, shardings):
    """ShapeDtypeStruct tree of ``tree``'s shapes/dtypes with ``shardings`` attached."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def batch_shapes(cfg: TrainConfig, draft_cfg: DraftConfig, feature_dtype=jnp.float32) -> dict:
    """Global ShapeDtypeStructs of one optimizer step's batch (see the module docstring)."""
    rows = (cfg.grad_accum, cfg.micro_batch_size, cfg.max_length)
    out = {"input_ids": jax.ShapeDtypeStruct(rows, jnp.int32),
           "loss_mask": jax.ShapeDtypeStruct(rows, jnp.float32)}
    if cfg.features == "cache":
        h = draft_cfg.hidden_size
        out["features"] = jax.ShapeDtypeStruct(rows + (draft_cfg.num_context_features * h,), feature_dtype)
        out["last_hidden"] = jax.ShapeDtypeStruct(rows + (h,), feature_dtype)
    return out


def _check_batch_divides(cfg: TrainConfig, mesh: Mesh) -> None:
    n = math.prod(mesh.shape[a] for a in ("data", "fsdp"))
    if cfg.micro_batch_size % n:
        raise ConfigError(f"micro-batch of {cfg.micro_batch_size} rows (batch_size/grad_accum) does not "
                          f"divide over {n} data-parallel devices of mesh {dict(mesh.shape)}")


def build_program(draft_cfg: DraftConfig, target_cfg: TargetConfig, train_cfg: TrainConfig, mesh: Mesh, *,
                  total_steps: int, weights_dtype=jnp.float32, feature_dtype=jnp.float32,
                  fast_compile: bool = False) -> Program:
    """The sharded, jitted train step of ``train_cfg`` on ``mesh`` with its shardings and abstract args.

    ``total_steps`` sets the learning-rate schedule; ``weights_dtype`` is the dtype of the frozen
    drafter and target weights and ``feature_dtype`` that of cached features in the abstract
    arguments (shardings do not depend on either). ``fast_compile`` lowers XLA's backend
    optimisation (``FAST_COMPILE_OPTIONS``). Params, frozen leaves and logical axes come from
    the drafter's and target's family declarations (``families.declare``); a drafter of another
    family than the target's (a drafter made for another target family) is a ConfigError before anything compiles.
    """
    if target_cfg is not None:
        families.check_pair(draft_cfg, target_cfg)
    _check_batch_divides(train_cfg, mesh)
    optimizer, schedule = optim.make_optimizer(train_cfg.optimizer, total_steps)
    seed = train_cfg.seed
    init = lambda p: step_lib.init_state(p, optimizer, seed)
    specs = families.declare(draft_cfg)
    trainable, frozen = params_lib.split_frozen(specs, params_lib.abstract_params(specs, jnp.float32))
    frozen = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, weights_dtype), frozen)
    axes_t, axes_f = params_lib.split_frozen(specs, params_lib.param_axes(specs))
    state_shapes = jax.eval_shape(init, trainable)
    state_sh = step_lib.state_shardings(state_shapes, axes_t, mesh, optimizer)
    frozen_sh = shard_lib.param_shardings(axes_f, mesh, frozen)
    online = train_cfg.features == "online"
    target, target_sh = None, None
    if online:
        target_specs = families.declare(target_cfg)
        target = params_lib.abstract_params(target_specs, weights_dtype)
        target_sh = shard_lib.param_shardings(params_lib.param_axes(target_specs), mesh, target)
        target = abstract(target, target_sh)
    batch = batch_shapes(train_cfg, draft_cfg, feature_dtype)
    batch_sh = step_lib.batch_shardings(mesh, batch)
    mem = train_cfg.memory
    fn = step_lib.build_train_step(draft_cfg, train_cfg.loss, optimizer, schedule,
                                   target_cfg=target_cfg if online else None,
                                   compute_dtype=compute_dtype(train_cfg), remat=mem.remat,
                                   loss_chunk=mem.loss_chunk, mesh=mesh if mem.shard_activations else None)
    step = jax.jit(fn, in_shardings=(state_sh, frozen_sh, target_sh, batch_sh),
                   out_shardings=(state_sh, shard_lib.replicated(mesh)), donate_argnums=(0,),
                   compiler_options=FAST_COMPILE_OPTIONS if fast_compile else None)
    init_state = jax.jit(init, in_shardings=(state_sh.params,), out_shardings=state_sh)
    return Program(step, init_state, optimizer, schedule, mesh, state_sh, frozen_sh, target_sh, batch_sh,
                   abstract(state_shapes, state_sh), abstract(frozen, frozen_sh), target,
                   abstract(batch, batch_sh))
