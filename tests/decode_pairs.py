"""Tiny hand-built target/drafter pairs and exact target distributions, for losslessness checks.

The target (vocab 8) gives token ``TARGET_ZERO`` probability exactly 0 in every
context; the drafter never proposes ``DRAFT_ZERO`` (the target does) and proposes
``TARGET_ZERO`` often, so acceptance, rejection and residual sampling are all
exercised. The confidence head reads the previous token strongly (logit about +-3 by
token parity-like pattern), so c_k varies with x_{k-1} (which an anticipating policy can
exploit). Params come from numpy's RNG: building them costs no XLA compilation.
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


@functools.lru_cache(maxsize=None)
def tiny_pair(block_size: int = 2, seed: int = 0):
    """(target_cfg, target_params, draft_cfg, draft_params) with deliberately different distributions.

    Cached: every test module of a session shares one pair (and so one set of compiled shapes).
    """
    tcfg = TargetConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, rope_theta=1e4,
                        max_position_embeddings=64)
    dcfg = DraftConfig.for_target(tcfg, num_hidden_layers=1, target_layer_ids=(0,),
                                  block_size=block_size, mask_token_id=VOCAB - 1, num_anchors=4,
                                  markov_rank=4, markov_head_type="vanilla")
    tp, dp = _build_params(tcfg, dcfg, seed)
    return tcfg, tp, dcfg, dp


def _random_like(tree, rng: np.random.Generator, std: float = 0.02) -> dict:
    """numpy init of an abstract params tree: norms 1, biases 0, the rest N(0, std^2)."""
    def leaf(path, a):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            return np.ones(a.shape, np.float32)
        if "bias" in name:
            return np.zeros(a.shape, np.float32)
        return (std * rng.standard_normal(a.shape)).astype(np.float32)
    return jax.tree_util.tree_map_with_path(leaf, tree)


def _build_params(tcfg, dcfg, seed):
    """All params with numpy's RNG (no XLA compilation: a jitted jax.random init took ~20 s)."""
    rng = np.random.default_rng(seed)
    key = jax.random.PRNGKey(0)  # only for eval_shape: the abstract tree structure, nothing runs
    tp = _random_like(jax.eval_shape(lambda k: qwen3.init_params(tcfg, k), key), rng)
    tp["layers"] = {k: a * 3.0 if a.ndim == 3 else a for k, a in tp["layers"].items()}
    embed = rng.standard_normal((VOCAB, 16)).astype(np.float32)
    embed[:, 0] = 4.0                                         # dim 0: constant, dominant
    tp["embed_tokens"] = embed
    head = (0.25 * rng.standard_normal((16, VOCAB))).astype(np.float32)
    head[:, TARGET_ZERO] = 0.0
    head[0, TARGET_ZERO] = -1e3
    tp["lm_head"] = head

    dp = _random_like(jax.eval_shape(lambda k: draft_model.init_params(dcfg, k), key), rng)
    dp["embed_tokens"] = embed
    dp["lm_head"] = (0.25 * rng.standard_normal((16, VOCAB))).astype(np.float32)
    w1 = (0.5 * rng.standard_normal((VOCAB, 4))).astype(np.float32)
    w1[:, 0] = 1.0                                            # latent dim 0 constant
    w1[:, 1] = 1.5 * np.array([1, -1, 1, -1, 1, -1, -1, 1])   # dim 1: read by the confidence head
    w2 = (0.5 * rng.standard_normal((4, VOCAB))).astype(np.float32)
    w2[0, DRAFT_ZERO] = -1e3
    w2[0, TARGET_ZERO] = 1.5
    dp["markov_head"] = {"markov_w1": w1, "markov_w2": w2}
    kernel = np.concatenate([0.05 * rng.standard_normal((16, 1)),
                             np.array([[0.0], [2.0], [0.0], [0.0]])], axis=0).astype(np.float32)
    dp["confidence_head"] = {"kernel": kernel, "bias": np.zeros((1,), np.float32)}
    return jax.tree.map(jnp.asarray, tp), jax.tree.map(jnp.asarray, dp)


@functools.partial(jax.jit, static_argnums=(1,))
def _target_logits(tparams, tcfg, tokens):
    from dspark_jax import families  # any registered target family (Qwen3, Gemma4)
    hidden, _, _ = families.for_config(tcfg).module().forward(tparams, tcfg, tokens)
    return families.compute_logits(tcfg, tparams, hidden)


def exact_joint(tcfg: TargetConfig, tparams: dict, prompt, n: int, temperature: float) -> np.ndarray:
    """Exact target distribution [V]*n of the first n sampled tokens after ``prompt`` (float64)."""
    v = tcfg.vocab_size
    prefixes = np.array(list(itertools.product(range(v), repeat=n - 1)), np.int32).reshape(-1, n - 1)
    toks = np.concatenate([np.tile(np.asarray(prompt, np.int32), (len(prefixes), 1)), prefixes], 1)
    logits = np.asarray(_target_logits(tparams, tcfg, jnp.asarray(toks)), np.float64)[:, len(prompt) - 1:]
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
