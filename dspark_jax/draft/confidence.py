"""Confidence head: c_k = sigmoid(w . [h_k ; W1[prev_k]] + b), one linear unit per position.

Params (``params["confidence_head"]``): kernel [D, 1], bias [1] (absent: no bias), where
D = H (+ r with Markov features). c_k reads x_{k-1}, never x_k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax import params as params_lib
from dspark_jax.config import DraftConfig
from dspark_jax.params import ParamSpec
from dspark_jax.draft import markov


def input_dim(config: DraftConfig) -> int:
    return config.hidden_size + (config.markov_rank if config.confidence_uses_markov else 0)


def declare(config: DraftConfig, std: float = 0.02, rng_path: tuple = ()) -> dict[tuple, ParamSpec]:
    """The confidence head's leaves (paths and torch names relative to ``confidence_head``)."""
    return {("kernel",): ParamSpec((input_dim(config), 1), (None, None), "proj.weight", transpose=True,
                                   init_std=std, rng_path=tuple(rng_path)),
            ("bias",): ParamSpec((1,), (None,), "proj.bias", init="zeros")}


def init_params(config: DraftConfig, rng: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    return params_lib.init_params(declare(config, std), rng, dtype)


def param_axes(config: DraftConfig) -> dict:
    return params_lib.param_axes(declare(config))


def logits(params: dict, config: DraftConfig, hidden: jax.Array, prev_tokens: jax.Array) -> jax.Array:
    """hidden [..., H]; prev_tokens [...] -> confidence logits [...] (float32, before sigmoid)."""
    features = hidden
    if config.confidence_uses_markov:
        e = markov.prev_embeddings(params["markov_head"], prev_tokens).astype(hidden.dtype)
        features = jnp.concatenate([hidden, e], axis=-1)
    head = params["confidence_head"]
    out = jnp.einsum("...d,do->...o", features, head["kernel"].astype(features.dtype),
                     preferred_element_type=jnp.float32)
    return out[..., 0] + (head["bias"][0].astype(jnp.float32) if "bias" in head else 0.0)  # V4's has none
