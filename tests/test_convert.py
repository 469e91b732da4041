"""Checkpoint conversion: bit-exact round trips, PyTorch parity of exports, bad input, CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dspark_jax.cli import main as cli_main
from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.convert import checkpoint, formats, safetensors_io
from dspark_jax.convert.checkpoint import convert, load_draft, load_target, save_draft, save_target
from dspark_jax.convert.formats import read_extras
from dspark_jax.draft import model as draft_model
from dspark_jax.errors import CheckpointError, ConfigError, InputError
from dspark_jax.target import qwen3

torch = pytest.importorskip("torch")
from torch_dspark import TorchDSpark  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


# ----------------------------------------------------------------------------- helpers

def assert_same_tensors(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), f"tensor {k} differs"


def assert_same_tree(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def no_leftovers(parent: Path, name: str):
    return not [p for p in parent.iterdir() if p.name.startswith(f".{name}.")]


@pytest.fixture
def draft_src(tiny_dir, tmp_path) -> Path:
    d = tmp_path / "src_draft"
    shutil.copytree(tiny_dir / "draft", d)
    return d


TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_target_layers=4,
            target_layer_ids=(0, 2), block_size=4, mask_token_id=63, num_anchors=4,
            rope_theta=1e4, max_position_embeddings=128)

HEADS = {
    "vanilla_conf_markov": dict(markov_rank=8, markov_head_type="vanilla"),
    "gated_conf_markov": dict(markov_rank=8, markov_head_type="gated"),
    "rnn_conf_markov": dict(markov_rank=8, markov_head_type="rnn"),
    "rnn_conf_plain": dict(markov_rank=8, markov_head_type="rnn", confidence_head_with_markov=False),
    "gated_no_conf": dict(markov_rank=8, markov_head_type="gated", enable_confidence_head=False,
                          confidence_head_with_markov=False),
    "dflash_conf": dict(markov_rank=0, confidence_head_with_markov=False),
    "dflash_no_conf": dict(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False),
}


def random_params(shapes, seed: int, dtype=np.float32):
    """numpy random values for a ShapeDtypeStruct tree (every leaf random: norms and biases too)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray((0.3 * rng.standard_normal(s.shape) + (1.0 if s.ndim == 1 else 0.0))
                                              .astype(np.float32).astype(dtype)), shapes)


def random_draft(name: str, seed: int = 0, dtype=np.float32):
    """A drafter built in JAX (tree from draft.model.init_params) with random values."""
    cfg = DraftConfig(**{**TINY, **HEADS[name]})
    shapes = jax.eval_shape(lambda: draft_model.init_params(cfg, jax.random.key(0)))
    return cfg, random_params(shapes, seed, dtype)


_train_forward = jax.jit(draft_model.training_forward, static_argnums=1)
_target_logits = jax.jit(lambda p, c, t: qwen3.compute_logits(p, qwen3.forward(p, c, t)[0]), static_argnums=1)


# ----------------------------------------------------------------------------- (a) round trips

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fixture_drafter_round_trip_bit_exact(draft_src, tmp_path, dtype):
    src = draft_src
    if dtype == "bfloat16":  # cast first, then every later hop must be exact
        convert(draft_src, tmp_path / "bf16", to="torch", dtype="bfloat16")
        src = tmp_path / "bf16"
    original = safetensors_io.read_tensors(src)
    assert {t.dtype for t in original.values()} == {np.dtype(dtype)}
    assert convert(src, tmp_path / "j") == "jax"
    assert formats.detect_format(tmp_path / "j") == "jax"
    assert convert(tmp_path / "j", tmp_path / "t") == "torch"
    assert_same_tensors(original, safetensors_io.read_tensors(tmp_path / "t"))
    # configs survive, including fields our dataclass does not model
    a = json.loads((src / "config.json").read_text())
    b = json.loads((tmp_path / "t" / "config.json").read_text())
    assert DraftConfig.from_hf(a) == DraftConfig.from_hf(b)
    assert b["transformers_version"] == a["transformers_version"]
    assert b["dtype"] == dtype
    # jax params load identically from both formats
    _, p_torch = load_draft(src)
    _, p_jax = load_draft(tmp_path / "j")
    assert_same_tree(p_torch, p_jax)
    assert {x.dtype for x in jax.tree.leaves(p_jax)} == {np.dtype(dtype)}


