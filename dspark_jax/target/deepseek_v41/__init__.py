"""DeepSeek-V4.1 (``DeepseekV41ForCausalLM``) as a model family: config, declaration, forward.

``config``: ``DeepseekV41Config`` from the released composite config.json or transformers' flat
one; ``declare``: every parameter once (upstream names); ``model``: the forward (CSA2 with shared
compressed KV and index sources, single-pass mHC, Engram, the reference's fake quantizers);
``engram``: the n-gram hash (its token map read from the checkpoint's tokenizer.json by
``complete_config``); ``cache``: the decode cache and the protocol's ``forward`` (whole sequence
or over a cache). V4's pieces are imported from ``target.deepseek_v4``. Text only: the vision
tower's tensors (``vision.*``, ``aligner.*``, ``image_*``) and the DSpark module (``mtp.*``) are
set aside by conversion (``aside.safetensors``), which says so.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax import params as params_lib
from dspark_jax import runtime
from dspark_jax.target.deepseek_v41.cache import V41Cache, forward, init_cache
from dspark_jax.target.deepseek_v41.config import ARCHITECTURE, MODEL_TYPE, TEXT_MODEL_TYPE, DeepseekV41Config
from dspark_jax.target.deepseek_v41.declare import declare, hf_name, source_names
from dspark_jax.target.deepseek_v41.engram import read_token_map
from dspark_jax.target.deepseek_v41.model import compute_logits

__all__ = ["DeepseekV41Config", "V41Cache", "declare", "forward", "compute_logits", "init_cache", "init_params",
           "hf_name", "FAMILY"]

ASIDE = ("mtp.", "vision.", "aligner.", "image_")


def init_params(cfg: DeepseekV41Config, rng: jax.Array, dtype=jnp.float32) -> dict:
    """Random params (std 0.02; norms, mHC scales, Engram weights 1; biases, sinks 0)."""
    return params_lib.init_params(declare(cfg), rng, dtype)


def lm_head_kernel(params: dict) -> jax.Array:
    """The [H, V] output projection (untied)."""
    return params["head"]


def feature_dim(cfg, taps) -> int:
    return runtime.concat_features(cfg.hidden_size, taps)


FAMILY = params_lib.Family(
    name="deepseek_v41", kind="target", architectures=(ARCHITECTURE,), model_types=(MODEL_TYPE, TEXT_MODEL_TYPE),
    config_cls=DeepseekV41Config, declare=declare, forward=__name__,
    ignored_tensors=ASIDE, aside_tensors=ASIDE, source_names=source_names, complete_config=read_token_map,
    runtime=runtime.TargetRuntime(
        init_cache=init_cache, forward=forward, logits=compute_logits, feature_dim=feature_dim,
        replicable=frozenset({"kv_heads"})))
