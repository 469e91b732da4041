"""Chat datasets in the formats users have, read into one shape: ``Conversation``.

Formats (one JSON object per line; ``auto`` detects the format of a file from its first row
and refuses a later row of another format, naming its line):

- ``sharegpt``: ``{"conversations": [{"from": "human", "value": ...}, ...]}``; ``from`` is
  ``system``, ``human``/``user`` or ``gpt``/``assistant``/``chatgpt``/``bing``/``bard``/``model``;
- ``deepspec``: ``{"conversations": [{"role": ..., "content": ...}, ...]}``, the reference's
  (deepseek-ai/DeepSpec) training data that its data generation regenerates;
- ``messages``: ``{"messages": [{"role": ..., "content": ...}, ...]}`` (OpenAI / Hugging Face);
- ``turns``: ``{"turns": ["user turn", ...]}``, the reference's evaluation prompt files (only
  the first turn is used, as the reference does: later turns need replies that do not exist);
- ``prompt``: a single user prompt in ``"prompt"``, ``"text"``, ``"question"`` or
  ``"instruction"`` (first present, in that order).

Roles are ``system``, ``user``, ``assistant`` and ``tool``; contents are strings (an assistant
message with ``tool_calls`` and no content gets ""); other message fields (``reasoning_content``,
``tool_calls``, ``name``, ...) are kept for the chat template. A row without a user message, with an assistant message before any user message, or with an unknown role or a
non-string content is an InputError naming ``file:line``. Other fields of a row (``id``, ...)
are kept in ``Conversation.extra``.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from dspark_jax.errors import InputError
from dspark_jax.fileio import iter_jsonl

FORMATS = ("sharegpt", "deepspec", "messages", "turns", "prompt")
PROMPT_FIELDS = ("prompt", "text", "question", "instruction")
CONVERSATION_FORMATS = ("sharegpt", "deepspec", "messages")  # rows that carry whole chats
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
                  "bard": "assistant", "model": "assistant", "tool": "tool", "observation": "tool",
                  "function_response": "tool"}


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One row: ``where`` ("file:line"), ``row`` (0-based row index in the file), ``messages``
    (``[{"role", "content"}, ...]``), ``id`` (the row's ``id`` field, else None), ``extra``
    (the row's other fields), ``format`` (one of ``FORMATS``)."""

    where: str
    row: int
    messages: list[dict]
    id: Any = None
    extra: dict = dataclasses.field(default_factory=dict)
    format: str = ""

    def generation_points(self) -> list[int]:
        """Indices ``k`` such that a reply is generated after ``messages[:k]``: every assistant
        message, plus the end when the conversation ends with a user message."""
        points = [k for k, m in enumerate(self.messages) if m["role"] == "assistant"]
        if self.messages[-1]["role"] == "user":
            points.append(len(self.messages))
        return points