def test_bf16_cast_matches_numpy_cast(draft_src, tmp_path):
    convert(draft_src, tmp_path / "j", dtype="bfloat16")
    src = safetensors_io.read_tensors(draft_src)
    convert(tmp_path / "j", tmp_path / "t")
    out = safetensors_io.read_tensors(tmp_path / "t")
    assert_same_tensors({k: v.astype(BF16) for k, v in src.items()}, out)


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_jax_torch_jax_bit_exact(tmp_path, dtype):
    cfg, params = random_draft("rnn_conf_markov", dtype=dtype)
    save_draft(tmp_path / "j", cfg, params, format="jax", extras={"sts_temperatures": [1.0, 0.5]})
    convert(tmp_path / "j", tmp_path / "t")
    convert(tmp_path / "t", tmp_path / "j2")
    cfg2, params2 = load_draft(tmp_path / "j2")
    assert cfg2 == cfg
    assert_same_tree(params, params2)
    assert read_extras(tmp_path / "t") == {"sts_temperatures": [1.0, 0.5]}
    assert read_extras(tmp_path / "j2") == {"sts_temperatures": [1.0, 0.5]}
    # HF loaders must not see extras as a model field other than the namespaced key
    hf = json.loads((tmp_path / "t" / "config.json").read_text())
    assert hf["dspark_jax"] == {"extras": {"sts_temperatures": [1.0, 0.5]}}


def test_load_dtype_cast(draft_src):
    _, p32 = load_draft(draft_src)
    _, p16 = load_draft(draft_src, dtype="bfloat16")
    for a, b in zip(jax.tree.leaves(p32), jax.tree.leaves(p16)):
        assert b.dtype == jnp.bfloat16
        assert np.asarray(a).astype(BF16).tobytes() == np.asarray(b).tobytes()


# ----------------------------------------------------------------------------- (b) JAX-built -> torch parity

def _random_inputs(cfg: DraftConfig, seed=0, b=2, s=20):
    rng = np.random.default_rng(seed)
    n = 4
    ids = rng.integers(0, cfg.vocab_size - 1, (b, s))
    loss_mask = np.ones((b, s), np.float32)
    loss_mask[:, :3] = 0
    loss_mask[1, 12:14] = 0
    anchors = np.array([[3, 7, 15, 18], [4, 9, 16, 0]])
    keep = np.array([[True, True, True, True], [True, True, True, False]])
    hid = rng.standard_normal((b, s, cfg.num_context_features * cfg.hidden_size)).astype(np.float32)
    last = rng.standard_normal((b, s, cfg.hidden_size)).astype(np.float32)
    return ids, hid, loss_mask, anchors[:, :n], keep[:, :n], last


# Four compiles cover every head type, rank 0, confidence with/without Markov and no confidence head.
FORWARD_CASES = ["vanilla_conf_markov", "gated_no_conf", "rnn_conf_plain", "dflash_conf"]


@pytest.mark.parametrize("name", list(HEADS))
def test_jax_built_drafter_round_trip(tmp_path, name):
    cfg, params = random_draft(name, seed=len(name), dtype=BF16 if len(name) % 2 else np.float32)
    save_draft(tmp_path / "t", cfg, params, format="torch")
    TorchDSpark.from_pretrained(tmp_path / "t")  # strict state dict: names and shapes per SPEC 11
    convert(tmp_path / "t", tmp_path / "j")
    convert(tmp_path / "j", tmp_path / "t2")
    assert_same_tensors(safetensors_io.read_tensors(tmp_path / "t"), safetensors_io.read_tensors(tmp_path / "t2"))
    cfg2, params2 = load_draft(tmp_path / "j")
    assert cfg2 == cfg
    assert_same_tree(params, params2)


