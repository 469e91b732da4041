"""Eagle3 test-time training (DeepSpec's ``compute_eagle3_loss``): the TTT forward and its loss.

Shapes: B rows of S positions, K = ``ttt_length`` steps, V vocab, H hidden.

Step k (0..K-1) runs the module once over all S positions: position i reads token
``input_ids[i + k + 1]`` (0 past the end), the hidden state step k-1 produced at i (step 0:
``fc(features)[i]``) and rotary position ``i + k``; it predicts the token k+2 ahead of i, whose
target distribution is ``softmax(target_logits[i + k + 1])`` (uniform past the end). All steps
share one KV cache: query i of step k sees step 0's keys j <= i and the key at i of each step
1..k (each keeps its own step's rotary), and only while ``i < length - k``; other queries'
attention output is 0. The loss of step k is the soft cross-entropy summed over its positions
``position_mask[k]`` (``loss_mask`` without the row's last valid position, shifted left by k),
weighted ``step_loss_decay ** k``; every term is divided by the caller's denominator (DeepSpec:
B * S of the batch; the trainer: of the global batch).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax import nn
from dspark_jax.draft.eagle3 import model as m


class TTTForward(NamedTuple):
    """Per step k: logits [K, B, S, V] f32, hidden [K, B, S, H] (step k's layer output)."""

    logits: jax.Array
    hidden: jax.Array


def shift_left(x: jax.Array, n: int) -> jax.Array:
    """x [B, S] shifted left by n along S, zero-filled."""
    return jnp.pad(x[:, n:], ((0, 0), (0, min(n, x.shape[1]))))


def lengths_of(loss_mask: jax.Array) -> jax.Array:
    """[B] valid length of rows with no attention mask: one past the last loss position (the
    positions after it carry no loss and, for Eagle3, no target either)."""
    s = loss_mask.shape[1]
    idx = jnp.arange(1, s + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(loss_mask > 0, idx, 0), axis=1).astype(jnp.int32)


def _attend(q, k0, v0, diag_k, diag_v, live, scale):
    """Step attention: q [B, S, Hq, D] against step 0's keys (causal) and the diagonal keys of
    steps 1..k (lists of [B, S, Hkv, D]); rows with ``live`` [B, S] False give 0."""
    b, s, hq, d = q.shape
    hkv = k0.shape[2]
    qg = q.reshape(b, s, hkv, hq // hkv, d).astype(jnp.float32)
    causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k0.astype(jnp.float32))
    visible = causal[None, None, None] & live[:, None, None, :, None]
    parts, masks = [scores], [jnp.broadcast_to(visible, scores.shape)]
    for kd in diag_k:
        sc = jnp.einsum("bqhgd,bqhd->bhgq", qg, kd.astype(jnp.float32))[..., None]
        parts.append(sc)
        masks.append(jnp.broadcast_to(live[:, None, None, :, None], sc.shape))
    probs = nn.masked_softmax(jnp.concatenate(parts, -1), jnp.concatenate(masks, -1), scale)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs[..., :s], v0.astype(jnp.float32))
    for j, vd in enumerate(diag_v):
        out = out + probs[..., s + j].transpose(0, 3, 1, 2)[..., None] * vd.astype(jnp.float32)[:, :, :, None]
    return out.reshape(b, s, hq, d).astype(q.dtype)


def ttt_hidden(p: dict, cfg, input_ids: jax.Array, features: jax.Array, lengths: jax.Array,
               steps: int | None = None, remat: bool = False):
    """The K steps' layer outputs [K, B, S, H] (before ``norm``); same inputs as ``ttt_forward``."""
    k_steps = steps or cfg.ttt_length
    b, s = input_ids.shape
    h = m.project_features(p, cfg, features)
    base = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    scale = m.scale(cfg)
    k0 = v0 = None
    diag_k, diag_v, outs = [], [], []

    def one(p, h, ids, pos, k0, v0, diag_k, diag_v, live):
        q, k, v = m.step_inputs(p, cfg, h, ids, pos)
        kk, vv = (k, v) if k0 is None else (k0, v0)
        dk, dv = (diag_k, diag_v) if k0 is None else (diag_k + [k], diag_v + [v])
        return m.step_output(p, cfg, h, _attend(q, kk, vv, dk, dv, live, scale)), k, v

    if remat:
        one = jax.checkpoint(one)
    for step in range(k_steps):
        live = jnp.arange(s)[None, :] < (lengths - step)[:, None]
        h, k, v = one(p, h, shift_left(input_ids, step + 1), base + step, k0, v0, diag_k, diag_v, live)
        if k0 is None:
            k0, v0 = k, v
        else:
            diag_k, diag_v = diag_k + [k], diag_v + [v]
        outs.append(h)
    return jnp.stack(outs)


def ttt_forward(p: dict, cfg, input_ids: jax.Array, features: jax.Array, lengths: jax.Array,
                steps: int | None = None) -> TTTForward:
    """input_ids [B, S]; features [B, S, 5H] (tapped target layers, concatenated in
    ``target_layer_ids`` order); lengths [B] valid positions per row -> ``TTTForward``."""
    hidden = ttt_hidden(p, cfg, input_ids, features, lengths, steps)
    return TTTForward(m.logits(p, cfg, hidden), hidden)


