"""Byte-level tokenizer: round trips, special tokens, chat format, save/load."""

import json

import numpy as np
import pytest

from dspark_jax.errors import CheckpointError, InputError
from dspark_jax.tokenizer import TOKENIZER_FILE, ByteTokenizer, load_tokenizer

TEXTS = [
    "",
    "hello world",
    "def f(x):\n    return x ** 2\r\n\ttab",
    "naïve café — “quotes” ½ ∑ ∞",
    "日本語のテキスト, 中文, 한국어",
    "emoji 🙂👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "combining e\u0301 and zero\u200bwidth, nul \x00 and \x7f",
    "<|eos|> looks special but is text",
]


def _random_text(rng, n):
    cps = rng.integers(0, 0x10FFFF, size=n)
    return "".join(chr(c) for c in cps if not 0xD800 <= c <= 0xDFFF)


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


def test_ids_and_vocab(tok):
    assert tok.vocab_size == 264 and tok.vocab_size % 8 == 0 and len(tok) == 264
    ids = {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.mask_token_id}
    assert len(ids) == 4 and min(ids) >= 256 and max(ids) < tok.vocab_size
    assert tok.all_special_ids == list(range(256, 264))
    assert tok.token_to_id("<|mask|>") == tok.mask_token_id
    with pytest.raises(InputError, match="unknown special token"):
        tok.token_to_id("<|nope|>")


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_fixed(tok, text):
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_round_trip_random_unicode(tok):
    rng = np.random.default_rng(0)
    for _ in range(20):
        text = _random_text(rng, int(rng.integers(1, 200)))
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text


def test_special_tokens(tok):
    text = "a<|eos|>b"
    assert tok.eos_token_id not in tok.encode(text)  # literal text by default
    ids = tok.encode(text, allow_special=True, add_bos=True, add_eos=True)
    assert ids == [tok.bos_token_id, ord("a"), tok.eos_token_id, ord("b"), tok.eos_token_id]
    assert tok.decode(ids) == "<|bos|>a<|eos|>b<|eos|>"
    assert tok.decode(ids, skip_special_tokens=True) == "ab"
    assert tok.encode(tok.decode(ids), allow_special=True) == ids
    assert tok("x", add_special_tokens=True)["input_ids"] == [tok.bos_token_id, ord("x")]


def test_decode_invalid_utf8_and_out_of_range(tok):
    # a lone continuation byte and a truncated 3-byte sequence decode to U+FFFD, not an exception
    assert tok.decode([0x80, ord("a"), 0xE6, 0x97]) == "\ufffda\ufffd"
    # a special token splits a multi-byte character: both halves become U+FFFD
    s = "é".encode()
    assert tok.decode([s[0], tok.eos_token_id, s[1]], skip_special_tokens=True) == "\ufffd\ufffd"
    with pytest.raises(InputError, match="outside the vocabulary"):
        tok.decode([1, tok.vocab_size])
    with pytest.raises(InputError, match="expects a str"):
        tok.encode(b"bytes")


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi ☃"}]
    ids = tok.apply_chat_template(msgs)
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<|bos|><|system|>be brief<|end|><|user|>hi ☃<|end|><|assistant|>"
    assert tok.encode(text, allow_special=True) == ids
    assert tok.chat_prompt("hi ☃") == tok.apply_chat_template(msgs[1:], enable_thinking=True)
    no_gen = tok.apply_chat_template(msgs[1:] + [{"role": "assistant", "content": "yo"}],
                                     add_generation_prompt=False)
    assert no_gen[-1] == tok.eos_token_id and no_gen[-3:-1] == list(b"yo")
    with pytest.raises(InputError, match="role 'bot'"):
        tok.apply_chat_template([{"role": "bot", "content": "x"}])
    with pytest.raises(InputError, match="content must be a string"):
        tok.apply_chat_template([{"role": "user", "content": None}])


def test_save_load(tmp_path, tok):
    path = tok.save(tmp_path)
    assert path.name == TOKENIZER_FILE
    again = ByteTokenizer.load(tmp_path)
    assert again.special_tokens == tok.special_tokens
    assert again.encode("é<|mask|>", allow_special=True) == tok.encode("é<|mask|>", allow_special=True)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)

    bad = json.loads(path.read_text())
    bad["special_tokens"]["<|mask|>"] = 300
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="contiguous"):
        ByteTokenizer.load(tmp_path / "bad.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        ByteTokenizer.load(tmp_path / "broken.json")
    with pytest.raises(CheckpointError, match="does not exist"):
        ByteTokenizer.load(tmp_path / "missing")


def test_load_tokenizer_none(tmp_path):
    assert load_tokenizer(tmp_path) is None
    with pytest.raises(InputError, match="has no tokenizer"):
        load_tokenizer(tmp_path, required=True)
