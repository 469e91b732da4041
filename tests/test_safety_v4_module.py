"""A DeepSeek-V4 checkpoint's own DSpark module (``mtp.*`` + ``dspark_*`` keys) is part of the
checkpoint through ``convert`` (issue 36): both ways, ``--draft D`` reads it after any conversion
(bit for bit the fixture's module, so its greedy tokens), ``inspect`` says where it is, and a
broken module tensor (missing, wrong shape, NaN) is refused by ``convert`` and ``inspect``."""

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dspark_jax import cli
from dspark_jax.convert import checkpoint, formats

FIX = Path(__file__).parent / "fixtures" / "deepseek_v4_tiny"
PAIR = FIX / "target_dspark"


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    """The fixture converted to the project format (``j``) and back to PyTorch (``t``)."""
    d = tmp_path_factory.mktemp("v4")
    assert cli.main(["convert", str(PAIR), str(d / "j")]) == 0
    assert cli.main(["convert", str(d / "j"), str(d / "t")]) == 0
    return d


@functools.lru_cache(maxsize=None)
def _fixture_pair():
    tcfg, tparams = checkpoint.load_target(PAIR)
    return tcfg, tparams, *checkpoint.load_draft(PAIR, target_params=tparams)


@pytest.mark.parametrize("which", ["j", "t"])
def test_module_survives_conversion_bit_for_bit(round_trip, which, capsys):
    d = round_trip / which
    assert not (d / formats.ASIDE_NAME).exists()  # carried as the module, not put aside
    tcfg, tparams, dcfg, dparams = _fixture_pair()
    tc2, tp2 = checkpoint.load_target(d)
    dc2, dp2 = checkpoint.load_draft(d, target_params=tp2)
    assert dc2 == dcfg and dict(tc2.extra) == dict(tcfg.extra)  # pass-through keys: same, maybe reordered
    assert dataclasses.replace(tc2, extra=()) == dataclasses.replace(tcfg, extra=())
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), (tparams, dparams), (tp2, dp2))
    assert all(jax.tree.leaves(same))
    assert checkpoint.load_draft(d)[0] == dcfg  # without the target's params: read from beside it
    capsys.readouterr()
    assert cli.main(["inspect", str(d)]) == 0
    out = capsys.readouterr().out
    assert "module tensors (mtp.*): 144" in out and "no mtp.* tensors" not in out, out


def _corrupt(src: Path, dst: Path, how: str) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    name = "mtp.1.attn.wq_a.weight" if "mtp.1.attn.wq_a.weight" in tensors else sorted(
        n for n in tensors if n.startswith("mtp.") and tensors[n].ndim == 2)[0]
    if how == "missing":
        del tensors[name]
    elif how == "shape":
        tensors[name] = tensors[name][:, :-1].copy()
    else:
        tensors[name] = tensors[name].copy()
        tensors[name].flat[3] = np.nan
    save_file(tensors, str(dst / "model.safetensors"))
    return name


@pytest.mark.parametrize("how", ["missing", "shape", "nan"])
def test_broken_module_tensor_refused_by_convert_and_inspect(how, tmp_path, capsys):
    name = _corrupt(PAIR, tmp_path / "bad", how)
    assert cli.main(["convert", str(tmp_path / "bad"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and name in err[0], err
    assert not (tmp_path / "out").exists()
    if how != "nan":  # inspect reads headers only: the shape and presence of every module tensor
        assert cli.main(["inspect", str(tmp_path / "bad")]) == 2
        cap = capsys.readouterr()
        assert "BROKEN" in cap.out and name in cap.err, cap


@pytest.mark.slow  # one V4 speculative compile
def test_generate_with_the_converted_module_gives_the_fixture_tokens(round_trip, tmp_path):
    ref = json.loads((FIX / "decode_greedy.json").read_text())
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ref["prompts"]))
    d = str(round_trip / "t")
    assert cli.main(["generate", "--target", d, "--draft", d, "--prompts", str(prompts), "--out",
                     str(tmp_path / "o.jsonl"), "--max-new-tokens", str(ref["new_tokens"]), "--stop-token-ids",
                     "--max-cache-len", "256", "--batch-size", "3", "--batching", "static"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [r["output_ids"] for r in rows] == ref["output_ids"]
