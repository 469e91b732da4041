"""Eagle3 at decode time: the chain drafter's state and its init / propose / commit (the
*chain* kind of ``runtime``'s drafter record; DeepSpec's ``Eagle3Evaluator`` protocol).

Shapes: B rows, S draft-cache capacity, k chain steps (``cfg.block_size``), V vocab, H hidden,
Hkv KV heads, D head size, F = 5H tapped target features.

The drafter keeps its own one-layer KV cache holding only entries computed from target
features: committed position t pairs the target's feature x_t with token t+1 (rotary position t).
``h_last`` / ``logits_last`` are the module's output at the last committed position, whose token
is the anchor (the last committed token): its logits give draft 1 of the next round. A proposal
then runs k-1 single-token steps, step j reading (its previous hidden state, draft j) at rotary
position anchor + j - 1 against the committed cache plus the chain's own keys so far (held
locally, never written: the next ``commit`` writes the verified positions instead).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from dspark_jax import nn, runtime, sampling
from dspark_jax.draft.eagle3 import model as m

KV_AXES = (runtime.BATCH, "kv_heads", runtime.STEP, "head_dim")  # head-major, as nn.attention's prefix


@flax.struct.dataclass
class ChainState:
    """The drafter's KV cache ``k, v [B, Hkv, S, D]`` (row b holds positions < lengths[b]),
    ``h_last [B, H]`` and ``logits_last [B, V]`` float32 (the output at position lengths - 1)."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    h_last: jax.Array
    logits_last: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def axes(self) -> "ChainState":
        return ChainState(KV_AXES, KV_AXES, (runtime.BATCH,), (runtime.BATCH, "embed"),
                          (runtime.BATCH, "vocab"))

    def delta_axes(self):
        return (KV_AXES, KV_AXES)

    def commit(self, delta, n_new: jax.Array) -> "ChainState":
        """Write the first ``n_new[b]`` entries of delta = (k, v [B, Hkv, T, D]) at positions
        lengths[b] + t and advance ``lengths`` (h_last / logits_last are the caller's)."""
        k_new, v_new = delta
        t = k_new.shape[2]
        write = runtime.step_mask(n_new, t)
        slots = jnp.where(write, self.lengths[:, None] + jnp.arange(t, dtype=jnp.int32), self.capacity)
        return self.replace(k=runtime.write_steps(self.k, k_new, slots),
                            v=runtime.write_steps(self.v, v_new, slots),
                            lengths=self.lengths + n_new.astype(jnp.int32))


def empty(cfg, batch: int, capacity: int, dtype) -> ChainState:
    shape = (batch, cfg.num_key_value_heads, capacity, cfg.head_dim)
    return ChainState(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32),
                      jnp.zeros((batch, cfg.hidden_size), dtype), jnp.zeros((batch, cfg.vocab_size), jnp.float32))


def _visible_cache(state: ChainState, queries: int) -> jax.Array:
    """[B, Q, S] bool: the committed slots (< lengths), for every query."""
    s = state.capacity
    return jnp.broadcast_to((jnp.arange(s)[None, :] < state.lengths[:, None])[:, None, :],
                            (state.lengths.shape[0], queries, s))


def _run(p, cfg, state: ChainState, h, ids, positions, new_mask):
    """One module step over T tokens: h [B, T, H], ids, positions [B, T]; new_mask [B, T, T] the
    visibility among the new tokens (the committed cache is always visible). -> (h', k, v) with
    k, v [B, Hkv, T, D] (head-major)."""
    q, k, v = m.step_inputs(p, cfg, h, ids, positions)
    prefix = (state.k.astype(q.dtype), state.v.astype(q.dtype), _visible_cache(state, q.shape[1]))
    attn = nn.attention(q, k, v, new_mask, prefix=prefix, scale=m.scale(cfg))
    return m.step_output(p, cfg, h, attn), nn.head_major(k), nn.head_major(v)


def _absorb(p, cfg, state: ChainState, features, tokens, positions, n_new) -> ChainState:
    """Commit T positions (features [B, T, F], tokens [B, T] = each position's token t+1,
    positions [B, T]) of which the first n_new [B] count; h_last / logits_last from the last."""
    b, t = tokens.shape
    h0 = m.project_features(p, cfg, features)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    h, k, v = _run(p, cfg, state, h0, tokens, positions, causal)
    last = jnp.clip(n_new.astype(jnp.int32) - 1, 0, t - 1)
    h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
    moved = (n_new > 0)[:, None]
    new = state.commit((k, v), n_new)
    return new.replace(h_last=jnp.where(moved, h_last, state.h_last),
                       logits_last=jnp.where(moved, m.logits(p, cfg, h_last), state.logits_last))


def init(p, cfg, features, tokens, lens, max_len: int, *, ctx=None) -> ChainState:
    """After the prefill: features [B, P, F] of prompt positions 0..P-1, tokens [B, P+1] (row b's
    first sampled token at index lens[b]), lens [B] -> the state holding positions < lens."""
    b, pl = features.shape[:2]
    dtype = (ctx.dtype if ctx is not None and ctx.dtype is not None else p["fc"].dtype)
    state = empty(cfg, b, max_len, dtype)
    positions = jnp.broadcast_to(jnp.arange(pl, dtype=jnp.int32), (b, pl))
    return _absorb(p, cfg, state, features, tokens[:, 1:pl + 1], positions, lens)


def commit(p, cfg, state: ChainState, features, tokens, positions, n_new, *, ctx=None) -> ChainState:
    """After verification: fold in row b's first n_new[b] verified positions (features [B, k+1, F]
    of positions p..p+k, tokens [B, k+1] the token after each: accepted drafts then the bonus)."""
    return _absorb(p, cfg, state, features, tokens, positions, n_new)


def propose(p, cfg, state: ChainState, anchor, pos, key, temperature, greedy: bool, *, ctx=None, **spans):
    """(drafts [B, k] int32, draft logits [B, k, V] float32, None): draft 1 from ``logits_last``,
    then k-1 chain steps at rotary positions pos .. pos+k-2 (pos [B]: the anchor's position = the
    committed length). Pure: the chain's keys stay local."""
    del anchor, ctx, spans
    k_steps = cfg.block_size
    keys = sampling.split(key, k_steps)
    b = pos.shape[0]
    logits, h = state.logits_last, state.h_last[:, None, :]
    drafts, all_logits, spec_k, spec_v = [], [], [], []
    for j in range(k_steps):
        tok = sampling.sample_logits(keys[j], logits, temperature, greedy)
        drafts.append(tok)
        all_logits.append(logits)
        if j == k_steps - 1:
            break
        q, k, v = m.step_inputs(p, cfg, h, tok[:, None], (pos + j)[:, None])
        spec_k, spec_v = spec_k + [k], spec_v + [v]
        kk, vv = jnp.concatenate(spec_k, 1), jnp.concatenate(spec_v, 1)
        prefix = (state.k.astype(q.dtype), state.v.astype(q.dtype), _visible_cache(state, 1))
        attn = nn.attention(q, kk, vv, jnp.ones((b, 1, j + 1), bool), prefix=prefix, scale=m.scale(cfg))
        h = m.step_output(p, cfg, h, attn)
        logits = m.logits(p, cfg, h[:, 0])
    return jnp.stack(drafts, 1).astype(jnp.int32), jnp.stack(all_logits, 1), None
