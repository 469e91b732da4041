"""What a drafter learns from a training file: token and loss-mask statistics, and a sample of
rows split into trained (loss_mask > 0) and untrained spans (``dspark-jax data inspect``).

Reads tokens JSONL (``{"input_ids", "loss_mask"}``, as ``train`` reads it) or chat JSONL
(``messages`` / ShareGPT ``conversations``, rendered with a tokenizer's chat template exactly
as ``train data_format=chat`` renders it).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from dspark_jax.errors import InputError
from dspark_jax.fileio import iter_jsonl

FORMATS = ("auto", "tokens", "chat")
PERCENTILES = (50, 90, 99)


def detect_format(path) -> str:
    """"tokens" or "chat" from the first row; InputError for an empty or unknown file."""
    from dspark_jax.data import formats

    for where, rec in iter_jsonl(path, "data file"):
        if isinstance(rec, dict) and "input_ids" in rec:
            return "tokens"
        fmt = formats.detect_format(rec, where)
        if fmt in formats.CONVERSATION_FORMATS:
            return "chat"
        raise InputError(f"{where}: a {fmt!r} row holds a prompt but no reply; expected "
                         "'input_ids' (tokens), 'messages' or 'conversations' (chat)")
    raise InputError(f"data file {str(path)!r} has no rows")


def iter_rows(path, fmt: str, tokenizer=None, *, thinking: bool | None = None
              ) -> Iterator[tuple[str, list[int], list[float]]]:
    """Yield ``("file:line", ids, loss_mask)`` of every row, as training reads them."""
    from dspark_jax.data.chat import iter_chat_rows
    from dspark_jax.data.sources import parse_token_record

    if fmt == "chat":
        if tokenizer is None:
            raise InputError(f"{path}: chat data needs a tokenizer (--tokenizer DIR, or a --target DIR "
                             "that has one)")
        yield from iter_chat_rows(path, tokenizer, thinking=thinking)
        return
    vocab = len(tokenizer) if tokenizer is not None else None
    for where, rec in iter_jsonl(path, "data file"):
        ids, mask = parse_token_record(rec, where)
        if len(ids) != len(mask):
            raise InputError(f"{where}: input_ids has {len(ids)} tokens but loss_mask has {len(mask)}")
        if vocab is not None and ids and (min(ids) < 0 or max(ids) >= vocab):
            raise InputError(f"{where}: token id outside the tokenizer's vocabulary [0, {vocab})")
        yield where, ids, mask


def segments(ids: Sequence[int], mask: Sequence[float], tokenizer=None) -> list[tuple[str, bool]]:
    """Consecutive runs of trained / untrained tokens as (text, trained): decoded with
    ``tokenizer``, else the ids written out."""
    out: list[tuple[str, bool]] = []
    start = 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or (mask[k] > 0) != (mask[start] > 0):
            run = [int(t) for t in ids[start:k]]
            text = tokenizer.decode(run) if tokenizer is not None else " ".join(map(str, run))
            out.append((text, bool(mask[start] > 0)))
            start = k
    return out


def mark(segs: Sequence[tuple[str, bool]], *, color: bool, sep: str = "") -> str:
    """One string with the trained spans in green (``color``) or within « » (``sep``: " "
    between id lists)."""
    if color:
        return sep.join(f"\033[32m{t}\033[0m" if on else t for t, on in segs)
    return sep.join(f"«{t}»" if on else t for t, on in segs)


def inspect_data(path, *, tokenizer=None, fmt: str = "auto", thinking: bool | None = None,
                 max_length: int | None = None, sample_rows: int = 3) -> dict:
    """Statistics of a training file and its first ``sample_rows`` rows as segments.

    Returns {"file", "format", "decoded" (sample decoded with a tokenizer, else ids), "rows",
    "tokens", "trained_tokens", "trained_share",
    "length": {min, mean, p50, p90, p99, max}, "rows_without_trained", "first_without_trained"
    (up to 5 "file:line"), ["max_length", "rows_over_max_length", "trained_tokens_cut"],
    "sample": [{"where", "tokens", "trained", "segments": [[text, trained], ...]}]}.
    """
    if fmt not in FORMATS:
        raise InputError(f"--format {fmt!r} must be one of {FORMATS}")
    if fmt == "auto":
        fmt = detect_format(path)
    lengths, trained, without, sample = [], [], [], []
    over, cut = 0, 0
    for where, ids, mask in iter_rows(path, fmt, tokenizer, thinking=thinking):
        m = np.asarray(mask, np.float64) > 0
        lengths.append(len(ids))
        trained.append(int(m.sum()))
        if not m.any():
            without.append(where)
        if max_length is not None and len(ids) > max_length:
            over += 1
            cut += int(m[max_length:].sum())
        if len(sample) < sample_rows:
            sample.append({"where": where, "tokens": len(ids), "trained": int(m.sum()),
                           "segments": [[t, on] for t, on in segments(ids, mask, tokenizer)]})
    if not lengths:
        raise InputError(f"data file {str(path)!r} has no rows")
    n = np.asarray(lengths)
    total = int(n.sum())
    out = {"file": str(path), "format": fmt, "decoded": tokenizer is not None, "rows": len(lengths), "tokens": total,
           "trained_tokens": int(sum(trained)), "trained_share": round(sum(trained) / max(total, 1), 4),
           "length": {"min": int(n.min()), "mean": round(float(n.mean()), 1),
                      **{f"p{q}": int(np.percentile(n, q, method="nearest")) for q in PERCENTILES},
                      "max": int(n.max())},
           "rows_without_trained": len(without), "first_without_trained": without[:5]}
    if max_length is not None:
        out.update(max_length=max_length, rows_over_max_length=over, trained_tokens_cut=cut)
    out["sample"] = sample
    return out


def report(info: dict, *, color: bool) -> str:
    """The text that ``data inspect`` prints for ``inspect_data``'s result."""
    L = info["length"]
    lines = [f"file: {info['file']} ({info['format']})",
             f"rows: {info['rows']}",
             f"tokens: {info['tokens']}  trained (loss_mask > 0): {info['trained_tokens']} "
             f"({100 * info['trained_share']:.1f}%)",
             "row length: " + "  ".join(f"{k} {L[k]}" for k in ("min", "mean", "p50", "p90", "p99", "max")),
             f"rows with no trained token: {info['rows_without_trained']}"
             + (f" (first: {', '.join(info['first_without_trained'])})" if info["rows_without_trained"] else "")]
    if "max_length" in info:
        lines.append(f"rows longer than max_length={info['max_length']}: {info['rows_over_max_length']} "
                     f"(truncation drops {info['trained_tokens_cut']} trained tokens)")
    if info["sample"]:
        how = "in green" if color else "within « »"
        lines.append(f"sample ({len(info['sample'])} rows; trained spans {how}):")
        for row in info["sample"]:
            lines.append(f"--- {row['where']}: {row['tokens']} tokens, {row['trained']} trained")
            lines.append(mark([(t, on) for t, on in row["segments"]], color=color,
                              sep="" if info["decoded"] else " ").rstrip("\n"))
    return "\n".join(lines)