@pytest.mark.parametrize("name", FORWARD_CASES)
def test_jax_built_drafter_export_matches_torch(tmp_path, name):
    cfg, params = random_draft(name, seed=len(name))
    save_draft(tmp_path / "t", cfg, params, format="torch")
    hf = json.loads((tmp_path / "t" / "config.json").read_text())
    for field in ("architectures", "num_hidden_layers", "num_target_layers", "block_size",
                  "tie_word_embeddings", "layer_types", "mask_token_id", "target_layer_ids",
                  "num_anchors", "enable_confidence_head", "markov_rank"):
        assert field in hf, field
    assert ("markov_head_type" in hf) == cfg.has_markov
    assert ("confidence_head_with_markov" in hf) == cfg.enable_confidence_head
    tm = TorchDSpark.from_pretrained(tmp_path / "t")  # strict state dict
    ids, hid, lm, anchors, keep, last = _random_inputs(cfg)
    ours = _train_forward(params, cfg, jnp.asarray(ids), jnp.asarray(hid), jnp.asarray(lm),
                                        jnp.asarray(anchors), jnp.asarray(keep), jnp.asarray(last))
    theirs = tm.training_forward(*(torch.from_numpy(np.asarray(x)) for x in (ids, hid, lm, anchors, keep, last)))
    for field in ("draft_logits", "confidence_logits", "aligned_target_logits"):
        a, b = getattr(ours, field), theirs[field]
        assert (a is None) == (b is None), field
        if a is not None:
            np.testing.assert_allclose(np.asarray(a), b.numpy(), atol=1e-4, rtol=0, err_msg=field)
    np.testing.assert_array_equal(np.asarray(ours.target_ids), theirs["target_ids"].numpy())
    np.testing.assert_array_equal(np.asarray(ours.eval_mask), theirs["eval_mask"].numpy())
    assert np.asarray(ours.eval_mask).any()


def test_torch_stand_in_matches_reference_fixture(tiny_dir):
    z = np.load(tiny_dir / "train_forward.npz")
    tm = TorchDSpark.from_pretrained(tiny_dir / "draft")
    out = tm.training_forward(*(torch.from_numpy(z[k]) for k in (
        "input_ids", "target_hidden_states", "loss_mask", "anchor_positions", "block_keep_mask",
        "target_last_hidden_states")))
    for k in ("draft_logits", "confidence_logits", "aligned_target_logits"):
        np.testing.assert_allclose(out[k].numpy(), z[k], atol=1e-4, rtol=0, err_msg=k)
    np.testing.assert_array_equal(out["target_ids"].numpy(), z["target_ids"])
    np.testing.assert_array_equal(out["eval_mask"].numpy(), z["eval_mask"])


# ----------------------------------------------------------------------------- (c) Qwen3 target

