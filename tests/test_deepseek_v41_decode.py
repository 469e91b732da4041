"""DeepSeek-V4.1's decode cache: cached greedy decoding equals the reference's tokens, and the
cached path equals the whole-sequence forward across compression boundaries with rejected drafts.

One compiled step (B rows, K = 16 new tokens, commit of each row's first n_new) serves prefill
chunks, greedy steps (the last token + K - 1 junk tokens, n_new = 1) and draft verification
(junk after the accepted tokens): only accepted tokens reach the cache.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import families
from dspark_jax.convert import checkpoint
from dspark_jax.target import deepseek_v41 as v41

FIX = Path(__file__).parent / "fixtures" / "deepseek_v41_tiny"
K = 16


@pytest.fixture(scope="module")
def loaded():
    return checkpoint.load_target(FIX / "target")


@functools.partial(jax.jit, static_argnums=(1,))
def _step(params, cfg, cache, tokens, n_new):
    hidden, _, delta = v41.forward(params, cfg, tokens, cache)
    return v41.compute_logits(params, cfg, hidden), cache.commit(delta, n_new)


def _greedy(cfg, params, prompts, new_tokens: int) -> list[list[int]]:
    """Greedy continuation of every prompt (rows batched, each at its own length)."""
    rt = families.target_runtime(cfg)
    cache = rt.init_cache(cfg, len(prompts), 256, jnp.float32)
    fed = [0] * len(prompts)
    out = [[] for _ in prompts]
    junk = np.random.default_rng(0)
    while any(len(o) < new_tokens for o in out):
        tokens = junk.integers(0, cfg.vocab_size, (len(prompts), K)).astype(np.int32)
        n_new = np.zeros(len(prompts), np.int32)
        for b, p in enumerate(prompts):
            if fed[b] < len(p):
                n_new[b] = min(K, len(p) - fed[b])
                tokens[b, :n_new[b]] = p[fed[b]:fed[b] + n_new[b]]
            elif len(out[b]) < new_tokens:
                n_new[b], tokens[b, 0] = 1, out[b][-1]
        logits, cache = _step(params, cfg, cache, jnp.asarray(tokens), jnp.asarray(n_new))
        logits = np.asarray(logits)
        for b, p in enumerate(prompts):
            if n_new[b] and len(out[b]) < new_tokens and fed[b] + n_new[b] >= len(p):
                out[b].append(int(logits[b, n_new[b] - 1].argmax()))
            fed[b] += int(n_new[b])
    return out


def test_cached_greedy_decoding_equals_the_reference(loaded):
    cfg, params = loaded
    ref = json.loads((FIX / "decode_greedy.json").read_text())
    assert _greedy(cfg, params, ref["prompts"], ref["new_tokens"]) == ref["output_ids"]


@pytest.mark.slow  # a second compile of the cached step (without the quantizers); ~15 s quiet
def test_cached_path_equals_the_whole_sequence_with_rejected_drafts(loaded):
    """Without the quantizers (smooth): chunks of 1..K accepted tokens followed by rejected junk,
    crossing every ratio-2 group boundary and the candidate blocks; logits within 1e-4 of the
    whole sequence's (the reference's, which our whole-sequence forward gives to 1e-5:
    test_deepseek_v41.py; comparing to it saves a compile)."""
    cfg, params = loaded
    cfg = dataclasses.replace(cfg, qat=False)
    ref = np.load(FIX / "forward_noqat.npz")
    tokens, full = np.asarray(ref["input_ids"]), ref["logits"]
    cache = v41.FAMILY.runtime.init_cache(cfg, 2, 256, jnp.float32)
    rng = np.random.default_rng(1)
    pos, got = 0, np.zeros_like(full)
    while pos < tokens.shape[1]:
        n = min(int(rng.integers(1, K + 1)), tokens.shape[1] - pos)
        chunk = rng.integers(0, cfg.vocab_size, (2, K)).astype(np.int32)
        chunk[:, :n] = tokens[:, pos:pos + n]
        logits, cache = _step(params, cfg, cache, jnp.asarray(chunk), jnp.full((2,), n, jnp.int32))
        got[:, pos:pos + n] = np.asarray(logits)[:, :n]
        pos += n
    assert int(cache.lengths[0]) == tokens.shape[1]
    assert np.abs(got - full).max() < 1e-4
