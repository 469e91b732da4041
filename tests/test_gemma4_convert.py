"""Gemma4 conversion: `dspark-jax convert` both ways bit-exact for the fixture target and drafter
(float32 and bfloat16), multimodal checkpoints read as their text model, streaming load/export,
and a JAX-built Gemma4 drafter exported in the reference layout with the same training forward."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dspark_jax import sharding
from dspark_jax.cli import main as cli_main
from dspark_jax.convert import mapping, safetensors_io, streaming
from dspark_jax.convert.checkpoint import load_draft, load_target, save_draft
from dspark_jax.draft import gemma4 as draft_gemma4
from dspark_jax.errors import CheckpointError, ConfigError
from dspark_jax.target import gemma4
from train_tiny import REPO

FIXTURE = REPO / "tests/fixtures/dspark_gemma4_tiny"
TOWER = "model.vision_tower.encoder.patch.weight"


def same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), k


def same_tree(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


def cli(*argv) -> None:
    assert cli_main(["convert", *map(str, argv)]) == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["target", "draft"])
def test_cli_round_trips_are_bit_exact(kind, dtype, tmp_path):
    src = FIXTURE / kind
    if dtype == "bfloat16":  # cast once; every later hop must be exact
        cli(src, tmp_path / "bf16", "--to", "torch", "--dtype", "bfloat16")
        src = tmp_path / "bf16"
    original = safetensors_io.read_tensors(src)
    assert {t.dtype.name for t in original.values()} == {dtype}
    cli(src, tmp_path / "j")
    cli(tmp_path / "j", tmp_path / "t")
    same_tensors(original, safetensors_io.read_tensors(tmp_path / "t"))
    cli(tmp_path / "t", tmp_path / "j2")
    load = load_target if kind == "target" else load_draft
    (c1, p1), (c2, p2), (c3, p3) = load(src), load(tmp_path / "j"), load(tmp_path / "j2")
    assert c1 == c2 == c3
    same_tree(p1, p2)
    same_tree(p2, p3)
    hf = json.loads((tmp_path / "t" / "config.json").read_text())
    assert hf["architectures"] == json.loads((FIXTURE / kind / "config.json").read_text())["architectures"]
    assert hf["dtype"] == dtype


def multimodal_copy(dst):
    """The fixture target in the unified multimodal layout: text weights under model.language_model.,
    a vision tower, the text config under text_config."""
    dst.mkdir()
    state = load_file(str(FIXTURE / "target" / "model.safetensors"))
    mm = {k.replace("model.", "model.language_model.", 1): v for k, v in state.items()}
    mm[TOWER] = np.ones((4, 4), np.float32)
    save_file(mm, str(dst / "model.safetensors"))
    text = json.loads((FIXTURE / "target" / "config.json").read_text())
    wrapped = {"architectures": ["Gemma4UnifiedForConditionalGeneration"], "model_type": "gemma4_unified",
               "text_config": text, "vision_config": {"hidden_size": 4}}
    (dst / "config.json").write_text(json.dumps(wrapped))
    return state


def test_multimodal_checkpoint_converts_as_its_text_model(tmp_path):
    state = multimodal_copy(tmp_path / "mm")
    cfg, params = load_target(tmp_path / "mm")
    ref_cfg, ref = load_target(FIXTURE / "target")
    assert cfg == ref_cfg
    same_tree(params, ref)
    cli(tmp_path / "mm", tmp_path / "j")
    cli(tmp_path / "j", tmp_path / "t")
    same_tensors(state, safetensors_io.read_tensors(tmp_path / "t"))  # text layout, towers dropped
    hf = json.loads((tmp_path / "t" / "config.json").read_text())
    assert hf["architectures"] == ["Gemma4UnifiedForCausalLM"] and "text_config" not in hf
    # streaming reads the same layout
    mesh = sharding.make_mesh("fsdp=2,tensor=2", jax.devices()[:4])
    same_tree(streaming.stream_load(tmp_path / "mm", cfg, mesh), ref)
    # a missing text tensor is named
    broken = dict(load_file(str(tmp_path / "mm" / "model.safetensors")))
    del broken["model.language_model.layers.2.self_attn.k_norm.weight"]
    save_file(broken, str(tmp_path / "mm" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="layers.2.self_attn.k_norm"):
        load_target(tmp_path / "mm")


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_stream_load_and_export_equal_plain(kind, tmp_path):
    cfg, params = (load_target if kind == "target" else load_draft)(FIXTURE / kind)
    tensors = safetensors_io.read_tensors(FIXTURE / kind)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    streaming.write_tensor_stream(ckpt, iter(tensors.items()), max_shard_size="100KB")
    shutil.copy(FIXTURE / kind / "config.json", ckpt / "config.json")
    assert (ckpt / safetensors_io.INDEX_NAME).exists()  # really multi-shard
    mesh = sharding.make_mesh("fsdp=2,tensor=2", jax.devices()[:4])
    stats = {}
    loaded = streaming.stream_load(ckpt, cfg, mesh, stats=stats)
    same_tree(loaded, params)
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(loaded))
    assert stats["bytes_read"] > 0
    streaming.stream_export(tmp_path / "export", cfg, loaded, max_shard_size="150KB")
    same_tensors(mapping.checkpoint_tensors(cfg, tensors, "fixture"), safetensors_io.read_tensors(tmp_path / "export"))
    (c2, p2) = (load_target if kind == "target" else load_draft)(tmp_path / "export")
    assert c2 == cfg
    same_tree(p2, params)


def test_jax_built_drafter_exports_in_the_reference_layout(tmp_path):
    """A Gemma4 drafter initialised in JAX, saved as torch: the fixture's tensor names, shapes and
    config keys; the reference-layout reader gives the same params and training forward."""
    ref_cfg, _ = draft_gemma4.load_params(FIXTURE / "draft")
    _, target = load_target(FIXTURE / "target")
    cfg = draft_gemma4.Gemma4DraftConfig.for_target(
        gemma4.Gemma4TargetConfig.from_hf(json.loads((FIXTURE / "target" / "config.json").read_text())),
        num_hidden_layers=2, target_layer_ids=(0, 2, 4), mask_token_id=511, num_anchors=8, markov_rank=64)
    assert cfg == ref_cfg
    params = draft_gemma4.init_params(cfg, jax.random.PRNGKey(1), embed_tokens=target["embed_tokens"],
                                      lm_head=gemma4.lm_head_kernel(target))
    save_draft(tmp_path / "t", cfg, params, format="torch")
    ours = load_file(str(tmp_path / "t" / "model.safetensors"))
    ref = load_file(str(FIXTURE / "draft" / "model.safetensors"))
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in ref.items()}
    hf = json.loads((tmp_path / "t" / "config.json").read_text())
    ref_hf = json.loads((FIXTURE / "draft" / "config.json").read_text())
    missing = set(ref_hf) - set(hf) - {"transformers_version", "initializer_range", "use_cache"}
    assert not missing, missing
    cfg2, back = draft_gemma4.load_params(tmp_path / "t")  # the reference-layout reader
    assert cfg2 == cfg
    same_tree(jax.tree.map(np.asarray, params), back)
    data = dict(np.load(FIXTURE / "train_forward.npz"))
    args = [jnp.asarray(data[k]) for k in ("input_ids", "target_hidden_states", "loss_mask", "anchor_positions",
                                           "block_keep_mask", "target_last_hidden_states")]
    a = draft_gemma4.training_forward(params, cfg, *args)
    b = draft_gemma4.training_forward(jax.tree.map(jnp.asarray, back), cfg2, *args)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_kind_and_family_errors(tmp_path):
    with pytest.raises((ConfigError, CheckpointError), match="not a draft"):
        load_draft(FIXTURE / "target")
    hf = json.loads((FIXTURE / "target" / "config.json").read_text())
    bad = tmp_path / "bad"
    shutil.copytree(FIXTURE / "target", bad)
    (bad / "config.json").write_text(json.dumps(dict(hf, architectures=["Gemma5ForCausalLM"])))
    with pytest.raises(ConfigError, match="unknown architecture 'Gemma5ForCausalLM'.*Gemma4UnifiedForCausalLM"):
        load_target(bad)


def test_foreign_import_refuses_a_gemma4_target(tmp_path, capsys):
    """`convert --from specforge --target` with a Gemma4 target: the SpecForge drafter is a Qwen3
    one, refused (exit 2) before anything is read or written."""
    from test_foreign import write_specforge
    qwen = REPO / "tests/fixtures/dspark_qwen3_tiny/draft"
    write_specforge(tmp_path / "sf", json.loads((qwen / "config.json").read_text()),
                    load_file(str(qwen / "model.safetensors")))
    rc = cli_main(["convert", str(tmp_path / "sf"), str(tmp_path / "ours"), "--from", "specforge",
                   "--target", str(FIXTURE / "target")])
    assert rc == 2 and not (tmp_path / "ours").exists()
    assert "'qwen3_dspark' reads 'qwen3' targets" in capsys.readouterr().err
