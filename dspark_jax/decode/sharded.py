"""Logical axes of the decode state and its placement on a mesh (the params' scheme, for caches).

Every decode-state leaf declares logical axes, like ``params.ParamSpec.axes``:

==========================  =========================================================
leaf                        logical axes
==========================  =========================================================
seq [B, L]                  ("batch", "sequence")
pos/num_input/active/...    ("batch",)
acc/prop/drafts rec [B, R]  ("batch", None); conf_rec [B, R, G] ("batch", None, None)
target cache k, v           ("layers", "batch", "sequence", "kv_heads", "head_dim") (Gemma4: each
                            layer-type group of the k/v dicts)
draft context cache k, v    ("layers", "batch", "sequence", "kv_heads", "head_dim")
cache lengths [B]           ("batch",)
key, round, policy state    replicated
==========================  =========================================================

``DECODE_RULES`` extends ``sharding.DEFAULT_RULES``: requests (batch) over ``data``/``fsdp``,
KV heads over ``tensor``, sequence and head_dim unsharded. Params use their declared axes
(``families.declare``), so tensor parallelism splits heads and MLP of target and drafter alike.
``check_mesh`` refuses a mesh that does not divide heads / MLP / the batch, before compiling
(Gemma4's KV heads excepted: an indivisible KV-head dim stays replicated). ``state_sharding_tree``
derives the full tree from the actual state pytree, so Qwen3 and Gemma4 caches both fit.

Multi-process (``jax.distributed``, a mesh over several processes' devices): every host->device
and device->host transfer of the decode loop and engine goes through ``sharding.to_global`` /
``sharding.to_host`` (one device_put / device_get on a single process), and every process runs
the same host control flow from the same gathered values, so the collectives stay in lockstep.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dspark_jax import families, params as params_lib, sharding
from dspark_jax.errors import ConfigError

DECODE_RULES: dict[str, object] = {**sharding.DEFAULT_RULES, "sequence": None, "head_dim": None}

KV_AXES = ("layers", "batch", "sequence", "kv_heads", "head_dim")
ROW = ("batch",)

# DecodeState / ARState field -> logical axes (None: replicated, the whole subtree).
STATE_AXES: dict[str, Any] = {
    "seq": ("batch", "sequence"), "pos": ROW, "num_input": ROW, "max_new": ROW, "active": ROW,
    "key": None, "round": None, "rounds": ROW, "acc_rec": ("batch", None),
    "prop_rec": ("batch", None), "drafts_rec": ("batch", None),
    "conf_rec": ("batch", None, None), "policy_state": None,
}
CACHE_AXES = {"k": KV_AXES, "v": KV_AXES, "lengths": ROW}


def _named(mesh: Mesh, axes, rules) -> NamedSharding:
    return NamedSharding(mesh, P() if axes is None else sharding.logical_to_spec(axes, rules))


def state_shardings(state_cls, mesh: Mesh, rules: Mapping[str, object] = DECODE_RULES,
                    with_ctx: bool = True):
    """A ``state_cls`` (DecodeState / ARState) whose leaves are NamedShardings (a pytree prefix
    of the state: the policy state subtree is one replicated sharding)."""
    from dspark_jax.draft.decode import ContextCache
    fields = {}
    for name in state_cls.__dataclass_fields__:
        if name == "cache":
            cache_cls = _cache_cls()
            fields[name] = cache_cls(**{k: _named(mesh, a, rules) for k, a in CACHE_AXES.items()})
        elif name == "ctx":
            fields[name] = (ContextCache(_named(mesh, KV_AXES, rules), _named(mesh, KV_AXES, rules))
                            if with_ctx else None)
        else:
            fields[name] = _named(mesh, STATE_AXES[name], rules)
    return state_cls(**fields)


def state_sharding_tree(state, mesh: Mesh, rules: Mapping[str, object] = DECODE_RULES):
    """Full NamedSharding tree of ``state`` (arrays or ShapeDtypeStructs) from its leaves' shapes.

    Works off the actual cache pytree (Qwen3 KVCache, or Gemma4Cache whose k/v are dicts of
    per-layer-type groups): every k/v leaf takes ``KV_AXES``, ``lengths`` ``ROW``, other fields
    ``STATE_AXES``. A dim its mesh axes do not divide stays replicated (e.g. Gemma4's full-attention
    group with 1 KV head under tensor=2)."""
    def leaf(path, x):
        name = path[0].name
        if name in ("cache", "ctx"):
            axes = ROW if path[1].name == "lengths" else KV_AXES
        else:
            axes = STATE_AXES[name]
        if axes is None:
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, sharding.logical_to_spec(axes, rules, x.shape, mesh))
    return jax.tree_util.tree_map_with_path(leaf, state)


def _cache_cls():
    from dspark_jax.target import qwen3
    return qwen3.KVCache


def batch_multiple(mesh: Mesh | None, rules: Mapping[str, object] = DECODE_RULES) -> int:
    """Number of shards of the batch (rows per step must be a multiple of it)."""
    if mesh is None:
        return 1
    target = rules.get("batch")
    names = (target,) if isinstance(target, str) else tuple(target or ())
    return math.prod(mesh.shape[n] for n in names)


def check_mesh(mesh: Mesh | None, target_cfg, draft_cfg, batch_size: int,
               rules: Mapping[str, object] = DECODE_RULES) -> None:
    """ConfigError unless ``mesh`` splits heads, KV heads, MLP of both models and the batch."""
    if mesh is None:
        return
    t = rules.get("heads")
    tnames = (t,) if isinstance(t, str) else tuple(t or ())
    tp = math.prod(mesh.shape[n] for n in tnames)
    for cfg, who in ((target_cfg, "target"), (draft_cfg, "drafter")):
        if cfg is None:
            continue
        gemma4 = families.for_config(cfg).name.startswith("gemma4")
        for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            if field == "num_key_value_heads" and gemma4:
                # Gemma4 (1 KV head in full layers / the drafter): an indivisible KV-head dim
                # stays replicated, in params (params.shardings) and cache (state_sharding_tree).
                continue
            size = getattr(cfg, field, None)
            if size is not None and size % tp:
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


def expand(prefix, shapes):
    """The full sharding tree of ``shapes`` from a sharding pytree ``prefix`` of it."""
    return jax.tree.map(lambda sh, sub: jax.tree.map(lambda _: sh, sub), prefix, shapes)
