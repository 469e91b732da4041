"""Analytic model FLOPs of a DSpark train step (the numerator of MFU), for any target / drafter family.

``model_flops`` counts what the model needs, not what a compiler emits: the frozen target's
forward (2 x layer matmul params x tokens + causal attention) when the target runs inside the
step (online), and the drafter's forward + backward (3 forwards) over its block tokens. No
rematerialisation, padding or masked-out work is counted; ``hlo_cost.step_cost`` gives the
compiled program's own count beside it.
"""

from __future__ import annotations

import jax
import numpy as np

from dspark_jax import families
from dspark_jax.target import gemma4


def _matmul_params(layers: dict) -> int:
    """Weights of the stacked layer matmuls: every 3-D leaf ([layers, in, out]) of ``layers``."""
    return int(sum(np.prod(v.shape) for v in jax.tree.leaves(layers) if len(v.shape) == 3))


def _visible_keys(seq: int, window: int | None) -> int:
    """Keys summed over the S queries of causal attention (within ``window`` when sliding)."""
    if window is None or window >= seq:
        return seq * (seq + 1) // 2
    return window * (window + 1) // 2 + (seq - window) * window


def target_attention_flops(tcfg, seq: int) -> float:
    """QK^T + PV FLOPs of a causal forward over ``seq`` tokens, all layers: 4 x Hq x D x visible
    keys per layer. Gemma4: sliding layers (``head_dim``) see <= ``sliding_window`` keys, full
    layers ``global_head_dim``; Qwen3: every layer full with ``head_dim``."""
    hq = tcfg.num_attention_heads
    layer_types = getattr(tcfg, "layer_types", None)
    if layer_types is None:
        return float(tcfg.num_hidden_layers * 4 * hq * tcfg.head_dim * _visible_keys(seq, None))
    total = 0
    for t in layer_types:
        full = t == gemma4.FULL
        total += 4 * hq * (tcfg.global_head_dim if full else tcfg.head_dim) * _visible_keys(
            seq, None if full else tcfg.sliding_window)
    return float(total)


def model_flops(tcfg, dcfg, seq: int, online: bool = True) -> float:
    """Analytic FLOPs of one train step on one sequence (no remat recompute counted); the
    target forward only when ``online`` (cache mode reads precomputed features). Any target /
    drafter family (params from ``families.init_params`` shapes).

    Target forward: 2 x layer matmul params x S + causal attention (``target_attention_flops``).
    Drafter (forward + backward = 3 forwards) over N x G block tokens: layer matmuls, the
    [H, V] LM head and Markov [r, V] projection per block token, attention over <= S context
    + G block keys; context fc + k/v projections over the S context tokens.
    """
    key = jax.random.PRNGKey(0)
    tpar = jax.eval_shape(lambda k: families.init_params(tcfg, k), key)
    dpar = jax.eval_shape(lambda k: families.init_params(dcfg, k), key)
    t_fwd = 2 * _matmul_params(tpar) * seq + target_attention_flops(tcfg, seq)
    ng = dcfg.num_anchors * dcfg.block_size
    h, v = dcfg.hidden_size, dcfg.vocab_size
    layers = dpar["layers"]
    d_layers = _matmul_params(layers)
    d_tok = 2 * (d_layers + h * v + (dcfg.markov_rank * v if dcfg.has_markov else 0))
    d_attn = dcfg.num_hidden_layers * 4 * (seq / 2 + dcfg.block_size) * dcfg.num_attention_heads * dcfg.head_dim
    kv = sum(int(np.prod(layers[k].shape)) for k in ("k_proj", "v_proj") if k in layers)  # all layers
    d_ctx = 2 * (dcfg.num_context_features * h * h + kv) * seq
    return float((t_fwd if online else 0) + 3 * (ng * (d_tok + d_attn) + d_ctx))
