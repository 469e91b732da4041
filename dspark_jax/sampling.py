"""Token sampling helpers. ``greedy`` is a static Python bool (T < 1e-5 in the reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

GREEDY_EPS = 1e-5  # temperatures below this decode greedily (the reference's rule)


def is_greedy(temperature: float) -> bool:
    return float(temperature) < GREEDY_EPS


def argmax(x: jax.Array) -> jax.Array:
    """[..., V] -> [...] int32 index of the first maximum (``jnp.argmax`` semantics, NaN-free input).

    Two plain reductions (max, then min index attaining it): XLA's CPU backend runs
    ``jnp.argmax``'s variadic (value, index) reduce element by element, several times slower.
    """
    v = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)
    idx = jnp.min(jnp.where(x == top, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
    return jnp.minimum(idx, v - 1)


def probs_from_logits(logits: jax.Array, temperature, greedy: bool) -> jax.Array:
    """[..., V] logits -> [..., V] float32 probabilities (one-hot argmax when greedy)."""
    logits = logits.astype(jnp.float32)
    if greedy:
        return jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(logits / temperature, axis=-1)


def sample_logits(key: jax.Array, logits: jax.Array, temperature, greedy: bool) -> jax.Array:
    """Sample [...] int32 tokens from [..., V] logits at ``temperature`` (argmax when greedy)."""
    if greedy:
        return argmax(logits)
    return categorical(key, logits.astype(jnp.float32) / temperature)


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """``jax.random.categorical`` over the last axis (same Gumbel-max draw) with the fast ``argmax``."""
    return argmax(logits + jax.random.gumbel(key, logits.shape, logits.dtype))


def sample_probs(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Sample [...] int32 tokens from (unnormalised, non-negative) probabilities [..., V]."""
    logp = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
    return categorical(key, logp)
