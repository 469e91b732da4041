"""Feature cache (write, read, validate), grain pipeline, JSONL/chat sources, bad input."""

import json
import shutil

import jax
import numpy as np
import pytest

from dspark_jax.cli import main as cli_main
from dspark_jax.config import DraftConfig
from dspark_jax.convert.checkpoint import load_target
from dspark_jax.convert.identity import target_identity
from dspark_jax.data import cache as cache_lib
from dspark_jax.data import chat, pipeline, sources
from dspark_jax.data.sample import sample_sequences, write_jsonl
from dspark_jax.errors import ConfigError, InputError
from dspark_jax.target.features import target_features
from dspark_jax.train.config import TrainConfig
from dspark_jax.train.loop import load_source
from dspark_jax.train.loop import train as _train
from train_tiny import DRAFT, TARGET
from train_tiny import tiny_config as _tiny


@pytest.fixture(scope="module")
def target():
    return load_target(TARGET)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory, target):
    cfg, params = target
    path = tmp_path_factory.mktemp("data") / "seqs.jsonl"
    seqs = sample_sequences(params, cfg, 16, 32, seed=3)
    write_jsonl(path, [s[: 20 + i % 13] for i, s in enumerate(seqs)])  # ragged lengths 20..32
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, data_file):
    out = tmp_path_factory.mktemp("cache") / "feats"
    rc = cli_main(["cache", "--target", str(TARGET), "--data", str(data_file), "--out", str(out),
                   "--layer-ids", "0,2,4", "--max-length", "32", "--batch-size", "4", "--quiet"])
    assert rc == 0
    return out


def tiny_config(tmp, **kw) -> TrainConfig:
    return _tiny(tmp / "run", **kw)


def train(cfg):
    return _train(cfg, fast_compile=True)


def test_cache_holds_target_features(cache_dir, data_file, target):
    tcfg, tparams = target
    cache = cache_lib.FeatureCache(cache_dir)
    m = cache.manifest
    assert m["layer_ids"] == [0, 2, 4] and m["num_records"] == 16 and m["feature_dim"] == 192
    assert m["target"]["sha256"] == target_identity(tcfg, tparams)
    src = sources.read_token_jsonl(data_file, 32)
    for i in (0, 7):
        rec = cache[i]
        n = len(src.raw(i)[0])
        np.testing.assert_array_equal(rec["input_ids"], src[i]["input_ids"])
        feats, last, _ = target_features(tparams, tcfg, (0, 2, 4), rec["input_ids"][None, :n])
        np.testing.assert_allclose(rec["features"][:n], np.asarray(feats[0]), atol=1e-5)
        np.testing.assert_allclose(rec["last_hidden"][:n], np.asarray(last[0]), atol=1e-5)
        assert not rec["features"][n:].any()
    with pytest.raises(InputError, match="already exists"):
        cli_main_raise(["cache", "--target", str(TARGET), "--data", str(data_file), "--out", str(cache_dir),
                        "--layer-ids", "0,2,4", "--max-length", "32", "--quiet"])


def cli_main_raise(argv):
    from dspark_jax.cli import build_parser
    args = build_parser().parse_args(argv)
    return args.func(args)


def test_online_and_cache_runs_give_the_same_losses(cache_dir, data_file, tmp_path):
    online = train(tiny_config(tmp_path / "on", data=str(data_file)))
    cached = train(tiny_config(tmp_path / "ca", features="cache", cache_dir=str(cache_dir)))
    a = [r["loss"] for r in online["history"]]
    b = [r["loss"] for r in cached["history"]]
    np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    assert [r["data"] for r in online["history"]] == [r["data"] for r in cached["history"]]


