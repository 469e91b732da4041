"""DeepSeek-V4 decoding with its cache (``deepseek_v4.cache.V4Cache``): prefill, multi-token extends
and rejected tokens equal a full recompute; greedy decoding through the engine reproduces the
golden fixture's tokens (batch 1, all prompts in one batch, continuously batched, on a mesh)."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.target import deepseek_v4 as v4
from test_deepseek_v4 import WIDE_MIX as MIX  # CSA, HCA, sliding, CSA
from test_deepseek_v4 import _hf_model, _random_params, _rel, _small

FIX = Path(__file__).parent / "fixtures" / "deepseek_v4_tiny"


def _full_logits(params, cfg, tokens):
    hidden, _, _ = v4.forward(params, cfg, tokens, None)
    return np.asarray(v4.compute_logits(params, cfg, hidden))


@functools.partial(jax.jit, static_argnums=(1, 4))
def _extend(params, cfg, tokens, cache, span=None):
    hidden, _, delta = v4.forward(params, cfg, tokens, cache, span=span)
    return v4.compute_logits(params, cfg, hidden), delta


WIDTH = 8  # every extend feeds 8 tokens and commits the first n (the rest are rejected drafts)


def _decode_in_steps(params, cfg, tokens, prefill, counts, capacity=64, span=None):
    """Logits [B, prefill + sum(counts)]: a prefill of ``prefill`` tokens, then one extend of
    WIDTH tokens per entry of ``counts`` [n per row] committing each row's first n (2 compiles)."""
    b, total = tokens.shape
    padded = jnp.pad(tokens, ((0, 0), (0, WIDTH)))
    cache = v4.init_cache(cfg, b, capacity, params["embed"].dtype)
    logits, delta = _extend(params, cfg, tokens[:, :prefill], cache, span)
    cache = cache.commit(delta, jnp.full((b,), prefill, jnp.int32))
    out, p = [np.asarray(logits)], prefill
    for n in counts:
        logits, delta = _extend(params, cfg, padded[:, p:p + WIDTH], cache, span)
        cache = cache.commit(delta, jnp.full((b,), n, jnp.int32))
        out.append(np.asarray(logits)[:, :n])
        p += n
    assert p <= total
    return np.concatenate(out, axis=1), cache


