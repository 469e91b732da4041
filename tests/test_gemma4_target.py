"""Gemma4 text target: the reference fixture, transformers' own model, checkpoint loading."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import params as params_lib
from dspark_jax.errors import CheckpointError, ConfigError
from dspark_jax.target import gemma4

FIXTURE = Path(__file__).parent / "fixtures" / "dspark_gemma4_tiny"


@pytest.fixture(scope="module")
def fixture_target():
    cfg, params = gemma4.load_params(FIXTURE / "target")
    return cfg, jax.tree.map(jnp.asarray, params)


# ------------------------------------------------------------------ (a) the reference fixture


def test_fixture_features_hidden_and_logits(fixture_target):
    cfg, params = fixture_target
    data = np.load(FIXTURE / "train_forward.npz")
    ids = jnp.asarray(data["tgt_input_ids"])
    assert ids.shape[1] > cfg.sliding_window
    hidden, taps, _ = jax.jit(lambda p, i: gemma4.forward(p, cfg, i, tap_layer_ids=(0, 2, 4)))(params, ids)
    logits = gemma4.compute_logits(params, cfg, hidden)
    for name, got in (("tgt_hidden_states", taps), ("tgt_last_hidden_states", hidden), ("tgt_logits", logits)):
        ref = data[name]
        err = np.abs(np.asarray(got) - ref).max()
        assert err <= 1e-4 * max(1.0, np.abs(ref).max()), (name, err)


@pytest.mark.parametrize("layout", ["stacked", "per-layer params and cache"])
def test_fixture_cached_extends_match_full_pass(fixture_target, layout):
    """Prefill + multi-token extends past the window give the full pass's logits; the same with
    per-layer params (params.unstack_layers of both stacks: an unrolled layer loop) over per-layer
    cache buffers (ring and full): GPU decode's form."""
    from dspark_jax import params as params_lib
    cfg, params = fixture_target
    ids = jnp.asarray(np.load(FIXTURE / "train_forward.npz")["tgt_input_ids"])
    full, _, _ = gemma4.forward(params, cfg, ids)
    p = params if layout == "stacked" else params_lib.unstack_layers(params, gemma4.STACKS)
    cache = gemma4.init_cache(cfg, ids.shape[0], 80, per_layer=layout.endswith("cache"))
    assert cache.per_layer == layout.endswith("cache")
    step = jax.jit(lambda p, i, c: gemma4.forward(p, cfg, i, c))
    start = 0
    for size in (20, 7, 1, 12, 24):
        hidden, _, cache = step(p, ids[:, start:start + size], cache)
        np.testing.assert_allclose(np.asarray(hidden), np.asarray(full[:, start:start + size]), atol=1e-4)
        start += size
    assert start == ids.shape[1] and (np.asarray(cache.lengths) == start).all()
    if layout != "stacked":
        np.testing.assert_allclose(np.asarray(gemma4.forward(p, cfg, ids)[0]), np.asarray(full), atol=1e-4)


def test_ring_cache_matches_full_length_cache(fixture_target):
    """Sliding ring of window-1+max_extend slots == full-length cache, through padded prefill,
    random extends of <= max_extend tokens and rollbacks to a kept prefix (speculative decoding)."""
    cfg, params = fixture_target
    rng = np.random.default_rng(3)
    b, max_extend, max_len = 3, 8, 160
    ring = gemma4.ring_slots(cfg, max_extend)
    full = gemma4.init_cache(cfg, b, max_len)
    small = gemma4.init_cache(cfg, b, max_len, max_extend=max_extend)
    assert small.k["sliding"].shape[3] == ring < max_len and small.k["full"].shape[3] == max_len
    step = jax.jit(lambda p, i, c, n: gemma4.forward(p, cfg, i, c, num_new=n))
    lens = jnp.asarray([40, 9, 25])
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, 40)))
    outs = [step(params, prompt, c, lens) for c in (full, small)]
    for row, n in enumerate(np.asarray(lens)):
        np.testing.assert_allclose(np.asarray(outs[0][0][row, :n]), np.asarray(outs[1][0][row, :n]), atol=1e-4)
    full, small = outs[0][2], outs[1][2]
    for _ in range(14):  # extends of t tokens padded to max_extend (one compile, as in a round)
        t = int(rng.integers(1, max_extend + 1))
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, max_extend)))
        num = jnp.full((b,), t, jnp.int32)
        (h_full, _, full), (h_small, _, small) = (step(params, tokens, c, num) for c in (full, small))
        np.testing.assert_allclose(np.asarray(h_full[:, :t]), np.asarray(h_small[:, :t]), atol=1e-4)
        keep = np.asarray(full.lengths) - t + rng.integers(1, t + 1, b)
        full, small = full.replace(lengths=jnp.asarray(keep)), small.replace(lengths=jnp.asarray(keep))
    assert int(np.asarray(full.lengths).min()) > ring + cfg.sliding_window   # every ring wrapped


