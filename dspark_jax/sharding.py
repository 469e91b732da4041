"""Mesh construction and the logical-axis -> mesh-axis rules table.

Params carry logical axis names (declared once per leaf, ``params.ParamSpec.axes``;
``params.param_axes`` mirrors the params tree). One rules table maps them onto a Mesh with axes
``("data", "fsdp", "tensor")``: weights are sharded over ``fsdp`` (ZeRO-3
style) and ``tensor`` (Megatron style); activations' batch over
``("data", "fsdp")``. A mixture-of-experts family (DeepSeek-V4) may add an ``expert`` axis
(``--mesh expert=8``; mesh axes then ``("data", "fsdp", "expert", "tensor")``): the logical
``expert`` axis of its routed-expert weights shards over it (expert parallelism), everything else
is replicated along it. A family without experts refuses a mesh whose ``expert`` axis is > 1.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dspark_jax.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")
EXPERT = "expert"
EXPERT_MESH_AXES = ("data", "fsdp", EXPERT, "tensor")  # a mesh that names the expert axis

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated)
DEFAULT_RULES: dict[str, object] = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    # the drafter's context projection's input (n concatenated target layers' features): sharded
    # like a row-parallel kernel, so a decode round on a tensor mesh reads 1/tensor of ``fc`` per
    # chip (replicated, it was 0.17 GB of a Qwen3-8B round on every v5e chip) and sums [B, T, H]
    "features": "tensor",
    "rank": None,
    "layers": None,
    "expert": EXPERT,  # only on meshes with an expert axis (dropped elsewhere, see logical_to_spec)
}


def platform_of(mesh: Mesh | None) -> str:
    """The platform a program over ``mesh`` is compiled for: its devices' (compile-only TPU / GPU
    devices included); without a mesh, JAX's default backend."""
    return jax.default_backend() if mesh is None else mesh.devices.flat[0].platform


def parse_mesh_spec(spec: str | Mapping[str, int] | None) -> dict[str, int]:
    """``"data=2,fsdp=2,tensor=1"`` -> {"data": 2, "fsdp": 2, "tensor": 1}; -1 = the rest.
    ``expert`` is in the result only when the spec names it."""
    if spec is None or spec == "":
        sizes: dict[str, int] = {}
    elif isinstance(spec, str):
        sizes = {}
        for part in spec.split(","):
            if "=" not in part:
                raise ConfigError(f"mesh spec part {part!r} is not of the form axis=size")
            name, value = part.split("=", 1)
            try:
                sizes[name.strip()] = int(value)
            except ValueError:
                raise ConfigError(f"mesh spec part {part!r}: size is not an integer") from None
    else:
        sizes = dict(spec)
    unknown = set(sizes) - set(EXPERT_MESH_AXES)
    if unknown:
        raise ConfigError(f"unknown mesh axes {sorted(unknown)}; expected {EXPERT_MESH_AXES}")
    return {a: sizes.get(a, 1) for a in (EXPERT_MESH_AXES if EXPERT in sizes else MESH_AXES)}


def make_mesh(spec: str | Mapping[str, int] | None = None, devices: Sequence | None = None) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh over ``devices`` (default: all); ("data", "fsdp",
    "expert", "tensor") when the spec names ``expert``.

    Missing axes are 1; one axis may be -1 to take the remaining devices.
    With no spec, all devices go to ``data``.
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = parse_mesh_spec(spec)
    if spec is None or spec == "":
        sizes["data"] = -1
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ConfigError("at most one mesh axis may be -1")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if len(devices) % fixed:
            raise ConfigError(f"{len(devices)} devices do not divide into fixed mesh axes of size {fixed}")
        sizes[free[0]] = len(devices) // fixed
    total = math.prod(sizes.values())
    if total != len(devices):
        raise ConfigError(too_few_devices(sizes, total, len(devices)))
    axes = tuple(sizes)
    arr = np.asarray(devices, dtype=object).reshape([sizes[a] for a in axes])
    return Mesh(arr, axes)


def too_few_devices(mesh, need: int, have: int) -> str:
    """The message for a mesh that needs more devices than exist, with the CPU fix."""
    return (f"mesh {mesh} needs {need} devices but {have} are available; on a CPU, simulate them "
            f"with XLA_FLAGS=--xla_force_host_platform_device_count={need} (set before the command "
            "starts), or run several processes with launch/local.py")


