"""Byte-level tokenizer of the embedded default target (no download, no dependencies).

Ids ``0..255`` are the UTF-8 bytes; the special tokens follow (``<|pad|>`` 256,
``<|bos|>`` 257, ``<|eos|>`` 258, ``<|mask|>`` 259 — the drafter's
``mask_token_id`` —, ``<|system|>``, ``<|user|>``, ``<|assistant|>``, ``<|end|>``),
so ``vocab_size`` is 264, a multiple of 8.

The object mimics the parts of a Hugging Face tokenizer that the rest of the
project uses: ``encode``, ``decode``, ``batch_decode``, ``eos_token_id``,
``pad_token_id``, ``bos_token_id``, ``mask_token_id``, ``vocab_size``,
``apply_chat_template``. The chat format is minimal::

    <|bos|>[<|system|>text<|end|>]<|user|>text<|end|><|assistant|>reply<|eos|>

It is saved as a small JSON file (``dspark_tokenizer.json``; deliberately not
``tokenizer.json``, the name of the HF ``tokenizers`` format).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from dspark_jax.errors import CheckpointError, InputError

TOKENIZER_FILE = "dspark_tokenizer.json"
FORMAT = "dspark-byte-tokenizer"
FORMAT_VERSION = 1
NUM_BYTES = 256

DEFAULT_SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|mask|>",
                          "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")

_ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}


class ByteTokenizer:
    """UTF-8 bytes + special tokens. ``encode(str) -> list[int]``, ``decode(ids) -> str``."""

    def __init__(self, special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS):
        special_tokens = tuple(special_tokens)
        required = ("<|pad|>", "<|bos|>", "<|eos|>", "<|mask|>")
        for name in required:
            if name not in special_tokens:
                raise CheckpointError(f"byte tokenizer: special token {name!r} is missing")
        if len(set(special_tokens)) != len(special_tokens):
            raise CheckpointError(f"byte tokenizer: duplicate special tokens in {list(special_tokens)}")
        for name in special_tokens:
            if not isinstance(name, str) or not name:
                raise CheckpointError(f"byte tokenizer: special token {name!r} must be a non-empty string")
        self.special_tokens = special_tokens
        self._special_to_id = {name: NUM_BYTES + i for i, name in enumerate(special_tokens)}
        self._id_to_special = {i: name for name, i in self._special_to_id.items()}
        # Longest first so that no special token is matched by one of its prefixes.
        alternatives = sorted(special_tokens, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(re.escape(s) for s in alternatives) + ")")

    # ------------------------------------------------------------------ ids
    @property
    def vocab_size(self) -> int:
        """Number of ids: 256 bytes + specials (264 for the default set)."""
        return NUM_BYTES + len(self.special_tokens)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int:
        if token not in self._special_to_id:
            raise InputError(f"unknown special token {token!r}; known: {list(self.special_tokens)}")
        return self._special_to_id[token]

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.token_to_id(token)

    pad_token_id = property(lambda self: self._special_to_id["<|pad|>"])
    bos_token_id = property(lambda self: self._special_to_id["<|bos|>"])
    eos_token_id = property(lambda self: self._special_to_id["<|eos|>"])
    mask_token_id = property(lambda self: self._special_to_id["<|mask|>"])
    pad_token = property(lambda self: "<|pad|>")
    bos_token = property(lambda self: "<|bos|>")
    eos_token = property(lambda self: "<|eos|>")
    mask_token = property(lambda self: "<|mask|>")

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self._id_to_special)

    # ------------------------------------------------------------ encode/decode
    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False,
               allow_special: bool = False, add_special_tokens: bool | None = None) -> list[int]:
        """``text`` -> ids. Literal ``<|eos|>``-style strings are plain bytes unless
        ``allow_special``. ``add_special_tokens`` (HF spelling) is ``add_bos``."""
        if not isinstance(text, str):
            raise InputError(f"tokenizer.encode expects a str, got {type(text).__name__}")
        if add_special_tokens is not None:
            add_bos = bool(add_special_tokens)
        ids: list[int] = [self.bos_token_id] if add_bos else []
        if allow_special:
            for i, piece in enumerate(self._special_re.split(text)):
                if i % 2:
                    ids.append(self._special_to_id[piece])
                elif piece:
                    ids.extend(piece.encode("utf-8"))
        else:
            ids.extend(text.encode("utf-8"))
        if add_eos:
            ids.append(self.eos_token_id)
        return ids

    def __call__(self, text: str, **kwargs) -> dict:
        """HF-style call: ``{"input_ids": [...]}``."""
        return {"input_ids": self.encode(text, **kwargs)}

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """ids -> text. Byte runs decode as UTF-8 (invalid sequences -> U+FFFD);
        special ids render as their names unless ``skip_special_tokens``."""
        out: list[str] = []
        run = bytearray()
        for raw in ids:
            i = int(raw)
            if 0 <= i < NUM_BYTES:
                run.append(i)
                continue
            if run:
                out.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
            if i in self._id_to_special:
                if not skip_special_tokens:
                    out.append(self._id_to_special[i])
            else:
                raise InputError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        if run:
            out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def batch_decode(self, batch: Iterable[Iterable[int]], *, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in batch]

    # ------------------------------------------------------------------- chat
    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, tokenize: bool = True,
                            add_generation_prompt: bool = True, enable_thinking: bool = False,
                            **_ignored):
        """Render ``[{"role": ..., "content": ...}, ...]`` in the minimal chat format.

        Returns ids (``tokenize=True``) or the text with special-token names.
        With ``add_generation_prompt`` the result ends with ``<|assistant|>``.
        ``enable_thinking`` is accepted for HF compatibility and has no effect
        (the byte format has no thinking section).
        """
        del enable_thinking
        ids = [self.bos_token_id]
        for n, message in enumerate(messages):
            role = message.get("role") if isinstance(message, Mapping) else None
            if role not in _ROLE_TOKENS:
                raise InputError(f"chat message {n}: role {role!r} is not one of {sorted(_ROLE_TOKENS)}")
            content = message.get("content")
            if not isinstance(content, str):
                raise InputError(f"chat message {n}: content must be a string, got {type(content).__name__}")
            ids.append(self.token_to_id(_ROLE_TOKENS[role]))
            ids.extend(content.encode("utf-8"))
            ids.append(self.eos_token_id if role == "assistant" else self.token_to_id("<|end|>"))
        if add_generation_prompt:
            ids.append(self.token_to_id("<|assistant|>"))
        return ids if tokenize else self.decode(ids)

    def chat_prompt(self, text: str) -> list[int]:
        """Ids of a single-turn user prompt, ending with ``<|assistant|>``."""
        return self.apply_chat_template([{"role": "user", "content": text}])

    # -------------------------------------------------------------- save/load
    def to_json(self) -> dict:
        return {"format": FORMAT, "version": FORMAT_VERSION, "num_bytes": NUM_BYTES,
                "special_tokens": {name: i for name, i in self._special_to_id.items()},
                "vocab_size": self.vocab_size,
                "chat_format": "<|bos|>[<|system|>text<|end|>]<|user|>text<|end|><|assistant|>reply<|eos|>"}

    @classmethod
    def from_json(cls, data: Mapping, where: str = "byte tokenizer") -> "ByteTokenizer":
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise CheckpointError(f"{where}: not a {FORMAT} file (format={data.get('format') if isinstance(data, Mapping) else None!r})")
        if data.get("version") != FORMAT_VERSION:
            raise CheckpointError(f"{where}: unsupported version {data.get('version')!r} (expected {FORMAT_VERSION})")
        specials = data.get("special_tokens")
        if not isinstance(specials, Mapping):
            raise CheckpointError(f"{where}: 'special_tokens' must be an object name -> id")
        ordered = sorted(specials.items(), key=lambda kv: kv[1])
        for n, (name, i) in enumerate(ordered):
            if i != NUM_BYTES + n:
                raise CheckpointError(f"{where}: special token {name!r} has id {i}, expected {NUM_BYTES + n} "
                                      "(ids must be contiguous after the 256 bytes)")
        return cls([name for name, _ in ordered])

    def save(self, path) -> Path:
        """Write ``dspark_tokenizer.json`` atomically. ``path``: a directory or a .json file."""
        path = Path(path)
        if path.suffix != ".json":
            path = path / TOKENIZER_FILE
        from dspark_jax.fileio import write_json
        return write_json(path, self.to_json())

    @classmethod
    def load(cls, path) -> "ByteTokenizer":
        """From a directory holding ``dspark_tokenizer.json`` or the file itself."""
        path = Path(path)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        if not path.is_file():
            raise CheckpointError(f"byte tokenizer file {str(path)!r} does not exist")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"byte tokenizer file {str(path)!r} is not valid JSON: {e}") from None
        return cls.from_json(data, where=str(path))

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, specials={list(self.special_tokens)})"


def encode_prompt(tokenizer, text: str, *, raw: bool = False, thinking: bool = False) -> list[int]:
    """Prompt ids of ``text`` for ``generate``, ``eval``, the demo and the benchmarks.

    Default: the tokenizer's chat template over one user turn with the generation prompt
    (``enable_thinking=thinking``; the byte tokenizer's minimal chat format; a Hugging Face
    tokenizer without a template falls back to raw). ``raw``: the plain text, after
    ``<|bos|>`` for the byte tokenizer, ``tokenizer.encode(text)`` for a Hugging Face one.
    """
    if raw or not (isinstance(tokenizer, ByteTokenizer) or getattr(tokenizer, "chat_template", None)):
        if isinstance(tokenizer, ByteTokenizer):
            return tokenizer.encode(text, add_bos=True)
        return [int(t) for t in tokenizer.encode(text)]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                        add_generation_prompt=True, enable_thinking=thinking)
    if isinstance(ids, Mapping):  # some transformers versions return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def has_byte_tokenizer(directory) -> bool:
    return (Path(directory) / TOKENIZER_FILE).is_file()


def load_tokenizer(directory, *, required: bool = False):
    """The tokenizer of a target checkpoint directory.

    ``dspark_tokenizer.json`` -> ByteTokenizer; else a Hugging Face tokenizer
    (``AutoTokenizer``) when the directory has tokenizer files; else ``None``,
    or InputError when ``required`` (e.g. text prompts need a tokenizer).
    """
    directory = Path(directory)
    if has_byte_tokenizer(directory):
        return ByteTokenizer.load(directory)
    hf_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if any((directory / name).is_file() for name in hf_files):
        try:
            from transformers import AutoTokenizer
        except ImportError:  # pragma: no cover - transformers is optional at runtime
            raise InputError(f"{str(directory)!r} has a Hugging Face tokenizer but the "
                             "'transformers' package is not installed") from None
        try:
            return AutoTokenizer.from_pretrained(str(directory))
        except Exception as e:  # corrupted or incompatible tokenizer files are bad input
            raise InputError(f"cannot load the tokenizer in {str(directory)!r}: {e}") from None
    if required:
        raise InputError(f"target directory {str(directory)!r} has no tokenizer ({TOKENIZER_FILE} or "
                         "Hugging Face tokenizer files); give token ids instead of text prompts")
    return None
