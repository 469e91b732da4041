"""Silently useless results are refused (issue 36): a NaN drafter by ``export`` and ``inspect``'s
verdict as by ``convert`` (``--allow-nonfinite`` overrides), training data without a trainable
position, ``--verify fixed:K`` beyond the block."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from dspark_jax import cli
from dspark_jax.convert import checkpoint

TINY = Path(__file__).resolve().parents[1] / "tests/fixtures/dspark_qwen3_tiny"


@pytest.fixture(scope="module")
def nan_draft(tmp_path_factory):
    cfg, params = checkpoint.load_draft(TINY / "draft")
    params = jax.tree.map(lambda a: np.array(a, copy=True), params)
    leaf = params["layers"] if "layers" in params else next(iter(params.values()))
    first = jax.tree.leaves(leaf)[0]
    first.flat[0] = np.nan
    d = tmp_path_factory.mktemp("nan") / "draft"
    checkpoint.save_draft(d, cfg, params)
    return d


def test_nan_drafter_refused_by_export_and_inspect(nan_draft, tmp_path, capsys):
    assert cli.main(["export", str(nan_draft), str(tmp_path / "x"), "--engine", "vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "NaN/inf" in err[0] and "--allow-nonfinite" in err[0], err
    assert not (tmp_path / "x").exists()
    assert cli.main(["export", str(nan_draft), str(tmp_path / "x"), "--engine", "vllm", "--allow-nonfinite"]) == 0
    capsys.readouterr()
    assert cli.main(["inspect", str(nan_draft)]) == 0
    out = capsys.readouterr().out
    assert "weights BROKEN" in out and " loadable" not in out.replace("NOT loadable", ""), out


def test_fixed_k_beyond_the_block_refused_before_loading(tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n')
    block = checkpoint.load_draft(TINY / "draft")[0].block_size
    argv = ["generate", "--target", str(TINY / "target"), "--draft", str(TINY / "draft"), "--prompts",
            str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl"), "--verify", f"fixed:{block + 1}"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"K must be <= {block}" in err[0], err


def test_training_data_without_a_trainable_position_refused(tmp_path, capsys):
    rows = [{"input_ids": [1, 2, 3], "loss_mask": [0, 0, 1]}, {"input_ids": [4], "loss_mask": [1]},
            {"input_ids": [1, 2, 3, 4, 5, 6], "loss_mask": [0, 0, 0, 0, 1, 1]}]  # trainable past max_length 4
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = dict(target=str(TINY / "target"), data=str(tmp_path / "d.jsonl"), output_dir=str(tmp_path / "run"),
               max_length=4, batch_size=1, steps=1, progress=False, num_devices=1, mesh="data=1",
               draft=dict(num_hidden_layers=1, target_layer_ids=(0, 2, 4), mask_token_id=511, num_anchors=2))
    (tmp_path / "cfg.py").write_text(f"CONFIG = {cfg!r}\n")
    assert cli.main(["train", "--config", str(tmp_path / "cfg.py")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none of its 3 row(s) (1, 2, 3)" in err[0] and "max_length=4" in err[0], err
    from dspark_jax.data.sources import check_trainable

    class Rows:
        def __init__(self, rows):
            self.rows = rows

        def __len__(self):
            return len(self.rows)

        def raw(self, i):
            return self.rows[i]["input_ids"], self.rows[i]["loss_mask"]

    check_trainable(Rows(rows), 6)  # the third row trains within 6 tokens


def test_nan_ue8m0_scale_is_nan_without_a_numpy_warning():
    import warnings

    from dspark_jax.convert import quant
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v = quant.scale_values(np.array([127, 128, 0xFF], np.uint8))
    assert v[0] == 1 and v[1] == 2 and np.isnan(v[2])
