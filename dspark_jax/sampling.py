"""Token sampling helpers. ``greedy`` is a static Python bool (T < 1e-5 in the reference).

Keys: a single PRNG key ``uint32 [2]`` draws the noise of a whole batch at once; per-row keys
``uint32 [B, 2]`` (the continuous engine's ``request_keys``) draw row b's noise from its own key
only, so a request's samples do not depend on the other rows of its batch. ``split`` /
``categorical`` / ``uniform`` accept both (the single-key path is the plain ``jax.random`` call).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GREEDY_EPS = 1e-5  # temperatures below this decode greedily (the reference's rule)


NONFINITE = -2  # token id of a draw from non-finite target logits: the host raises on it


def well_defined(logits: jax.Array) -> jax.Array:
    """[..., V] logits -> [...] bool: a distribution can be drawn from them (no NaN, no +inf, not
    all -inf; single -inf entries are a zero probability and fine)."""
    return ~jnp.any(jnp.isnan(logits) | (logits == jnp.inf), axis=-1) & jnp.any(logits > -jnp.inf, axis=-1)


def guard(tokens: jax.Array, logits: jax.Array) -> jax.Array:
    """``tokens`` [...] drawn from ``logits`` [..., V], with ``NONFINITE`` where those logits
    are not ``well_defined`` (a broken target: the host names it instead of emitting garbage)."""
    return jnp.where(well_defined(logits), tokens, NONFINITE)


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


def split(key: jax.Array, num: int = 2) -> jax.Array:
    """``num`` new keys: a key [2] -> [num, 2]; per-row keys [B, 2] -> [num, B, 2] (each row
    splits its own key)."""
    if key.ndim == 2:
        return jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k, num))(key), 0, 1)
    return jax.random.split(key, num)


def _noise(draw, key: jax.Array, shape, dtype) -> jax.Array:
    """``draw(key, shape, dtype)``; with per-row keys [B, 2], row b of the [B, ...] result comes
    from key b alone."""
    if key.ndim == 2:
        return jax.vmap(lambda k: draw(k, tuple(shape[1:]), dtype))(key)
    return draw(key, shape, dtype)


def uniform(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
    """U[0, 1) of ``shape`` (per-row keys: see ``_noise``)."""
    return _noise(jax.random.uniform, key, shape, dtype)


def top_p_filter(logits: jax.Array, top_p: float) -> jax.Array:
    """Nucleus filtering of [..., V] (temperature-scaled) logits: tokens outside the smallest
    set of the most probable ones whose probability reaches ``top_p`` get -inf (the most
    probable token always stays; tokens tied with the last one kept stay too). ``top_p`` is a
    static float in (0, 1]; 1 returns ``logits`` unchanged."""
    if top_p >= 1.0:
        return logits
    desc = -jnp.sort(-logits, axis=-1)                                  # [..., V] descending
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs                         # mass above each token
    keep = jnp.sum((before < top_p).astype(jnp.int32), axis=-1, keepdims=True)  # >= 1
    cutoff = jnp.take_along_axis(desc, keep - 1, axis=-1)               # smallest kept logit
    return jnp.where(logits >= cutoff, logits, -jnp.inf)


def sample_logits(key: jax.Array, logits: jax.Array, temperature, greedy: bool,
                  top_p: float = 1.0) -> jax.Array:
    """Sample [...] int32 tokens from [..., V] logits at ``temperature`` (argmax when greedy),
    restricted to the nucleus ``top_p`` (static; 1 = no filtering, the unchanged program)."""
    if greedy:
        return argmax(logits)
    return categorical(key, top_p_filter(logits.astype(jnp.float32) / temperature, top_p))


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """``jax.random.categorical`` over the last axis (same Gumbel-max draw) with the fast ``argmax``."""
    return argmax(logits + _noise(jax.random.gumbel, key, logits.shape, logits.dtype))


def sample_probs(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Sample [...] int32 tokens from (unnormalised, non-negative) probabilities [..., V]."""
    logp = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
    return categorical(key, logp)