@pytest.mark.parametrize("topk, window, hca", [(2, 8, 8), (64, 5, 4)])
def test_cached_extends_equal_the_full_forward(topk, window, hca):
    """A prefill of 13 then extends committing 1..8 tokens (crossing window, CSA-ratio and
    HCA-ratio boundaries; top-k below and above the entry count; the uncommitted tail of each
    extend is a rejected draft) give the full forward's logits."""
    cfg = _small(num_hidden_layers=4, layer_types=MIX, mlp_layer_types=("hash_moe", "moe", "moe", "moe"),
                 index_topk=topk, sliding_window=window, hca_ratio=hca)
    params = _random_params(cfg)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 40)), jnp.int32)
    got, cache = _decode_in_steps(params, cfg, tokens, 13, (1, 6, 3, 5, 4, 8))
    assert _rel(got, _full_logits(params, cfg, tokens)) < 1e-5
    assert int(cache.lengths[0]) == 40
    # entries are written once their window is complete: 40 // 4 CSA and 40 // hca HCA ones
    assert np.linalg.norm(np.asarray(cache.csa.entries[:, :, :10]), axis=-1).min() > 0
    assert np.all(np.asarray(cache.csa.entries[:, :, 10:]) == 0)
    assert np.all(np.asarray(cache.hca.entries[:, :, 40 // hca:]) == 0)


def test_rejected_tokens_never_reach_the_cache():
    """Rows of different lengths (15, 14) extend by 8, commit 2 and 3 (the rest rejected), then go on with
    other tokens: logits equal a full recompute of the accepted sequences (the partial compressor
    windows are rebuilt from the ring, no pooled state is undone); a ``span`` covering every row
    gives the same logits."""
    cfg = _small(num_hidden_layers=4, layer_types=MIX, mlp_layer_types=("hash_moe", "moe", "moe", "moe"))
    params = _random_params(cfg, seed=1)
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, cfg.vocab_size, (2, 40)).astype(np.int32)
    cache = v4.init_cache(cfg, 2, 64)
    _, delta = _extend(params, cfg, jnp.asarray(tokens[:, :WIDTH]), cache)
    cache = cache.commit(delta, jnp.asarray([8, 7], jnp.int32))
    _, delta = _extend(params, cfg, jnp.asarray(np.stack([tokens[0, 8:16], tokens[1, 7:15]])), cache)  # at 8, 7
    cache = cache.commit(delta, jnp.asarray([7, 7], jnp.int32))
    ext = np.stack([tokens[0, 15:15 + WIDTH], tokens[1, 14:14 + WIDTH]])
    ext[:, 2:] = rng.integers(0, cfg.vocab_size, (2, WIDTH - 2))  # drafts that will be rejected
    _, delta = _extend(params, cfg, jnp.asarray(ext), cache)
    cache = cache.commit(delta, jnp.asarray([2, 3], jnp.int32))     # row 1 keeps one rejected-looking token
    accepted = [np.concatenate([tokens[0, :17]]), np.concatenate([tokens[1, :16], ext[1, 2:3]])]
    follow = rng.integers(0, cfg.vocab_size, (2, WIDTH)).astype(np.int32)
    for span in (None, 32):
        logits, _ = _extend(params, cfg, jnp.asarray(follow), cache, span)
        for b in range(2):
            seq = jnp.asarray(np.concatenate([accepted[b], follow[b]])[None])
            ref = _full_logits(params, cfg, seq)[0, len(accepted[b]):]
            assert _rel(np.asarray(logits)[b], ref) < 1e-5, (b, span)


@pytest.mark.slow
def test_cached_extends_match_transformers_built_in_the_test(tmp_path):
    """transformers' DeepseekV4ForCausalLM (16 experts top-4, HCA ratio 8, window 8 < the prompt, a
    CSA / HCA / sliding mix, top-k >= entries where its full-sequence forward is causal): our
    cached prefill + extends give its logits in float32; in bfloat16 they stay as close to the
    float32 truth as transformers' bfloat16 forward."""
    import torch
    from dspark_jax.convert import checkpoint
    model, tokens = _hf_model(tmp_path / "wide", index_topk=16)
    with torch.no_grad():
        ref = model(tokens).logits.numpy()
    cfg, params = checkpoint.load_target(tmp_path / "wide")
    ids = jnp.asarray(tokens.numpy(), jnp.int32)
    got, _ = _decode_in_steps(params, cfg, ids, 11, (1, 6, 5, 8, 7, 2))
    assert _rel(got, ref) < 1e-4
    cfg16, params16 = checkpoint.load_target(tmp_path / "wide", dtype="bfloat16")
    got16, _ = _decode_in_steps(params16, cfg16, ids, 11, (1, 6, 5, 8, 7, 2))
    from transformers import DeepseekV4ForCausalLM
    with torch.no_grad():
        ref16 = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "wide", dtype=torch.bfloat16).eval()(
            tokens).logits.float().numpy()
    # bfloat16 noise (amplified by these random weights' routing flips): about as far from the
    # float32 truth as transformers' own bfloat16 forward
    err = lambda x: float(np.abs(x - ref).mean() / np.abs(ref).mean())  # noqa: E731
    assert err(got16) < 1.5 * err(ref16) and err(got16) < 0.15, (err(got16), err(ref16))
    assert (got16.argmax(-1) == ref.argmax(-1)).mean() > 0.9


def _golden():
    return json.loads((FIX / "decode_greedy.json").read_text())


@pytest.mark.slow
def test_greedy_decoding_reproduces_the_fixture():
    """decode_greedy.json (3 prompts of 80, 53, 136 tokens; 24 greedy tokens each, made by a full
    transformers forward per step) token for token: all in one batch, and continuously batched
    through 2 slots (rows refilled mid-run). One prompt at a time: the DSpark module's greedy
    test (tests/test_deepseek_v4_dspark_decode.py), whose batch of one reproduces these tokens."""
    from dspark_jax.convert import checkpoint
    from dspark_jax.decode.api import autoregressive_generate
    ref = _golden()
    cfg, params = checkpoint.load_target(FIX / "target")
    n = len(ref["output_ids"][0])
    for batch, batching in ((3, "static"), (2, "continuous")):
        res = autoregressive_generate(cfg, params, ref["prompts"], max_new_tokens=n, batch_size=batch,
                                      batching=batching, cache_spans=(256,), max_cache_len=256)
        assert [list(r.output_ids) for r in res] == ref["output_ids"], (batch, batching)


@pytest.mark.slow
def test_generate_command_decodes_v4_on_an_expert_mesh(tmp_path):
    """`dspark-jax generate` loads the transformers-layout checkpoint and decodes the fixture's
    prompts without a drafter, continuously batched on a data=2 x expert=4 mesh of simulated
    devices: the fixture's tokens."""
    from dspark_jax import cli
    ref = _golden()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ref["prompts"]))
    out = tmp_path / "out.jsonl"
    rc = cli.main(["generate", "--target", str(FIX / "target_hf"), "--prompts", str(prompts), "--out", str(out),
                   "--max-new-tokens", str(len(ref["output_ids"][0])), "--batch-size", "2",
                   "--mesh", "data=2,expert=4", "--stop-token-ids", "--max-cache-len", "256"])
    assert rc in (0, None)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["output_ids"] for r in rows] == ref["output_ids"]


