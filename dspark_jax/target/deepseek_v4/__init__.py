"""DeepSeek-V4 (``DeepseekV4ForCausalLM``) as a model family: config, declaration, forward, cache.

``config``: ``DeepseekV4Config`` from either config.json layout; ``declare``: every parameter once
(upstream names, transformers' names derived); ``model``: the forward (mHC, shared-KV attention
with sliding window + CSA / HCA, hash and score-routed MoE), whole-sequence or over a ``cache``
(``V4Cache``: window ring, compressor state and entries, indexer keys). Registered in
``families._BUILTIN`` with its runtime record (``dspark_jax.runtime``), so the decode engine and
the trainer run it like any other target.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax import params as params_lib
from dspark_jax import runtime
from dspark_jax.target.deepseek_v4.cache import V4Cache, init_cache
from dspark_jax.target.deepseek_v4.config import ARCHITECTURE, DeepseekV4Config
from dspark_jax.target.deepseek_v4.declare import declare, hf_name, source_names
from dspark_jax.target.deepseek_v4.model import STREAMS, compute_logits, forward, tap_width

__all__ = ["DeepseekV4Config", "V4Cache", "declare", "forward", "compute_logits", "init_cache", "init_params",
           "hf_name", "FAMILY"]


def init_params(cfg: DeepseekV4Config, rng: jax.Array, dtype=jnp.float32) -> dict:
    """Random params (std 0.02; norms, mHC scales 1; biases, sinks, ape 0; tid2eid 0)."""
    return params_lib.init_params(declare(cfg), rng, dtype)


def lm_head_kernel(params: dict) -> jax.Array:
    """The [H, V] output projection (untied)."""
    return params["head"]


FAMILY = params_lib.Family(
    name="deepseek_v4", kind="target", architectures=(ARCHITECTURE,), model_types=("deepseek_v4",),
    config_cls=DeepseekV4Config, declare=declare, forward=__name__,
    ignored_tensors=("mtp.",), aside_tensors=("mtp.",), source_names=source_names,
    runtime=runtime.TargetRuntime(
        init_cache=init_cache, forward=forward, logits=compute_logits,
        feature_dim=tap_width,
        replicable=frozenset({"kv_heads"})))  # one shared K=V head: replicated under tensor parallelism