def test_fixture_loads_through_declaration(tmp_path):
    """Tied head: no lm_head.weight; every stored tensor is declared and used; multimodal layout."""
    from safetensors.numpy import load_file, save_file

    hf = json.loads((FIXTURE / "target" / "config.json").read_text())
    cfg = gemma4.Gemma4TargetConfig.from_hf(hf)
    state = load_file(str(FIXTURE / "target" / "model.safetensors"))
    decl = gemma4.declare(cfg, gemma4.checkpoint_prefix(hf))
    assert set(params_lib.torch_shapes(decl)) == set(state)
    assert ("lm_head",) not in decl and cfg.tie_word_embeddings
    tree = params_lib.from_torch(decl, state)
    assert "v_proj" not in tree["full"] and "v_proj" in tree["sliding"]
    # multimodal layout: the same tensors under model.language_model., towers ignored
    mm_dir = tmp_path / "mm"
    mm_dir.mkdir()
    mm = {k.replace("model.", "model.language_model.", 1): v for k, v in state.items()}
    mm["model.vision_tower.patch.weight"] = np.zeros((2, 2), np.float32)
    save_file(mm, str(mm_dir / "model.safetensors"))
    wrapped = {"architectures": ["Gemma4UnifiedForConditionalGeneration"], "model_type": "gemma4_unified",
               "text_config": hf}
    (mm_dir / "config.json").write_text(json.dumps(wrapped))
    assert gemma4.checkpoint_prefix(wrapped) == "model.language_model."
    mm_cfg, mm_tree = gemma4.load_params(mm_dir)
    assert mm_cfg == cfg
    jax.tree.map(np.testing.assert_array_equal, mm_tree, tree)
    # a missing tensor is a CheckpointError naming it
    del mm["model.language_model.layers.3.layer_scalar"]
    save_file(mm, str(mm_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match="layers.3.layer_scalar"):
        gemma4.load_params(mm_dir)


def test_config_round_trip_and_errors():
    hf = json.loads((FIXTURE / "target" / "config.json").read_text())
    cfg = gemma4.Gemma4TargetConfig.from_hf(hf)
    assert gemma4.Gemma4TargetConfig.from_hf(cfg.to_hf()) == cfg
    assert cfg.full_num_key_value_heads == 1 and cfg.layer_ids("full_attention") == (2, 5)
    for change, match in (({"enable_moe_block": True}, "enable_moe_block"),
                          ({"hidden_size_per_layer_input": 256}, "hidden_size_per_layer_input"),
                          ({"model_type": "qwen3"}, "model_type"),
                          ({"hidden_activation": "silu"}, "hidden_activation"),
                          ({"layer_types": ["sliding_attention"] * 5}, "layer_types")):
        with pytest.raises(ConfigError, match=match):
            gemma4.Gemma4TargetConfig.from_hf({**hf, **change})
    text = {k: v for k, v in hf.items() if k != "hidden_size_per_layer_input"}
    with pytest.raises(ConfigError, match="hidden_size_per_layer_input"):   # gemma4_text default is 256
        gemma4.Gemma4TargetConfig.from_hf({**text, "model_type": "gemma4_text"})


# ------------------------------------------------------------------ (b) transformers' Gemma4 text model

CONFIGS = {
    # window 8, sliding/full mix, k = v on full layers, partial rotary 0.25, tied head
    "kv_shared_tied": dict(model_type="gemma4_text", layer_types=["sliding_attention", "full_attention",
                                                                  "sliding_attention", "sliding_attention",
                                                                  "full_attention"],
                           attention_k_eq_v=True, num_global_key_value_heads=1, tie_word_embeddings=True,
                           partial_rotary_factor=0.25),
    # no k = v (full layers keep v_proj and num_key_value_heads), partial 0.5, untied head, unified text
    "separate_v_untied": dict(model_type="gemma4_unified_text", layer_types=["full_attention", "sliding_attention",
                                                                             "sliding_attention", "full_attention"],
                              attention_k_eq_v=False, num_global_key_value_heads=None, tie_word_embeddings=False,
                              partial_rotary_factor=0.5),
}


def _hf_model(name):
    torch = pytest.importorskip("torch")
    spec = dict(CONFIGS[name])
    partial = spec.pop("partial_rotary_factor")
    model_type = spec.pop("model_type")
    hf = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=len(spec["layer_types"]),
              num_attention_heads=4, num_key_value_heads=2, head_dim=12, global_head_dim=16, sliding_window=8,
              final_logit_softcapping=5.0, rms_norm_eps=1e-6, max_position_embeddings=256,
              hidden_activation="gelu_pytorch_tanh", enable_moe_block=False, num_kv_shared_layers=0,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                                  "partial_rotary_factor": partial}}, **spec)
    if model_type == "gemma4_text":
        from transformers.models.gemma4 import Gemma4ForCausalLM as Model, Gemma4TextConfig as Config
        hf["hidden_size_per_layer_input"] = 0
    else:
        from transformers.models.gemma4_unified import (Gemma4UnifiedForCausalLM as Model,
                                                        Gemma4UnifiedTextConfig as Config)
    torch.manual_seed(0)
    model = Model(Config(**hf, attn_implementation="eager")).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, t in model.named_parameters():
            scale = 0.3 if ("norm" in pname) else 0.08
            base = 1.0 if "norm" in pname else 0.0
            t.copy_(base + scale * torch.randn(t.shape, generator=gen))
        for pname, t in model.named_buffers():
            if pname.endswith("layer_scalar"):
                t.copy_(0.6 + 0.8 * torch.rand(t.shape, generator=gen))
    return model, {**hf, "model_type": model_type}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_transformers_prefill_and_extends(name):
    torch = pytest.importorskip("torch")
    model, hf = _hf_model(name)
    cfg = gemma4.Gemma4TargetConfig.from_hf(hf)
    assert cfg.sliding_window == 8 and cfg.attention_k_eq_v == CONFIGS[name]["attention_k_eq_v"]
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    params = jax.tree.map(jnp.asarray, params_lib.from_torch(gemma4.declare(cfg, "model."), state))
    assert ("v_proj" in params["full"]) != cfg.attention_k_eq_v

    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (2, 34))
    with torch.no_grad():
        out = model(torch.as_tensor(ids), output_hidden_states=True)
    ref_logits = out.logits.numpy()

    # no cache: logits and tapped layer outputs
    hidden, taps, _ = gemma4.forward(params, cfg, jnp.asarray(ids), tap_layer_ids=(-1, 1, 2))
    logits = np.asarray(gemma4.compute_logits(params, cfg, hidden))
    assert np.abs(logits - ref_logits).max() <= 1e-4
    ref_taps = np.concatenate([out.hidden_states[i + 1].numpy() for i in (-1, 1, 2)], axis=-1)
    assert np.abs(np.asarray(taps) - ref_taps).max() <= 1e-4 * max(1.0, np.abs(ref_taps).max())

    # prefill 20 then extends of 6 + 5 + 3 (well past the window of 8); full-length and ring sliding caches
    step = jax.jit(lambda p, i, c: gemma4.forward(p, cfg, i, c))
    for slots in (None, 6):
        cache = gemma4.init_cache(cfg, 2, 40, max_extend=slots)
        start = 0
        for size in (20, 6, 5, 3):
            hidden, _, cache = step(params, jnp.asarray(ids[:, start:start + size]), cache)
            got = np.asarray(gemma4.compute_logits(params, cfg, hidden))
            assert np.abs(got - ref_logits[:, start:start + size]).max() <= 1e-4, (slots, size, start)
            start += size

    # per-row lengths + rollback: row 1 keeps only 17 of the first 20 tokens, then both extend
    cache = gemma4.init_cache(cfg, 2, 40)
    _, _, cache = step(params, jnp.asarray(ids[:, :20]), cache)
    cache = cache.replace(lengths=jnp.asarray([20, 17]))
    other = rng.integers(0, cfg.vocab_size, (2, 6))
    hidden, _, cache = step(params, jnp.asarray(other), cache)
    got = np.asarray(gemma4.compute_logits(params, cfg, hidden))
    for row, keep in ((0, 20), (1, 17)):
        seq = np.concatenate([ids[row, :keep], other[row]])[None]
        with torch.no_grad():
            ref = model(torch.as_tensor(seq)).logits.numpy()[0, keep:]
        assert np.abs(got[row] - ref).max() <= 1e-4, row
    assert list(np.asarray(cache.lengths)) == [26, 23]


