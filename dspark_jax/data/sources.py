"""Random-access grain sources of training sequences.

Every source yields records ``{"input_ids": int32 [S], "loss_mask": float32 [S],
"index": int64 []}`` padded to ``max_length`` (pad id 0, loss_mask 0).
Sequences longer than ``max_length`` are cut to the first ``max_length`` tokens
(``overlong="truncate"``) or rejected with the offending line (``"refuse"``).
All lines are parsed and validated once on construction, before any compilation.
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


def _fit(ids, mask, max_length, overlong, where):
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
            self._seqs.append(_fit(ids, mask, max_length, overlong, where))
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


def read_token_jsonl(path, max_length: int, vocab_size: int | None = None,
                     overlong: str = "truncate") -> TokenSequences:
    """JSONL lines ``{"input_ids": [...], "loss_mask": [...]}`` (loss_mask optional: all 1)."""
    seqs, wheres = [], []
    for where, rec in iter_jsonl(path, "data file"):
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
        if len(ids) > max_length and overlong == "refuse":
            _fit(ids, mask, max_length, overlong, where)
        seqs.append((ids, mask))
        wheres.append(where)
    return TokenSequences(seqs, max_length, vocab_size, overlong, name=str(path), wheres=wheres)


def chat_to_tokens(tokenizer, messages: list[dict]) -> tuple[list[int], list[float]]:
    """Tokenize a conversation with the tokenizer's chat template; loss_mask 1 on assistant tokens.

    The assistant span of turn i is the token difference between the template of
    messages[:i] with a generation prompt and the template of messages[:i+1].
    """
    def render(msgs, gen):
        out = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    ids: list[int] = []
    mask: list[float] = []
    for i, msg in enumerate(messages):
        full = render(messages[: i + 1], False)
        if msg.get("role") == "assistant":
            prompt = render(messages[:i], True)
            if full[: len(prompt)] != prompt:
                raise InputError("chat template is not prefix-stable; cannot locate assistant tokens")
            prefix_len = len(prompt)
        else:
            prefix_len = len(ids)
        if full[: len(ids)] != ids:
            raise InputError("chat template is not prefix-stable; cannot locate assistant tokens")
        new_mask = [0.0] * (prefix_len - len(ids)) + [1.0 if msg.get("role") == "assistant" else 0.0] * (len(full) - prefix_len)
        mask.extend(new_mask)
        ids = full
    return ids, mask


def read_chat_jsonl(path, tokenizer, max_length: int, overlong: str = "truncate") -> TokenSequences:
    """JSONL lines ``{"messages": [{"role", "content"}, ...]}`` via ``tokenizer``'s chat template."""
    seqs, wheres = [], []
    for where, rec in iter_jsonl(path, "data file"):
        msgs = rec.get("messages") if isinstance(rec, dict) else None
        if not isinstance(msgs, list) or not msgs:
            raise InputError(f"{where}: expected an object with a non-empty 'messages' list")
        ids, mask = chat_to_tokens(tokenizer, msgs)
        _fit(ids, mask, max_length, overlong, where)
        seqs.append((ids, mask))
        wheres.append(where)
    return TokenSequences(seqs, max_length, None, overlong, name=str(path), wheres=wheres)