def _edit_manifest(src, dst, **changes):
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    for k, v in changes.items():
        if k == "sha256":
            m["target"]["sha256"] = v
        else:
            m[k] = v
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def test_cache_for_other_layers_hidden_size_or_target_is_rejected(cache_dir, target, tmp_path):
    tcfg, tparams = target
    cache = cache_lib.FeatureCache(cache_dir)
    other_layers = DraftConfig.for_target(tcfg, **dict(DRAFT, target_layer_ids=(1, 3)))
    with pytest.raises(ConfigError, match=r"layer_ids \[0, 2, 4\] != drafter target_layer_ids \[1, 3\]"):
        cache.validate(other_layers, tcfg)
    bad = cache_lib.FeatureCache(_edit_manifest(cache_dir, tmp_path / "h", hidden_size=128))
    with pytest.raises(ConfigError, match="hidden_size 128 != drafter hidden_size 64"):
        bad.validate(DraftConfig.for_target(tcfg, **DRAFT))
    # other target weights: the identity hash differs; checked by the training entry before compiling
    other = jax.tree.map(lambda a: a * 1.001, tparams)
    with pytest.raises(ConfigError, match="target identity"):
        cache.validate(DraftConfig.for_target(tcfg, **DRAFT), tcfg, target_identity(tcfg, other))
    cfg = tiny_config(tmp_path, features="cache", cache_dir=str(cache_dir), draft=dict(DRAFT, target_layer_ids=(1, 3)))
    with pytest.raises(ConfigError, match="does not fit this run"):
        load_source(cfg, tcfg, cfg.draft_config(tcfg), tparams)


def test_empty_dataset_and_overlong_sequences(tmp_path, data_file):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(InputError, match="empty"):
        sources.read_token_jsonl(empty, 32)
    with pytest.raises(InputError, match=r"seqs.jsonl:\d+: sequence of \d+ tokens is longer than max_length=24"):
        sources.read_token_jsonl(data_file, 24, overlong="refuse")
    cut = sources.read_token_jsonl(data_file, 24, overlong="truncate")
    full = sources.read_token_jsonl(data_file, 32)
    assert len(cut) == len(full) == 16
    assert max(len(cut.raw(i)[0]) for i in range(16)) == 24
    np.testing.assert_array_equal(cut[15]["input_ids"], full[15]["input_ids"][:24])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2, 3], "loss_mask": [1, 1]}\n')
    with pytest.raises(InputError, match=r"bad\.jsonl:1: input_ids has 3 tokens but loss_mask has 2"):
        sources.read_token_jsonl(bad, 32)
    with pytest.raises(InputError, match="fewer than one global batch"):
        pipeline.make_dataset(full, global_batch=32, grad_accum=1, seed=0, epochs=1)


def test_pipeline_is_deterministic_sharded_and_checkpointable(data_file):
    src = sources.read_token_jsonl(data_file, 32)
    ids = lambda batch: [int(i) for i in batch["index"]]
    whole = [ids(b) for b in pipeline.make_dataset(src, global_batch=8, grad_accum=2, seed=5, epochs=2)]
    assert len(whole) == 4 and sorted(sum(whole[:2], [])) == list(range(16))
    assert whole == [ids(b) for b in pipeline.make_dataset(src, global_batch=8, grad_accum=2, seed=5, epochs=2)]
    assert whole != [ids(b) for b in pipeline.make_dataset(src, global_batch=8, grad_accum=2, seed=6, epochs=2)]
    # two processes, each holding rows [0, 2) or [2, 4) of each 4-row micro-batch
    parts = [[ids(b) for b in pipeline.make_dataset(src, global_batch=8, grad_accum=2, seed=5, epochs=2,
                                                    row_start=r, row_count=2)] for r in (0, 2)]
    for t in range(4):
        p0, p1 = parts[0][t], parts[1][t]
        assert p0[:2] + p1[:2] + p0[2:] + p1[2:] == whole[t]
    it = iter(pipeline.make_dataset(src, global_batch=8, grad_accum=2, seed=5, epochs=2))
    next(it)
    state = it.get_state()
    rest = [ids(b) for b in it]
    it2 = iter(pipeline.make_dataset(src, global_batch=8, grad_accum=2, seed=5, epochs=2))
    it2.set_state(state)
    assert [ids(b) for b in it2] == rest == whole[1:]


class _CharTokenizer:
    """A minimal chat-template tokenizer: one token per character, role markers as tokens."""

    vocab_size = 512

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
        ids = []
        for m in messages:
            ids += [1 if m["role"] == "user" else 2] + [10 + (ord(c) % 400) for c in m["content"]] + [3]
        if add_generation_prompt:
            ids += [2]
        return ids