def position_masks(loss_mask: jax.Array, lengths: jax.Array, steps: int) -> jax.Array:
    """[K, B, S] float: step k's loss positions (``loss_mask`` less the last valid position,
    shifted left by k)."""
    s = loss_mask.shape[1]
    pm0 = loss_mask.astype(jnp.float32) * (jnp.arange(s)[None, :] < (lengths - 1)[:, None])
    return jnp.stack([shift_left(pm0, k) for k in range(steps)])


def target_probs(target_logits: jax.Array, step: int) -> jax.Array:
    """[B, S, V] step ``step``'s soft targets: softmax(target_logits[i + step + 1]), uniform past S."""
    b, s, v = target_logits.shape
    p = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)
    n = step + 1
    tail = jnp.full((b, min(n, s), v), 1.0 / v, jnp.float32)
    return jnp.concatenate([p[:, n:], tail], axis=1)


def step_sums(logits: jax.Array, target_logits: jax.Array, mask: jax.Array, step: int) -> dict:
    """Additive statistics of one step: logits [B, S, V], mask [B, S] -> ce (soft cross-entropy
    sum), valid, correct (argmax agreement), accept (sum of clamp(1 - TV, 0, 1)) and the per-position
    correct / accept [B, S] (for tau)."""
    q = target_probs(target_logits, step)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    ce = -(q * logp).sum(-1)
    valid = mask > 0
    correct = (jnp.argmax(logits, -1) == jnp.argmax(q, -1)) & valid
    acc = jnp.clip(1.0 - 0.5 * jnp.abs(jnp.exp(logp) - q).sum(-1), 0.0, 1.0)
    acc = jax.lax.stop_gradient(acc) * valid
    return {"ce": (ce * mask).sum(), "valid": valid.sum().astype(jnp.float32),
            "correct": correct.sum().astype(jnp.float32), "accept": acc.sum(),
            "correct_map": correct, "accept_map": acc}


def loss_sums(p: dict, cfg, input_ids, features, last_hidden, loss_mask, *, lengths=None,
              steps: int | None = None, remat: bool = False) -> dict:
    """Additive sums of one (micro-)batch: ``loss`` (sum_k decay^k * ce_k), per-step
    ``ce`` / ``valid`` / ``correct`` / ``accept`` [K], and the tau numerators over rows valid at
    step 0 (``tau_rows``, ``tau_greedy``, ``tau_prob``: sums of leading correct / cumulative
    accept products). ``last_hidden`` [B, S, H]: the target's hidden after its final norm."""
    lengths = lengths_of(loss_mask) if lengths is None else lengths
    hidden = ttt_hidden(p, cfg, input_ids, features, lengths, steps, remat=remat)
    return hidden_sums(p, cfg, hidden, last_hidden, loss_mask, lengths, remat=remat)


def hidden_sums(p: dict, cfg, hidden, last_hidden, loss_mask, lengths, remat: bool = False) -> dict:
    """``loss_sums`` of the steps' layer outputs hidden [K, B, S, H] (``ttt_hidden``). ``remat``:
    each step's [B, S, V] logits and softmaxes are recomputed in the backward pass, not kept
    (K of them at S = 4096 and a 152k vocabulary are 17 GB)."""
    k_steps = hidden.shape[0]
    target_logits = jax.lax.stop_gradient(m.head(p, cfg, last_hidden.astype(hidden.dtype)))
    masks = position_masks(loss_mask, lengths, k_steps)
    def one(p, h, target_logits, mask, k):
        return step_sums(m.logits(p, cfg, h), target_logits, mask, k)
    if remat:
        one = jax.checkpoint(one, static_argnums=(4,))
    per = [one(p, hidden[k], target_logits, masks[k], k) for k in range(k_steps)]
    decay = jnp.asarray([cfg.step_loss_decay ** k for k in range(k_steps)], jnp.float32)
    stack = lambda key: jnp.stack([d[key] for d in per])
    ce = stack("ce")
    rows = masks[0] > 0
    lead = jnp.cumprod(stack("correct_map").astype(jnp.float32), axis=0).sum(0)
    prob = jnp.cumprod(stack("accept_map"), axis=0).sum(0)
    return {"loss": (decay * ce).sum(), "ce": ce, "valid": stack("valid"),
            "correct": stack("correct"), "accept": stack("accept"),
            "tau_rows": rows.sum().astype(jnp.float32), "tau_greedy": (lead * rows).sum(),
            "tau_prob": (prob * rows).sum()}


def finalize(sums: dict, denominator) -> tuple[jax.Array, dict]:
    """(loss, metrics) from (globally) summed ``loss_sums``: loss = sums["loss"] / denominator;
    ``step_loss@k``, ``accuracy@k``, ``accept_rate@k`` and the two tau estimates."""
    loss = sums["loss"] / denominator
    out = {"loss": loss}
    for k in range(sums["ce"].shape[0]):
        n = jnp.maximum(sums["valid"][k], 1.0)
        out[f"step_loss@{k}"] = sums["ce"][k] / denominator
        out[f"accuracy@{k}"] = sums["correct"][k] / n
        out[f"accept_rate@{k}"] = sums["accept"][k] / n
    rows = jnp.maximum(sums["tau_rows"], 1.0)
    out["tau_greedy"] = 1.0 + sums["tau_greedy"] / rows
    out["tau_probabilistic"] = 1.0 + sums["tau_prob"] / rows
    out["expected_accept_length"] = out["tau_probabilistic"]
    return loss, out
