"""Registry of model families: a checkpoint's ``architectures`` / ``model_type`` -> its Family.

A family (``params.Family``: config class, parameter declaration, forward module, tied-head
rule, runtime record) is declared next to its model code as ``FAMILY = params.Family(...)`` and
registered here by one line in ``_BUILTIN``. Everything that needs to tell models apart
(conversion, streaming, checkpoint validation, the planner, decoding, training) asks this
registry instead of testing ``isinstance(config, ...)`` or ``kind`` strings; decoding and
training call only the family's runtime record (``target_runtime`` / ``draft_ops``; the
protocol is ``dspark_jax.runtime``).

Adding a family::

    # dspark_jax/target/gemma4/__init__.py
    FAMILY = params.Family(name="gemma4", kind="target",
                           architectures=("Gemma4ForCausalLM", "Gemma4UnifiedForCausalLM"),
                           model_types=("gemma4_text", "gemma4_unified_text"),
                           config_cls=Gemma4Config, declare=declare, forward=__name__,
                           tied_head=_tied_head, ignored_tensors=("model.vision_tower.",),
                           runtime=runtime.TargetRuntime(init_cache=init_cache,
                                                         forward=forward_pure, logits=...,
                                                         feature_dim=...))
    # dspark_jax/families.py, _BUILTIN:
    gemma4.FAMILY,
"""

from __future__ import annotations

from typing import Any, Mapping

from dspark_jax import params as params_lib
from dspark_jax.draft import deepseek_v4 as draft_deepseek_v4
from dspark_jax.draft import deepseek_v4_mtp as draft_deepseek_v4_mtp
from dspark_jax.draft import eagle3 as draft_eagle3
from dspark_jax.draft import deepseek_v41 as draft_deepseek_v41
from dspark_jax.draft import gemma4 as draft_gemma4
from dspark_jax.draft import model as draft_model
from dspark_jax.errors import CheckpointError, ConfigError
from dspark_jax.params import Family
from dspark_jax.target import deepseek_v4, deepseek_v41, gemma4, qwen3

_BUILTIN: tuple[Family, ...] = (
    qwen3.FAMILY,
    draft_model.FAMILY,
    gemma4.FAMILY,
    draft_gemma4.FAMILY,
    deepseek_v4.FAMILY,
    draft_deepseek_v4.FAMILY,  # V4's in-checkpoint DSpark module (mtp.*)
    draft_deepseek_v4_mtp.FAMILY,  # V4's in-checkpoint MTP-1 module (mtp.0.*), a chain drafter
    draft_eagle3.QWEN3_FAMILY,  # Eagle3 (DeepSpec's format), a chain drafter
    draft_eagle3.GEMMA4_FAMILY,
    deepseek_v41.FAMILY,
    draft_deepseek_v41.FAMILY,  # V4.1's in-checkpoint DSpark module (mtp.*, attention-input taps)
)

FAMILIES: dict[str, Family] = {}


class UnknownArchitectureError(ConfigError, CheckpointError):
    """A config.json names an architecture no registered family reads."""


def register(family: Family) -> Family:
    """Add ``family``; its name and architectures must be new."""
    if family.name in FAMILIES:
        raise ValueError(f"model family {family.name!r} is already registered")
    taken = {a: f.name for f in FAMILIES.values() for a in f.architectures}
    clash = [a for a in family.architectures if a in taken]
    if clash:
        raise ValueError(f"architecture {clash[0]!r} of family {family.name!r} is already read by "
                         f"family {taken[clash[0]]!r}")
    FAMILIES[family.name] = family
    return family


for _family in _BUILTIN:
    register(_family)


def known_architectures(kind: str | None = None) -> list[str]:
    return [a for f in FAMILIES.values() if kind in (None, f.kind) for a in f.architectures]


def _known() -> str:
    return (f"known: targets {known_architectures('target')}, "
            f"drafters {known_architectures('draft')}")


def by_name(name: str) -> Family:
    if name not in FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name]


def for_hf(hf: Mapping[str, Any], where: str = "config.json") -> Family:
    """The family of a Hugging Face config dict: ``architectures[0]``, else ``model_type``
    (a config with ``target_layer_ids`` is a drafter). UnknownArchitectureError (both a
    ConfigError and a CheckpointError) lists the known architectures."""
    arch = hf.get("architectures") or []
    if not isinstance(arch, list):
        raise ConfigError(f"{where}: field 'architectures' must be a list, got {arch!r}")
    if arch:
        for family in FAMILIES.values():
            if arch[0] in family.architectures:
                return family
        raise UnknownArchitectureError(f"{where}: unknown architecture {arch[0]!r} in field "
                                       f"'architectures'; {_known()}")
    kind = "draft" if "target_layer_ids" in hf else "target"
    model_type = hf.get("model_type")
    for family in FAMILIES.values():
        if family.kind == kind and model_type in family.model_types:
            return family
    raise UnknownArchitectureError(f"{where}: no field 'architectures' and unknown {kind} model_type "
                                   f"{model_type!r}; {_known()}")


