"""DeepSeek-V4.1 target: config, declaration, conversion, fake quantizers, Engram hash, forward
parity and causality.

Fixture: tests/fixtures/deepseek_v41_tiny (transformers main's DeepseekV41ForCausalLM; see its
README section in the golden set): ``target/`` upstream layout, ``target_hf/`` transformers' (its
config and tensor names),
``forward.npz`` (with the fake quantizers) / ``forward_noqat.npz`` (without), ``qat_ops.npz``.
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
from dspark_jax.target import deepseek_v41 as v41
from dspark_jax.target.deepseek_v41 import DeepseekV41Config, engram, qat

FIX = Path(__file__).parent / "fixtures" / "deepseek_v41_tiny"
LAYOUTS = ("target", "target_hf")
N_LAYERS = 8


def _hf(layout: str = "target") -> dict:
    return json.loads((FIX / layout / "config.json").read_text())


@functools.lru_cache(maxsize=None)
def _ref(name: str) -> dict:
    return dict(np.load(FIX / name))


@pytest.fixture(scope="module")
def loaded():
    return checkpoint.load_target(FIX / "target")


@functools.partial(jax.jit, static_argnums=(1,), static_argnames=("taps",))
def _run(params, cfg, tokens, taps=()):
    hidden, features, _ = v41.forward(params, cfg, tokens, None, taps=taps)
    return v41.compute_logits(params, cfg, hidden), hidden, features


# ----------------------------------------------------------------------------- config


def test_config_reads_both_layouts_the_same():
    up, hf = (DeepseekV41Config.from_hf(_hf(x)) for x in LAYOUTS)
    assert dataclasses.replace(up, image_token_id=None) == hf and up.image_token_id == 129264
    assert up.compress_ratios == (0, 0, 2, 2, 2, 1, 1, 1) and up.kv_source(3) == 2 and up.kv_source(7) == 5
    assert up.index_source(6) == 5 and up.gated_sources == (2, 4) and up.yarn == (16.0, 256, 32.0, 1.0)
    assert up.engram_pad_token_id == 2 and up.num_nextn_predict_layers == 3
    assert DeepseekV41Config.from_hf(up.to_hf()) == up
    assert up.to_hf()["text_config"]["compress_ratios"] == _hf()["text_config"]["compress_ratios"]
    assert families.for_hf(_hf()).name == "deepseek_v41"


@pytest.mark.parametrize("change, field", [
    (lambda h: h.pop("text_config"), "text_config"),
    (lambda h: (h.pop("text_config"), h.update(vision_config={})), "vision-only"),
    (lambda h: h["text_config"].update(compress_ratios=[0, 2, 1]), "compress_ratios"),
    (lambda h: h["text_config"].update(kv_source_layer_ids=[4, 5]), "layer 2"),
    (lambda h: h["text_config"].update(index_source_layer_ids=[2, 5]), "layer 4"),
    (lambda h: h["text_config"].update(engram_num_embeddings=[138]), "engram_num_embeddings"),
    (lambda h: h["text_config"].update(gate_temp=2.0), "gate_temp"),
])
def test_config_refuses_in_one_line_by_name(change, field):
    hf = json.loads(json.dumps(_hf()))
    change(hf)
    with pytest.raises(ConfigError, match=field) as e:
        DeepseekV41Config.from_hf(hf)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- declaration, conversion


def test_declaration_names_every_fixture_tensor_once():
    from safetensors import safe_open
    cfg = DeepseekV41Config.from_hf(_hf())
    specs = v41.declare(cfg)
    names = [n for s in specs.values() for n in s.torch_names()]
    assert len(names) == len(set(names))
    with safe_open(str(FIX / "target" / "model.safetensors"), "np") as f:
        stored = {"target": list(f.keys())}
    # transformers' save_pretrained layout: its tensor names (the weights are target/'s)
    stored["target_hf"] = json.loads((FIX / "target_hf" / "tensor_names.json").read_text())
    for layout in LAYOUTS:
        assert sorted(v41.source_names(_hf(layout), stored[layout])) == sorted(names)
    assert specs[("gated_source", "wgate")].torch_names() == ["layers.2.attn.compressor.wgate.weight",
                                                              "layers.4.attn.compressor.wgate.weight"]
    assert specs[("engram_table", "1", "rows")].shape == (152, 32)
    assert v41.hf_name("head.weight") == "lm_head.weight"


@pytest.mark.parametrize("layout", ["target"])
def test_round_trip_is_byte_exact_in_upstream_names(layout, tmp_path):
    from safetensors import safe_open
    checkpoint.convert(FIX / layout, tmp_path / "jax")
    checkpoint.convert(tmp_path / "jax", tmp_path / "torch", to="torch")
    with safe_open(str(FIX / layout / "model.safetensors"), "np") as a, \
            safe_open(str(tmp_path / "torch" / "model.safetensors"), "np") as b:
        names = v41.source_names(_hf(layout), list(a.keys()))
        assert sorted(b.keys()) == sorted(names)
        for declared, stored in names.items():
            x, y = a.get_tensor(stored), b.get_tensor(declared)
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), declared
    written = json.loads((tmp_path / "torch" / "config.json").read_text())
    assert written["text_config"]["compress_ratios"] == [0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0]
    assert DeepseekV41Config.from_hf(written) == DeepseekV41Config.from_hf(_hf(layout))


# ----------------------------------------------------------------------------- quantizers, Engram


def test_fake_quantizers_equal_the_reference_bit_for_bit():
    ref = _ref("qat_ops.npz")
    ops = {"fp8_b32": jax.jit(lambda a: qat.fp8_block(a, 32)), "fp4_b32_ue8m0": jax.jit(lambda a: qat.fp4_block(a, 32)),
           "fp4_b16_e4m3": jax.jit(lambda a: qat.fp4_block(a, 16, e4m3_scales=True))}
    for name, op in ops.items():
        np.testing.assert_array_equal(np.asarray(op(jnp.asarray(ref["synthetic_in"]))), ref[f"synthetic_{name}"])
        np.testing.assert_array_equal(np.asarray(op(jnp.asarray(ref[f"real_{name}_in"]))), ref[f"real_{name}_out"])
    assert qat.fp8_block(jnp.ones((3, 20)), 32).shape == (3, 20)  # unblockable: unchanged


def test_engram_token_map_and_hash_ids_equal_the_reference(loaded):
    cfg, _ = loaded
    ref = _ref("forward.npz")
    np.testing.assert_array_equal(np.asarray(cfg.engram_token_map.ids), ref["engram_token_map"])
    tokens = jnp.asarray(ref["input_ids"])
    hash_ids = jax.jit(engram.hash_ids, static_argnums=0)
    ids = np.asarray(hash_ids(cfg, tokens))
    np.testing.assert_array_equal(ids, ref["engram_hash_ids"])
    # the same rows from a later chunk with its history (what a decode step does)
    n = cfg.engram_max_ngram_size - 1
    tail = hash_ids(cfg, tokens[:, 100:], history=tokens[:, 100 - n:100])
    np.testing.assert_array_equal(np.asarray(tail), ref["engram_hash_ids"][:, 100:])


# ----------------------------------------------------------------------------- forward


@pytest.fixture(scope="module")
def noqat_run(loaded):
    cfg, params = loaded
    cfg = dataclasses.replace(cfg, qat=False)
    taps = tuple(("attn_in", i) for i in range(N_LAYERS)) + (N_LAYERS - 1,)
    ref = _ref("forward_noqat.npz")
    return cfg, params, taps, _run(params, cfg, jnp.asarray(ref["input_ids"]), taps=taps)


def test_forward_without_quantizers_matches_the_reference(noqat_run):
    """Logits, last hidden and the stream mean entering every layer (+ the last output)."""
    _, _, _, (logits, hidden, features) = noqat_run
    ref = _ref("forward_noqat.npz")
    assert np.abs(np.asarray(logits) - ref["logits"]).max() < 1e-4
    assert np.abs(np.asarray(hidden) - ref["last_hidden"]).max() < 1e-4
    means = np.asarray(features)[0].reshape(150, N_LAYERS + 1, 64).transpose(1, 0, 2)
    for i in range(N_LAYERS + 1):
        assert np.abs(means[i] - ref["layer_in_mean_row0"][i]).max() < 1e-4, i


def test_prefix_logits_do_not_depend_on_later_tokens(noqat_run):
    """Tokens after position 90 replaced: positions <= 90 unchanged (CSA2's selections causal)."""
    cfg, params, taps, (logits, _, _) = noqat_run
    tokens = np.array(_ref("forward_noqat.npz")["input_ids"])
    tokens[:, 91:] = (tokens[:, 91:] * 7 + 3) % cfg.vocab_size
    other = np.asarray(_run(params, cfg, jnp.asarray(tokens), taps=taps)[0])
    assert np.abs(other[:, :91] - np.asarray(logits)[:, :91]).max() < 2e-5
    assert np.abs(other[:, 91:] - np.asarray(logits)[:, 91:]).max() > 1e-2


@pytest.mark.slow
def test_forward_with_quantizers_matches_within_the_reference_spread(loaded):
    """With the fake quantizers a float-noise rounding flip moves later logits (golden README), so
    a position agrees within 1e-4 + its own spread under a 1e-6 weight perturbation; nearly all
    do, and the argmax agrees nearly everywhere."""
    cfg, params = loaded
    ref = _ref("forward.npz")
    logits = np.asarray(_run(params, cfg, jnp.asarray(ref["input_ids"]))[0])
    err = np.abs(logits - ref["logits"]).max(-1)
    within = err <= 1e-4 + ref["perturb_1e-6_max_abs_dlogits"]
    assert within.mean() >= 0.95, (err.max(), np.argwhere(~within)[:10])
    assert err[:, :20].max() < 1e-4  # before any flip can build up
    assert (logits.argmax(-1) == ref["logits"].argmax(-1)).mean() >= 0.95


def test_dspark_taps_are_attention_inputs(noqat_run):
    """The features the V4.1 DSpark module asks the target for (its ``target_layer_ids``) are the
    stream means ENTERING layers 5, 6, 7 (dspark_round_noqat.npz's taps, prompt 0 = row 0's first
    60 tokens); read at those layers' outputs they would differ by ~0.8: this test then fails."""
    from dspark_jax.draft.deepseek_v41 import DeepseekV41DSparkConfig
    cfg, _, taps, (_, _, features) = noqat_run
    dcfg = DeepseekV41DSparkConfig.from_hf(_hf("target"))
    by_tap = {t: np.asarray(features)[0, :, k * 64:(k + 1) * 64] for k, t in enumerate(taps)}
    by_tap.update({i: by_tap[("attn_in", i + 1)] for i in range(N_LAYERS - 1)})  # layer i's output
    assert np.abs(by_tap[N_LAYERS - 1] - by_tap[("attn_in", 7)]).max() > 0.1   # the real output tap
    got = np.concatenate([by_tap[t][:60] for t in dcfg.target_layer_ids], axis=-1)
    want = _ref("dspark_round_noqat.npz")["taps"]
    assert np.abs(got - want).max() < 1e-4
    outputs = np.concatenate([by_tap[i][:60] for i in (5, 6, 7)], axis=-1)
    assert np.abs(outputs - want).max() > 0.1
