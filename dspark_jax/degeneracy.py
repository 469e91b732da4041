"""Degenerate-output measures: is a continuation a loop, and how much of it is whitespace?

A drafter that predicts whitespace loops scores a high acceptance length on a
target that emits them, so speculative-decoding tables report these next to τ.
Pure functions over token id sequences (any tokenizer); no JAX.

- ``distinct_ngram_ratio(tokens, n)``: distinct n-grams / n-grams (1.0 = no
  repeats; a run of one token -> 1 / (len - n + 1)).
- ``whitespace_fraction(tokens, tokenizer=None)``: share of tokens that decode
  to whitespace only (byte ids 0..255 when no tokenizer is given).
- ``is_degenerate(tokens)``: distinct-4-gram ratio below 0.3.
- ``summarize(outputs)``: both measures over a set of outputs, as a dict.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

DEFAULT_N = 4
DEFAULT_THRESHOLD = 0.3
WHITESPACE_BYTES = frozenset(b" \t\n\r\f\v")


def distinct_ngram_ratio(tokens: Sequence[int], n: int = DEFAULT_N) -> float:
    """Distinct n-grams / all n-grams of ``tokens`` [T]; 1.0 when T < n (too short to repeat)."""
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"distinct_ngram_ratio: n must be a positive int, got {n!r}")
    toks = [int(t) for t in tokens]
    total = len(toks) - n + 1
    if total <= 0:
        return 1.0
    return len({tuple(toks[i:i + n]) for i in range(total)}) / total


def _whitespace_ids(tokens: Iterable[int], tokenizer) -> set[int]:
    """The ids among ``tokens`` that decode (alone) to non-empty whitespace."""
    out = set()
    for t in set(tokens):
        if tokenizer is None:
            if t in WHITESPACE_BYTES:
                out.add(t)
            continue
        try:
            text = tokenizer.decode([t], skip_special_tokens=True)
        except TypeError:  # a decode without skip_special_tokens
            text = tokenizer.decode([t])
        if text and not text.strip():
            out.add(t)
    return out


def whitespace_fraction(tokens: Sequence[int], tokenizer=None) -> float:
    """Share of ``tokens`` [T] that are whitespace; 0.0 for an empty sequence.

    ``tokenizer`` None: ids are bytes (the byte tokenizer; ids >= 256 are special
    tokens, never whitespace). Otherwise a token is whitespace when
    ``tokenizer.decode([id])`` is non-empty and only whitespace.
    """
    toks = [int(t) for t in tokens]
    if not toks:
        return 0.0
    ws = _whitespace_ids(toks, tokenizer)
    return sum(t in ws for t in toks) / len(toks)


def is_degenerate(tokens: Sequence[int], *, n: int = DEFAULT_N,
                  threshold: float = DEFAULT_THRESHOLD) -> bool:
    """True when the distinct-``n``-gram ratio of ``tokens`` is below ``threshold`` (a loop)."""
    return distinct_ngram_ratio(tokens, n) < threshold


def summarize(outputs: Sequence[Sequence[int]], *, tokenizer=None, n: int = DEFAULT_N,
              threshold: float = DEFAULT_THRESHOLD) -> dict:
    """Degeneracy of a set of outputs (each a token id sequence, prompt excluded).

    Returns ``{"num_outputs", "num_degenerate", "degenerate_fraction",
    "whitespace_fraction" (over all generated tokens), "mean_distinct_ngram_ratio",
    "n", "threshold"}``; fractions are 0.0 for no outputs.
    """
    seqs = [[int(t) for t in o] for o in outputs]
    ratios = [distinct_ngram_ratio(s, n) for s in seqs]
    n_deg = sum(r < threshold for r in ratios)
    all_tokens = [t for s in seqs for t in s]
    return {
        "num_outputs": len(seqs),
        "num_degenerate": n_deg,
        "degenerate_fraction": n_deg / len(seqs) if seqs else 0.0,
        "whitespace_fraction": whitespace_fraction(all_tokens, tokenizer),
        "mean_distinct_ngram_ratio": sum(ratios) / len(ratios) if ratios else 0.0,
        "n": n,
        "threshold": threshold,
    }


def format_summary(summary: Mapping) -> str:
    """One line: ``degenerate 3/50 (6.0%), whitespace 21.4% of tokens``."""
    return (f"degenerate {summary['num_degenerate']}/{summary['num_outputs']} "
            f"({100 * summary['degenerate_fraction']:.1f}%), "
            f"whitespace {100 * summary['whitespace_fraction']:.1f}% of tokens")
