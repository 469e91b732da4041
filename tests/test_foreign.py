"""Checkpoints and caches from other trainers: SpecForge, speculators, DeepSpec's target cache v2.

The foreign checkpoints are built here from the fixture drafter's weights following those
projects' tensor names and config keys (read from their code; see dspark_jax/convert/foreign.py
for the files), and must give the same training forward as the fixture in our layout. The
DeepSpec cache is written following its writer (deepspec/data/target_cache_dataset.py:
LocalTargetCacheWriter + finalize_target_cache_index + build_target_cache_manifest).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dspark_jax.cli import main as cli_main
from dspark_jax.config import DraftConfig, LossConfig
from dspark_jax.convert import checkpoint, foreign, formats, mapping
from dspark_jax.data import cache as cache_lib
from dspark_jax.data import reference_cache
from dspark_jax.data.sources import TokenSequences
from dspark_jax.draft import model
from dspark_jax.errors import CheckpointError, ConfigError
from dspark_jax.train import loss as loss_lib

TINY = Path(__file__).parent / "fixtures" / "dspark_qwen3_tiny"
QWEN3_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters",
              "max_position_embeddings", "attention_bias", "hidden_act", "model_type")


@pytest.fixture(scope="module")
def fixture():
    hf = json.loads((TINY / "draft" / "config.json").read_text())
    cfg = DraftConfig.from_hf(hf)
    tensors = load_file(str(TINY / "draft" / "model.safetensors"))
    data = dict(np.load(TINY / "train_forward.npz"))
    return hf, cfg, tensors, data


def forward(cfg, params, data):
    params = jax.tree.map(jnp.asarray, params)
    return model.training_forward(
        params, cfg, jnp.asarray(data["input_ids"]), jnp.asarray(data["target_hidden_states"]),
        jnp.asarray(data["loss_mask"]), jnp.asarray(data["anchor_positions"]),
        jnp.asarray(data["block_keep_mask"]), jnp.asarray(data["target_last_hidden_states"]))


def write_specforge(d: Path, hf, tensors, *, nested_heads=False):
    """specforge/modeling/draft/{dflash,dspark}.py: Qwen3Config + num_target_layers + block_size
    + dflash_config; no embed_tokens / lm_head; old checkpoints nest heads under logit_head."""
    d.mkdir()
    cfg = {k: hf[k] for k in QWEN3_KEYS if k in hf}
    cfg.update({"architectures": ["DSparkDraftModel"], "num_target_layers": hf["num_target_layers"],
                "block_size": hf["block_size"],
                "dflash_config": {"target_layer_ids": hf["target_layer_ids"], "mask_token_id": hf["mask_token_id"],
                                  "projector_type": "dspark", "attention_mode": "gqa",
                                  "markov_rank": hf["markov_rank"], "markov_head_type": hf["markov_head_type"],
                                  "enable_confidence_head": True, "confidence_head_alpha": 1.0,
                                  "confidence_head_with_markov": hf["confidence_head_with_markov"]}})
    (d / "config.json").write_text(json.dumps(cfg))
    out = {}
    for k, t in tensors.items():
        if k in ("embed_tokens.weight", "lm_head.weight"):
            continue
        if nested_heads and k.startswith(("markov_head.", "confidence_head.")):
            k = "logit_head." + k
        out[k] = t
    save_file(out, str(d / "model.safetensors"), metadata={"format": "pt"})


def write_speculators(d: Path, hf, tensors, **over):
    """src/speculators/models/dspark/config.py + dflash/config.py; aux ids = ours + 1
    (convert/dflash/converter.py); lm_head saved, embed_tokens / verifier_norm not."""
    d.mkdir()
    tl = {k: hf[k] for k in QWEN3_KEYS if k in hf}
    cfg = {"speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"],
           "transformer_layer_config": tl, "draft_vocab_size": hf["vocab_size"], "block_size": hf["block_size"],
           "aux_hidden_state_layer_ids": [i + 1 for i in hf["target_layer_ids"]],
           "mask_token_id": hf["mask_token_id"], "sliding_window_non_causal": False, "sample_from_anchor": True,
           "markov_rank": hf["markov_rank"], "markov_head_type": hf["markov_head_type"],
           "enable_confidence_head": True, "confidence_head_with_markov": hf["confidence_head_with_markov"],
           "speculators_config": {"algorithm": "dspark", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 7}],
                                  "verifier": {"name_or_path": str(TINY / "target"),
                                               "architectures": ["Qwen3ForCausalLM"]}}}
    cfg.update(over)
    (d / "config.json").write_text(json.dumps(cfg))
    out = {k: t for k, t in tensors.items() if k != "embed_tokens.weight"}
    save_file(out, str(d / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("fmt,nested", [("specforge", False), ("specforge", True), ("speculators", False)])
def test_foreign_checkpoint_gives_same_training_forward(tmp_path, fixture, fmt, nested):
    hf, cfg, tensors, data = fixture
    src = tmp_path / fmt
    if fmt == "specforge":
        write_specforge(src, hf, tensors, nested_heads=nested)
    else:
        write_speculators(src, hf, tensors)
    assert foreign.detect(src) == fmt
    got_cfg, got, _ = foreign.load_foreign(src, target=TINY / "target")
    assert got_cfg == cfg.replace(num_anchors=512)  # a training setting neither trainer stores
    ours = mapping.draft_from_torch(cfg, tensors)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ours)):
        np.testing.assert_array_equal(a, b)
    fwd, ref = forward(got_cfg, got, data), forward(cfg, ours, data)
    for name in ("draft_logits", "confidence_logits", "aligned_target_logits"):
        np.testing.assert_array_equal(np.asarray(getattr(fwd, name)), np.asarray(getattr(ref, name)))
        np.testing.assert_allclose(np.asarray(getattr(fwd, name)), data[name], atol=1e-4, rtol=0)


def test_cli_convert_from_specforge(tmp_path, fixture):
    hf, cfg, tensors, _ = fixture
    write_specforge(tmp_path / "sf", hf, tensors)
    rc = cli_main(["convert", str(tmp_path / "sf"), str(tmp_path / "ours"), "--from", "specforge",
                   "--target", str(TINY / "target")])
    assert rc == 0
    got_cfg, params = checkpoint.load_draft(tmp_path / "ours")
    assert got_cfg == cfg.replace(num_anchors=512)
    assert formats.read_extras(tmp_path / "ours") == {"imported_from": "specforge"}
    rc = cli_main(["convert", str(tmp_path / "sf"), str(tmp_path / "ours2"), "--from", "specforge"])
    assert rc == 2 and not (tmp_path / "ours2").exists()  # no embed_tokens / lm_head without --target


def test_foreign_refusals(tmp_path, fixture):
    hf, _, tensors, _ = fixture
    write_speculators(tmp_path / "a", hf, tensors, sample_from_anchor=False)
    with pytest.raises(ConfigError, match="sample_from_anchor"):
        foreign.load_foreign(tmp_path / "a", target=TINY / "target")
    write_speculators(tmp_path / "b", hf, tensors, draft_vocab_size=256)
    with pytest.raises(ConfigError, match="reduced draft vocabularies"):
        foreign.load_foreign(tmp_path / "b", target=TINY / "target")
    write_speculators(tmp_path / "c", hf, tensors)
    with pytest.raises(ConfigError, match="layer count"):
        foreign.load_foreign(tmp_path / "c")
    with pytest.raises(CheckpointError, match="embed_tokens"):  # lm_head saved, embed_tokens not
        foreign.load_foreign(tmp_path / "c", num_target_layers=6)
    write_specforge(tmp_path / "d", hf, tensors)
    with pytest.raises(CheckpointError, match="embed_tokens"):
        foreign.load_foreign(tmp_path / "d")
    assert foreign.detect(TINY / "draft") is None


def test_foreign_dflash_twin_and_rnn(tmp_path, fixture):
    """SpecForge drafters without a Markov head / with an rnn head map onto our params too."""
    hf, cfg, tensors, data = fixture
    for variant in ("dflash", "rnn"):
        vcfg = (cfg.replace(markov_rank=0, confidence_head_with_markov=False) if variant == "dflash"
                else cfg.replace(markov_head_type="rnn"))
        params = jax.tree.map(np.asarray, model.init_params(vcfg, jax.random.key(3)))
        t = mapping.draft_to_torch(vcfg, params)
        vhf = {**hf, **vcfg.to_hf()}
        write_specforge(tmp_path / variant, {**vhf, "markov_head_type": vhf.get("markov_head_type", "vanilla"),
                                             "markov_rank": vcfg.markov_rank}, t)
        target = tmp_path / f"{variant}_target"
        target.mkdir()
        save_file({"model.embed_tokens.weight": t["embed_tokens.weight"], "lm_head.weight": t["lm_head.weight"]},
                  str(target / "model.safetensors"))
        (target / "config.json").write_text(json.dumps({"num_hidden_layers": 6}))
        got_cfg, got, _ = foreign.load_foreign(tmp_path / variant, target=target)
        assert got_cfg == vcfg.replace(num_anchors=512)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
            np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------- DeepSpec cache v2

def write_deepspec_cache(out: Path, records, layer_ids, hidden_size, max_shard_bytes=1 << 14):
    """Follows deepspec/data/target_cache_dataset.py: per sample, back to back in a shard,
    input_ids int32, attention_mask uint8, loss_mask uint8, target_hidden_states bf16 [L, n*H],
    target_last_hidden_states bf16 [L, H]; samples.idx records "<QIIQQQQQ"; manifest v2."""
    out.mkdir()
    rec_struct = struct.Struct("<QIIQQQQQ")
    shards, index, buf = [], [], bytearray()

    def flush():
        nonlocal buf
        if buf:
            name = f"shard-{len(shards):05d}.bin"
            (out / name).write_bytes(bytes(buf))
            shards.append({"shard_id": len(shards), "file_name": name})
            buf = bytearray()

    for sid, (ids, mask, feats, last) in enumerate(records):
        parts = [np.asarray(ids, np.int32).tobytes(), np.ones(len(ids), np.uint8).tobytes(),
                 np.asarray(mask, np.uint8).tobytes(), np.asarray(feats, ml_dtypes.bfloat16).tobytes(),
                 np.asarray(last, ml_dtypes.bfloat16).tobytes()]
        if buf and len(buf) + sum(map(len, parts)) > max_shard_bytes:
            flush()
        offsets = []
        for p in parts:
            offsets.append(len(buf))
            buf += p
        index.append(rec_struct.pack(sid, len(shards), len(ids), *offsets))
    flush()
    (out / "samples.idx").write_bytes(b"".join(index))
    manifest = {"version": 2, "num_samples": len(records), "num_shards": len(shards),
                "target_layer_ids": list(layer_ids), "hidden_dtype": "bfloat16", "token_dtype": "int32",
                "mask_dtype": "uint8", "index_record_size": rec_struct.size, "hidden_size": hidden_size,
                "shards": shards, "target_model_name_or_path": str(TINY / "target"), "max_length": 32,
                "min_loss_tokens": 1}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))


@pytest.fixture(scope="module")
def both_caches(tmp_path_factory):
    tcfg, tparams = checkpoint.load_target(TINY / "target")
    rng = np.random.default_rng(0)
    seqs = []
    for i in range(6):
        n = 20 + 2 * i
        ids = rng.integers(0, 500, n).tolist()
        mask = [0.0] * 5 + [1.0] * (n - 5)
        seqs.append((ids, mask))
    root = tmp_path_factory.mktemp("caches")
    data = TokenSequences(seqs, max_length=32)
    ours = root / "ours"
    cache_lib.write_cache(ours, tcfg, tparams, [0, 2, 4], data, batch_size=4, dtype="float32", progress=False)
    # the reference writes the same target outputs (raw layer outputs, final hidden) per sample
    m = json.loads((ours / "manifest.json").read_text())
    index = np.load(ours / "index.npy")
    records = []
    for shard, start, length in index:
        sh = ours / m["shards"][shard]["name"]
        arr = {k: np.load(sh / f"{k}.npy", mmap_mode="r")[start:start + length]
               for k in ("tokens", "loss_mask", "features", "last_hidden")}
        records.append((arr["tokens"], arr["loss_mask"], arr["features"], arr["last_hidden"]))
    ref = root / "deepspec"
    write_deepspec_cache(ref, records, [0, 2, 4], tcfg.hidden_size)
    return ours, ref


def bf16(rec):
    """A record with features rounded to bfloat16 (the reference cache's hidden dtype)."""
    return {k: (v.astype(ml_dtypes.bfloat16).astype(np.float32) if k in ("features", "last_hidden") else v)
            for k, v in rec.items()}


def test_reference_cache_reads_same_records(both_caches):
    ours_dir, ref_dir = both_caches
    ours = cache_lib.FeatureCache(ours_dir)
    ref = reference_cache.open_feature_cache(ref_dir)
    assert isinstance(ref, reference_cache.ReferenceFeatureCache)
    assert isinstance(reference_cache.open_feature_cache(ours_dir), cache_lib.FeatureCache)
    assert len(ref) == len(ours) == 6 and ref.layer_ids == ours.layer_ids == (0, 2, 4)
    assert len(ref.manifest["shards"]) > 1  # several shards exercised
    for i in range(len(ours)):
        a, b = bf16(ours[i]), ref[i]
        assert set(a) == set(b)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
            assert a[k].dtype == b[k].dtype, k


def test_reference_cache_same_losses(both_caches, fixture):
    _, cfg, tensors, _ = fixture
    ours_dir, ref_dir = both_caches
    ours, ref = cache_lib.FeatureCache(ours_dir), reference_cache.ReferenceFeatureCache(ref_dir)
    ref.validate(cfg)
    params = jax.tree.map(jnp.asarray, mapping.draft_from_torch(cfg, tensors))
    anchors = jnp.asarray([[5, 9, 12, 15, 18, 6, 7, 8]] * 4)
    keep = jnp.ones((4, 8), bool)

    def losses(src, rnd=lambda r: r):
        b = {k: jnp.asarray(np.stack([rnd(src[i])[k] for i in range(4)])) for k in
             ("input_ids", "loss_mask", "features", "last_hidden")}
        fwd = model.training_forward(params, cfg, b["input_ids"], b["features"], b["loss_mask"], anchors,
                                     keep, b["last_hidden"])
        total, terms = loss_lib.dspark_loss(fwd, LossConfig())
        return float(total), {k: float(v) for k, v in terms.items()}

    assert losses(ours, bf16) == losses(ref)  # same features -> same losses, exactly
    np.testing.assert_allclose(losses(ours)[0], losses(ref)[0], rtol=2e-2)  # bf16 storage only


def test_reference_cache_bad_input(both_caches, tmp_path, fixture):
    import shutil
    _, ref_dir = both_caches
    bad = tmp_path / "bad"
    shutil.copytree(ref_dir, bad)
    m = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**m, "index_record_size": 48}))
    with pytest.raises(CheckpointError, match="index_record_size"):
        reference_cache.ReferenceFeatureCache(bad)
    (bad / "manifest.json").write_text(json.dumps({**m, "num_samples": 7}))
    with pytest.raises(CheckpointError, match="samples.idx"):
        reference_cache.ReferenceFeatureCache(bad)
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ConfigError, match="target_layer_ids"):
        reference_cache.ReferenceFeatureCache(bad).validate(fixture[1].replace(target_layer_ids=(0, 1, 4)))


