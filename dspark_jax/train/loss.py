"""DSpark loss: CE + TV (L1) distance + confidence BCE, each weighted by exp(-k / gamma) at block
position k over the eval mask and divided by the global sum of those weights; and metrics.

Everything is expressed as sums (numerators and denominators) so a caller can
add them over micro-batches or data-parallel shards before dividing: the
denominators are then global, as the reference requires.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from dspark_jax.config import LossConfig
from dspark_jax.config import DraftConfig
from dspark_jax.draft import model as draft_model
from dspark_jax.draft.model import TrainForward, TrainHidden

EPS = 1e-6


def decay_weights(eval_mask: jax.Array, loss_decay_gamma: float) -> jax.Array:
    """w[..., k] = eval_mask * exp(-k / loss_decay_gamma), [B, N, G] float32."""
    g = eval_mask.shape[-1]
    return eval_mask.astype(jnp.float32) * jnp.exp(-jnp.arange(g, dtype=jnp.float32) / loss_decay_gamma)


EXPECTED_ACCEPT_LENGTH_NOTE = (
    "expected_accept_length is a training-batch estimate, 1 + sum_k prod_{i<=k} (1 - TV(draft_i, "
    "target_i)) at temperature 1 on the last step's training rows with the true tokens in each "
    "block's context; eval's tau is measured by decoding held-out prompts at their --temperature, "
    "each round conditioned on the drafter's own samples, so tau is usually lower")


def accept_rate_targets(draft_logits: jax.Array, target_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(c* = clamp(1 - TV, 0, 1), L1 distance) per position, both [B, N, G] float32."""
    p = jax.nn.softmax(draft_logits.astype(jnp.float32), axis=-1)
    q = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)
    l1 = jnp.abs(p - q).sum(-1)
    return jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0), l1


def loss_sums(fwd: TrainForward, cfg: LossConfig) -> dict[str, jax.Array]:
    """Additive statistics of one (micro-)batch: loss numerators, denominators, metric sums."""
    w = decay_weights(fwd.eval_mask, cfg.loss_decay_gamma)
    valid = fwd.eval_mask.astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(fwd.draft_logits.astype(jnp.float32),
                                                         fwd.target_ids)
    sums = {"weight": w.sum(), "ce": (ce * w).sum(), "valid_tokens": valid.sum(),
            "valid_per_position": valid.sum(axis=(0, 1))}
    if fwd.aligned_target_logits is not None:
        c_star, l1 = accept_rate_targets(fwd.draft_logits, fwd.aligned_target_logits)
        c_star = jax.lax.stop_gradient(c_star)
        sums["l1"] = (l1 * w).sum()
        sums["accept_per_position"] = (c_star * valid).sum(axis=(0, 1))
        valid_blocks = (fwd.block_keep_mask & fwd.eval_mask.any(-1)).astype(jnp.float32)
        tau = 1.0 + jnp.cumprod(c_star * valid, axis=-1).sum(-1)
        sums["tau"] = (tau * valid_blocks).sum()
        sums["blocks"] = valid_blocks.sum()
        if fwd.confidence_logits is not None:
            logit = fwd.confidence_logits.astype(jnp.float32)
            bce = optax.sigmoid_binary_cross_entropy(logit, c_star)
            sums["confidence"] = (bce * w).sum()
            sums["confidence_abs_error"] = (jnp.abs(jax.nn.sigmoid(logit) - c_star) * w).sum()
    return sums


def finalize(sums: dict[str, jax.Array], cfg: LossConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Total loss and named metrics from (globally) summed statistics."""
    den = sums["weight"] + EPS
    terms = {"ce_loss": sums["ce"] / den}
    loss = cfg.ce_weight * terms["ce_loss"]
    if "l1" in sums:
        terms["l1_loss"] = sums["l1"] / den
        loss = loss + cfg.l1_weight * terms["l1_loss"]
        per_pos = sums["accept_per_position"] / jnp.maximum(sums["valid_per_position"], 1.0)
        for k in range(per_pos.shape[0]):
            terms[f"accept_rate@{k}"] = per_pos[k]
        terms["expected_accept_length"] = sums["tau"] / jnp.maximum(sums["blocks"], 1.0)
    if "confidence" in sums:
        terms["confidence_loss"] = sums["confidence"] / den
        terms["confidence_abs_error"] = sums["confidence_abs_error"] / den
        loss = loss + cfg.confidence_weight * terms["confidence_loss"]
    terms["loss"] = loss
    return loss, terms


def dspark_loss(fwd: TrainForward, cfg: LossConfig = LossConfig()):
    """Loss and metrics of a whole batch (denominators over everything in ``fwd``)."""
    return finalize(loss_sums(fwd, cfg), cfg)


def chunked_loss_sums(p: dict, config: DraftConfig, th: TrainHidden, cfg: LossConfig, chunk: int = 0,
                      constrain=None, ops=None) -> dict[str, jax.Array]:
    """``loss_sums`` of ``training_forward`` computed ``chunk`` anchors at a time.

    p: compute-dtype drafter params (``draft_model.cast_params``); th from
    ``draft_model.training_hidden``. The [B, N, G, V] logits, softmaxes and
    their gradients never exist at once: each chunk's heads and loss run under
    ``jax.checkpoint`` inside ``lax.map``, so only [B, chunk, G, V] is live and the
    backward pass recomputes it. N is padded with empty (not kept, not evaluated)
    blocks to a multiple of ``chunk``; they add exactly 0 to every sum. chunk 0 (or
    >= N): one piece, no loop. ``constrain`` (x -> x) pins chunk activations' sharding.
    ``ops``: the drafter family's backbone functions (``families.draft_ops``; None = ``draft.model``'s default).
    """
    b, n, g = th.target_ids.shape
    pin = constrain or (lambda x: x)

    def sums_of(piece: TrainHidden):
        logits, conf, aligned = draft_model.block_heads(p, config, pin(piece.hidden), piece.prev_ids,
                                                        None if piece.target_hidden is None
                                                        else pin(piece.target_hidden), ops=ops)
        fwd = TrainForward(pin(logits), conf, piece.target_ids, piece.eval_mask,
                           None if aligned is None else pin(aligned), piece.block_keep_mask)
        return loss_sums(fwd, cfg)

    if chunk <= 0 or chunk >= n:
        return sums_of(th)
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n

    def split(x):  # [B, N, ...] -> [n_chunks, B, chunk, ...], padded with zeros / False
        if x is None:
            return None
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, n_chunks, chunk, *x.shape[2:]), 1, 0)

    pieces = TrainHidden(*(split(x) for x in th))
    per_chunk = jax.lax.map(jax.checkpoint(sums_of), pieces)
    return jax.tree.map(lambda x: x.sum(axis=0), per_chunk)