def for_config(config) -> Family:
    """The family whose config class ``config`` is (the most derived registered class wins)."""
    for cls in type(config).__mro__:
        found = [f for f in FAMILIES.values() if f.config_cls is cls]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            name = getattr(config, "family", None)
            for f in found:
                if f.name == name:
                    return f
            raise ConfigError(f"{type(config).__name__} is the config of families "
                              f"{[f.name for f in found]}; set its 'family' field")
    raise ConfigError(f"{type(config).__name__} is not the config class of a registered model "
                      f"family; known: {sorted(FAMILIES)}")


def declare(config) -> dict:
    """``{path: ParamSpec}`` of ``config``'s model."""
    return for_config(config).declare(config)


def abstract_params(config, mesh, dtype, rules=None) -> tuple[Any, Any]:
    """(abstract params with shardings, shardings) for any registered config (the planner's
    derived from the declaration)."""
    return params_lib.planned(declare(config), mesh, dtype, rules)


def check_pair(draft_config, target_config) -> None:
    """ConfigError unless the drafter's family reads the target's family (e.g. a Gemma4
    drafter on a Qwen3 target), before anything compiles."""
    d, t = for_config(draft_config), for_config(target_config)
    if d.kind != "draft" or t.kind != "target":
        raise ConfigError(f"expected a drafter and a target, got a {d.kind} ({d.name}) and a "
                          f"{t.kind} ({t.name})")
    if d.pairs_with != t.name:
        raise ConfigError(f"drafter family {d.name!r} reads {d.pairs_with!r} targets, not "
                          f"{t.name!r} ({t.architectures[0]})")


def drafter_family(target_config, kind: str = "dspark") -> Family:
    """The drafter family of ``kind`` (``Family.draft_kind``) that reads ``target_config``'s
    family (e.g. gemma4 -> gemma4_dspark; gemma4, "eagle3" -> gemma4_eagle3)."""
    t = for_config(target_config)
    found = [f for f in FAMILIES.values() if f.kind == "draft" and f.pairs_with == t.name
             and f.draft_kind == kind]
    if not found:
        kinds = sorted({f.draft_kind for f in FAMILIES.values() if f.kind == "draft" and f.pairs_with == t.name})
        raise ConfigError(f"no registered {kind!r} drafter family reads {t.name!r} targets (kinds: {kinds})")
    return found[0]


def runtime_of(config):
    """The runtime record (``runtime.TargetRuntime`` / ``runtime.DraftRuntime``) of ``config``'s
    family; ConfigError when the family registered none."""
    family = for_config(config)
    if family.runtime is None:
        raise ConfigError(f"model family {family.name!r} has no runtime (decode/train) functions")
    return family.runtime


def target_runtime(target_config):
    """The ``runtime.TargetRuntime`` of a target config (ConfigError for a drafter's)."""
    if for_config(target_config).kind != "target":
        raise ConfigError(f"{type(target_config).__name__} is not a target model config")
    return runtime_of(target_config)


def draft_ops(draft_config):
    """The drafter's ``runtime.DraftRuntime`` (its backbone functions: ``draft.model``'s ``ops``)."""
    if for_config(draft_config).kind != "draft":
        raise ConfigError(f"{type(draft_config).__name__} is not a drafter config")
    return runtime_of(draft_config)


def init_params(config, rng, dtype=None, **shared):
    """Random params of any registered config (``shared``: e.g. a drafter's ``embed_tokens`` /
    ``lm_head`` taken from its target), through the family module's ``init_params``."""
    import jax.numpy as jnp
    return for_config(config).module().init_params(config, rng, dtype or jnp.float32, **shared)


def shared_with_target(draft_config, target_config, target_params) -> dict:
    """The target arrays a fresh drafter shares (``init_params`` keywords): its family's
    ``shared_from_target(target_params)`` when declared (V4's DSpark: ``embed`` / ``head``), else
    the embedding and LM head kernel (``embed_tokens`` / ``lm_head``)."""
    own = for_config(draft_config).shared_from_target
    if own is not None:
        return own(target_params)
    return {"embed_tokens": target_params["embed_tokens"],
            "lm_head": lm_head_kernel(target_config, target_params)}


def lm_head_kernel(target_config, target_params):
    """The target's [H, V] output projection (its embedding's transpose when tied)."""
    return for_config(target_config).module().lm_head_kernel(target_params)


def compute_logits(config, params, hidden):
    """Family-level logits of any registered target or drafter: hidden [..., H] (after the final
    norm) -> [..., V] float32 (softcapped where the family caps), through its runtime record."""
    family = for_config(config)
    rt = runtime_of(config)
    fn = rt.logits if family.kind == "target" else rt.compute_logits
    return fn(params, config, hidden)
