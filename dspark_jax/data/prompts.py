"""JSONL prompt files for generation: one JSON object per line.

Each line holds ``"prompt_ids": [int, ...]`` or ``"text": str`` (text needs a
tokenizer: the target directory's, see dspark_jax.tokenizer.load_tokenizer).
Other fields (e.g. ``"id"``) are kept and copied to the output line.
"""

from __future__ import annotations

from typing import Any, Callable

from dspark_jax.errors import InputError
from dspark_jax.fileio import iter_jsonl


def read_prompts(path, encode: Callable[[str], list[int]] | None = None,
                 tokenizer_hint: str = "") -> list[tuple[dict[str, Any], list[int]]]:
    """[(record, prompt_ids)] from a JSONL file; InputError naming the line on bad input.

    ``encode`` turns text into ids (None: ``{"text": ...}`` lines are an error).
    """
    out = []
    for where, rec in iter_jsonl(path, "prompts file"):
        if not isinstance(rec, dict):
            raise InputError(f"{where}: expected a JSON object with 'prompt_ids' or 'text'")
        if "prompt_ids" in rec:
            ids = rec["prompt_ids"]
            if not isinstance(ids, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InputError(f"{where}: 'prompt_ids' must be a list of ints")
        elif "text" in rec:
            if not isinstance(rec["text"], str):
                raise InputError(f"{where}: 'text' must be a string")
            if encode is None:
                raise InputError(f"{where}: a 'text' prompt needs a tokenizer{tokenizer_hint}; "
                                 "give 'prompt_ids' instead")
            ids = [int(t) for t in encode(rec["text"])]
        else:
            raise InputError(f"{where}: expected a 'prompt_ids' or 'text' field")
        if not ids:
            raise InputError(f"{where}: the prompt is empty")
        out.append((rec, ids))
    if not out:
        raise InputError(f"prompts file {str(path)!r} holds no prompts")
    return out
