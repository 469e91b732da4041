"""Verification-length policies: how many draft tokens each row sends to the target.

A policy is a hashable, pure object (it is a static argument of the jitted
decode round)::

    class VerifyPolicy(Protocol):
        def init_state(self, batch_size: int, block_size: int): ...
        def __call__(self, state, confidences, active) -> tuple[lengths, new_state]: ...

- ``init_state`` returns a pytree carried across rounds (``()`` when stateless).
- ``confidences``: [B, G] float32 probabilities c_1..c_G (``sigmoid(logit_k / t_k)``
  with optional STS temperatures t_k), all ones when the drafter has no
  confidence head. c_k was computed from x_{k-1}, never from x_k.
- ``active``: [B] bool, False for finished rows (their lengths are ignored).
- ``lengths``: [B] int32 in [0, G].

A policy may also declare ``constant_length(block_size) -> int | None``: the one length it
always returns (``full``: G, ``fixed:K``: min(K, G)); the decode round then compiles only the
verification width that length needs (``shapes.round_widths``). A policy whose lengths vary
gets every compiled width and the round picks one per round from the lengths of its active
rows. A policy may declare ``verify_widths``: the widths its cost model assumes (the
scheduler's round table); the round compiles those unless the decode program sets its own.

Losslessness needs the non-anticipating property (speculative sampling stays exact): whether
x_k is verified may depend only on c_1..c_k (information available before x_k
was sampled), never on c_{k+1} or later. Every policy here satisfies it.

``parse_policy`` maps a spec string to a policy. "full", "threshold"
(optionally "threshold:C"), "fixed:K" are built in; other names are looked up
in a registry (``register_policy``) and, for "scheduler*", delegated to
``dspark_jax.decode.scheduler.make_policy(spec, sps_table, ...)`` when that
module exists.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Protocol

import jax.numpy as jnp

from dspark_jax import families
from dspark_jax.draft import kinds
from dspark_jax.errors import ConfigError


class VerifyPolicy(Protocol):
    def init_state(self, batch_size: int, block_size: int) -> Any: ...

    def __call__(self, state, confidences, active) -> tuple[Any, Any]: ...


def constant_length(policy, block_size: int) -> int | None:
    """The single length ``policy`` always returns for block size G (in [0, G]), or None when its
    lengths vary (no ``constant_length`` method)."""
    fn = getattr(policy, "constant_length", None)
    if fn is None:
        return None
    k = fn(block_size)
    return None if k is None else max(0, min(int(k), block_size))


def require_confidence(policy, draft_cfg) -> None:
    """ConfigError (one line) when ``policy`` reads confidences (its lengths vary: no
    ``constant_length``) but the drafter's kind has no confidence head (a chain drafter: MTP,
    Eagle3), before anything compiles; ``full`` and ``fixed:K`` work for every kind."""
    kind = kinds.proposer(draft_cfg)
    if policy is None or kind.confidence or constant_length(policy, draft_cfg.block_size) is not None:
        return
    name = families.for_config(draft_cfg).name
    raise ConfigError(f"verification policy {type(policy).__name__}: the {name} drafter has no confidence "
                      f"head, which this policy reads; use --verify full or fixed:K")


@dataclasses.dataclass(frozen=True)
class FullPolicy:
    """Verify all G draft tokens."""

    def init_state(self, batch_size: int, block_size: int):
        return ()

    def constant_length(self, block_size: int) -> int:
        return block_size

    def __call__(self, state, confidences, active):
        b, g = confidences.shape
        return jnp.full((b,), g, jnp.int32), state


def confident_prefix_length(confidences, threshold: float):
    """[B, G] -> [B] int32: longest prefix with every c_k >= threshold (threshold <= 0: G)."""
    b, g = confidences.shape
    if threshold <= 0.0:
        return jnp.full((b,), g, jnp.int32)
    ok = (confidences >= threshold).astype(jnp.int32)
    return jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class ThresholdPolicy:
    """The reference rule: the longest prefix with every confidence >= ``threshold``."""

    threshold: float = 0.5

    def __post_init__(self):
        if not 0.0 <= float(self.threshold) <= 1.0:
            raise ConfigError(f"--confidence-threshold (or --verify threshold:C) must be in [0, 1] "
                              f"(a draft token is verified while its confidence is >= C), "
                              f"got {self.threshold}")

    def init_state(self, batch_size: int, block_size: int):
        return ()

    def __call__(self, state, confidences, active):
        return confident_prefix_length(confidences, float(self.threshold)), state


@dataclasses.dataclass(frozen=True)
class FixedPolicy:
    """Verify min(k, G) draft tokens every round."""

    k: int

    def __post_init__(self):
        if not isinstance(self.k, int) or self.k < 0:
            raise ConfigError(f"fixed:k needs an int k >= 0, got {self.k!r}")

    def init_state(self, batch_size: int, block_size: int):
        return ()

    def constant_length(self, block_size: int) -> int:
        return min(self.k, block_size)

    def __call__(self, state, confidences, active):
        b, g = confidences.shape
        return jnp.full((b,), min(self.k, g), jnp.int32), state


_REGISTRY: dict[str, Callable[..., VerifyPolicy]] = {}


def register_policy(name: str, factory: Callable[..., VerifyPolicy]) -> None:
    """Add a policy family: ``factory(spec, **kwargs)`` is called for specs ``name`` / ``name:...``."""
    _REGISTRY[name] = factory


def parse_policy(spec: str, *, confidence_threshold: float | None = None, sps_table=None,
                 **kwargs) -> VerifyPolicy:
    """Policy from a spec: "full", "threshold" / "threshold:C", "fixed:K", or a registered name.

    ``confidence_threshold`` supplies C for a bare "threshold" (default 0.5);
    ``sps_table`` and other kwargs are passed to scheduler policies.
    """
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"verification policy must be a non-empty string, got {spec!r}")
    name, _, arg = spec.partition(":")
    if name == "full":
        if arg:
            raise ConfigError(f"policy 'full' takes no argument, got {spec!r}")
        return FullPolicy()
    if name == "threshold":
        value = arg or (confidence_threshold if confidence_threshold is not None else 0.5)
        try:
            return ThresholdPolicy(float(value))
        except ValueError:
            raise ConfigError(f"--verify {spec}: C in threshold:C must be a number in [0, 1], "
                              f"e.g. --verify threshold:0.5") from None
    if name == "fixed":
        try:
            k = int(arg)
        except ValueError:
            raise ConfigError(f"policy {spec!r}: expected fixed:K with an integer K >= 0") from None
        return FixedPolicy(k)
    if name in _REGISTRY:
        return _REGISTRY[name](spec, sps_table=sps_table, **kwargs)
    if name.startswith("scheduler"):
        try:
            module = importlib.import_module("dspark_jax.decode.scheduler")
        except ModuleNotFoundError as e:
            if e.name != "dspark_jax.decode.scheduler":
                raise
            raise ConfigError(f"policy {spec!r} needs dspark_jax.decode.scheduler, which is not "
                              "available") from None
        return module.make_policy(spec, sps_table, **kwargs)
    known = ["full", "threshold[:C]", "fixed:K", "scheduler", "scheduler-async", *_REGISTRY]
    raise ConfigError(f"unknown verification policy {spec!r}; expected one of {known}")
