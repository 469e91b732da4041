"""Markov heads: a low-rank bias on each block position from the previous token.

Params (``params["markov_head"]``): ``markov_w1 [V, r]`` (previous-token
table), ``markov_w2 [r, V]`` (bias projection); ``gate_proj`` {kernel [H+r, r],
bias [r]} for ``gated``; ``joint_proj`` {kernel [2r+H, 3r], bias [3r]} for ``rnn``.

``step`` is the one-position update used by the sequential sampler
(``lax.scan`` over the block); ``teacher_forced`` applies the same update over
a whole block of ground-truth previous tokens (training). Both share ``step``,
so training and decoding cannot drift apart.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.config import DraftConfig


def init_params(config: DraftConfig, rng: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    r, v, h = config.markov_rank, config.vocab_size, config.hidden_size
    k1, k2, k3 = jax.random.split(rng, 3)
    p = {
        "markov_w1": (std * jax.random.normal(k1, (v, r))).astype(dtype),
        "markov_w2": (std * jax.random.normal(k2, (r, v))).astype(dtype),
    }
    if config.markov_head_type == "gated":
        p["gate_proj"] = {"kernel": (std * jax.random.normal(k3, (h + r, r))).astype(dtype),
                          "bias": jnp.zeros((r,), dtype)}
    elif config.markov_head_type == "rnn":
        p["joint_proj"] = {"kernel": (std * jax.random.normal(k3, (2 * r + h, 3 * r))).astype(dtype),
                           "bias": jnp.zeros((3 * r,), dtype)}
    return p


def param_axes(config: DraftConfig) -> dict:
    axes = {"markov_w1": ("vocab", "rank"), "markov_w2": ("rank", "vocab")}
    if config.markov_head_type == "gated":
        axes["gate_proj"] = {"kernel": (None, "rank"), "bias": ("rank",)}
    elif config.markov_head_type == "rnn":
        axes["joint_proj"] = {"kernel": (None, None), "bias": (None,)}
    return axes


def prev_embeddings(p: dict, tokens: jax.Array) -> jax.Array:
    """W1[tokens]: [..., r]."""
    return p["markov_w1"][tokens]


def init_state(config: DraftConfig, leading_shape, dtype=jnp.float32) -> jax.Array:
    """Recurrent state s_{-1} = 0 (only the rnn head reads it)."""
    return jnp.zeros((*leading_shape, max(config.markov_rank, 1)), dtype)


def step(p: dict, config: DraftConfig, state: jax.Array, prev_tokens: jax.Array, hidden: jax.Array):
    """One block position.

    state [..., r]; prev_tokens [...]; hidden [..., H] (backbone output h_k).
    Returns (bias [..., V] float32, new state).
    """
    e = prev_embeddings(p, prev_tokens).astype(hidden.dtype)
    kind = config.markov_head_type
    if kind == "vanilla":
        latent = e
    elif kind == "gated":
        g = jax.nn.sigmoid(jnp.concatenate([hidden, e], -1) @ p["gate_proj"]["kernel"]
                           + p["gate_proj"]["bias"])
        latent = g * e
    elif kind == "rnn":
        z = jnp.concatenate([state.astype(hidden.dtype), e, hidden], -1)
        a, c, o = jnp.split(z @ p["joint_proj"]["kernel"] + p["joint_proj"]["bias"], 3, axis=-1)
        gate = jax.nn.sigmoid(a)
        state = (gate * state + (1.0 - gate) * jnp.tanh(c)).astype(state.dtype)
        latent = jnp.tanh(o)
    else:  # validated by DraftConfig
        raise ValueError(kind)
    bias = jnp.einsum("...r,rv->...v", latent, p["markov_w2"].astype(latent.dtype),
                      preferred_element_type=jnp.float32)
    return bias, state


def teacher_forced(p: dict, config: DraftConfig, base_logits: jax.Array, prev_tokens: jax.Array,
                   hidden: jax.Array) -> jax.Array:
    """Markov-corrected logits of whole blocks.

    base_logits [..., G, V]; prev_tokens [..., G] (anchor, then ground truth);
    hidden [..., G, H]. Returns [..., G, V] float32.
    """
    if config.markov_head_type != "rnn":
        bias, _ = step(p, config, None, prev_tokens, hidden)
        return base_logits + bias
    state0 = init_state(config, prev_tokens.shape[:-1], jnp.float32)

    def scan_fn(state, xs):
        tok, h = xs
        bias, state = step(p, config, state, tok, h)
        return state, bias

    _, biases = jax.lax.scan(scan_fn, state0, (jnp.moveaxis(prev_tokens, -1, 0),
                                               jnp.moveaxis(hidden, -2, 0)))
    return base_logits + jnp.moveaxis(biases, 0, -2)
