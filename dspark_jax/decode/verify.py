"""Lossless rejection sampling on a padded verify block (speculative sampling, paper section 4).

Row b verifies only its own ``lengths[b]`` = l_b draft tokens; block positions
k >= l_b are ignored. Shapes: B rows, G draft tokens, V vocab.

Losslessness never depends on the drafter being finite: a row whose draft logits are not a
distribution (NaN, +inf) at a verified position rejects all its drafts and takes the target's
own token at x0 (the decision reads only the drafter, so the output law stays the target's).
Target logits that are not a distribution at a position the row uses end the row's tokens
there with ``sampling.NONFINITE`` (the host raises naming it: a broken target cannot be
verified against).
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from dspark_jax import sampling


class Verdict(NamedTuple):
    """Per-row outcome. All [B]."""

    accepted: jax.Array        # int32: accepted draft tokens (cut at a stop token, which counts)
    next_token: jax.Array      # int32: replacement/bonus token (meaningless when stopped)
    stopped: jax.Array         # bool: a stop token among the accepted drafts ended generation
    proposal_length: jax.Array  # int32: l_b, or (stop index + 1) when stopped (the reference's count)


def first_true(mask: jax.Array) -> jax.Array:
    """[B, K] bool -> [B] int32 index of the first True (K when none)."""
    k = mask.shape[-1]
    return jnp.min(jnp.where(mask, jnp.arange(k, dtype=jnp.int32), k), axis=-1, initial=k)


def rejection_sample(
    key: jax.Array,
    target_logits: jax.Array,
    draft_logits: jax.Array,
    draft_tokens: jax.Array,
    lengths: jax.Array,
    temperature,
    greedy: bool,
    stop_ids: jax.Array,
    draw_width: int | None = None,
) -> Verdict:
    """Verify drafts.

    target_logits [B, G+1, V]: the target's logits after x0, x_1..x_G (position k
    predicts the token after x_k); draft_logits [B, G, V]: the Markov-corrected
    logits x_1..x_G were sampled from; draft_tokens [B, G]; lengths [B] in [0, G];
    stop_ids [S] (-1 = unused slot). ``greedy`` is static: argmax comparisons.
    G may be 0 (nothing to verify: the next token comes from the target at x0).
    ``draw_width`` (static, >= G; default G): the acceptance uniforms are drawn for this many
    positions and the first G used, so verifying a narrower prefix of a block (the decode
    round's width) consumes the same random numbers as verifying all of it.
    """
    b, g = draft_tokens.shape
    chex.assert_shape(draft_logits, (b, g, None))
    chex.assert_shape(target_logits, (b, g + 1, draft_logits.shape[-1]))
    chex.assert_shape(lengths, (b,))
    k_idx = jnp.arange(g, dtype=jnp.int32)[None, :]
    in_len = k_idx < lengths[:, None]
    rows = jnp.arange(b)
    draft_bad = jnp.any(~sampling.well_defined(draft_logits) & in_len, axis=-1)        # [B]
    lengths = jnp.where(draft_bad, 0, lengths)
    in_len = in_len & ~draft_bad[:, None]
    if greedy:
        target_argmax = sampling.argmax(target_logits)  # [B, G+1]
        accept = draft_tokens == target_argmax[:, :g]
    else:
        key_u, key_s = sampling.split(key)
        p_t = jax.nn.softmax(target_logits.astype(jnp.float32) / temperature, axis=-1)
        p_d = jax.nn.softmax(draft_logits.astype(jnp.float32) / temperature, axis=-1)
        pt_x = jnp.take_along_axis(p_t[:, :g], draft_tokens[..., None], axis=-1)[..., 0]
        pd_x = jnp.take_along_axis(p_d, draft_tokens[..., None], axis=-1)[..., 0]
        u = sampling.uniform(key_u, (b, max(g, draw_width or g)), jnp.float32)[:, :g]
        accept = u * jnp.maximum(pd_x, 1e-8) < pt_x  # u < min(1, p_t / p_d)
    accept = accept & in_len
    accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)

    is_stop = jnp.any(draft_tokens[..., None] == stop_ids[None, None, :], axis=-1)
    stop_at = first_true(is_stop & (k_idx < accepted[:, None]))
    stopped = stop_at < g
    accepted = jnp.where(stopped, stop_at + 1, accepted)
    proposal_length = jnp.where(stopped, stop_at + 1, lengths).astype(jnp.int32)

    if greedy:
        next_token = target_argmax[rows, accepted]
    else:
        # Rejected at a < l: residual norm(max(0, p_t - p_d)) at a; all l passed: p_t at l (bonus).
        pt_a = p_t[rows, accepted]
        pd_a = (jnp.where((accepted < lengths)[:, None], p_d[rows, jnp.minimum(accepted, g - 1)], 0.0)
                if g else jnp.zeros_like(pt_a))
        residual = jnp.maximum(pt_a - pd_a, 0.0)
        mass = jnp.sum(residual, axis=-1, keepdims=True)
        residual = jnp.where(mass <= 1e-8, pt_a, residual)
        next_token = sampling.sample_probs(key_s, residual)
    # the target's logits at the positions this row used (decisions 0..a-1, next token at a)
    first_bad = first_true(~sampling.well_defined(target_logits))                     # [B] (G+1: none)
    bad = (first_bad < accepted) | ((first_bad == accepted) & ~stopped)
    accepted = jnp.where(bad, first_bad, accepted)
    stopped = stopped & ~bad
    next_token = jnp.where(bad, sampling.NONFINITE, next_token)
    return Verdict(accepted, next_token.astype(jnp.int32), stopped, proposal_length)
