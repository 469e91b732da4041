"""One declaration per parameter: shape, logical axes, initializer, PyTorch name and layout.

A model family declares its parameters once, as ``declare(config) -> {path: ParamSpec}``
(``path`` is the key tuple of the leaf in our params tree). Initialisation, sharding axes,
abstract params for the planner, conversion to and from PyTorch state dicts and streaming
are all derived from that table.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import zlib
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from dspark_jax.errors import CheckpointError

Path = tuple[str, ...]

QUANT_FORMATS = ("fp8", "fp4")


@dataclasses.dataclass(frozen=True)
class Quant:
    """A quantized companion: the checkpoint stores the tensor in ``fmt`` plus a scale tensor.

    fmt:    ``"fp8"`` (float8 e4m3, one value per element) or ``"fp4"`` (MXFP4: two e2m1 values
            per int8 byte along the last torch dim, low nibble first).
    block:  ``(rows, cols)`` of the torch-layout tensor one scale covers (ue8m0: ``2**(e - 127)``),
            e.g. ``(128, 128)`` for FP8 weights, ``(1, 32)`` for MXFP4 experts.
    scale:  the scale tensor's name is the weight's with ``.weight`` replaced by this suffix.
    """

    fmt: str
    block: tuple[int, int]
    scale: str = ".scale"

    def __post_init__(self):
        if self.fmt not in QUANT_FORMATS:
            raise ValueError(f"unknown quantized format {self.fmt!r}; known {QUANT_FORMATS}")

    def scale_shape(self, torch_shape: tuple[int, ...]) -> tuple[int, ...]:
        """One scale per block (partial blocks at the edges count)."""
        return (*torch_shape[:-2], *(math.ceil(n / b) for n, b in zip(torch_shape[-2:], self.block)))

    def scale_name(self, name: str) -> str:
        base = name[:-len(".weight")] if name.endswith(".weight") else name
        return base + self.scale


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One leaf of a params tree.

    shape:     our layout (kernels ``[in, out]``; stacked leaves have leading stacking axes:
               ``len(layer_ids)`` layers, then ``len(expert_ids)`` experts when given).
    axes:      logical axis names, one per dim (``None`` = replicated), mapped to mesh
               axes by ``sharding`` rules.
    torch:     the PyTorch state-dict name; ``{i}`` marks a stacked leaf holding one torch
               tensor per entry of ``layer_ids``.
    transpose: torch stores the transpose (``nn.Linear.weight`` is ``[out, in]``).
    init:      ``"normal"`` (std ``init_std``), ``"zeros"`` or ``"ones"``.
    layer_ids: the torch layer indices the leading axis stacks, in order (``None``: not stacked).
    expert_ids: the ``{e}`` indices the next axis stacks (MoE experts stored one tensor each,
               ``layers.{i}.ffn.experts.{e}.w1.weight``), or ``None``.
    dtype:     a fixed dtype of this leaf whatever the model's dtype (``"float32"`` for leaves a
               checkpoint keeps in float32, ``"int32"`` for integer tables), or ``None``.
    torch_dtype: the dtype written to a PyTorch checkpoint when it differs from ``dtype``
               (an ``int64`` table held as ``int32``).
    quant:     the quantized companion a checkpoint may store this tensor with (``Quant``).
    bound:     an integer table's values must lie in ``[0, bound)`` (expert ids), checked on load.
    frozen:    never trained (embedding and LM head shared with the target).
    rng_path:  how ``init_params`` derives this leaf's key from the model key: each ``(n, i)``
               is ``key = jax.random.split(key, n)[i]``, outermost first. ``None`` (the
               default for new families): ``jax.random.fold_in(key, crc32("a/b/c"))`` of the
               leaf's path. Set by the Qwen3 declarations to keep their historic init values.
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    torch: str
    transpose: bool = False
    init: str = "normal"
    init_std: float = 0.02
    layer_ids: tuple[int, ...] | None = None
    frozen: bool = False
    rng_path: tuple[tuple[int, int], ...] | None = None
    expert_ids: tuple[int, ...] | None = None
    dtype: str | None = None
    torch_dtype: str | None = None
    quant: Quant | None = None
    bound: int | None = None

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"{self.torch}: shape {self.shape} and axes {self.axes} differ in rank")
        if self.init not in ("normal", "zeros", "ones"):
            raise ValueError(f"{self.torch}: unknown init {self.init!r}")
        if (self.layer_ids is None) != ("{i}" not in self.torch):
            raise ValueError(f"{self.torch}: '{{i}}' in the torch name iff layer_ids is given")
        if (self.expert_ids is None) != ("{e}" not in self.torch):
            raise ValueError(f"{self.torch}: '{{e}}' in the torch name iff expert_ids is given")
        for k, (key, ids) in enumerate(self.stacks):
            if self.shape[k] != len(ids):
                raise ValueError(f"{self.torch}: leading dim {k} is {self.shape[k]}, "
                                 f"expected {len(ids)} ('{{{key}}}' entries)")

    @property
    def stacks(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The stacking indices, outermost first: ``(("i", layer_ids), ("e", expert_ids))``."""
        return tuple((k, ids) for k, ids in (("i", self.layer_ids), ("e", self.expert_ids))
                     if ids is not None)

    @property
    def stacked(self) -> bool:
        return bool(self.stacks)

    @property
    def stack_shape(self) -> tuple[int, ...]:
        return tuple(len(ids) for _, ids in self.stacks)

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """Shape of one PyTorch tensor (one layer's / expert's, for a stacked leaf)."""
        shape = self.shape[len(self.stacks):]
        return tuple(reversed(shape)) if self.transpose else tuple(shape)

    def torch_names(self) -> list[str]:
        """The PyTorch tensor names this leaf holds, in (row-major) stacking order."""
        if not self.stacked:
            return [self.torch]
        keys = [k for k, _ in self.stacks]
        return [self.torch.format(**dict(zip(keys, combo)))
                for combo in itertools.product(*(ids for _, ids in self.stacks))]


