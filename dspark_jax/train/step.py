"""TrainState, its shardings, and the jitted, sharded, donated DSpark train step.

Batch (per optimizer step, global shapes; A = grad_accum, Bm = batch_size / A)::

    input_ids   int32   [A, Bm, S]
    loss_mask   float32 [A, Bm, S]
    features    [A, Bm, S, n*H]   (cache mode only; online mode runs the target)
    last_hidden [A, Bm, S, H]     (cache mode only)

Anchors are drawn for the whole global batch at once and the loss denominator
(sum of decayed eval weights) is computed over the whole global batch before
the gradient pass, so each micro-batch contributes numerator / global
denominator: the loss and gradient do not depend on A or on the mesh.
"""

from __future__ import annotations

from typing import Any, Callable

import chex
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from dspark_jax import families, runtime
from dspark_jax import sharding as shard_lib
from dspark_jax.config import DraftConfig, LossConfig, TargetConfig
from dspark_jax.draft import model as draft_model
from dspark_jax.draft.backbone import REMAT_MODES
from dspark_jax.errors import ConfigError
from dspark_jax.target.features import target_features
from dspark_jax.train import batch as batch_lib
from dspark_jax.train import loss as loss_lib
from dspark_jax.train.optim import merge_params


@flax.struct.dataclass
class TrainState:
    """step int32 []; params: trainable fp32 master weights; opt_state: optax state; rng uint32 [2]."""

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array


def init_state(trainable: dict, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), trainable)
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), jax.random.PRNGKey(seed))


def state_shardings(state_shapes: TrainState, trainable_axes: dict, mesh: Mesh,
                    optimizer: optax.GradientTransformation) -> TrainState:
    """NamedShardings for a TrainState: params by logical axes, Adam moments like their params."""
    rep = shard_lib.replicated(mesh)
    p_sh = shard_lib.param_shardings(trainable_axes, mesh, state_shapes.params)
    o_sh = optax.tree_map_params(optimizer, lambda _, s: s, state_shapes.opt_state, p_sh,
                                 transform_non_params=lambda _: rep,
                                 is_leaf=lambda x: isinstance(x, NamedSharding))
    return TrainState(rep, p_sh, o_sh, rep)


def batch_shardings(mesh: Mesh, batch_shapes: dict) -> dict:
    """Shard dim 1 (rows of each micro-batch) over the batch mesh axes."""
    def one(x):
        spec = shard_lib.logical_to_spec((None, "batch") + (None,) * (len(x.shape) - 2))
        return NamedSharding(mesh, spec)
    return jax.tree.map(one, batch_shapes)


def check_batch(batch: dict, draft_cfg: DraftConfig, *, online: bool) -> None:
    """chex shape checks of a train batch (trace time): input_ids/loss_mask [A, Bm, S]; in cache
    mode also features [A, Bm, S, n*H] and last_hidden [A, Bm, S, H]."""
    ids = batch["input_ids"]
    chex.assert_rank(ids, 3)
    chex.assert_type(ids, jnp.int32)
    chex.assert_equal_shape([ids, batch["loss_mask"]])
    if not online:
        a, bm, s = ids.shape
        h = draft_cfg.hidden_size
        chex.assert_shape(batch["features"], (a, bm, s, draft_cfg.num_context_features * h))
        chex.assert_shape(batch["last_hidden"], (a, bm, s, h))


def make_loss_terms(cfg: LossConfig):
    def objective(sums):
        obj = cfg.ce_weight * sums["ce"]
        if "l1" in sums:
            obj = obj + cfg.l1_weight * sums["l1"]
        if "confidence" in sums:
            obj = obj + cfg.confidence_weight * sums["confidence"]
        return obj
    return objective


