"""Eagle3 at decode time: the module pieces a chain drafter round needs (DeepSpec's
``Eagle3Evaluator`` protocol).

Shapes: B rows, T positions, S draft-cache capacity, k chain steps (``cfg.block_size``), V vocab,
H hidden, Hkv KV heads, D head size, F = 5H tapped target features.

The drafter keeps its own one-layer KV cache (``qwen3.KVCache`` [1, B, Hkv, S, D]) holding only
entries computed from target features: committed position t pairs the target's feature x_t
(``lift``: fc) with token t+1, rotary position t. During a round, step j reads (its previous
output hidden, draft j) at rotary position anchor + j - 1 against the committed cache plus the
chain's own keys so far; the next commit overwrites those speculative entries.
``init`` / ``propose`` / ``commit`` here drive ``forward`` as the chain round does.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from dspark_jax import nn, sampling
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


# ----------------------------------------------------------------------------- the round's calls


@flax.struct.dataclass
class ChainState:
    """The cache (committed positions < ``cache.lengths``) and the module's output at the last
    committed position: ``h_last [B, H]``, ``logits_last [B, V]`` float32 (draft 1)."""

    cache: qwen3.KVCache
    h_last: jax.Array
    logits_last: jax.Array


def _last(x, n_new, old):
    at = jnp.take_along_axis(x, jnp.maximum(n_new - 1, 0).reshape(-1, *([1] * (x.ndim - 1))), axis=1)[:, 0]
    return jnp.where((n_new > 0).reshape(-1, *([1] * (at.ndim - 1))), at.astype(old.dtype), old)


def commit(params, cfg, state: ChainState, features, next_tokens, positions, n_new, *, ctx=None) -> ChainState:
    """Fold in each row's first ``n_new`` verified positions (features [B, T, F], next_tokens
    [B, T] the token after each)."""
    del positions
    n_new = n_new.astype(jnp.int32)
    logits, hidden, delta = forward(params, cfg, lift(params, cfg, features), next_tokens, state.cache)
    return ChainState(state.cache.commit(delta, n_new), _last(hidden, n_new, state.h_last),
                      _last(logits, n_new, state.logits_last))


def init(params, cfg, features, next_tokens, lens, max_len: int, *, ctx=None) -> ChainState:
    """After the prefill: position t's feature [B, P, F] and token t+1 [B, P]; ``lens`` committed."""
    b = features.shape[0]
    dtype = params["fc"].dtype
    empty = ChainState(init_cache(cfg, b, max_len, dtype), jnp.zeros((b, cfg.hidden_size), dtype),
                       jnp.zeros((b, cfg.vocab_size), jnp.float32))
    return commit(params, cfg, empty, features, next_tokens, None, lens)


def propose(params, cfg, state: ChainState, anchor, pos, key, temperature, greedy, *, ctx=None, **spans):
    """(drafts [B, k], their logits [B, k, V] float32, None, state): draft 1 from ``logits_last``,
    then k-1 module steps on a local copy of the cache."""
    del anchor, pos, spans
    k = cfg.block_size
    keys = sampling.split(key, k)
    first = sampling.sample_logits(keys[0], state.logits_last, temperature, greedy)
    if k == 1:
        return first[:, None], state.logits_last[:, None], None, state
    ones = jnp.ones_like(first)

    def step(carry, key_j):
        cache, h, tok = carry
        logits, hidden, delta = forward(params, cfg, h[:, None], tok[:, None], cache)
        nxt = sampling.sample_logits(key_j, logits[:, 0], temperature, greedy)
        return (cache.commit(delta, ones), hidden[:, 0].astype(h.dtype), nxt), (nxt, logits[:, 0])

    _, (drafts, logits) = jax.lax.scan(step, (state.cache, state.h_last, first), keys[1:])
    drafts = jnp.concatenate([first[:, None], jnp.moveaxis(drafts, 0, 1)], axis=1)
    logits = jnp.concatenate([state.logits_last[:, None], jnp.moveaxis(logits, 0, 1)], axis=1)
    return drafts, logits, None, state