def _hf_target(tmp_path: Path, tied: bool) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(int(tied))
    config = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=64, rope_theta=5e4, tie_word_embeddings=tied)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # make norms non-trivial so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    d = tmp_path / f"hf_{'tied' if tied else 'untied'}"
    model.save_pretrained(d)
    (d / "generation_config.json").write_text(json.dumps({"do_sample": False, "max_new_tokens": 7}))
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return d


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_target_round_trip_and_logits(tmp_path, tied):
    from transformers import Qwen3ForCausalLM

    src = _hf_target(tmp_path, tied)
    convert(src, tmp_path / "j")
    convert(tmp_path / "j", tmp_path / "t")
    assert_same_tensors(safetensors_io.read_tensors(src), safetensors_io.read_tensors(tmp_path / "t"))
    for side in ("generation_config.json", "tokenizer_config.json"):
        assert (tmp_path / "t" / side).read_text() == (src / side).read_text()
    cfg, params = load_target(tmp_path / "j")
    assert cfg.tie_word_embeddings == tied and ("lm_head" in params) == (not tied)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9))
    ours = np.asarray(_target_logits(params, cfg, jnp.asarray(tokens)))
    for d in (src, tmp_path / "t"):  # the export loads in transformers too
        hf = Qwen3ForCausalLM.from_pretrained(d).eval()
        with torch.no_grad():
            ref = hf(torch.from_numpy(tokens)).logits.numpy()
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_sharded_equals_single_file(tmp_path):
    cfg = TargetConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    params = random_params(jax.eval_shape(lambda: qwen3.init_params(cfg, jax.random.key(0))), 3)
    save_target(tmp_path / "single", cfg, params)
    save_target(tmp_path / "sharded", cfg, params, max_shard_size="20KB")
    files = sorted(p.name for p in (tmp_path / "sharded").iterdir())
    assert safetensors_io.INDEX_NAME in files and "model-00001-of-" in files[1] and len(files) > 4
    assert_same_tensors(safetensors_io.read_tensors(tmp_path / "single"),
                        safetensors_io.read_tensors(tmp_path / "sharded"))
    index = json.loads((tmp_path / "sharded" / safetensors_io.INDEX_NAME).read_text())
    assert len(index["weight_map"]) == len(load_file(str(tmp_path / "single" / "model.safetensors")))
    _, a = load_target(tmp_path / "single")
    _, b = load_target(tmp_path / "sharded")
    assert_same_tree(a, b)
    assert_same_tree(params, b)


# ----------------------------------------------------------------------------- (d) bad input

def _rewrite(d: Path, fn):
    tensors = load_file(str(d / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(d / "model.safetensors"))


@pytest.mark.parametrize("edit, pattern", [
    (lambda t: t.pop("layers.1.mlp.up_proj.weight"), r"missing tensor 'layers\.1\.mlp\.up_proj\.weight'"),
    (lambda t: t.update({"extra_head.weight": np.zeros((2, 2), np.float32)}),
     r"unexpected tensor 'extra_head\.weight'"),
    (lambda t: t.update({"fc.weight": np.zeros((192, 64), np.float32)}),
     r"tensor 'fc\.weight' has shape \(192, 64\), expected \(64, 192\)"),
    (lambda t: t.update({"norm.weight": np.ones(64, np.int32)}), r"'norm\.weight'.*int32"),
    (lambda t: t.update({"norm.weight": np.ones(64, np.float16)}), r"mixed dtypes.*'norm\.weight' is float16"),
])
def test_bad_tensors_named(draft_src, tmp_path, edit, pattern):
    _rewrite(draft_src, edit)
    with pytest.raises(CheckpointError, match=pattern):
        load_draft(draft_src)
    with pytest.raises(CheckpointError, match=pattern):
        convert(draft_src, tmp_path / "out")
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path, "out")


def test_unknown_architecture(draft_src, tmp_path):
    hf = json.loads((draft_src / "config.json").read_text())
    hf["architectures"] = ["LlamaForCausalLM"]
    hf["model_type"] = "llama"
    (draft_src / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match="unknown architecture 'LlamaForCausalLM'.*architectures"):
        convert(draft_src, tmp_path / "out")
    with pytest.raises(ConfigError, match="LlamaForCausalLM"):
        load_draft(draft_src)
    assert not (tmp_path / "out").exists()


def test_wrong_kind(draft_src):
    with pytest.raises(ConfigError, match="draft, not a target"):
        load_target(draft_src)


def test_bad_config_field(draft_src):
    hf = json.loads((draft_src / "config.json").read_text())
    hf["target_layer_ids"] = [0, 5]  # 5 is the target's last layer
    (draft_src / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match="final decoder layer"):
        load_draft(draft_src)