def activation_constraint(mesh: Mesh | None):
    """x -> x with dim 0 (batch) sharded over the batch mesh axes (identity without a mesh).

    Pinning activations this way keeps XLA from computing contractions over
    fsdp-sharded weights as partial sums of whole-batch activations (which then
    need all-reduces of e.g. the full [B, N, G, V] logits on every device): with
    batch-sharded activations it all-gathers each weight instead (ZeRO-3).
    """
    if mesh is None:
        return None

    def pin(x):
        spec = shard_lib.logical_to_spec(("batch",) + (None,) * (x.ndim - 1), shape=x.shape, mesh=mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    return pin


def _check_memory_options(remat, loss_chunk) -> None:
    if not isinstance(loss_chunk, int) or isinstance(loss_chunk, bool) or loss_chunk < 0:
        raise ConfigError(f"loss_chunk={loss_chunk!r} must be an int >= 0 (0: no chunking)")
    if remat not in (True, False, None) and remat not in REMAT_MODES:
        raise ConfigError(f"remat={remat!r} must be one of {REMAT_MODES}")


def global_anchors(state: TrainState, batch: dict, draft_cfg: DraftConfig, loss_cfg: LossConfig):
    """Anchors of the whole global batch and its loss denominator (sum of decayed eval weights).

    Returns (rng of the next step, anchors int32 [A, Bm, N], keep bool [A, Bm, N], den [], tokens []).
    """
    ids = batch["input_ids"]
    a, bm, s = ids.shape
    rng, k_anchor = jax.random.split(state.rng)
    k_anchor = jax.random.fold_in(k_anchor, state.step)
    flat_ids = ids.reshape(a * bm, s)
    flat_lm = batch["loss_mask"].reshape(a * bm, s)
    anchors, keep = batch_lib.sample_anchors(k_anchor, flat_lm, draft_cfg.num_anchors)
    _, eval_mask, _ = batch_lib.block_targets(flat_ids, flat_lm, anchors, keep, draft_cfg.block_size)
    den = loss_lib.decay_weights(eval_mask, loss_cfg.loss_decay_gamma).sum() + loss_lib.EPS
    return rng, anchors.reshape(a, bm, -1), keep.reshape(a, bm, -1), den, flat_lm.sum()


def make_features(draft_cfg: DraftConfig, target_cfg: TargetConfig | None, compute_dtype, pin,
                  mesh: Mesh | None = None):
    """(target_params, micro-batch) -> (features [Bm, S, n*H], last_hidden [Bm, S, H]): the frozen
    target's (online, gradients stopped; its forward sees ``mesh``) or the cached ones."""
    ctx = runtime.Context.make(mesh, shard_lib.DEFAULT_RULES, compute_dtype)

    def features(target_params, mb):  # any target family (its runtime forward)
        if target_cfg is None:
            return mb["features"], mb["last_hidden"]
        feats, last, _ = jax.lax.stop_gradient(target_features(
            target_params, target_cfg, draft_cfg.target_layer_ids, mb["input_ids"], ctx=ctx))
        if pin is not None:
            feats, last = pin(feats), pin(last)
        return feats, last
    return features


def make_loss_sums(draft_cfg: DraftConfig, loss_cfg: LossConfig, compute_dtype, remat, loss_chunk,
                   mesh: Mesh | None, pin):
    """sums(trainable, frozen, mb, features, last_hidden, anchors, keep) -> loss sums of one
    micro-batch: ``training_forward`` + ``loss_sums`` without memory options, else
    ``training_hidden`` (remat, pinned activations) + ``chunked_loss_sums``. The drafter
    family's backbone (``families.draft_ops``) runs inside both."""
    plain = remat in (False, None, "none") and loss_chunk == 0 and pin is None
    # on a mesh the drafter's backbone may shard inside itself (V4's MoE stages: expert-parallel)
    ops = families.draft_ops(draft_cfg).on(runtime.Context.make(mesh, shard_lib.DEFAULT_RULES, compute_dtype))
    # the frozen [H, V] output head (``lm_head``; V4's module: the target's ``head``), by its declared axes
    heads = [path[0] for path, spec in families.declare(draft_cfg).items()
             if len(path) == 1 and spec.frozen and spec.axes == ("embed", "vocab")]

    def sums(tp, frozen, mb, feats, last, anc, kp):
        if plain:
            fwd = draft_model.training_forward(merge_params(tp, frozen), draft_cfg, mb["input_ids"], feats,
                                               mb["loss_mask"], anc, kp, last, compute_dtype=compute_dtype,
                                               ops=ops)
            return loss_lib.loss_sums(fwd, loss_cfg)
        p = draft_model.cast_params(merge_params(tp, frozen), compute_dtype)
        th = draft_model.training_hidden(p, draft_cfg, mb["input_ids"], feats, mb["loss_mask"], anc, kp, last,
                                         compute_dtype=compute_dtype, remat=remat, constrain=pin, ops=ops)
        if mesh is not None and loss_chunk:  # gather the LM head once, not once per chunk
            for k in heads:
                spec = shard_lib.logical_to_spec((None, "vocab"), shape=p[k].shape, mesh=mesh)
                p[k] = jax.lax.with_sharding_constraint(p[k], NamedSharding(mesh, spec))
        return loss_lib.chunked_loss_sums(p, draft_cfg, th, loss_cfg, loss_chunk, constrain=pin, ops=ops)
    return sums


def accumulate(one: Callable, xs):
    """Sum of ``one(*x) -> (grads, sums)`` over the leading (micro-batch) axis of ``xs``."""
    if jax.tree.leaves(xs)[0].shape[0] == 1:  # no accumulation loop to compile
        return one(*jax.tree.map(lambda x: x[0], xs))
    first = jax.tree.map(lambda x: x[0], xs)
    zeros = jax.tree.map(lambda sd: jnp.zeros(sd.shape, sd.dtype), jax.eval_shape(one, *first))

    def micro(carry, x):
        return jax.tree.map(jnp.add, carry, one(*x)), None
    return jax.lax.scan(micro, zeros, xs)[0]


def apply_update(optimizer: optax.GradientTransformation, state: TrainState, grads, loss, rng):
    """(next state, finite []): the optimizer update, applied only if loss and gradients are finite."""
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(grads))
    keep_new = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    return TrainState(state.step + 1, keep_new(new_params, state.params),
                      keep_new(opt_state, state.opt_state), rng), finite