def detect_format(rec, where: str) -> str:
    """The format of one row (InputError naming ``where`` when none fits)."""
    if not isinstance(rec, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "conversations" in rec:
        conv = rec["conversations"]
        if not isinstance(conv, list) or not conv or not isinstance(conv[0], dict):
            raise InputError(f"{where}: 'conversations' must be a non-empty list of objects")
        if "from" in conv[0] or "value" in conv[0]:
            return "sharegpt"
        if "role" in conv[0]:
            return "deepspec"
        raise InputError(f"{where}: 'conversations' messages need 'from'/'value' (ShareGPT) or "
                         f"'role'/'content' keys, got {sorted(conv[0])}")
    if "messages" in rec:
        return "messages"
    if "turns" in rec:
        return "turns"
    if any(f in rec for f in PROMPT_FIELDS):
        return "prompt"
    raise InputError(f"{where}: unknown format: expected 'conversations' (ShareGPT or the "
                     f"reference's role/content), 'messages', 'turns' or one of "
                     f"{list(PROMPT_FIELDS)}; got the fields {sorted(rec)[:8]}")


def _message(where: str, n: int, role, content, extra: dict | None = None) -> dict:
    """``{"role", "content", **extra}`` (extra: the message's other fields, deep-copied)."""
    if role not in ROLES:
        raise InputError(f"{where}: message {n}: role {role!r} is not one of {list(ROLES)}")
    extra = copy.deepcopy(extra or {})
    if content is None and extra.get("tool_calls"):
        content = ""
    if not isinstance(content, str):
        raise InputError(f"{where}: message {n}: content must be a string, got "
                         f"{type(content).__name__}")
    reasoning = extra.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise InputError(f"{where}: message {n}: reasoning_content must be a string")
    return {"role": role, "content": content, **extra}


def _messages(rec: dict, fmt: str, where: str) -> tuple[list[dict], set[str]]:
    """(messages, the fields they came from) of a row already detected as ``fmt``."""
    if fmt in ("sharegpt", "deepspec", "messages"):
        field = "messages" if fmt == "messages" else "conversations"
        raw = rec[field]
        if not isinstance(raw, list) or not raw:
            raise InputError(f"{where}: '{field}' must be a non-empty list of messages")
        out = []
        for n, m in enumerate(raw):
            if not isinstance(m, dict):
                raise InputError(f"{where}: message {n} is not an object")
            if fmt == "sharegpt":
                who = m.get("from")
                if who not in SHAREGPT_ROLES:
                    raise InputError(f"{where}: message {n}: 'from' {who!r} is not one of "
                                     f"{sorted(SHAREGPT_ROLES)}")
                rest = {k: v for k, v in m.items() if k not in ("from", "value")}
                out.append(_message(where, n, SHAREGPT_ROLES[who], m.get("value"), rest))
            else:
                rest = {k: v for k, v in m.items() if k not in ("role", "content")}
                out.append(_message(where, n, m.get("role"), m.get("content"), rest))
        return out, {field}
    if fmt == "turns":
        turns = rec["turns"]
        if not isinstance(turns, list) or not turns:
            raise InputError(f"{where}: 'turns' must be a non-empty list of strings")
        return [_message(where, 0, "user", turns[0])], {"turns"}
    field = next(f for f in PROMPT_FIELDS if f in rec)
    system = rec.get("system")
    out = [] if system is None else [_message(where, 0, "system", system)]
    out.append(_message(where, len(out), "user", rec[field]))
    return out, {field} | ({"system"} if system is not None else set())


def _check_turns(messages: list[dict], where: str) -> None:
    first_user = next((k for k, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise InputError(f"{where}: the conversation has no user message (nothing to reply to)")
    first_assistant = next((k for k, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first_assistant is not None and first_assistant < first_user:
        raise InputError(f"{where}: message {first_assistant} is an assistant message before any "
                         "user message")


def parse_row(rec, where: str, row: int, fmt: str) -> Conversation:
    """One row of format ``fmt`` as a Conversation (InputError naming ``where``)."""
    messages, used = _messages(rec, fmt, where)
    _check_turns(messages, where)
    extra = {k: v for k, v in rec.items() if k not in used and k != "id"}
    return Conversation(where, row, messages, rec.get("id"), extra, fmt)


def read_conversations(path, *, fmt: str = "auto") -> list[Conversation]:
    """Every row of the JSONL file ``path`` as a Conversation, in file order.

    ``fmt``: ``auto`` (the first row's format, every row must share it) or one of ``FORMATS``.
    InputError naming ``file:line`` on the first bad row; an empty file is an InputError too.
    """
    if fmt != "auto" and fmt not in FORMATS:
        raise InputError(f"unknown data format {fmt!r}; expected auto or one of {list(FORMATS)}")
    out: list[Conversation] = []
    file_fmt, first_where = (None, None) if fmt == "auto" else (fmt, None)
    for where, rec in iter_jsonl(path, "data file"):
        found = detect_format(rec, where)
        if file_fmt is None:
            file_fmt, first_where = found, where
        elif found != file_fmt:
            origin = (f"the file's first row ({first_where}) is {file_fmt}" if first_where
                      else f"--format is {file_fmt}")
            raise InputError(f"{where}: this row is in the {found} format but {origin}; "
                             "one file holds one format")
        out.append(parse_row(rec, where, len(out), file_fmt))
    if not out:
        raise InputError(f"data file {str(path)!r} holds no rows")
    return out
