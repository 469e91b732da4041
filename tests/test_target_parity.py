"""Qwen3 target parity with Hugging Face Qwen3ForCausalLM built in the test (float32)."""

import numpy as np
import pytest
import torch
import jax.numpy as jnp
from transformers import Qwen3Config, Qwen3ForCausalLM

from dspark_jax.config import TargetConfig
from dspark_jax.convert import mapping
from dspark_jax.target import qwen3

CONFIGS = [
    dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0),
    dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True, rope_theta=1e6),
    dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False, rope_theta=500.0),
]


def build_hf(seed, **kw):
    cfg = Qwen3Config(vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                      head_dim=12, max_position_embeddings=256, **kw)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # make the norms non-trivial so a skipped norm is caught
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def to_jax(model):
    cfg = TargetConfig.from_hf(model.config.to_dict())
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    params = mapping.target_from_torch(cfg, sd)
    import jax
    return cfg, jax.tree.map(jnp.asarray, params)


@pytest.mark.parametrize("kw", CONFIGS, ids=["gqa2-untied", "mqa-tied", "mha-theta500"])
def test_prefill_and_cached_extend_match_hf(kw):
    model = build_hf(0, **kw)
    cfg, params = to_jax(model)
    rng = np.random.RandomState(1)
    ids = rng.randint(0, cfg.vocab_size, (2, 14))
    taps = (-1, 0, 1)
    with torch.no_grad():
        out = model(torch.tensor(ids), output_hidden_states=True)
    ref_logits = out.logits.numpy()

    hidden, tap_feats, _ = qwen3.forward(params, cfg, jnp.asarray(ids), tap_layer_ids=taps)
    np.testing.assert_allclose(np.asarray(qwen3.compute_logits(params, hidden)), ref_logits, atol=1e-4, rtol=0)
    h = cfg.hidden_size
    for n, layer in enumerate(taps):  # HF hidden_states[i+1] is decoder layer i's raw output
        np.testing.assert_allclose(np.asarray(tap_feats[..., n * h:(n + 1) * h]),
                                   out.hidden_states[layer + 1].numpy(), atol=1e-4, rtol=0)

    # Prefill 6 then extend 5 + 3 through the static cache; rows at different lengths.
    cache = qwen3.init_cache(cfg, 2, 32)
    pieces = []
    for lo, hi in ((0, 6), (6, 11), (11, 14)):
        hid, _, cache = qwen3.forward(params, cfg, jnp.asarray(ids[:, lo:hi]), cache)
        pieces.append(np.asarray(qwen3.compute_logits(params, hid)))
    np.testing.assert_allclose(np.concatenate(pieces, 1), ref_logits, atol=1e-4, rtol=0)
    assert np.asarray(cache.lengths).tolist() == [14, 14]


def test_per_layer_weights_match_hf():
    """The target's layers as separate per-layer buffers (params.unstack_layers: an unrolled layer
    loop, what XLA:GPU reads without copying them) give HF's logits, taps and the same cache."""
    from dspark_jax import params as params_lib
    model = build_hf(2, **CONFIGS[1])
    cfg, params = to_jax(model)
    per_layer = params_lib.unstack_layers(params)
    assert len(per_layer["layers"]) == cfg.num_hidden_layers
    ids = np.random.RandomState(5).randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        out = model(torch.tensor(ids), output_hidden_states=True)
    hidden, taps, _ = qwen3.forward(per_layer, cfg, jnp.asarray(ids), tap_layer_ids=(-1, 1))
    np.testing.assert_allclose(np.asarray(qwen3.compute_logits(params, hidden)), out.logits.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(taps[..., cfg.hidden_size:]), out.hidden_states[2].numpy(), atol=1e-4, rtol=0)
    caches = []
    # stacked params + stacked cache; per-layer params over the stacked cache; per-layer both
    # (decode's form on GPUs: one cache buffer per layer, written by one scatter per layer)
    for p, apart in ((params, False), (per_layer, False), (per_layer, True)):
        cache = qwen3.init_cache(cfg, 2, 16, per_layer=apart)
        assert cache.per_layer == apart and cache.capacity == 16
        _, _, cache = qwen3.forward(p, cfg, jnp.asarray(ids[:, :5]), cache)
        hid, _, cache = qwen3.forward(p, cfg, jnp.asarray(ids[:, 5:]), cache, num_new=jnp.array([4, 2]))
        np.testing.assert_allclose(np.asarray(qwen3.compute_logits(params, hid)), out.logits.numpy()[:, 5:],
                                   atol=1e-4, rtol=0)
        caches.append(cache)
    for cache in caches[1:]:
        for name in ("k", "v"):
            np.testing.assert_allclose(np.stack(getattr(cache, name)), np.asarray(getattr(caches[0], name)),
                                       atol=1e-6, rtol=0)
        assert np.asarray(cache.lengths).tolist() == [9, 7]
    assert caches[2].axes().k == (qwen3.LAYER_KV_AXES,) * cfg.num_hidden_layers
    with pytest.raises(ValueError, match="per-layer params"):
        qwen3.forward(params, cfg, jnp.asarray(ids[:, :2]), qwen3.init_cache(cfg, 2, 16, per_layer=True))


def test_per_row_positions_and_rollback():
    """Rows at different cache lengths extend independently; rolling back = setting lengths."""
    model = build_hf(3, **CONFIGS[0])
    cfg, params = to_jax(model)
    rng = np.random.RandomState(2)
    a, b = rng.randint(0, cfg.vocab_size, 9), rng.randint(0, cfg.vocab_size, 5)
    with torch.no_grad():
        ref_a = model(torch.tensor(a[None])).logits.numpy()[0]
        ref_b = model(torch.tensor(b[None])).logits.numpy()[0]
    cache = qwen3.init_cache(cfg, 2, 16)
    # Prefill padded prompts of lengths 6 and 3.
    toks = np.zeros((2, 6), np.int64)
    toks[0], toks[1, :3] = a[:6], b[:3]
    _, _, cache = qwen3.forward(params, cfg, jnp.asarray(toks), cache, num_new=jnp.array([6, 3]))
    # Garbage extend, then roll back to the committed lengths.
    _, _, cache = qwen3.forward(params, cfg, jnp.full((2, 3), 7), cache)
    cache = cache.replace(lengths=jnp.array([6, 3]))
    ext = np.zeros((2, 3), np.int64)
    ext[0], ext[1, :2] = a[6:9], b[3:5]
    hid, _, cache = qwen3.forward(params, cfg, jnp.asarray(ext), cache, num_new=jnp.array([3, 2]))
    logits = np.asarray(qwen3.compute_logits(params, hid))
    np.testing.assert_allclose(logits[0], ref_a[6:9], atol=1e-4, rtol=0)
    np.testing.assert_allclose(logits[1, :2], ref_b[3:5], atol=1e-4, rtol=0)
    assert np.asarray(cache.lengths).tolist() == [9, 5]


def test_writes_past_capacity_are_dropped():
    model = build_hf(4, **CONFIGS[0])
    cfg, params = to_jax(model)
    cache = qwen3.init_cache(cfg, 1, 8)
    _, _, cache = qwen3.forward(params, cfg, jnp.ones((1, 6), jnp.int32), cache)
    k_before = np.asarray(cache.k[:, :, :, :6])
    _, _, cache2 = qwen3.forward(params, cfg, jnp.ones((1, 4), jnp.int32), cache)  # slots 6..9
    np.testing.assert_array_equal(np.asarray(cache2.k[:, :, :, :6]), k_before)