def build_train_step(draft_cfg: DraftConfig, loss_cfg: LossConfig, optimizer: optax.GradientTransformation,
                     schedule: Callable, *, target_cfg: TargetConfig | None = None,
                     compute_dtype=jnp.float32, remat: bool | str = False, loss_chunk: int = 0,
                     mesh: Mesh | None = None) -> Callable:
    """Pure step(state, frozen, target_params, batch) -> (state, metrics). Online mode when
    ``target_cfg`` is given (features computed from target_params), else cache mode.

    Memory options (numerics unchanged): ``remat`` ("none", "dots", "full"; see
    ``backbone.block_forward``) rematerialises draft layers in the backward pass;
    ``loss_chunk`` > 0 computes the vocabulary-sized heads and loss that many anchors
    at a time (``loss.chunked_loss_sums``). ``mesh`` pins activations batch-sharded
    (``activation_constraint``). With all three off the step is ``training_forward``
    + ``loss_sums`` exactly as before.
    """
    _check_memory_options(remat, loss_chunk)
    own = families.draft_ops(draft_cfg).objective
    if own is not None:  # a drafter trained on its own objective (runtime.TrainObjective)
        return build_objective_step(draft_cfg, own, optimizer, schedule, target_cfg=target_cfg,
                                    compute_dtype=compute_dtype, remat=remat, mesh=mesh)
    objective = make_loss_terms(loss_cfg)
    pin = activation_constraint(mesh)
    features = make_features(draft_cfg, target_cfg, compute_dtype, pin, mesh)
    loss_sums = make_loss_sums(draft_cfg, loss_cfg, compute_dtype, remat, loss_chunk, mesh, pin)

    def step(state: TrainState, frozen: dict, target_params, batch: dict):
        check_batch(batch, draft_cfg, online=target_cfg is not None)
        rng, anchors, keep, den, tokens = global_anchors(state, batch, draft_cfg, loss_cfg)

        def one(mb, anc, kp):
            """(grads, sums) of one micro-batch; grads already divided by the global denominator."""
            feats, last = features(target_params, mb)

            def loss_fn(tp):
                sums = loss_sums(tp, frozen, mb, feats, last, anc, kp)
                return objective(sums) / den, sums
            (_, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
            return grads, sums

        grads, sums = accumulate(one, ({k: v for k, v in batch.items() if k != "index"}, anchors, keep))
        loss, metrics = loss_lib.finalize(sums, loss_cfg)
        new_state, finite = apply_update(optimizer, state, grads, loss, rng)
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads), learning_rate=schedule(state.step),
                       loss_weight=sums["weight"], tokens=tokens, finite=finite)
        return new_state, metrics

    return step


def build_objective_step(draft_cfg, own: runtime.TrainObjective, optimizer: optax.GradientTransformation,
                         schedule: Callable, *, target_cfg=None, compute_dtype=jnp.float32,
                         remat: bool | str = False, mesh: Mesh | None = None) -> Callable:
    """``build_train_step`` for a family's own objective: the same features (online or cached),
    micro-batch accumulation and guarded update; the denominator is ``own.denominator`` of the
    whole global batch, so the loss and gradient do not depend on ``grad_accum`` or the mesh."""
    pin = activation_constraint(mesh)
    features = make_features(draft_cfg, target_cfg, compute_dtype, pin, mesh)
    remat = remat not in (False, None, "none")

    def step(state: TrainState, frozen: dict, target_params, batch: dict):
        check_batch(batch, draft_cfg, online=target_cfg is not None)
        ids, mask = batch["input_ids"], batch["loss_mask"]
        den = own.denominator(draft_cfg, ids.reshape(-1, ids.shape[-1]), mask.reshape(-1, mask.shape[-1]))

        def one(mb):
            feats, last = features(target_params, mb)

            def loss_fn(tp):
                p = draft_model.cast_params(merge_params(tp, frozen), compute_dtype)
                sums = own.sums(p, draft_cfg, mb["input_ids"], feats, last, mb["loss_mask"], remat=remat)
                return sums["loss"] / den, sums
            (_, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
            return grads, sums

        grads, sums = accumulate(one, ({k: v for k, v in batch.items() if k != "index"},))
        loss, metrics = own.finalize(sums, den)
        new_state, finite = apply_update(optimizer, state, grads, loss, state.rng)
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads), learning_rate=schedule(state.step),
                       tokens=mask.sum(), finite=finite)
        return new_state, metrics

    return step
