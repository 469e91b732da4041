"""The embedded target's training text: the Python standard library's own ``.py`` files.

Every machine with Python has it (``sysconfig.get_paths()["stdlib"]``, without ``site-packages``
and test suites). A deterministic ~5% of the files (by a salted hash of their relative path) is
held out (``split_files``). Training sequences are random windows of the concatenated files
(``<|bos|> bytes <|eos|>`` per file, ``build_stream``); a fraction is rendered in the minimal chat
format (``<|bos|><|user|>prefix<|end|><|assistant|>continuation``, ``sample_batch``) so that
chat-formatted prompts make the model continue the user's text. ``heldout_prompts`` cuts eval
prompts from the held-out files.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Sequence

import numpy as np

from dspark_jax.errors import InputError
from dspark_jax.tokenizer import ByteTokenizer

HELDOUT_SALT = "dspark-default-heldout-v1"
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """Sorted relative paths of the standard library's ``.py`` files (no tests, no site-packages)."""
    root = Path(root) if root is not None else stdlib_dir()
    if not root.is_dir():
        raise InputError(f"standard library directory {str(root)!r} does not exist")
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        out.append(rel.as_posix())
    return sorted(out)


def split_files(rel_paths: Sequence[str], heldout_fraction: float,
                salt: str = HELDOUT_SALT) -> tuple[list[str], list[str]]:
    """Deterministic (train, held-out) split by a salted SHA-256 of each relative path."""
    train, heldout = [], []
    for rel in rel_paths:
        h = int.from_bytes(hashlib.sha256(f"{salt}:{rel}".encode()).digest()[:8], "big")
        (heldout if h / 2**64 < heldout_fraction else train).append(rel)
    if not train or not heldout:
        raise InputError(f"pretrain: the split of {len(rel_paths)} files left an empty side "
                         f"(train {len(train)}, held-out {len(heldout)})")
    return train, heldout


def build_stream(root: Path, rel_paths: Sequence[str], tok: ByteTokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate ``<|bos|> bytes <|eos|>`` per file -> (stream [N] int32, doc_starts [F] int64)."""
    pieces, starts, pos = [], [], 0
    for rel in rel_paths:
        data = np.frombuffer((Path(root) / rel).read_bytes(), np.uint8).astype(np.int32)
        doc = np.concatenate([[tok.bos_token_id], data, [tok.eos_token_id]]).astype(np.int32)
        starts.append(pos)
        pieces.append(doc)
        pos += doc.size
    return np.concatenate(pieces), np.asarray(starts, np.int64)


def sample_batch(rng: np.random.Generator, stream: np.ndarray, doc_starts: np.ndarray,
                 tok: ByteTokenizer, batch: int, seq_len: int, chat_fraction: float) -> np.ndarray:
    """Random windows ``[batch, seq_len + 1]`` (inputs ``[:, :-1]``, labels ``[:, 1:]``).

    A ``chat_fraction`` of rows reads ``<|bos|><|user|>P<|end|><|assistant|>C``
    where P is 8..seq_len/2 bytes of one file and C the text that follows P.
    """
    n = seq_len + 1
    out = np.empty((batch, n), np.int32)
    user, end, assistant = (tok.token_to_id(t) for t in ("<|user|>", "<|end|>", "<|assistant|>"))
    for b in range(batch):
        if rng.random() < chat_fraction:
            o = int(rng.integers(1, stream.size - n))
            doc_start = int(doc_starts[np.searchsorted(doc_starts, o, side="right") - 1]) + 1
            p = int(rng.integers(8, max(9, seq_len // 2)))
            prompt = stream[max(doc_start, o - p):o]
            head = np.concatenate([[tok.bos_token_id, user], prompt, [end, assistant]])
            row = np.concatenate([head, stream[o:o + n]])[:n]
        else:
            o = int(rng.integers(0, stream.size - n))
            row = stream[o:o + n]
        out[b] = row
    return out


def eval_windows(stream: np.ndarray, count: int, seq_len: int) -> np.ndarray:
    """``count`` evenly spaced plain windows ``[count, seq_len + 1]`` (deterministic)."""
    n = seq_len + 1
    if stream.size <= n:
        raise InputError(f"pretrain: evaluation text has {stream.size} tokens, fewer than a window of {n}")
    offsets = np.linspace(0, stream.size - n - 1, count).astype(np.int64)
    return np.stack([stream[o:o + n] for o in offsets])


def heldout_prompts(count: int, *, root: Path | None = None, max_bytes: int = 320,
                    min_bytes: int = 64, seed: int = 0, heldout_fraction: float = 0.05) -> list[dict]:
    """Prompts cut from held-out files: ``[{"turns": [text], "source": "rel/path.py:LINE"}]``.

    Each text is whole consecutive lines (``min_bytes``..``max_bytes`` UTF-8
    bytes) starting at a random line of a held-out file, in the reference's
    eval JSONL record format. Deterministic for a given stdlib and ``seed``.
    """
    root = Path(root) if root is not None else stdlib_dir()
    _, heldout = split_files(stdlib_files(root), heldout_fraction)
    rng = np.random.default_rng(seed)
    out: list[dict] = []
    for attempt in range(50 * count):
        if len(out) >= count:
            break
        rel = heldout[attempt % len(heldout)] if attempt < len(heldout) else heldout[int(rng.integers(len(heldout)))]
        try:
            lines = (root / rel).read_text(encoding="utf-8").splitlines(keepends=True)
        except (OSError, UnicodeDecodeError):
            continue
        cut = cut_lines(lines, rng, min_bytes, max_bytes)
        if cut is not None:
            out.append({"turns": [cut[0]], "source": f"{rel}:{cut[1] + 1}"})
    return out


def cut_lines(lines: Sequence[str], rng: np.random.Generator, min_bytes: int, max_bytes: int
              ) -> tuple[str, int] | None:
    """Whole consecutive ``lines`` (with their newlines) from a random start line, at most
    ``max_bytes`` UTF-8 bytes: ``(text, start index)``; None for a file of fewer than 4 lines (no
    draw from ``rng``) or a cut shorter than ``min_bytes`` or blank."""
    if len(lines) < 4:
        return None
    start = int(rng.integers(0, len(lines) - 2))
    text, end = "", start
    while end < len(lines) and len((text + lines[end]).encode()) <= max_bytes:
        text += lines[end]
        end += 1
    if len(text.encode()) < min_bytes or not text.strip():
        return None
    return text, start
