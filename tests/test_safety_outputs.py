"""Inputs are sacred and outputs are never half-written (issue 27): the shared output check
(``fileio.check_output``) and the removal of temporaries an interrupted run left behind."""

import os

import pytest

from dspark_jax.errors import InputError
from dspark_jax.fileio import atomic_dir, atomic_open, check_output, remove_stale_temps


def test_output_that_is_contains_or_lies_inside_an_input_is_refused_even_with_force(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f.json").write_text("{}")
    for out, how in ((src, "is"), (tmp_path, "contains"), (src / "sub" / "new.json", "lies inside"),
                     (src / "sub" / "f.json", "lies inside")):
        with pytest.raises(InputError, match=rf"--out .* {how} the input --src .*src'"):
            check_output(out, force=True, kind="dir" if out.is_dir() else "file", inputs={"--src": src})
    link = tmp_path / "link"
    link.symlink_to(src / "sub" / "f.json")
    with pytest.raises(InputError, match="is the input --file"):
        check_output(link, force=True, inputs={"--file": src / "sub" / "f.json"})
    assert check_output(tmp_path / "other", kind="dir", inputs={"--src": src, "--none": None}) == tmp_path / "other"


def test_run_directory_is_absent_empty_or_ours(tmp_path):
    run = tmp_path / "run"
    assert check_output(run, kind="dir", marker="run.json", reuse=True)  # absent
    run.mkdir()
    assert check_output(run, kind="dir", marker="run.json", reuse=True)  # empty
    (run / "run.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    assert check_output(run, kind="dir", marker="run.json", reuse=True)  # ours
    (run / "run.json").unlink()
    with pytest.raises(InputError, match="folder of other files .*metrics.jsonl.*not one dspark-jax wrote"):
        check_output(run, kind="dir", marker="run.json", force=True)


def test_stale_temporaries_of_dead_writers_are_removed(tmp_path, capsys):
    dst = tmp_path / "out"
    dead = tmp_path / ".out.tmp-999999999-0badc0de"  # beyond pid_max: no such process
    legacy = tmp_path / ".out.tmp-0badc0de"  # older versions: no pid
    live = tmp_path / f".out.tmp-{os.getpid()}-0badc0de"
    other = tmp_path / ".outer.tmp-999999999-0badc0de"
    for d in (dead, legacy, live, other):
        d.mkdir()
        (d / "part.npy").write_bytes(b"x")
    (tmp_path / ".out.tmp-999999999-file").write_text("torn")
    with atomic_dir(dst) as tmp:
        (tmp / "a").write_text("a")
    assert not dead.exists() and not legacy.exists() and not (tmp_path / ".out.tmp-999999999-file").exists()
    assert live.exists() and other.exists() and (dst / "a").read_text() == "a"
    err = capsys.readouterr().err
    assert err.count("incomplete output of an interrupted earlier run") == 3
    (tmp_path / ".f.json.tmp-999999999-abc").write_text("torn")
    with atomic_open(tmp_path / "f.json") as f:
        f.write("{}")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".f.json")) == []
    assert remove_stale_temps(tmp_path / "nowhere" / "x") == []


def test_json_outputs_are_strict(tmp_path):
    import json

    import numpy as np

    from dspark_jax.fileio import dumps, write_json, write_jsonl

    row = {"a": float("nan"), "b": [1.0, float("inf"), np.float32("-inf"), np.float64(2.5)], "c": (np.int32(3),)}
    assert dumps(row) == '{"a": null, "b": [1.0, null, null, 2.5], "c": [3]}'
    write_jsonl(tmp_path / "r.jsonl", [row])
    write_json(tmp_path / "r.json", row)
    strict = lambda s: json.loads(s, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert strict((tmp_path / "r.jsonl").read_text())["a"] is None
    assert strict((tmp_path / "r.json").read_text())["b"][1] is None


def _fake_cache(d, tokens=6):
    """A feature cache written by hand (no target run): one record of ``tokens`` tokens."""
    import json

    import numpy as np

    sh = d / "shard_00000"
    sh.mkdir(parents=True)
    for k, a in (("tokens", np.arange(tokens, dtype=np.int32)), ("loss_mask", np.ones(tokens, np.uint8)),
                 ("features", np.zeros((tokens, 8), np.float32)), ("last_hidden", np.zeros((tokens, 4), np.float32))):
        np.save(sh / f"{k}.npy", a)
    np.save(d / "index.npy", np.array([[0, 0, tokens]], np.int64))
    (d / "manifest.json").write_text(json.dumps({
        "format": "dspark-feature-cache", "version": 1, "layer_ids": [0, 1], "hidden_size": 4, "feature_dim": 8,
        "max_length": 8, "feature_dtype": "float32", "num_records": 1, "num_tokens": tokens,
        "shards": [{"name": sh.name, "tokens": tokens}]}))
    return d


@pytest.mark.parametrize("victim", ["index.npy", "shard_00000/features.npy", "shard_00000/tokens.npy"])
def test_truncated_cache_shard_is_named(tmp_path, victim):
    from dspark_jax.data.cache import FeatureCache
    from dspark_jax.errors import CheckpointError

    d = _fake_cache(tmp_path / "c")
    assert len(FeatureCache(d)._shards) == 1
    f = d / victim
    f.write_bytes(f.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match=f"{victim}.*(truncated|holds)"):
        FeatureCache(d)


def test_rerun_after_a_killed_convert_removes_its_temporary(tmp_path, capsys):
    from pathlib import Path

    from dspark_jax import cli

    draft = Path(__file__).parent / "fixtures/dspark_qwen3_tiny/draft"
    stale = tmp_path / ".dst.tmp-999999999-deadbeef"  # what a SIGKILLed convert leaves (its pid is gone)
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"torn")
    assert cli.main(["convert", str(draft), str(tmp_path / "dst")]) == 0
    assert "incomplete output of an interrupted earlier run" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_sts_temperatures_at_the_search_bound_warn(tmp_path, capsys):
    """Confidence logits that do not rank acceptance (independent of it): STS flattens them to the
    grid's largest temperature, which is said, not silently saved."""
    import json

    import numpy as np

    from dspark_jax import cli

    rng = np.random.default_rng(0)
    rows = [{"confidence_logits": (4 * rng.standard_normal(2)).tolist(), "accepted": int(rng.integers(0, 3)),
             "proposal": 2} for _ in range(400)]
    logs = tmp_path / "logs.jsonl"
    logs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["calibrate", "--logs", str(logs), "--out", str(tmp_path / "sts")]) == 0
    cap = capsys.readouterr()
    assert "sits at the search bound" in cap.err, cap.err
    assert 20.0 in json.loads(cap.out.strip().splitlines()[-1])["temperatures"]
