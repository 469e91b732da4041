"""Eval prompt files in the reference JSONL format: reading, names, and errors."""

import json

import pytest

from dspark_jax.data import eval_datasets as ed
from dspark_jax.errors import InputError


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture
def data_dir(tmp_path):
    _write(tmp_path / "alpha.jsonl", [
        json.dumps({"turns": ["first ☃", "second turn ignored"], "id": 1}),
        "",
        json.dumps({"turns": ["two"]}),
        json.dumps({"turns": ["three"], "extra": [1, 2]}),
    ])
    _write(tmp_path / "mt-bench.jsonl", [json.dumps({"turns": ["q"]})])
    (tmp_path / "notes.txt").write_text("not a dataset")
    return tmp_path


def test_reads_first_turns(data_dir):
    prompts = ed.load_dataset("alpha", data_dir)
    assert [p.text for p in prompts] == ["first ☃", "two", "three"]
    assert [p.line for p in prompts] == [1, 3, 4]  # blank line 2 skipped, line numbers kept
    assert [p.index for p in prompts] == [0, 1, 2] and prompts[0].dataset == "alpha"
    assert ed.load_prompts("alpha", data_dir, max_samples=2) == ["first ☃", "two"]
    assert ed.available_datasets(data_dir) == ["alpha", "mt-bench"]


def test_name_normalisation_and_many(data_dir):
    assert ed.dataset_path("MT_Bench", data_dir).name == "mt-bench.jsonl"
    got = ed.load_datasets("alpha, mt_bench", data_dir, max_samples=1)
    assert list(got) == ["alpha", "mt_bench"] and got["mt_bench"][0].text == "q"
    with pytest.raises(InputError, match="names no dataset"):
        ed.parse_dataset_names(" , ")


def test_unknown_name_lists_available(data_dir):
    with pytest.raises(InputError, match=r"unknown dataset 'gsm9k'.*available: alpha, mt-bench"):
        ed.load_dataset("gsm9k", data_dir)
    # every name is checked before any file is read
    (data_dir / "alpha.jsonl").write_text("{broken\n")
    with pytest.raises(InputError, match="unknown dataset 'nope'"):
        ed.load_datasets(["alpha", "nope"], data_dir)


def test_missing_dir(tmp_path):
    with pytest.raises(InputError, match="is not a directory"):
        ed.available_datasets(tmp_path / "absent")


@pytest.mark.parametrize("bad_line, message", [
    ('{"turns": ["ok"', "malformed JSONL line"),
    ('["a list"]', "expected a JSON object"),
    ('{"prompt": "x"}', "missing field 'turns'"),
    ('{"turns": "x"}', "'turns' must be a list"),
    ('{"turns": []}', "'turns' is empty"),
    ('{"turns": [""]}', "first turn must be a non-empty string"),
    ('{"turns": [3]}', "first turn must be a non-empty string"),
])
def test_bad_lines_name_file_and_line(tmp_path, bad_line, message):
    path = _write(tmp_path / "d.jsonl", [json.dumps({"turns": ["a"]}), "", bad_line])
    with pytest.raises(InputError, match=message) as info:
        ed.read_prompt_file(path)
    assert f"{path}:3:" in str(info.value)


def test_empty_file_and_bad_max_samples(tmp_path):
    path = _write(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(InputError, match="holds no prompts"):
        ed.read_prompt_file(path)
    with pytest.raises(InputError, match="max-samples"):
        ed.read_prompt_file(path, max_samples=0)


def test_shipped_copy():
    d = ed.default_data_dir()
    names = ed.available_datasets()
    for name in ("humaneval", "mbpp", "gsm8k", "mt-bench", "stdlib-heldout"):
        assert name in names
    total = sum(p.stat().st_size for p in d.iterdir())
    assert total < 1_000_000
    for name in names:
        prompts = ed.load_dataset(name)
        assert 1 <= len(prompts) <= 50
        first = json.loads((d / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()[0])
        assert prompts[0].text == first["turns"][0]