def test_train_reads_a_reference_cache(both_caches, tmp_path):
    """`train features=cache cache_dir=<DeepSpec v2 cache>` trains like our own cache (bf16 storage)."""
    from train_tiny import tiny_config

    from dspark_jax.train.loop import train

    ours_dir, ref_dir = both_caches
    runs = {name: train(tiny_config(tmp_path / name, features="cache", cache_dir=str(d), batch_size=2,
                                    steps=2))
            for name, d in (("ours", ours_dir), ("ref", ref_dir))}
    ours = [r["loss"] for r in runs["ours"]["history"]]
    ref = [r["loss"] for r in runs["ref"]["history"]]
    assert len(ours) == len(ref) == 2
    np.testing.assert_allclose(ref, ours, rtol=2e-2)


def test_train_warns_for_engines_that_cannot_serve(tmp_path, capsys):
    from train_tiny import DRAFT, tiny_config

    from dspark_jax.train import loop

    with pytest.raises(ConfigError, match="serve_engines: unknown engine 'tgi'"):
        tiny_config(tmp_path / "x", serve_engines=["tgi"])
    cfg = tiny_config(tmp_path / "dflash", draft=dict(DRAFT, markov_rank=0, confidence_head_with_markov=False),
                      serve_engines=["vllm", "sglang"], data=str(tmp_path / "d.jsonl"))
    (tmp_path / "d.jsonl").write_text("".join(
        json.dumps({"input_ids": list(range(i, i + 20)), "loss_mask": [1] * 20}) + "\n" for i in range(8)))
    loop.setup(cfg)
    err = capsys.readouterr().err
    # vllm 0.33.0 loads a rank-0 head (empty Markov head): a limitation, not a refusal
    assert "vllm will load it with a limitation" in err and "cannot be served by sglang" in err
