"""Token sampling helpers. ``greedy`` is a static Python bool (T < 1e-5 in the reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

GREEDY_EPS = 1e-5  # temperatures below this decode greedily (the reference's rule)


def is_greedy(temperature: float) -> bool:
    return float(temperature) < GREEDY_EPS


def probs_from_logits(logits: jax.Array, temperature, greedy: bool) -> jax.Array:
    """[..., V] logits -> [..., V] float32 probabilities (one-hot argmax when greedy)."""
    logits = logits.astype(jnp.float32)
    if greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(logits / temperature, axis=-1)


def sample_logits(key: jax.Array, logits: jax.Array, temperature, greedy: bool) -> jax.Array:
    """Sample [...] int32 tokens from [..., V] logits at ``temperature`` (argmax when greedy)."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits.astype(jnp.float32) / temperature, axis=-1).astype(jnp.int32)


def sample_probs(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Sample [...] int32 tokens from (unnormalised, non-negative) probabilities [..., V]."""
    logp = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
    return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)
