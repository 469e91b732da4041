"""Evaluation prompts in the reference JSONL format.

A dataset ``NAME`` is the file ``NAME.jsonl`` in a data directory; each
non-blank line is a JSON object ``{"turns": ["first user turn", ...], ...}``
and only the first turn is used (as the reference does). Names match the file
stem case-insensitively with ``_`` and ``-`` interchangeable
(``mt_bench`` -> ``mt-bench.jsonl``).

The package ships a small copy (the first 50 prompts of a few benchmarks, plus
``stdlib-heldout``: prefixes of the embedded default target's held-out
standard-library files) under ``dspark_jax/assets/eval_datasets``; that is the
data directory when none is given.

Errors are InputError: unknown name (listing the available ones), missing
directory, a malformed line (file and 1-based line number), empty ``turns``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from dspark_jax.errors import InputError
from dspark_jax.fileio import iter_jsonl

SUFFIX = ".jsonl"


def default_data_dir() -> Path:
    """The prompt files shipped with the package."""
    return Path(__file__).resolve().parent.parent / "assets" / "eval_datasets"


@dataclasses.dataclass(frozen=True)
class EvalPrompt:
    """One prompt: its dataset, 0-based index, 1-based line in the file, and first-turn text."""

    dataset: str
    index: int
    line: int
    text: str


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def _resolve_dir(data_dir) -> Path:
    d = default_data_dir() if data_dir is None else Path(data_dir)
    if not d.is_dir():
        raise InputError(f"--data-dir {str(d)!r} is not a directory")
    return d


def available_datasets(data_dir=None) -> list[str]:
    """Sorted dataset names (``*.jsonl`` stems) in ``data_dir`` (default: the shipped copy)."""
    d = _resolve_dir(data_dir)
    return sorted(p.name[: -len(SUFFIX)] for p in d.iterdir() if p.name.endswith(SUFFIX) and p.is_file())


def parse_dataset_names(spec: str | Sequence[str]) -> list[str]:
    """``"gsm8k,mt-bench"`` (or a list) -> ``["gsm8k", "mt-bench"]``; empty -> InputError."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [s.strip() for s in items if s and s.strip()]
    if not names:
        raise InputError(f"--datasets {spec!r} names no dataset")
    return list(dict.fromkeys(names))


def dataset_path(name: str, data_dir=None) -> Path:
    """The file of dataset ``name``; InputError listing the available names if unknown."""
    d = _resolve_dir(data_dir)
    names = available_datasets(d)
    matches = [n for n in names if _norm(n) == _norm(name)]
    if not matches:
        raise InputError(f"unknown dataset {name!r} in {str(d)!r}; available: "
                         + (", ".join(names) if names else "none (no *.jsonl files)"))
    exact = [n for n in matches if n == name]
    return d / ((exact or matches)[0] + SUFFIX)


def read_prompt_file(path, *, dataset: str | None = None, max_samples: int | None = None) -> list[EvalPrompt]:
    """First turns of a JSONL prompt file, in file order (at most ``max_samples``).

    Blank lines are skipped. A line that is not a JSON object with a non-empty
    list ``turns`` whose first entry is a non-empty string raises InputError
    naming the file and the line number.
    """
    path = Path(path)
    if max_samples is not None and (not isinstance(max_samples, int) or max_samples <= 0):
        raise InputError(f"--max-samples must be a positive int, got {max_samples!r}")
    dataset = dataset or path.name.removesuffix(SUFFIX)
    out: list[EvalPrompt] = []
    for where, record in iter_jsonl(path, "prompt file"):
        lineno = int(where.rsplit(":", 1)[1])
        if not isinstance(record, dict):
            raise InputError(f"{where}: expected a JSON object with 'turns', got {type(record).__name__}")
        if "turns" not in record:
            raise InputError(f"{where}: missing field 'turns' (keys: {sorted(record)})")
        turns = record["turns"]
        if not isinstance(turns, list):
            raise InputError(f"{where}: 'turns' must be a list of strings, got {type(turns).__name__}")
        if not turns:
            raise InputError(f"{where}: 'turns' is empty")
        first = turns[0]
        if not isinstance(first, str) or not first.strip():
            raise InputError(f"{where}: the first turn must be a non-empty string, got {first!r:.60}")
        out.append(EvalPrompt(dataset=dataset, index=len(out), line=lineno, text=first))
        if max_samples is not None and len(out) >= max_samples:
            break
    if not out:
        raise InputError(f"prompt file {str(path)!r} holds no prompts")
    return out


def load_dataset(name: str, data_dir=None, *, max_samples: int | None = None) -> list[EvalPrompt]:
    """Prompts of dataset ``name`` from ``data_dir`` (default: the shipped copy)."""
    path = dataset_path(name, data_dir)
    return read_prompt_file(path, dataset=path.name[: -len(SUFFIX)], max_samples=max_samples)


def load_prompts(name: str, data_dir=None, *, max_samples: int | None = None) -> list[str]:
    """First-turn texts of dataset ``name``."""
    return [p.text for p in load_dataset(name, data_dir, max_samples=max_samples)]


def load_datasets(names: str | Sequence[str], data_dir=None, *,
                  max_samples: int | None = None) -> dict[str, list[EvalPrompt]]:
    """``{name: prompts}`` for ``"a,b"`` or a list; every name is checked before any file is read."""
    names = parse_dataset_names(names)
    paths = {n: dataset_path(n, data_dir) for n in names}
    return {n: read_prompt_file(p, dataset=n, max_samples=max_samples) for n, p in paths.items()}