def logical_to_spec(axes: Sequence[str | None], rules: Mapping[str, object] = DEFAULT_RULES,
                    shape: Sequence[int] | None = None, mesh: Mesh | None = None) -> P:
    """PartitionSpec for logical ``axes``; an axis is left replicated where its size does
    not divide (when shape/mesh given).

    A mesh axis that two logical axes of ``axes`` map to is a ConfigError naming them (a
    PartitionSpec may use each mesh axis once; silently replicating one would hide a bad
    rules table or declaration). With ``mesh`` given, rules naming a mesh axis it lacks (``expert``
    on a mesh without one) replicate.
    """
    if mesh is not None and EXPERT not in mesh.axis_names:
        rules = {k: _without(v, EXPERT) for k, v in rules.items()}
    owner: dict[str, str] = {}
    for name in axes:
        target = rules.get(name) if name is not None else None
        for mesh_axis in (target,) if isinstance(target, str) else tuple(target or ()):
            if mesh_axis in owner:
                raise ConfigError(f"logical axes {owner[mesh_axis]!r} and {name!r} of {tuple(axes)} "
                                  f"both map to mesh axis {mesh_axis!r}; a mesh axis may shard one "
                                  "dimension only (fix the rules or the declared axes)")
            owner[mesh_axis] = name
    spec = []
    for i, name in enumerate(axes):
        target = rules.get(name) if name is not None else None
        names = (target,) if isinstance(target, str) else tuple(target or ())
        if names and shape is not None and mesh is not None:
            size = math.prod(mesh.shape[n] for n in names)
            if shape[i] % size:
                names = ()
        spec.append(None if not names else names[0] if len(names) == 1 else names)
    return P(*spec)


def _without(target, axis: str):
    names = (target,) if isinstance(target, str) else tuple(target or ())
    kept = tuple(n for n in names if n != axis)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def check_expert_axis(axes: Sequence[Sequence[str | None]], mesh: Mesh) -> None:
    """ConfigError when ``mesh`` has an ``expert`` axis > 1 but no declared logical axis is
    ``expert`` (a family without routed experts, e.g. Qwen3 or Gemma4)."""
    if mesh.shape.get(EXPERT, 1) > 1 and not any(EXPERT in a for a in axes):
        raise ConfigError(f"mesh axis 'expert'={mesh.shape[EXPERT]} needs a mixture-of-experts model; this "
                          "model has no routed experts (use data / fsdp / tensor)")


def is_axes_leaf(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def param_shardings(axes_tree, mesh: Mesh, shapes_tree=None, rules: Mapping[str, object] = DEFAULT_RULES):
    """NamedSharding tree for a params tree whose logical axes are ``axes_tree``.

    ``shapes_tree`` (params or ``jax.eval_shape`` of them) lets indivisible axes
    fall back to replication.
    """
    if shapes_tree is None:
        return jax.tree.map(lambda ax: NamedSharding(mesh, logical_to_spec(ax, rules)),
                            axes_tree, is_leaf=is_axes_leaf)
    return jax.tree.map(
        lambda ax, x: NamedSharding(mesh, logical_to_spec(ax, rules, x.shape, mesh)),
        axes_tree, shapes_tree, is_leaf=is_axes_leaf)


def batch_sharding(mesh: Mesh, ndim: int, rules: Mapping[str, object] = DEFAULT_RULES) -> NamedSharding:
    """Shard dim 0 of an activation/batch array over the batch mesh axes."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def to_global(tree, shardings):
    """Host values (numpy, jax or python scalars; the same on every process) -> global jax.Arrays.

    ``shardings``: one Sharding for every leaf, or a tree (a prefix of ``tree``: a Sharding stands
    for its whole subtree). A fully addressable sharding (one process) is a plain
    ``jax.device_put``; otherwise each process builds its own shards with
    ``jax.make_array_from_callback`` (``device_put`` cannot place onto other processes' devices).
    """
    def one(x, sh):
        if sh.is_fully_addressable:
            return jax.device_put(x, sh)
        x = np.asarray(jax.device_get(x))
        return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])

    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: one(x, shardings), tree)
    return jax.tree.map(lambda sh, sub: jax.tree.map(lambda x: one(x, sh), sub), shardings, tree)


def to_host(tree):
    """Host numpy copy of a tree of (possibly multi-process) arrays, every leaf in full.

    ``jax.device_get`` when this process holds every leaf (one process, or replicated leaves);
    otherwise ``multihost_utils.process_allgather``, a collective: every process must call it at
    the same point with the same tree (the decode host loops do: they decide from gathered values).
    """
    leaves = jax.tree.leaves(tree)
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated
           for x in leaves):
        return jax.device_get(tree)
    from jax.experimental import multihost_utils
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def shard_params(params, axes_tree, mesh: Mesh, rules: Mapping[str, object] = DEFAULT_RULES):
    """Place a params tree on ``mesh`` according to its logical axes."""
    shardings = param_shardings(axes_tree, mesh, params, rules)
    return jax.tree.map(jax.device_put, params, shardings)
