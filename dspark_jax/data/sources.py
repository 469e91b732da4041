"""Random-access grain sources of training sequences.

Every source yields records ``{"input_ids": int32 [S], "loss_mask": float32 [S],
"index": int64 []}`` padded to ``max_length`` (pad id 0, loss_mask 0).
Sequences longer than ``max_length`` are cut to the first ``max_length`` tokens
(``overlong="truncate"``) or rejected with the offending line (``"refuse"``).
All lines are parsed and validated once on construction, before any compilation.
Chat conversations (rendered with a tokenizer's chat template) are read by ``data/chat.py``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dspark_jax.errors import InputError
from dspark_jax.fileio import iter_jsonl


def pad_record(ids: Sequence[int], mask: Sequence[float], max_length: int, index: int) -> dict:
    """Pad one sequence to [max_length] and build the record dict."""
    out_ids = np.zeros((max_length,), np.int32)
    out_mask = np.zeros((max_length,), np.float32)
    n = min(len(ids), max_length)
    out_ids[:n] = np.asarray(ids[:n], np.int32)
    out_mask[:n] = np.asarray(mask[:n], np.float32)
    return {"input_ids": out_ids, "loss_mask": out_mask, "index": np.int64(index)}


def fit_sequence(ids, mask, max_length: int, overlong: str, where: str):
    """(ids, mask) cut to ``max_length`` (``overlong="truncate"``) or InputError naming ``where``."""
    if len(ids) > max_length:
        if overlong == "refuse":
            raise InputError(f"{where}: sequence of {len(ids)} tokens is longer than max_length="
                             f"{max_length} (set overlong='truncate' to cut it)")
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask


class TokenSequences:
    """In-memory sequences (lists of ids and loss masks) as a grain random-access source."""

    def __init__(self, sequences: Sequence[tuple[Sequence[int], Sequence[float]]], max_length: int,
                 vocab_size: int | None = None, overlong: str = "truncate", name: str = "dataset",
                 wheres: Sequence[str] | None = None):
        self.max_length = max_length
        self._seqs = []
        for i, (ids, mask) in enumerate(sequences):
            where = wheres[i] if wheres is not None else f"{name} record {i + 1}"
            ids, mask = list(ids), list(mask)
            if len(ids) != len(mask):
                raise InputError(f"{where}: input_ids has {len(ids)} tokens but loss_mask has {len(mask)}")
            if not ids:
                raise InputError(f"{where}: empty input_ids")
            if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
                raise InputError(f"{where}: token id outside the vocabulary [0, {vocab_size})")
            self._seqs.append(fit_sequence(ids, mask, max_length, overlong, where))
        if not self._seqs:
            raise InputError(f"{name} is empty: no training sequences")
        if not any(any(m) for _, m in self._seqs):
            raise InputError(f"{name}: every loss_mask is 0 (after cutting to max_length={max_length}), "
                             "so there is nothing to train on; mark the tokens to learn with 1")

    def __len__(self) -> int:
        return len(self._seqs)

    def __getitem__(self, index: int) -> dict:
        ids, mask = self._seqs[index]
        return pad_record(ids, mask, self.max_length, index)

    def raw(self, index: int) -> tuple[list[int], list[float]]:
        return self._seqs[index]


def reply_record(prompt_ids: Sequence[int], reply_ids: Sequence[int]) -> dict:
    """The token-JSONL record of a prompt and its reply: ``{"input_ids": prompt + reply,
    "loss_mask": 0 on the prompt, 1 on the reply}`` (what ``read_token_jsonl`` reads)."""
    prompt, reply = [int(t) for t in prompt_ids], [int(t) for t in reply_ids]
    return {"input_ids": prompt + reply, "loss_mask": [0] * len(prompt) + [1] * len(reply)}


def parse_token_record(rec, where: str) -> tuple[list[int], list[float]]:
    """``{"input_ids": [...], "loss_mask": [...]}`` (loss_mask optional: all 1) -> (ids, mask);
    InputError naming ``where`` for a wrong shape or type."""
    if not isinstance(rec, dict) or "input_ids" not in rec:
        raise InputError(f"{where}: expected an object with 'input_ids'")
    ids = rec["input_ids"]
    mask = rec.get("loss_mask", [1] * len(ids) if isinstance(ids, list) else [])
    for field, values in (("input_ids", ids), ("loss_mask", mask)):
        if not isinstance(values, list) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise InputError(f"{where}: '{field}' must be a list of numbers")
    if not all(isinstance(t, int) for t in ids):
        raise InputError(f"{where}: 'input_ids' must be a list of ints")
    odd = next((j for j, v in enumerate(mask) if v not in (0, 1)), None)
    if odd is not None:
        raise InputError(f"{where}: 'loss_mask' value {mask[odd]!r} at index {odd} is not 0 or 1")
    return ids, mask


def read_token_jsonl(path, max_length: int, vocab_size: int | None = None,
                     overlong: str = "truncate") -> TokenSequences:
    """JSONL lines ``{"input_ids": [...], "loss_mask": [...]}`` (loss_mask optional: all 1)."""
    seqs, wheres = [], []
    for where, rec in iter_jsonl(path, "data file"):
        ids, mask = parse_token_record(rec, where)
        if len(ids) > max_length and overlong == "refuse":
            fit_sequence(ids, mask, max_length, overlong, where)
        seqs.append((ids, mask))
        wheres.append(where)
    return TokenSequences(seqs, max_length, vocab_size, overlong, name=str(path), wheres=wheres)


def check_trainable(source, max_length: int, what: str = "data") -> None:
    """InputError unless some row of ``source`` (``raw(i)`` -> (ids, loss_mask)) has a trainable
    position within ``max_length``: an anchor with a next token, both with loss_mask > 0 (what
    ``train.batch.anchor_candidates`` samples). Data without one trains nothing (loss 0, gradient
    0) yet would "succeed"; names the first rows. Stops at the first trainable row."""
    if not hasattr(source, "raw"):
        return
    n = len(source)
    for i in range(n):
        mask = np.asarray(source.raw(i)[1][:max_length], np.float32) > 0.5
        if (mask[:-1] & mask[1:]).any():
            return
    rows = ", ".join(str(i + 1) for i in range(min(n, 5))) + (", ..." if n > 5 else "")
    raise InputError(f"{what}: none of its {n} row(s) ({rows}) has a trainable position (two consecutive "
                     f"tokens with loss_mask 1 within max_length={max_length}): training would learn "
                     "nothing; give longer rows, a loss_mask over the replies, or a larger max_length")
