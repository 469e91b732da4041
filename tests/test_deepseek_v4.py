"""DeepSeek-V4 target: config from both layouts, declaration, forward parity, causality, conversion.

Fixture: tests/fixtures/deepseek_v4_tiny (made with transformers' DeepseekV4ForCausalLM; see
its README section in the golden set): ``target/`` upstream layout, ``target_hf/`` transformers'.
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
from dspark_jax.errors import ConfigError
from dspark_jax.target import deepseek_v4 as v4
from dspark_jax.target.deepseek_v4 import DeepseekV4Config

FIX = Path(__file__).parent / "fixtures" / "deepseek_v4_tiny"
LAYOUTS = ("target", "target_hf")


def _hf(layout: str) -> dict:
    return json.loads((FIX / layout / "config.json").read_text())


@functools.lru_cache(maxsize=None)
def _reference():
    return dict(np.load(FIX / "forward.npz"))


@functools.partial(jax.jit, static_argnums=(1,), static_argnames=("taps",))
def _run(params, cfg, tokens, taps=()):
    hidden, features, _ = v4.forward(params, cfg, tokens, None, taps=taps)
    return v4.compute_logits(params, cfg, hidden), hidden, features


def _rel(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float32) - b).max() / np.abs(b).max())


# ----------------------------------------------------------------------------- config


def test_config_reads_both_layouts_the_same():
    up, hf = (DeepseekV4Config.from_hf(_hf(x)) for x in LAYOUTS)
    assert up == hf
    assert up.layer_types[:3] == ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
    assert up.mlp_layer_types == ("hash_moe",) * 2 + ("moe",) * 4
    assert up.qk_rope_head_dim == 8 and up.yarn == (16.0, 256, 32.0, 1.0)
    assert DeepseekV4Config.from_hf(up.to_hf()) == up
    assert families.for_hf(_hf("target")).name == "deepseek_v4"


@pytest.mark.parametrize("change, field", [
    ({"compress_ratios": [0, 4, 128, 8, 128, 0]}, "compress_ratios"),
    ({"layer_types": ["sliding_attention"] * 5 + ["full_attention"]}, "attention type"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"expert_dtype": "int4"}, "expert_dtype"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"attention_bias": True}, "attention_bias"),
    ({"quantization_config": {"quant_method": "awq"}}, "quant_method"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_type"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                       "attention_factor": 1.277}}, "attention_factor"),
])
def test_config_refuses_what_is_not_implemented_by_name(change, field):
    hf = dict(_hf("target"), **change)
    with pytest.raises(ConfigError, match=field) as e:
        DeepseekV4Config.from_hf(hf)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- declaration


def test_declaration_names_every_fixture_tensor_once():
    from safetensors import safe_open
    cfg = DeepseekV4Config.from_hf(_hf("target"))
    specs = v4.declare(cfg)
    names = [n for s in specs.values() for n in s.torch_names()]
    assert len(names) == len(set(names))
    for layout in LAYOUTS:
        with safe_open(str(FIX / layout / "model.safetensors"), "np") as f:
            stored = list(f.keys())
        assert sorted(v4.source_names(_hf(layout), stored)) == sorted(names)
    experts = specs[("layers", "experts_w1")]
    assert experts.shape == (6, 8, 64, 32) and experts.torch_names()[9] == "layers.1.ffn.experts.1.w1.weight"
    assert v4.hf_name("layers.3.attn.indexer.compressor.ape") == \
        "model.layers.3.self_attn.compressor.indexer.position_bias"
    assert v4.hf_name("layers.0.ffn.shared_experts.w3.weight") == "model.layers.0.mlp.shared_experts.up_proj.weight"


# ----------------------------------------------------------------------------- forward parity


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_matches_transformers_fixture(layout):
    cfg, params = checkpoint.load_target(FIX / layout)
    ref = _reference()
    logits, hidden, features = _run(params, cfg, jnp.asarray(ref["input_ids"]), taps=tuple(range(6)))
    assert _rel(logits, ref["logits"]) < 1e-4
    assert _rel(hidden, ref["last_hidden"]) < 1e-4
    means = np.asarray(features).reshape(2, 160, 6, 64).transpose(2, 0, 1, 3)
    for i in range(6):
        assert _rel(means[i], ref["layer_mean"][i]) < 1e-4, i


def _small(**kw) -> DeepseekV4Config:
    base = dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=2, head_dim=16, q_lora_rank=16, qk_rope_head_dim=8, o_groups=2,
                o_lora_rank=8, layer_types=("compressed_sparse_attention", "heavily_compressed_attention",
                                            "sliding_attention"),
                mlp_layer_types=("hash_moe", "moe", "moe"), n_routed_experts=4, num_experts_per_tok=2,
                index_n_heads=2, index_head_dim=8, index_topk=2, sliding_window=8, hca_ratio=8,
                yarn=(16.0, 256, 32.0, 1.0))
    base.update(kw)
    return DeepseekV4Config(**base)


def _random_params(cfg, seed=0):
    """Every leaf random (incl. the zero-initialised sinks, ape, biases), tid2eid random experts."""
    rng = np.random.default_rng(seed)
    out = {}
    for path, s in v4.declare(cfg).items():
        if s.dtype == "int32":
            out[path] = rng.integers(0, cfg.n_routed_experts, s.shape).astype(np.int32)
        else:
            out[path] = ((1.0 if s.init == "ones" else 0.0) + 0.3 * rng.standard_normal(s.shape)).astype(np.float32)
    from flax import traverse_util
    return jax.tree.map(jnp.asarray, traverse_util.unflatten_dict(out))


def test_csa_top_k_is_causal():
    """index_topk (2) < entries (12 at 48 tokens): a prefix's logits do not change when tokens are
    appended, and the top-k does select (a larger top-k gives other logits)."""
    cfg = _small(num_hidden_layers=2, layer_types=("compressed_sparse_attention", "heavily_compressed_attention"),
                 mlp_layer_types=("hash_moe", "moe"))
    params = _random_params(cfg)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 48)), jnp.int32)
    full = np.asarray(_run(params, cfg, tokens)[0])
    prefix = np.asarray(_run(params, cfg, tokens[:, :29])[0])
    assert _rel(prefix, full[:, :29]) < 2e-5
    wide = np.asarray(_run(params, dataclasses.replace(cfg, index_topk=64), tokens)[0])
    assert np.abs(wide - full).max() > 1e-3


# ----------------------------------------------------------------------------- conversion


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_is_byte_exact_in_upstream_names(layout, tmp_path):
    from safetensors import safe_open
    checkpoint.convert(FIX / layout, tmp_path / "jax")
    checkpoint.convert(tmp_path / "jax", tmp_path / "torch", to="torch")
    with safe_open(str(FIX / layout / "model.safetensors"), "np") as a, \
            safe_open(str(tmp_path / "torch" / "model.safetensors"), "np") as b:
        names = v4.source_names(_hf(layout), list(a.keys()))
        assert sorted(b.keys()) == sorted(names)
        for declared, stored in names.items():
            x, y = a.get_tensor(stored), b.get_tensor(declared)
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), declared
    written = json.loads((tmp_path / "torch" / "config.json").read_text())
    assert written["compress_ratios"] == [0, 4, 128, 4, 128, 0] and written.get("layer_types") is None
    assert DeepseekV4Config.from_hf(written) == DeepseekV4Config.from_hf(_hf(layout))


# ----------------------------------------------------------------------------- transformers, other shapes


WIDE_MIX = ("compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention",
            "compressed_sparse_attention")


def _hf_model(tmp_path, index_topk: int, layer_types=WIDE_MIX):
    """A transformers DeepseekV4ForCausalLM of other shapes than the fixture (16 experts top-4, HCA
    ratio 8, window 8 < the prompt, CSA / HCA / sliding mix), every weight random, saved to disk."""
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV4Config as HFConfig, DeepseekV4ForCausalLM
    hfc = HFConfig(
        vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=2,
        head_dim=16, q_lora_rank=16, partial_rotary_factor=0.5, o_groups=2, o_lora_rank=8,
        layer_types=list(layer_types),
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        n_routed_experts=16, num_experts_per_tok=4, index_n_heads=2, index_head_dim=8, index_topk=index_topk,
        sliding_window=8, max_position_embeddings=1024,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(hfc).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if name.endswith("norm.weight") else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, 16, b.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    model.save_pretrained(tmp_path)
    tokens = torch.randint(0, 64, (2, 40), generator=g)
    return model, tokens


@pytest.mark.slow
def test_matches_transformers_built_in_the_test(tmp_path):
    """Logits equal transformers' at every position where its CSA is causal-equivalent (top-k >=
    entries; bfloat16 as accurate as transformers' bfloat16); with top-k < entries at the last
    position of each prompt when the only CSA layer is the last layer (no future entries exist
    for that query, and no earlier position's non-causal top-k feeds it), where transformers'
    full-sequence top-k is right (elsewhere it is not causal: see test_csa_top_k_is_causal)."""
    import torch
    model, tokens = _hf_model(tmp_path / "wide", index_topk=16)
    with torch.no_grad():
        ref = model(tokens).logits.numpy()
    cfg, params = checkpoint.load_target(tmp_path / "wide")
    assert cfg.n_routed_experts == 16 and cfg.hca_ratio == 8 and cfg.index_topk == 16
    ids = jnp.asarray(tokens.numpy(), jnp.int32)
    assert _rel(_run(params, cfg, ids)[0], ref) < 1e-4

    from transformers import DeepseekV4ForCausalLM
    checkpoint.convert(tmp_path / "wide", tmp_path / "jax")  # written back in the upstream layout:
    checkpoint.convert(tmp_path / "jax", tmp_path / "upstream", to="torch")  # transformers reads it
    with torch.no_grad():
        again = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "upstream", dtype=torch.float32).eval()(tokens)
    np.testing.assert_array_equal(again.logits.numpy(), ref)

    bf16 = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "wide", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref16 = bf16(tokens).logits.float().numpy()
    cfg16, params16 = checkpoint.load_target(tmp_path / "wide", dtype="bfloat16")
    assert params16["layers"]["hc_attn_fn"].dtype == jnp.float32 and params16["embed"].dtype == jnp.bfloat16
    ours16 = np.asarray(_run(params16, cfg16, ids)[0])
    # bfloat16 noise (amplified by these random weights' routing flips) is compared with transformers'
    # own: our bf16 logits are about as far from the float32 truth as transformers' bf16 logits are
    err = lambda x: float(np.abs(x - ref).mean() / np.abs(ref).mean())  # noqa: E731
    assert err(ours16) < 1.5 * err(ref16) and err(ours16) < 0.15, (err(ours16), err(ref16))
    assert (ours16.argmax(-1) == ref.argmax(-1)).mean() > 0.9

    model, tokens = _hf_model(tmp_path / "narrow", index_topk=3,  # 10 CSA entries at 40 tokens
                              layer_types=WIDE_MIX[1:3] + ("heavily_compressed_attention", WIDE_MIX[0]))
    cfg, params = checkpoint.load_target(tmp_path / "narrow")
    ids = jnp.asarray(tokens.numpy(), jnp.int32)
    with torch.no_grad():
        last = model(tokens).logits[:, -1].numpy()
    assert _rel(_run(params, cfg, ids)[0][:, -1], last) < 1e-4


@pytest.mark.parametrize("name, sizes", [
    ("deepseek-ai/DeepSeek-V4-Flash", dict(H=4096, L=43, nh=64, q=1024, g=8, o=1024, E=256, I=2048)),
    ("deepseek-ai/DeepSeek-V4-Pro", dict(H=7168, L=61, nh=128, q=1536, g=16, o=1024, E=384, I=3072)),
])
def test_presets_match_the_documented_sizes(name, sizes):
    """The declaration of the V4-Flash / V4-Pro presets against the sizes in DEEPSEEK_V4.md, and
    its parameter count against one written out here from those sizes (Flash 284.3B, Pro 1.573T)."""
    import math
    from dspark_jax import presets
    cfg = presets.TARGETS[name]
    specs = v4.declare(cfg)
    H, L, nh, q, g, o, E, I = (sizes[k] for k in ("H", "L", "nh", "q", "g", "o", "E", "I"))
    V, D, N, ih, idim = 129280, 512, 4, 64, 128
    assert specs[("layers", "wq_b")].torch_shape == (nh * D, q)
    assert specs[("layers", "wo_a")].torch_shape == (g * o, nh * D // g)
    assert specs[("layers", "experts_w1")].shape == (L, E, H, I)
    assert specs[("hash", "tid2eid")].shape == (3, V, 6)
    mix = (2 + N) * N
    per_layer = (H * q + q + q * nh * D + H * D + D + nh * D * o + g * o * H + nh + 2 * H
                 + 2 * (mix * N * H + mix + 3) + H * E + 3 * H * I + E * 3 * H * I)
    csa = 2 * H * 2 * D + 4 * 2 * D + D + 2 * H * 2 * idim + 4 * 2 * idim + idim + q * ih * idim + H * ih
    hca = 2 * H * D + 128 * D + D
    n_csa, n_hca = len(cfg.layer_ids("compressed_sparse_attention")), len(cfg.layer_ids("heavily_compressed_attention"))
    total = (2 * V * H + H + N * N * H + N + 1 + L * per_layer + 3 * V * 6 + (L - 3) * E
             + n_csa * csa + n_hca * hca)
    assert sum(math.prod(s.shape) for s in specs.values()) == total