def test_sharded_and_bf16_forward(fixture_target):
    """Params placed by their logical axes on a data/fsdp/tensor mesh give the same outputs; bf16 runs."""
    from dspark_jax import sharding

    cfg, params = fixture_target
    ids = jnp.asarray(np.load(FIXTURE / "train_forward.npz")["tgt_input_ids"])
    run = jax.jit(lambda p, i: gemma4.forward(p, cfg, i, tap_layer_ids=(0, 2, 4))[:2])
    ref_h, ref_t = run(params, ids)
    mesh = sharding.make_mesh("data=1,fsdp=2,tensor=4")
    sharded = sharding.shard_params(params, gemma4.param_axes(cfg), mesh)
    h, t = run(sharded, jax.device_put(ids, sharding.batch_sharding(mesh, 2)))
    np.testing.assert_allclose(np.asarray(h), np.asarray(ref_h), atol=1e-4)
    np.testing.assert_allclose(np.asarray(t), np.asarray(ref_t), atol=1e-4)

    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    h16, _ = run(bf16, ids)
    assert h16.dtype == jnp.bfloat16
    logits16 = np.asarray(gemma4.compute_logits(bf16, cfg, h16))
    logits = np.asarray(gemma4.compute_logits(params, cfg, ref_h))
    assert np.mean(logits16.argmax(-1) == logits.argmax(-1)) > 0.9
    # the embedding scale is cast to the weight dtype first: sqrt(3840) -> 62.0 in bf16
    table = jnp.ones((2, 3840), jnp.bfloat16)
    assert float(gemma4.embed(table, jnp.asarray([0]))[0, 0]) == 62.0
