"""Logical axes of the decode state and its placement on a mesh (the params' scheme, for caches).

Every decode-state leaf declares logical axes, like ``params.ParamSpec.axes``:

==========================  =========================================================
leaf                        logical axes
==========================  =========================================================
seq [B, L]                  ("batch", "sequence")
pos/num_input/active/...    ("batch",)
acc/prop/drafts rec [B, R]  ("batch", None); conf_rec [B, R, G] ("batch", None, None)
target cache                its own declaration, ``cache.axes()`` (``dspark_jax.runtime``)
draft context cache k, v    ("layers", "batch", "kv_heads", "sequence", "head_dim") (v None: K = V)
key, round, policy state    replicated (``()``)
==========================  =========================================================

``DECODE_RULES`` extends ``sharding.DEFAULT_RULES``: requests (batch) over ``data``/``fsdp``,
KV heads over ``tensor``, sequence and head_dim unsharded; ``decode_rules(target_cfg)`` adds the
target family's own rules (``TargetRuntime.rules``). Params use their declared axes
(``families.declare``), so tensor parallelism splits heads and MLP of target and drafter alike.
``check_mesh`` refuses a mesh that does not divide heads / MLP / the batch, before compiling
(an axis the family declares ``replicable`` stays replicated instead). ``state_sharding_tree``
derives the full tree from the state's own declarations (``state_axes``).

Multi-process (``jax.distributed``, a mesh over several processes' devices): every host->device
and device->host transfer of the decode loop and engine goes through ``sharding.to_global`` /
``sharding.to_host`` (one device_put / device_get on a single process), and every process runs
the same host control flow from the same gathered values, so the collectives stay in lockstep.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dspark_jax import families, params as params_lib, runtime, sharding
from dspark_jax.errors import ConfigError

DECODE_RULES: dict[str, object] = {**sharding.DEFAULT_RULES, "sequence": None, "head_dim": None}

ROW = (runtime.BATCH,)
REPLICATED = ()

# DecodeState / ARState field -> logical axes of each of its leaves (the caches declare theirs).
STATE_AXES: dict[str, Any] = {
    "seq": (runtime.BATCH, runtime.STEP), "pos": ROW, "num_input": ROW, "max_new": ROW,
    "active": ROW, "key": REPLICATED, "round": REPLICATED, "rounds": ROW,
    "acc_rec": (runtime.BATCH, None), "prop_rec": (runtime.BATCH, None),
    "drafts_rec": (runtime.BATCH, None), "conf_rec": (runtime.BATCH, None, None),
    "policy_state": REPLICATED,
}
CACHE_FIELDS = ("cache", "ctx")  # state fields that are self-declaring caches


def decode_rules(target_cfg) -> dict[str, object]:
    """``DECODE_RULES`` plus the target family's extra rules."""
    return {**DECODE_RULES, **families.target_runtime(target_cfg).rules}


def state_axes(state):
    """The logical axes of every leaf of a decode state (the same pytree, tuple leaves)."""
    def field(name, value):
        if value is None or name in CACHE_FIELDS:
            return None if value is None else value.axes()
        return jax.tree.map(lambda _: STATE_AXES[name], value)
    return state.replace(**{f.name: field(f.name, getattr(state, f.name))
                            for f in dataclasses.fields(state)})


def state_sharding_tree(state, mesh: Mesh, rules: Mapping[str, object] = DECODE_RULES):
    """Full NamedSharding tree of ``state`` (arrays or ShapeDtypeStructs) from its declared axes
    (``state_axes``). A dim its mesh axes do not divide stays replicated (e.g. a
    full-attention group with 1 KV head under tensor=2; ``check_mesh`` refused the others)."""
    return jax.tree.map(
        lambda x, axes: NamedSharding(mesh, sharding.logical_to_spec(axes, rules, x.shape, mesh)),
        state, state_axes(state))


def batch_multiple(mesh: Mesh | None, rules: Mapping[str, object] = DECODE_RULES) -> int:
    """Number of shards of the batch (rows per step must be a multiple of it)."""
    if mesh is None:
        return 1
    target = rules.get("batch")
    names = (target,) if isinstance(target, str) else tuple(target or ())
    return math.prod(mesh.shape[n] for n in names)


# Config fields whose size a tensor-parallel mesh splits, and their logical axes.
_SPLIT_FIELDS = (("num_attention_heads", "heads"), ("num_key_value_heads", "kv_heads"),
                 ("intermediate_size", "mlp"))


def check_mesh(mesh: Mesh | None, target_cfg, draft_cfg, batch_size: int,
               rules: Mapping[str, object] = DECODE_RULES) -> None:
    """ConfigError unless ``mesh`` splits heads, KV heads, MLP of both models and the batch
    (an axis in the family runtime's ``replicable`` may stay replicated instead)."""
    if mesh is None:
        return
    for cfg, who in ((target_cfg, "target"), (draft_cfg, "drafter")):
        if cfg is None:
            continue
        replicable = families.runtime_of(cfg).replicable
        for field, axis in _SPLIT_FIELDS:
            target = rules.get(axis)
            names = (target,) if isinstance(target, str) else tuple(target or ())
            tp = math.prod(mesh.shape[n] for n in names)
            size = getattr(cfg, field, None)
            if size is not None and size % tp and axis not in replicable:
                raise ConfigError(f"mesh {dict(mesh.shape)}: tensor parallelism {tp} does not divide "
                                  f"the {who}'s {field} = {size}")
    dp = batch_multiple(mesh, rules)
    if batch_size % dp:
        raise ConfigError(f"mesh {dict(mesh.shape)}: --batch-size {batch_size} is not a multiple of the "
                          f"data-parallel size {dp}; pass e.g. --batch-size {dp * -(-batch_size // dp)}")


def param_shardings(config, mesh: Mesh, rules: Mapping[str, object] = DECODE_RULES):
    """NamedSharding tree of ``config``'s params from its family's declaration."""
    return params_lib.shardings(families.declare(config), mesh, rules)


def place_params(params, config, mesh: Mesh | None, rules: Mapping[str, object] = DECODE_RULES):
    """``params`` placed on ``mesh`` by their declared logical axes (unchanged without a mesh)."""
    if mesh is None or params is None:
        return params
    from flax import traverse_util
    shards = traverse_util.flatten_dict(param_shardings(config, mesh, rules))
    flat = traverse_util.flatten_dict(params)
    rep = NamedSharding(mesh, P())
    return traverse_util.unflatten_dict(
        {path: sharding.to_global(x, shards.get(path, rep)) for path, x in flat.items()})


def make_decode_mesh(spec: str | None) -> Mesh | None:
    """``"data=2,tensor=2"`` -> Mesh over the first data*fsdp*tensor devices; None/"" -> None.

    ConfigError when the mesh needs more devices than exist."""
    if not spec:
        return None
    sizes = sharding.parse_mesh_spec(spec)
    if any(v == -1 for v in sizes.values()):
        return sharding.make_mesh(spec)
    need = math.prod(sizes.values())
    have = jax.devices()
    if need > len(have):
        raise ConfigError(sharding.too_few_devices(repr(spec), need, len(have)))
    return sharding.make_mesh(spec, have[:need])
