"""Compiled shapes: verification widths, cache spans, prompt buckets and the cache capacity.

Every shape the decode programs see is static; what varies from round to round is chosen
among a small compiled set:

- widths (``round_widths``): the round verifies the anchor and w-1 drafts per row for the
  smallest compiled width w >= the longest active proposal + 1 (``width_index``), one
  ``lax.switch`` branch per width (``default_widths(G)`` = 1, 2, 4, .., G+1; one width for a
  constant-length policy such as ``full`` or ``fixed:K``);
- spans (``compiled_spans``): attention reads the smallest compiled span >= the longest active
  row's committed length (``span_index``, ``by_span``) instead of the whole capacity L;
- prompt buckets (``buckets``): the continuous engine prefills a prompt of length n padded to
  the smallest power of two >= n (at least ``MIN_PROMPT_BUCKET``);
- capacity (``plan_shapes``): the padded prompt length P and the cache capacity L of a batch.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

from dspark_jax import runtime
from dspark_jax.decode.policies import constant_length
from dspark_jax.errors import ConfigError, InputError

MAX_STOP_IDS = 8     # stop-id slots (padded with -1) so the count never changes shapes
MIN_PROMPT_BUCKET = 16  # padded prompt length P is a power of two >= this
CACHE_BUCKET = 64    # default cache capacity L is a multiple of this
SPAN_ALIGN = 128     # compiled cache spans (``default_spans``) are multiples of this
NUM_SPANS = 4        # at most this many spans by default


def default_widths(block_size: int) -> tuple[int, ...]:
    """The default compiled verification widths for block size G: the powers of two below G+1,
    then G+1 (G=7: (1, 2, 4, 8)). A width w verifies the anchor and w-1 drafts per row; a
    round runs the smallest width >= its longest active proposal + 1, so doubling widths
    keep the padding waste under 2x with log2(G+1)+1 compiled branches."""
    out, w = [], 1
    while w < block_size + 1:
        out.append(w)
        w *= 2
    return tuple(out) + (block_size + 1,)

def verify_widths(block_size: int, widths=None) -> tuple[int, ...]:
    """Sorted distinct widths in [1, G+1], G+1 always included (``widths`` None: the default).
    ConfigError on a width outside [1, G+1]."""
    if widths is None:
        return default_widths(block_size)
    ws = sorted({int(w) for w in widths} | {block_size + 1})
    if ws[0] < 1 or ws[-1] > block_size + 1:
        raise ConfigError(f"verification widths must be in [1, block_size + 1 = {block_size + 1}], "
                          f"got {sorted(widths)}")
    return tuple(ws)

def round_widths(static) -> tuple[int, ...]:
    """The widths the round of ``static`` compiles: ``static.widths``, else the policy's
    ``verify_widths`` (a scheduler measured on a round table uses the table's widths), else
    ``default_widths(G)``; a policy of one constant length l (``policies.constant_length``:
    full, fixed:K) keeps only the smallest width >= l+1 (one branch, no switch)."""
    g = static.draft.block_size
    ws = static.widths if static.widths is not None else getattr(static.policy, "verify_widths", None)
    ws = verify_widths(g, ws)
    fixed = constant_length(static.policy, g)
    if fixed is not None:
        return (next(w for w in ws if w >= min(fixed, g) + 1),)
    return ws

def width_index(lengths: jax.Array, active: jax.Array, widths: Sequence[int]) -> jax.Array:
    """Index into ``widths`` (sorted, last >= G+1) of the smallest width >= max(lengths of
    active rows) + 1 (scalar int32; ``widths[0]`` when no row is active). lengths/active [B]."""
    longest = jnp.max(jnp.where(active, lengths, 0), initial=0)
    ws = jnp.asarray(widths, jnp.int32)
    return jnp.minimum(jnp.sum((ws < longest + 1).astype(jnp.int32)), len(widths) - 1)

def default_spans(max_len: int, n: int = NUM_SPANS) -> tuple[int, ...]:
    """The default compiled cache spans for capacity L: ceil(k L / n) rounded up to SPAN_ALIGN,
    k = 1..n, at most L (L = 448: 128, 256, 384, 448; L <= SPAN_ALIGN: L alone). A step whose
    longest row holds p positions attends over the smallest span >= p instead of all L slots,
    so attention reads the used part of the cache (to within SPAN_ALIGN or L/n), at the price
    of up to n times more compiled verification branches."""
    return tuple(sorted({min(max_len, -(-math.ceil(k * max_len / n) // SPAN_ALIGN) * SPAN_ALIGN)
                         for k in range(1, n + 1)}))

def compiled_spans(static, max_len: int) -> tuple[int, ...]:
    """The cache spans the round / AR step of ``static`` compiles for capacity ``max_len``:
    ``static.spans`` (sorted, capacity added, ConfigError outside [1, L]) or ``default_spans``."""
    if static.spans is None:
        return default_spans(max_len)
    spans = sorted({int(s) for s in static.spans} | {max_len})
    if spans[0] < 1 or spans[-1] > max_len:
        raise ConfigError(f"cache spans must be in [1, cache capacity {max_len}], got {sorted(static.spans)}")
    return tuple(spans)

def span_index(pos: jax.Array, active: jax.Array, spans: Sequence[int]) -> jax.Array:
    """Index into ``spans`` (sorted, last = capacity) of the smallest span >= the longest active
    row's committed length ``pos`` [B] (scalar int32; 0 when no row is active). Finished rows may
    read a truncated cache: their outputs are masked no-ops."""
    longest = jnp.max(jnp.where(active, pos, 0), initial=0)
    ss = jnp.asarray(spans, jnp.int32)
    return jnp.minimum(jnp.sum((ss < longest).astype(jnp.int32)), len(spans) - 1)

by_span = runtime.by_span

def round_up(x: int, m: int) -> int:
    return int(math.ceil(x / m) * m)

def plan_shapes(prompts: Sequence[Sequence[int]], max_new_tokens: int, slack: int,
                max_positions: int, max_cache_len: int | None) -> tuple[int, int]:
    """(P, L): padded prompt length and cache capacity; InputError when a request does not fit."""
    longest = max(len(p) for p in prompts)
    need = longest + max_new_tokens + slack
    if max_cache_len is not None and not 0 < max_cache_len <= max_positions:
        raise InputError(f"--max-cache-len {max_cache_len} must be in [1, {max_positions}] (the "
                         f"context of the model: max_position_embeddings = {max_positions})")
    limit = max_positions if max_cache_len is None else min(max_cache_len, max_positions)
    for i, p in enumerate(prompts):
        if len(p) + max_new_tokens + slack > limit:
            which = ("max_cache_len" if max_cache_len is not None and max_cache_len < max_positions
                     else "max_position_embeddings")
            raise InputError(
                f"prompt {i}: length {len(p)} + max_new_tokens {max_new_tokens} + block slack "
                f"{slack} = {len(p) + max_new_tokens + slack} exceeds the cache capacity "
                f"({which} = {limit})")
    max_len = max_cache_len if max_cache_len is not None else min(round_up(need, CACHE_BUCKET), limit)
    bucket = max(MIN_PROMPT_BUCKET, 1 << (longest - 1).bit_length())
    return min(bucket, max_len), max_len


def buckets(max_len: int) -> list[int]:
    """The prompt buckets for cache capacity ``max_len`` (powers of two >= MIN_PROMPT_BUCKET)."""
    out, p = [], MIN_PROMPT_BUCKET
    while p < max_len:
        out.append(p)
        p *= 2
    out.append(max_len)
    return out


def bucket_of(n: int, max_len: int) -> int:
    return next(b for b in buckets(max_len) if b >= n)


def warmup_prompts(prompts, max_len: int) -> list[int]:
    """Indices of one prompt per prompt bucket (the longest in it): decoding them compiles
    every shape a continuous run of ``prompts`` at cache capacity ``max_len`` will use."""
    best: dict[int, int] = {}
    for i, p in enumerate(prompts):
        b = bucket_of(len(p), max_len)
        if b not in best or len(p) > len(prompts[best[b]]):
            best[b] = i
    return sorted(best.values())