def test_cache_declares_its_axes_and_fits_the_engine():
    """Every cache leaf has one batch axis, every delta leaf one batch and one step axis (what
    the engine's put_row / pad_steps / sharding read); an empty model part has no leaves."""
    from dspark_jax import runtime
    cfg = _small(num_hidden_layers=2, layer_types=("sliding_attention", "heavily_compressed_attention"),
                 mlp_layer_types=("hash_moe", "moe"))
    cache = v4.init_cache(cfg, 3, 32, jnp.bfloat16)
    assert cache.csa is None and cache.index is None and cache.capacity == 32
    leaves = jax.tree.leaves(cache)
    axes = jax.tree.leaves(cache.axes(), is_leaf=lambda a: isinstance(a, tuple))
    assert len(leaves) == len(axes) == 5
    for x, a in zip(leaves, axes):
        assert len(a) == x.ndim and a.count(runtime.BATCH) == 1 and x.shape[a.index(runtime.BATCH)] == 3
    assert cache.window.dtype == jnp.bfloat16 and cache.hca.kv.dtype == jnp.float32
    _, delta = _extend(_random_params(cfg), cfg, jnp.zeros((3, WIDTH), jnp.int32), v4.init_cache(cfg, 3, 32))
    daxes = jax.tree.leaves(cache.delta_axes(), is_leaf=lambda a: isinstance(a, tuple))
    for x, a in zip(jax.tree.leaves(delta), daxes):
        assert x.shape[a.index(runtime.BATCH)] == 3 and x.shape[a.index(runtime.STEP)] == WIDTH
    padded = runtime.pad_steps(delta, cache.delta_axes(), 11)
    assert padded.window.shape[2] == 11 and dataclasses.is_dataclass(padded)


def test_sequences_shorter_than_a_compression_window():
    """3 tokens (< the CSA ratio 4 and the HCA ratio 8: no entry exists yet) run whole and cached."""
    cfg = _small(num_hidden_layers=2, layer_types=MIX[:2], mlp_layer_types=("hash_moe", "moe"))
    params = _random_params(cfg)
    tokens = jnp.asarray([[3, 1, 4], [1, 5, 9]], jnp.int32)
    logits, _ = _extend(params, cfg, tokens, v4.init_cache(cfg, 2, 16))
    assert _rel(np.asarray(logits), _full_logits(params, cfg, tokens)) < 1e-5


def test_feature_cache_of_a_v4_target_holds_the_layers_stream_means(tmp_path):
    """`dspark-jax cache` on the V4 fixture (upstream layout) stores, per token, the stream means of
    the tapped layers' outputs (what V4's DSpark reads) and the final hidden state: the fixture's
    ``layer_mean`` / ``last_hidden`` made by transformers."""
    from dspark_jax import cli
    from dspark_jax.data import cache as cache_lib
    ref = np.load(FIX / "forward.npz")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": ids.tolist(), "loss_mask": [1] * len(ids)}) + "\n"
                            for ids in ref["input_ids"]))
    assert cli.main(["cache", "--target", str(FIX / "target"), "--data", str(data), "--out", str(tmp_path / "fc"),
                     "--layer-ids", "1,3,5", "--max-length", "160", "--quiet"]) in (0, None)
    cache = cache_lib.FeatureCache(tmp_path / "fc")
    for i in range(2):
        rec = cache[i]
        feats = rec["features"].reshape(160, 3, 64).transpose(1, 0, 2)
        for k, layer in enumerate((1, 3, 5)):
            assert _rel(feats[k], ref["layer_mean"][layer, i]) < 1e-4, (i, layer)
        assert _rel(rec["last_hidden"], ref["last_hidden"][i]) < 1e-4
