"""Degenerate-output measures on loops vs real text (byte ids and a word-level tokenizer)."""

import pytest

from dspark_jax import degeneracy as dg
from dspark_jax.tokenizer import ByteTokenizer

REAL_CODE = (b"def _future_repr(future):\n"
             b"    info = ' '.join(_future_repr_info(future))\n"
             b"    return f'<{future.__class__.__name__} {info}>'\n")
REAL_PROSE = (b"The quick brown fox jumps over the lazy dog, while the cat watches from "
              b"the window and wonders why anyone would run in such weather.")


def ids(b: bytes) -> list[int]:
    return list(b)


def test_distinct_ngram_ratio_basic():
    assert dg.distinct_ngram_ratio([1, 2, 3, 4, 5]) == 1.0
    assert dg.distinct_ngram_ratio([7] * 10) == pytest.approx(1 / 7)  # one 4-gram, seen 7 times
    assert dg.distinct_ngram_ratio([1, 2, 1, 2, 1, 2], n=2) == pytest.approx(2 / 5)
    assert dg.distinct_ngram_ratio([1, 2, 3]) == 1.0  # shorter than n: nothing can repeat
    assert dg.distinct_ngram_ratio([]) == 1.0
    with pytest.raises(ValueError, match="positive"):
        dg.distinct_ngram_ratio([1, 2], n=0)


@pytest.mark.parametrize("loop", [
    b" " * 96,                                  # a run of spaces
    b"_" * 96,                                  # a run of underscores
    b"\n    \n    \n    " * 8,                  # blank indented lines
    b"self.assertEqual(" * 6,                   # a repeated phrase
    b"        return None\n" * 5,              # a repeated line
])
def test_loops_are_degenerate(loop):
    assert dg.is_degenerate(ids(loop)), dg.distinct_ngram_ratio(ids(loop))


@pytest.mark.parametrize("text", [REAL_CODE, REAL_PROSE, REAL_CODE[:40]])
def test_real_text_is_not_degenerate(text):
    assert not dg.is_degenerate(ids(text))
    assert dg.distinct_ngram_ratio(ids(text)) > 0.8


def test_threshold_and_n_are_parameters():
    half = ids(REAL_CODE[:48] + b" " * 48)  # real text then a loop: ratio about one half
    r = dg.distinct_ngram_ratio(half)
    assert 0.3 < r < 0.7
    assert not dg.is_degenerate(half) and dg.is_degenerate(half, threshold=0.7)
    assert dg.is_degenerate(ids(b"ab" * 20), n=2) and not dg.is_degenerate(ids(b"ab" * 20), n=1, threshold=0.01)


def test_whitespace_fraction_bytes():
    assert dg.whitespace_fraction(ids(b"    ")) == 1.0
    assert dg.whitespace_fraction(ids(b"a b\tc\n")) == pytest.approx(3 / 6)
    assert dg.whitespace_fraction([]) == 0.0
    tok = ByteTokenizer()
    # special tokens are never whitespace; the byte tokenizer gives the same answer as raw bytes
    seq = ids(b"x = 1\n") + [tok.eos_token_id]
    assert dg.whitespace_fraction(seq) == pytest.approx(3 / 7)
    assert dg.whitespace_fraction(seq, tok) == pytest.approx(3 / 7)


class WordTokenizer:
    """A toy tokenizer with multi-character tokens (like a BPE vocabulary)."""

    vocab = ["def", " ", "    ", "\n", "foo", "(", "):", "<eos>"]

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if (skip_special_tokens and self.vocab[i] == "<eos>") else self.vocab[i]
                       for i in ids)


def test_whitespace_fraction_with_a_tokenizer():
    tok = WordTokenizer()
    seq = [0, 1, 4, 5, 6, 3, 2, 7]  # "def foo():\n    <eos>"
    assert dg.whitespace_fraction(seq, tok) == pytest.approx(3 / 8)
    assert dg.whitespace_fraction([2] * 10, tok) == 1.0


def test_summarize_counts_loops_and_whitespace():
    outputs = [ids(REAL_CODE), ids(REAL_PROSE), ids(b" " * 96), ids(b"_" * 50)]
    s = dg.summarize(outputs)
    assert s["num_outputs"] == 4 and s["num_degenerate"] == 2
    assert s["degenerate_fraction"] == 0.5
    total = sum(map(len, outputs))
    ws = sum(c in b" \t\n" for o in outputs for c in o)
    assert s["whitespace_fraction"] == pytest.approx(ws / total)
    assert s["n"] == 4 and s["threshold"] == 0.3
    assert 0 < s["mean_distinct_ngram_ratio"] < 1
    line = dg.format_summary(s)
    assert line.startswith("degenerate 2/4 (50.0%)") and "% of tokens" in line
    empty = dg.summarize([])
    assert empty["num_outputs"] == 0 and empty["degenerate_fraction"] == 0.0
    assert empty["whitespace_fraction"] == 0.0
