"""Eagle3 at decode time: the module pieces a chain drafter round needs (DeepSpec's
``Eagle3Evaluator`` protocol).

Shapes: B rows, T positions, S draft-cache capacity, k chain steps (``cfg.block_size``), V vocab,
H hidden, Hkv KV heads, D head size, F = 5H tapped target features.

The drafter keeps its own one-layer KV cache (``qwen3.KVCache`` [1, B, Hkv, S, D]) holding only
entries computed from target features: committed position t pairs the target's feature x_t
(``lift``: fc) with token t+1, rotary position t. During a round, step j reads (its previous
output hidden, draft j) at rotary position anchor + j - 1 against the committed cache plus the
chain's own keys so far; the next commit overwrites those speculative entries.
``MODULE`` is what the chain kind (``draft.chain``) builds the round's record from.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax import nn
from dspark_jax.draft import chain
from dspark_jax.draft.eagle3 import model as m
from dspark_jax.target import qwen3


def taps(cfg) -> tuple[int, ...]:
    return tuple(cfg.target_layer_ids)


def init_cache(cfg, batch: int, capacity: int, dtype, max_extend=None) -> qwen3.KVCache:
    """An empty one-layer cache of ``capacity`` positions (``runtime.Cache``)."""
    del max_extend
    shape = (1, batch, cfg.num_key_value_heads, capacity, cfg.head_dim)
    return qwen3.KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


def lift(params, cfg, features: jax.Array) -> jax.Array:
    """Target features [B, T, F] -> the module's hidden input [B, T, H] (fc)."""
    return m.project_features(params, cfg, features)


def forward(params, cfg, hidden, tokens, cache: qwen3.KVCache, *, ctx=None, span=None):
    """T positions at ``cache.lengths + t``: hidden [B, T, H], tokens [B, T] (token t+1 of each)
    -> (logits [B, T, V] float32, hidden out [B, T, H], delta (k, v) [1, B, Hkv, T, D]); each sees
    the committed positions and the new ones causally. Never writes (``cache.commit``)."""
    del ctx, span
    b, t = tokens.shape
    positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
    q, k, v = m.step_inputs(params, cfg, hidden, tokens, positions)
    s = cache.capacity
    visible = jnp.broadcast_to((jnp.arange(s)[None, :] < cache.lengths[:, None])[:, None, :], (b, t, s))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    prefix = (cache.k[0].astype(q.dtype), cache.v[0].astype(q.dtype), visible)
    out = m.step_output(params, cfg, hidden, nn.attention(q, k, v, causal, prefix=prefix, scale=m.scale(cfg)))
    return m.logits(params, cfg, out), out, (nn.head_major(k)[None], nn.head_major(v)[None])


MODULE = chain.ChainModule(init_cache=init_cache, lift=lift, forward=forward, taps=taps)