def test_chat_source_masks_only_assistant_tokens(tmp_path):
    path = tmp_path / "chat.jsonl"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo!"},
            {"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"}]
    path.write_text(json.dumps({"messages": msgs}) + "\n")
    src = chat.read_chat_jsonl(path, _CharTokenizer(), 32)
    ids, mask = src.raw(0)
    # user "hi" = [1, h, i, 3]; assistant = [2] (prompt) + "yo!" + [3]
    assert ids[:4] == [1, 10 + ord("h"), 10 + ord("i"), 3]
    assert mask == [0] * 4 + [0] + [1] * 4 + [0] * 3 + [0] + [1] * 3
    with pytest.raises(InputError, match="longer than max_length=8"):
        chat.read_chat_jsonl(path, _CharTokenizer(), 8, overlong="refuse")


def test_bfloat16_cache_round_trip_and_older_bfloat16_caches(cache_dir, data_file, tmp_path):
    """A bfloat16 cache reads back as the float32 cache rounded to bfloat16 (stored as uint16 bit
    patterns); a cache written before that (bfloat16 saved raw, numpy's '|V2') still reads."""
    import ml_dtypes

    out = tmp_path / "bf16"
    assert cli_main(["cache", "--target", str(TARGET), "--data", str(data_file), "--out", str(out),
                     "--layer-ids", "0,2,4", "--max-length", "32", "--batch-size", "4", "--dtype", "bfloat16",
                     "--quiet"]) == 0
    f32, bf16 = cache_lib.FeatureCache(cache_dir), cache_lib.FeatureCache(out)
    assert bf16.manifest["feature_dtype"] == "bfloat16"
    assert np.load(out / "shard_00000" / "features.npy", mmap_mode="r").dtype == np.uint16  # plain numpy reads it

    def check(cache):
        for i in (0, 7):
            a, b = f32[i], cache[i]
            for k in ("features", "last_hidden"):
                assert b[k].dtype == np.float32
                want = a[k].astype(ml_dtypes.bfloat16).astype(np.float32)
                np.testing.assert_array_equal(b[k], want)
            np.testing.assert_array_equal(b["input_ids"], a["input_ids"])
    check(bf16)

    older = tmp_path / "bf16_older"  # the same cache as the previous writer stored it
    shutil.copytree(out, older)
    for shard in older.glob("shard_*"):
        for k in cache_lib.FEATURE_ARRAYS:
            bits = np.load(shard / f"{k}.npy")
            np.save(shard / f"{k}.npy", bits.view(ml_dtypes.bfloat16))
    assert np.load(older / "shard_00000" / "features.npy", mmap_mode="r").dtype.kind == "V"
    check(cache_lib.FeatureCache(older))


def test_cache_runs_each_batch_at_its_rows_bucket_with_the_padded_features(data_file, target, tmp_path,
                                                                          monkeypatch):
    """`cache` pads a batch to the power-of-two bucket of its longest row, not to --max-length:
    rows of 20..32 tokens with --max-length 64 run at width 32, and every stored feature equals
    the target's on the row padded to max_length (causal: padding after a token cannot change it)."""
    tcfg, tparams = target
    widths = []
    feature_fn = cache_lib._feature_fn

    def spy(*args):
        run = feature_fn(*args)
        return lambda params, tokens: (widths.append(tokens.shape), run(params, tokens))[1]

    monkeypatch.setattr(cache_lib, "_feature_fn", spy)
    out = tmp_path / "bucketed"
    assert cli_main(["cache", "--target", str(TARGET), "--data", str(data_file), "--out", str(out),
                     "--layer-ids", "-1,2", "--max-length", "64", "--batch-size", "16", "--quiet"]) == 0
    assert widths == [(16, 32)]
    cache = cache_lib.FeatureCache(out)
    src = sources.read_token_jsonl(data_file, 64)
    padded = np.stack([src[i]["input_ids"] for i in range(len(src))])
    feats, last, _ = jax.device_get(target_features(tparams, tcfg, (-1, 2), padded))
    for i in range(len(src)):
        n = len(src.raw(i)[0])
        rec = cache[i]
        np.testing.assert_allclose(rec["features"][:n], feats[i, :n], rtol=0, atol=1e-6)
        np.testing.assert_allclose(rec["last_hidden"][:n], last[i, :n], rtol=0, atol=1e-6)
