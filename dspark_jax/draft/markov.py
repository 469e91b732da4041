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

from dspark_jax import nn
from dspark_jax import params as params_lib
from dspark_jax.config import DraftConfig
from dspark_jax.params import ParamSpec


def declare(config: DraftConfig, std: float = 0.02, rng_path: tuple = ()) -> dict[tuple, ParamSpec]:
    """The Markov head's leaves (paths and torch names relative to ``markov_head``).

    ``rng_path`` is the key path of the whole head; leaf j takes ``split(key, 3)[j]``.
    """
    r, v, h = config.markov_rank, config.vocab_size, config.hidden_size
    specs = {
        ("markov_w1",): ParamSpec((v, r), ("vocab", "rank"), "markov_w1.weight", init_std=std,
                                  rng_path=(*rng_path, (3, 0))),
        ("markov_w2",): ParamSpec((r, v), ("rank", "vocab"), "markov_w2.weight", transpose=True,
                                  init_std=std, rng_path=(*rng_path, (3, 1))),
    }
    extra = {"gated": ("gate_proj", h + r, r, "rank"), "rnn": ("joint_proj", 2 * r + h, 3 * r, None)}
    if config.markov_head_type in extra:
        name, d_in, d_out, axis = extra[config.markov_head_type]
        specs[(name, "kernel")] = ParamSpec((d_in, d_out), (None, axis), f"{name}.weight", transpose=True,
                                            init_std=std, rng_path=(*rng_path, (3, 2)))
        specs[(name, "bias")] = ParamSpec((d_out,), (axis,), f"{name}.bias", init="zeros")
    return specs


def init_params(config: DraftConfig, rng: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    return params_lib.init_params(declare(config, std), rng, dtype)


def param_axes(config: DraftConfig) -> dict:
    return params_lib.param_axes(declare(config))


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
    bias = nn.project_f32(latent, p["markov_w2"].astype(latent.dtype))  # no f32 copy of W2 at B = 1 on CUDA
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