@pytest.mark.parametrize("damage", ["garbage_header", "truncated"])
def test_corrupted_safetensors(draft_src, damage):
    f = draft_src / "model.safetensors"
    data = f.read_bytes()
    if damage == "garbage_header":
        f.write_bytes(data[:8] + b"{not json" + data[17:])
    else:
        f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a valid safetensors file"):
        load_draft(draft_src)


def test_sharded_index_errors(draft_src, tmp_path):
    cfg, params = load_draft(draft_src)
    save_draft(tmp_path / "s", cfg, params, max_shard_size="200KB")
    index_path = tmp_path / "s" / safetensors_io.INDEX_NAME
    index = json.loads(index_path.read_text())
    _, two = load_draft(tmp_path / "s")
    assert_same_tree(params, two)
    # a tensor listed under the wrong shard
    bad = json.loads(json.dumps(index))
    shards = sorted(set(bad["weight_map"].values()))
    bad["weight_map"]["norm.weight"] = next(s for s in shards if s != index["weight_map"]["norm.weight"])
    index_path.write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match=r"'norm\.weight'"):
        load_draft(tmp_path / "s")
    # a missing shard
    index_path.write_text(json.dumps(index))
    (tmp_path / "s" / shards[-1]).unlink()
    with pytest.raises(CheckpointError, match=f"shard '{shards[-1]}'.*does not exist"):
        load_draft(tmp_path / "s")


