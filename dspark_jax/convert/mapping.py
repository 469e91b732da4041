"""PyTorch (Hugging Face) state dicts <-> our params pytrees, for any registered family.

Names, shapes and layouts all come from the family's declaration (``params.ParamSpec``):
PyTorch ``nn.Linear.weight`` is [out, in], our kernels [in, out]; per-layer tensors
``layers.{i}.*`` stack along a leading layer axis. Everything here works on numpy arrays
and never changes values or dtypes (round trips are bit-exact).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from dspark_jax import families
from dspark_jax import params as params_lib
from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.errors import CheckpointError  # noqa: F401  (re-exported)


def tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``config``'s PyTorch checkpoint with its torch shape (from the declaration)."""
    return params_lib.torch_shapes(families.declare(config))


def draft_tensor_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a ``Qwen3DSparkModel`` checkpoint with its torch shape (SPEC section 11)."""
    return tensor_shapes(cfg)


def target_tensor_shapes(cfg: TargetConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a ``Qwen3ForCausalLM`` checkpoint with its torch shape."""
    return tensor_shapes(cfg)


def check_tensors(tensors: Mapping[str, np.ndarray], expected: Mapping[str, tuple[int, ...]],
                  what: str, *, allow_extra: tuple[str, ...] = (), fixed: Mapping[str, str] = {}) -> None:
    """Raise CheckpointError naming the first missing, unexpected or mis-shaped tensor. ``fixed``
    (torch name -> dtype, ``params.fixed_dtypes``): tensors kept in their own dtype (float32 mHC
    weights, integer tables), left out of the one-float-dtype rule; integer ones must be integers."""
    missing = [k for k in expected if k not in tensors]
    if missing:
        raise CheckpointError(f"{what}: missing tensor {missing[0]!r}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = [k for k in tensors if k not in expected and not k.startswith(allow_extra or ("\0",))]
    if extra:
        raise CheckpointError(f"{what}: unexpected tensor {extra[0]!r}"
                              + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                              + " for this config")
    for k, shape in expected.items():
        if tuple(tensors[k].shape) != tuple(shape):
            raise CheckpointError(f"{what}: tensor {k!r} has shape {tuple(tensors[k].shape)}, "
                                  f"expected {tuple(shape)}")
    for k, dtype in fixed.items():
        is_int = np.issubdtype(np.dtype(tensors[k].dtype), np.integer)
        if np.issubdtype(np.dtype(dtype), np.integer) != is_int:
            raise CheckpointError(f"{what}: tensor {k!r} has dtype {np.dtype(tensors[k].dtype).name}, "
                                  f"expected {'an integer' if not is_int else 'a float'} dtype")
    tensors = {k: t for k, t in tensors.items() if k not in fixed}
    dtypes = {np.dtype(t.dtype) for t in tensors.values()}
    if len(dtypes) > 1:
        by_dtype = {}
        for k, t in tensors.items():
            by_dtype.setdefault(np.dtype(t.dtype).name, k)
        raise CheckpointError(f"{what}: tensors have mixed dtypes {sorted(by_dtype)}; e.g. "
                              + ", ".join(f"{k!r} is {d}" for d, k in sorted(by_dtype.items())))
    for k, t in tensors.items():
        if not np.issubdtype(np.dtype(t.dtype), np.floating) and np.dtype(t.dtype).name != "bfloat16":
            raise CheckpointError(f"{what}: tensor {k!r} has dtype {t.dtype}, expected a float dtype")


def param_sources(config) -> dict[tuple[str, ...], tuple[str, bool]]:
    """Where every leaf of our params tree lives in the PyTorch state dict.

    our path -> (torch name, transpose?). A name containing ``{i}`` marks a
    stacked leaf [L, ...] holding one torch tensor per layer.
    """
    return params_lib.torch_sources(families.declare(config))


def _what(config, suffix: str) -> str:
    return f"{'drafter' if families.for_config(config).kind == 'draft' else 'target'} {suffix}"


def checkpoint_tensors(config, tensors: Mapping[str, Any], what: str) -> dict[str, Any]:
    """``tensors`` (arrays, or anything with shape/dtype for header-only checks) as the
    declaration expects them: the family's ignored tensors and an explicitly written tied
    head dropped (the head checked equal to the embedding when it holds data)."""
    family = families.for_config(config)
    tensors = {k: v for k, v in tensors.items()
               if not (family.ignored_tensors and k.startswith(family.ignored_tensors))}
    tied = family.tied(config)
    if tied is not None and tied[0] in tensors:
        head, embed = tied
        # Some exports write the tied head explicitly; it must equal the embedding.
        if (isinstance(tensors[head], np.ndarray) and embed in tensors
                and not np.array_equal(tensors[head], tensors[embed])):
            raise CheckpointError(f"{what}: tie_word_embeddings=true but {head!r} differs from {embed!r}")
        del tensors[head]
    return tensors


def from_torch(config, tensors: Mapping[str, np.ndarray], what: str | None = None) -> dict:
    """Torch-named tensors of ``config``'s checkpoint -> our params tree (numpy leaves)."""
    what = what or _what(config, "checkpoint")
    specs = families.declare(config)
    tensors = checkpoint_tensors(config, tensors, what)
    check_tensors(tensors, params_lib.torch_shapes(specs), what, fixed=params_lib.fixed_dtypes(specs))
    return params_lib.from_torch(specs, tensors)


def to_torch(config, params: Mapping, what: str | None = None) -> dict[str, np.ndarray]:
    """Our params tree -> torch-named tensors (numpy, torch layout)."""
    specs = families.declare(config)
    out = params_lib.to_torch(specs, params)
    check_tensors(out, params_lib.torch_shapes(specs), what or _what(config, "params"),
                  fixed=params_lib.fixed_dtypes(specs))
    return out


def draft_from_torch(cfg: DraftConfig, tensors: Mapping[str, np.ndarray]) -> dict:
    """Torch-named tensors of a DSpark checkpoint -> our params tree (numpy leaves)."""
    return from_torch(cfg, tensors)


def draft_to_torch(cfg: DraftConfig, params: Mapping) -> dict[str, np.ndarray]:
    """Our params tree -> torch-named tensors (numpy, torch layout)."""
    return to_torch(cfg, params)


def target_from_torch(cfg: TargetConfig, tensors: Mapping[str, np.ndarray]) -> dict:
    """Torch-named tensors of a Qwen3ForCausalLM checkpoint -> our params tree."""
    return from_torch(cfg, tensors)


def target_to_torch(cfg: TargetConfig, params: Mapping) -> dict[str, np.ndarray]:
    """Our params tree -> torch-named tensors of a Qwen3ForCausalLM checkpoint."""
    return to_torch(cfg, params)
