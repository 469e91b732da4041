"""Tiny hand-built target/drafter pairs and exact target distributions, for losslessness checks.

The target (vocab 8) gives token ``TARGET_ZERO`` probability exactly 0 in every
context; the drafter never proposes ``DRAFT_ZERO`` (the target does) and proposes
``TARGET_ZERO`` often, so acceptance, rejection and residual sampling are all
exercised. The confidence head reads the previous token strongly, so c_k
varies with x_{k-1} (which an anticipating policy can exploit).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.draft import model as draft_model
from dspark_jax.target import qwen3

VOCAB = 8
TARGET_ZERO = 3   # the target never emits this token
DRAFT_ZERO = 5    # the drafter never proposes this token


def tiny_pair(block_size: int = 2, seed: int = 0):
    """(target_cfg, target_params, draft_cfg, draft_params) with deliberately different distributions."""
    tcfg = TargetConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, rope_theta=1e4,
                        max_position_embeddings=64)
    dcfg = DraftConfig.for_target(tcfg, num_hidden_layers=1, target_layer_ids=(0,),
                                  block_size=block_size, mask_token_id=VOCAB - 1, num_anchors=4,
                                  markov_rank=4, markov_head_type="vanilla")
    tp, dp = _build_params(tcfg, dcfg, seed)
    return tcfg, tp, dcfg, dp


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _build_params(tcfg, dcfg, seed):
    """All params in one compiled call (eager init would compile dozens of tiny ops)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    tp = qwen3.init_params(tcfg, ks[0])
    tp["layers"] = jax.tree.map(lambda a: a * 3.0 if a.ndim == 3 else a, tp["layers"])
    embed = jax.random.normal(ks[1], (VOCAB, 16))
    tp["embed_tokens"] = embed.at[:, 0].set(4.0)              # dim 0: constant, dominant
    head = 0.25 * jax.random.normal(ks[2], (16, VOCAB))
    tp["lm_head"] = head.at[:, TARGET_ZERO].set(0.0).at[0, TARGET_ZERO].set(-1e3)

    dp = draft_model.init_params(dcfg, ks[3], embed_tokens=tp["embed_tokens"])
    dp["lm_head"] = 0.25 * jax.random.normal(ks[4], (16, VOCAB))
    w1 = 0.5 * jax.random.normal(ks[5], (VOCAB, 4)).at[:, 0].set(1.0)   # latent dim 0 constant
    w2 = 0.5 * jax.random.normal(ks[6], (4, VOCAB)).at[0, DRAFT_ZERO].set(-1e3).at[0, TARGET_ZERO].set(1.5)
    dp["markov_head"] = {"markov_w1": w1, "markov_w2": w2}
    kernel = jnp.concatenate([0.05 * jax.random.normal(ks[7], (16, 1)),
                              jnp.array([[0.0], [3.0], [-3.0], [2.0]])], axis=0)
    dp["confidence_head"] = {"kernel": kernel, "bias": jnp.zeros((1,))}
    return tp, dp


def exact_joint(tcfg: TargetConfig, tparams: dict, prompt, n: int, temperature: float) -> np.ndarray:
    """Exact target distribution [V]*n of the first n sampled tokens after ``prompt`` (float64)."""
    v = tcfg.vocab_size
    prefixes = np.array(list(itertools.product(range(v), repeat=n - 1)), np.int32).reshape(-1, n - 1)
    toks = np.concatenate([np.tile(np.asarray(prompt, np.int32), (len(prefixes), 1)), prefixes], 1)
    hidden, _, _ = qwen3.forward(tparams, tcfg, jnp.asarray(toks))
    logits = np.asarray(qwen3.compute_logits(tparams, hidden), np.float64)[:, len(prompt) - 1:]
    z = logits / temperature
    z = z - z.max(-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(-1, keepdims=True)                           # [V^(n-1), n, V]
    out = np.zeros((v,) * n)
    for i, pre in enumerate(prefixes):
        prob = 1.0
        for t in range(n - 1):
            prob *= p[i, t, pre[t]]
        out[tuple(pre)] = prob * p[i, n - 1]
    return out


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of ``counts`` against ``probs`` (cells with small expectation pooled).

    Any count in a cell of probability 0 gives p = 0.
    """
    from scipy import stats

    counts = counts.reshape(-1).astype(np.float64)
    probs = probs.reshape(-1)
    total = counts.sum()
    if np.any(counts[probs <= 0] > 0):
        return 0.0
    expected = probs * total
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep]))
    return float(stats.chi2.sf(stat, keep.sum() - 1))