def test_pickle_refused_then_weights_only(draft_src, tmp_path):
    sd = {k: torch.from_numpy(v) for k, v in load_file(str(draft_src / "model.safetensors")).items()}
    (draft_src / "model.safetensors").unlink()
    torch.save(sd, draft_src / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*pickle.*--allow-pickle"):
        load_draft(draft_src)
    with pytest.raises(CheckpointError, match="pickle"):
        convert(draft_src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    cfg, params = load_draft(draft_src, allow_pickle=True)
    assert cfg.markov_rank == 64 and set(jax.tree.leaves(jax.tree.map(lambda x: x.dtype.name, params))) == {"float32"}
    convert(draft_src, tmp_path / "out", allow_pickle=True, to="torch")
    assert_same_tensors({k: v.numpy() for k, v in sd.items()}, safetensors_io.read_tensors(tmp_path / "out"))
    # a pickle carrying an arbitrary object is refused by weights_only
    import datetime
    torch.save({"x": datetime.datetime(2020, 1, 1)}, draft_src / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"weights_only=True"):
        load_draft(draft_src, allow_pickle=True)


def test_existing_destination_refused(draft_src, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("precious")
    with pytest.raises(InputError, match="destination exists.*force"):
        convert(draft_src, dst)
    assert (dst / "keep.txt").read_text() == "precious" and len(list(dst.iterdir())) == 1
    convert(draft_src, dst, force=True)
    assert not (dst / "keep.txt").exists() and formats.detect_format(dst) == "jax"
    assert no_leftovers(tmp_path, "dst")


def test_failure_mid_write_leaves_nothing(draft_src, tmp_path, monkeypatch):
    real = safetensors_io.write_planned

    def boom(directory, entries, arrays, **kw):
        real(directory, entries, arrays, **kw)  # the file is fully written ...
        raise OSError("disk full")              # ... then the write fails

    monkeypatch.setattr(safetensors_io, "write_planned", boom)
    convert(draft_src, tmp_path / "j")
    with pytest.raises(OSError, match="disk full"):
        convert(tmp_path / "j", tmp_path / "t")
    assert not (tmp_path / "t").exists() and no_leftovers(tmp_path, "t")
    # with force, the old destination survives a failed replacement
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "old.txt").write_text("old")
    with pytest.raises(OSError):
        convert(tmp_path / "j", tmp_path / "t", force=True)
    assert (tmp_path / "t" / "old.txt").read_text() == "old" and no_leftovers(tmp_path, "t")


def test_save_validates_params(tmp_path):
    cfg, params = random_draft("gated_conf_markov")
    params["markov_head"]["gate_proj"]["kernel"] = params["markov_head"]["gate_proj"]["kernel"][:, :4]
    for fmt in ("torch", "jax"):
        with pytest.raises(CheckpointError, match="markov_head/gate_proj/kernel"):
            save_draft(tmp_path / fmt, cfg, params, format=fmt)
        assert not (tmp_path / fmt).exists() and no_leftovers(tmp_path, fmt)


def test_jax_format_checked_against_config(draft_src, tmp_path):
    convert(draft_src, tmp_path / "j")
    meta_path = tmp_path / "j" / formats.META_NAME
    meta = json.loads(meta_path.read_text())
    meta["config"]["intermediate_size"] = 96
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"'layers/(down|gate|up)_proj' has shape"):
        load_draft(tmp_path / "j")
    meta["version"] = 99
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="'version'"):
        load_draft(tmp_path / "j")


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_draft(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        load_draft(tmp_path / "empty")


def test_parse_size():
    assert safetensors_io.parse_size("2GB") == 2_000_000_000
    assert safetensors_io.parse_size("1.5KiB") == 1536
    with pytest.raises(InputError, match="'lots'"):
        safetensors_io.parse_size("lots")


# ----------------------------------------------------------------------------- (e) CLI

def test_cli_convert_end_to_end(draft_src, tmp_path, capsys):
    assert cli_main(["convert", str(draft_src), str(tmp_path / "j")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert summary["format"] == "jax" and summary["kind"] == "draft" and summary["src_format"] == "torch"
    assert cli_main(["convert", str(tmp_path / "j"), str(tmp_path / "t"), "--dtype", "bfloat16",
                     "--max-shard-size", "300KB"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["format"] == "torch" and summary["dtype"] == "bfloat16"
    assert (tmp_path / "t" / safetensors_io.INDEX_NAME).exists()
    src = safetensors_io.read_tensors(draft_src)
    assert_same_tensors({k: v.astype(BF16) for k, v in src.items()}, safetensors_io.read_tensors(tmp_path / "t"))
    # refused destination: exit 2 with one clean line
    assert cli_main(["convert", str(draft_src), str(tmp_path / "j")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "destination exists" in err[0]
    assert cli_main(["convert", str(draft_src), str(tmp_path / "j"), "--force", "--to", "torch"]) == 0
    assert formats.detect_format(tmp_path / "j") == "torch"


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["convert", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--to", "--dtype", "--force", "--allow-pickle", "--max-shard-size"):
        assert flag in text


def test_decode_defaults_from_checkpoint_dirs(tmp_path, tiny_dir):
    """generate and eval share these: saved STS temperatures and the stop-token fallback chain."""
    cfg, params = load_draft(tiny_dir / "draft")
    assert formats.sts_temperatures(tiny_dir / "draft") is None
    save_draft(tmp_path / "d", cfg, params, extras={"sts_temperatures": [1.5] * cfg.block_size})
    assert formats.sts_temperatures(tmp_path / "d") == [1.5] * cfg.block_size
    assert formats.sts_temperatures(tmp_path / "d", [2.0] * 3) == [2.0] * 3  # the flag wins
    save_draft(tmp_path / "bad", cfg, params, extras={"sts_temperatures": "hot"})
    with pytest.raises(CheckpointError, match="sts_temperatures.*list of numbers"):
        formats.sts_temperatures(tmp_path / "bad")

    t = tmp_path / "t"
    t.mkdir()
    assert checkpoint.default_stop_ids(t) == []
    (t / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert checkpoint.default_stop_ids(t) == [7]
    (t / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 3, 9]}))
    assert checkpoint.default_stop_ids(t) == [3, 9]  # generation_config.json first

    class Tok:
        eos_token_id = 5
    assert checkpoint.default_stop_ids(tmp_path, Tok()) == [5]