Specs = Mapping[Path, ParamSpec]


# --------------------------------------------------------------------------- model families

KINDS = ("target", "draft")


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: how a checkpoint's config.json maps to our config, params and code.

    name:          registry key, e.g. ``"qwen3"`` (target) or ``"qwen3_dspark"`` (drafter).
    kind:          ``"target"`` or ``"draft"``.
    architectures: the HF ``architectures[0]`` values this family reads.
    model_types:   the HF ``model_type`` values it reads when ``architectures`` is absent
                   (``None`` in the tuple: also a config without ``model_type``).
    config_cls:    the config class; ``config_cls.from_hf(dict)`` and ``config.to_hf()``.
    declare:       ``config -> {path: ParamSpec}``, the one declaration of the params tree.
    forward:       dotted name of the module holding the family's forward functions
                   (``family.module()`` imports it).
    tied_head:     ``config -> (head torch name, embedding torch name) | None``: when it
                   returns names, the head is tied (not declared) and a checkpoint may still
                   carry it, equal to the embedding; it is then checked and dropped on load.
    ignored_tensors: torch-name prefixes a checkpoint may carry that this family does not read
                   (e.g. the vision tower of a unified multimodal checkpoint).
    pairs_with:    drafters: the name of the target family whose features they read.
    source_prefixes: ``hf config dict -> ((stored prefix, declared prefix), ...)``: torch-name
                   prefixes a checkpoint layout stores its tensors under instead of the declared
                   ones (e.g. a multimodal wrapper's text model under ``model.language_model.``);
                   reading renames them, writing always uses the declared names.
    source_names:  ``(hf config dict, stored names) -> {declared name: stored name}``, for layouts
                   that rename more than a prefix (DeepSeek-V4: upstream vs transformers names).
    aside_tensors: torch-name prefixes of tensors this family does not read but conversion keeps:
                   copied byte for byte into ``aside.safetensors`` next to the converted model
                   (DeepSeek-V4's in-checkpoint DSpark module, ``mtp.*``).
    runtime:       the ``runtime.TargetRuntime`` / ``runtime.DraftRuntime`` record the decode
                   engine and the trainer call (``families.target_runtime`` / ``draft_runtime``).
    draft_kind:    drafters: the drafter kind (``"dspark"``: anchored blocks, DSpark and DFlash;
                   ``"eagle3"``: a TTT-trained chain), which a training run's ``draft.kind`` picks.
    shared_from_target: drafters: ``target params -> {name: array}``, the target arrays a fresh
                   drafter shares (``families.shared_with_target``); None: the target's
                   ``embed_tokens`` and LM head kernel (``lm_head``).
    complete_config: ``(config, checkpoint directory) -> config``: facts a family reads from the
                   checkpoint's other files (DeepSeek-V4.1: the Engram token map, tokenizer.json).
    """

    name: str
    kind: str
    architectures: tuple[str, ...]
    model_types: tuple[str | None, ...]
    config_cls: type
    declare: Any
    forward: str
    tied_head: Any = None
    ignored_tensors: tuple[str, ...] = ()
    pairs_with: str | None = None
    source_prefixes: Any = None
    source_names: Any = None
    aside_tensors: tuple[str, ...] = ()
    runtime: Any = None
    shared_from_target: Any = None
    draft_kind: str = "dspark"
    complete_config: Any = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"family {self.name}: kind {self.kind!r} is not one of {KINDS}")
        if self.kind == "draft" and not self.pairs_with:
            raise ValueError(f"family {self.name}: a drafter family names the target family it pairs with")

    def config_from_hf(self, hf: Mapping[str, Any], directory=None):
        """The config of ``hf`` (completed from the checkpoint ``directory`` when given)."""
        cfg = self.config_cls.from_hf(hf)
        if directory is not None and self.complete_config is not None:
            cfg = self.complete_config(cfg, directory)
        return cfg

    def tied(self, config) -> tuple[str, str] | None:
        """(head, embedding) torch names when ``config`` ties the LM head, else None."""
        return self.tied_head(config) if self.tied_head is not None else None

    def stored_names(self, hf: Mapping[str, Any], names) -> dict[str, str]:
        """{declared torch name: stored name} of a checkpoint's tensor ``names`` under ``hf``'s layout."""
        if self.source_names is not None:
            return dict(self.source_names(hf, names))
        renames = tuple(self.source_prefixes(hf)) if self.source_prefixes is not None else ()
        out = {}
        for name in names:
            declared = name
            for stored, want in renames:
                if name.startswith(stored):
                    declared = want + name[len(stored):]
                    break
            out[declared] = name
        return out

    def module(self):
        import importlib
        return importlib.import_module(self.forward)


# --------------------------------------------------------------------------- building declarations

def with_prefix(specs: Specs, path_prefix: Path = (), torch_prefix: str = "") -> dict[Path, ParamSpec]:
    """``specs`` nested under ``path_prefix`` with ``torch_prefix`` prepended to every torch name."""
    return {tuple(path_prefix) + path: dataclasses.replace(s, torch=torch_prefix + s.torch)
            for path, s in specs.items()}


def rename_torch(specs: Specs, old_prefix: str, new_prefix: str) -> dict[Path, ParamSpec]:
    """Torch names starting with ``old_prefix`` get ``new_prefix`` instead (checkpoint layout
    variants, e.g. a unified checkpoint holding the text model under ``model.language_model.``)."""
    def fix(name: str) -> str:
        return new_prefix + name[len(old_prefix):] if name.startswith(old_prefix) else name
    return {path: dataclasses.replace(s, torch=fix(s.torch)) for path, s in specs.items()}


# --------------------------------------------------------------------------- derived trees

def _unflatten(flat: Mapping[Path, Any]) -> dict:
    return traverse_util.unflatten_dict(dict(flat))


def _leaf_key(rng: jax.Array, path: Path, spec: ParamSpec) -> jax.Array:
    if spec.rng_path is None:
        return jax.random.fold_in(rng, zlib.crc32("/".join(path).encode()) & 0x7FFFFFFF)
    key = rng
    for n, i in spec.rng_path:
        key = jax.random.split(key, n)[i]
    return key


def init_leaf(spec: ParamSpec, key: jax.Array, dtype) -> jax.Array:
    """One leaf: ``init_std * N(0, 1)`` drawn in float32 then cast, or zeros/ones (a leaf with
    a fixed ``spec.dtype`` keeps it)."""
    dtype = spec.dtype or dtype
    if spec.init == "zeros":
        return jnp.zeros(spec.shape, dtype)
    if spec.init == "ones":
        return jnp.ones(spec.shape, dtype)
    return (spec.init_std * jax.random.normal(key, spec.shape, jnp.float32)).astype(dtype)


def init_params(specs: Specs, rng: jax.Array, dtype=jnp.float32,
                given: Mapping[Path, jax.Array] | None = None) -> dict:
    """Random params tree of ``specs`` (each leaf's key per ``ParamSpec.rng_path``); leaves in
    ``given`` (e.g. a drafter's embedding shared with its target) are taken, cast to ``dtype``,
    instead of drawn."""
    given = dict(given or {})
    unknown = [p for p in given if p not in specs]
    if unknown:
        raise ValueError(f"given leaf {'/'.join(unknown[0])!r} is not declared")
    for path, x in given.items():
        if tuple(x.shape) != tuple(specs[path].shape):
            raise ValueError(f"given leaf {'/'.join(path)!r} has shape {tuple(x.shape)}, "
                             f"declared {tuple(specs[path].shape)}")
    return _unflatten({path: given[path].astype(specs[path].dtype or dtype) if path in given
                       else init_leaf(s, _leaf_key(rng, path, s), dtype) for path, s in specs.items()})


def param_axes(specs: Specs) -> dict:
    """Tree of logical-axis tuples, same structure as ``init_params``."""
    return _unflatten({path: tuple(s.axes) for path, s in specs.items()})


def shapes(specs: Specs) -> dict:
    """Tree of our-layout shapes (tuples)."""
    return _unflatten({path: tuple(s.shape) for path, s in specs.items()})


def abstract_params(specs: Specs, dtype=jnp.float32, shardings=None) -> dict:
    """ShapeDtypeStruct tree (no allocation); ``shardings`` (a tree of the same structure)
    is attached leaf by leaf when given."""
    flat_sh = traverse_util.flatten_dict(shardings) if shardings is not None else {}
    return _unflatten({path: jax.ShapeDtypeStruct(tuple(s.shape), s.dtype or dtype, sharding=flat_sh.get(path))
                       for path, s in specs.items()})


def shardings(specs: Specs, mesh, rules=None) -> dict:
    """NamedSharding tree: logical axes through ``rules``; indivisible dims stay replicated."""
    from jax.sharding import NamedSharding

    from dspark_jax import sharding as sharding_lib
    rules = sharding_lib.DEFAULT_RULES if rules is None else rules
    sharding_lib.check_expert_axis([s.axes for s in specs.values()], mesh)
    return _unflatten({path: NamedSharding(mesh, sharding_lib.logical_to_spec(s.axes, rules, s.shape, mesh))
                       for path, s in specs.items()})


def planned(specs: Specs, mesh, dtype, rules=None) -> tuple[dict, dict]:
    """(abstract params with shardings, shardings): what the planner compiles against."""
    sh = shardings(specs, mesh, rules)
    return abstract_params(specs, dtype, sh), sh


def per_layer(tree: Mapping, stacks: tuple[str, ...] = ("layers",)) -> bool:
    """Whether the layer stacks ``tree[k]`` (k in ``stacks``; absent ones ignored) are tuples of
    per-layer trees (``unstack_layers``), not stacked ([L, ...] leaves)."""
    return any(isinstance(tree.get(k), (list, tuple)) for k in stacks)


def unstack_layers(tree: Mapping, stacks: tuple[str, ...] = ("layers",)) -> dict:
    """``tree`` with each stacked subtree ``tree[k]`` (k in ``stacks`` and present; [L, ...] leaves)
    split into a tuple of L per-layer trees (arrays: ``a[i]``; ``jax.ShapeDtypeStruct``: the shape
    and sharding less the leading layer axis), for a forward that loops over separate per-layer
    buffers."""
    def one(a, i):
        if not isinstance(a, jax.ShapeDtypeStruct):
            return a[i]
        sharding = getattr(a, "sharding", None)
        if sharding is not None:
            sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
        return jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=sharding)

    def split(layers):
        n = jax.tree.leaves(layers)[0].shape[0]
        return tuple(jax.tree.map(lambda a: one(a, i), layers) for i in range(n))

    return {**tree, **{k: split(tree[k]) for k in stacks if k in tree}}


# --------------------------------------------------------------------------- frozen / trainable

def frozen_paths(specs: Specs) -> tuple[Path, ...]:
    return tuple(path for path, s in specs.items() if s.frozen)


def split_frozen(specs: Specs, tree: Mapping) -> tuple[dict, dict]:
    """(trainable, frozen) subtrees of a params-shaped ``tree`` (params, axes, shapes...)."""
    flat = traverse_util.flatten_dict(dict(tree), is_leaf=lambda _, x: not isinstance(x, Mapping))
    frozen = set(frozen_paths(specs))
    return (_unflatten({p: v for p, v in flat.items() if p not in frozen}),
            _unflatten({p: v for p, v in flat.items() if p in frozen}))


# --------------------------------------------------------------------------- PyTorch state dicts

def torch_shapes(specs: Specs) -> dict[str, tuple[int, ...]]:
    """Every PyTorch tensor name -> its torch-layout shape (for ``mapping.check_tensors``)."""
    return {name: s.torch_shape for s in specs.values() for name in s.torch_names()}


def fixed_dtypes(specs: Specs) -> dict[str, str]:
    """Torch name -> the fixed dtype of every tensor whose leaf keeps one (``ParamSpec.dtype``)."""
    return {name: s.dtype for s in specs.values() if s.dtype for name in s.torch_names()}


def fixed_paths(specs: Specs) -> dict[str, str]:
    """``"a/b"`` leaf path -> fixed dtype, for the leaves that keep one."""
    return {"/".join(path): s.dtype for path, s in specs.items() if s.dtype}


def quantized(specs: Specs) -> dict[str, Quant]:
    """Torch name -> the quantized format a checkpoint may store it in (``ParamSpec.quant``)."""
    return {name: s.quant for s in specs.values() if s.quant for name in s.torch_names()}


def torch_sources(specs: Specs) -> dict[Path, tuple[str, bool]]:
    """our path -> (torch name with ``{i}`` for stacked leaves, transpose?)."""
    return {path: (s.torch, s.transpose) for path, s in specs.items()}


def _fix(a: np.ndarray, transpose: bool) -> np.ndarray:
    return a.T if transpose else a


def _as_dtype(a: np.ndarray, dtype: str | None, name: str) -> np.ndarray:
    """``a`` as a leaf's fixed dtype; an integer table must survive the cast unchanged."""
    if dtype is None or a.dtype == np.dtype(dtype):
        return a
    out = a.astype(dtype)
    if np.issubdtype(out.dtype, np.integer) and not np.array_equal(out, a):
        raise CheckpointError(f"tensor {name!r}: values do not fit {dtype}")
    return out


def from_torch(specs: Specs, tensors: Mapping[str, np.ndarray]) -> dict:
    """Torch-named numpy tensors -> our params tree (numpy leaves, same dtypes, same bits;
    a leaf with a fixed ``dtype`` takes it)."""
    flat = {}
    for path, s in specs.items():
        if s.stacked:
            leaf = np.stack([_fix(np.asarray(tensors[n]), s.transpose) for n in s.torch_names()])
            leaf = leaf.reshape(s.shape)
        else:
            leaf = np.ascontiguousarray(_fix(np.asarray(tensors[s.torch]), s.transpose))
        flat[path] = check_bound(s, _as_dtype(leaf, s.dtype, s.torch))
    return _unflatten(flat)


def check_bound(spec: ParamSpec, a: np.ndarray) -> np.ndarray:
    """``a`` (some or all of ``spec``'s values); CheckpointError when ``spec.bound`` is set and a
    value lies outside ``[0, bound)``."""
    if spec.bound is not None and a.size and not (0 <= a.min() and a.max() < spec.bound):
        raise CheckpointError(f"tensor {spec.torch!r}: values must lie in [0, {spec.bound}), "
                              f"found {a.min()}..{a.max()}")
    return a


def iter_torch(specs: Specs, params: Mapping, to_host=np.asarray):
    """Yield (torch name, numpy tensor in torch layout) in declaration order; ``to_host`` turns
    one leaf into a numpy array (streaming export gathers sharded leaves with it)."""
    flat = traverse_util.flatten_dict(dict(params), is_leaf=lambda _, x: not isinstance(x, Mapping))
    for path, s in specs.items():
        if path not in flat:
            raise CheckpointError(f"params: missing param {'/'.join(path)!r}")
        leaf = to_host(flat[path])
        if s.torch_dtype is not None:
            leaf = np.asarray(leaf).astype(s.torch_dtype)
        if s.stacked:
            rows = np.asarray(leaf).reshape(-1, *leaf.shape[len(s.stacks):]) if len(s.stacks) > 1 else leaf
            for k, name in enumerate(s.torch_names()):
                yield name, np.ascontiguousarray(_fix(rows[k], s.transpose))
        else:
            yield s.torch, np.ascontiguousarray(_fix(leaf, s.transpose))


def to_torch(specs: Specs, params: Mapping) -> dict[str, np.ndarray]:
    """Our params tree -> torch-named numpy tensors in torch layout (same dtypes, same bits)."""
    return dict(iter_torch(specs, params))


PER_LAYER_PLATFORMS = ("gpu", "cuda", "rocm")


def for_platform(tree: Mapping, platform: str, stacks: tuple[str, ...] = ("layers",)) -> dict:
    """``tree`` as the programs of ``platform`` read it best: on GPUs its layer ``stacks`` (the
    family's ``runtime.stacks``: ``"layers"``, Gemma4's ``"sliding"`` / ``"full"``) as per-layer
    buffers (``unstack_layers``), elsewhere unchanged. XLA:GPU hands cuBLAS a copy of
    each layer's slice of a stacked kernel (its dynamic-slice fusion, which would pass the slice
    in place, fails to compile in jax 0.10.2): every decode step would move the weights twice.
    TPUs fuse the slice into the dot, and a ``lax.scan`` over the stack compiles faster."""
    if platform not in PER_LAYER_PLATFORMS or not any(k in tree for k in stacks) or per_layer(tree, stacks):
        return dict(tree)
    return unstack_layers(tree, stacks)
