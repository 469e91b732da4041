"""Chat data: conversations -> (token ids, loss mask) through a tokenizer's chat template.

Input rows (JSONL, one conversation a line) come in two shapes, normalised by
``to_messages``: ``{"messages": [{"role", "content", ["reasoning_content"]}, ...]}`` and
ShareGPT ``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}``.

What is trained (``loss_mask`` 1) is exactly what the target generates in an assistant turn:
the assistant content (with its rendered thinking block, if the template renders one there)
and the end-of-turn token that closes it (``<|im_end|>``, ``<|eot_id|>``, ...). Not trained:
system/user/tool turns, the role header / generation prompt (``<|im_start|>assistant\\n``, and
an empty ``<think>\\n\\n</think>\\n\\n`` when ``thinking=False`` puts it in the prompt), and
the newline a template writes after the end-of-turn token (the model stops at the end token and
never generates it).

How the spans are found (``ChatRenderer``), for templates that are not prefix-stable (Qwen3
renders earlier assistant turns without their reasoning, the last one with it):

1. the whole conversation is rendered once, as text T; the training sequence is T tokenized
   (exactly what ``apply_chat_template(tokenize=True)`` gives);
2. assistant turn i starts where the rendering of ``messages[:i]`` (without generation prompt)
   ends, plus the generation prompt if T continues with it; else plus the generation prompt of
   another thinking setting that T continues with (a turn that carries reasoning under
   ``thinking=False``); else plus the longest token-aligned prefix of the generation prompt
   that T continues with (an earlier turn rendered without the think block that the
   generation prompt opens);
3. the turn ends after the first end-of-turn string at or after its start; the end-of-turn
   string is the special token a template writes right after an assistant's content, found
   once per tokenizer by rendering a probe conversation (so tool calls the template writes
   before it are trained; content that contains that string literally ends the span there);
4. tokens whose character offset (``return_offsets_mapping`` of a fast tokenizer) starts inside
   a span get mask 1.

A template with ``{% generation %}`` blocks is trusted instead (transformers'
``return_assistant_tokens_mask``). Tokenizers without offsets (the embedded byte tokenizer,
slow HF tokenizers) use token-level prefixes: ``messages[:i]`` rendered must prefix the whole
rendering, else the row is refused. A conversation without an assistant turn, a template that
ignores ``add_generation_prompt`` or one that cannot place a turn: InputError naming the row.
"""

from __future__ import annotations

import re
from typing import Iterator, Mapping, Sequence

from dspark_jax.data import formats
from dspark_jax.errors import InputError
from dspark_jax.fileio import iter_jsonl

_GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")
_PROBE = "Zq7probeXv"  # assistant content of the probe conversation (no whitespace: templates trim)


def to_messages(record, where: str) -> list[dict]:
    """One JSONL training row -> ``[{"role", "content", ...}, ...]`` (copies; extra keys kept).

    ``{"messages": [...]}``, ShareGPT ``{"conversations": [{"from", "value"}, ...]}`` or the
    reference's ``{"conversations": [{"role", "content"}, ...]}``, read by
    ``dspark_jax.data.formats`` (the one reader of chat rows). InputError naming ``where`` for
    anything else (a prompt-only row has no reply to train on), unknown roles or non-string
    contents.
    """
    fmt = formats.detect_format(record, where)
    if fmt not in formats.CONVERSATION_FORMATS:
        raise InputError(f"{where}: a {fmt!r} row holds a prompt but no reply to train on; chat "
                         "training rows need 'messages' or 'conversations' (answer prompts with "
                         "`dspark-jax data regenerate`)")
    return formats.parse_row(record, where, 0, fmt).messages


def split_think(content: str) -> tuple[str | None, str]:
    """``"<think>\\nR\\n</think>\\n\\nC"`` -> ("R", "C"); content without ``</think>`` -> (None, content)."""
    if "</think>" not in content:
        return None, content
    head, _, tail = content.partition("</think>")
    return head.split("<think>")[-1].strip("\n"), tail.lstrip("\n")


def _template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):  # named templates: the default one
        template = template.get("default", next(iter(template.values()), ""))
    return template if isinstance(template, str) else ""


def _token_ids(out) -> list[int]:
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]


class ChatRenderer:
    """``renderer(messages, where) -> (ids, loss_mask)`` for one tokenizer and thinking setting.

    ``thinking``: ``enable_thinking`` passed to the template (None: the template's default).
    Holds per-tokenizer facts (mode, end-of-turn string) so a file is rendered consistently.
    """

    def __init__(self, tokenizer, *, thinking: bool | None = None):
        self.tokenizer = tokenizer
        self.kwargs = {} if thinking is None else {"enable_thinking": bool(thinking)}
        template = _template_text(tokenizer)
        hf = hasattr(tokenizer, "is_fast")
        if hf and not template:
            raise InputError(f"tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} "
                             "has no chat template; chat data needs one (or give tokens JSONL)")
        if not hasattr(tokenizer, "apply_chat_template"):
            raise InputError(f"{type(tokenizer).__name__} has no apply_chat_template; cannot render chat data")
        self.knows_reasoning = "reasoning_content" in template
        if _GENERATION_BLOCK.search(template):
            self.mode = "generation"
        elif hf and getattr(tokenizer, "is_fast", False):
            self.mode = "offsets"
        else:
            self.mode = "prefix"
        self._end = None  # end-of-turn string (offsets mode), from the probe

    # ---------------------------------------------------------------- rendering
    def _apply(self, messages, where, *, gen: bool, tokenize: bool, kwargs: dict | None = None):
        kwargs = self.kwargs if kwargs is None else kwargs
        try:
            return self.tokenizer.apply_chat_template(list(messages), tokenize=tokenize,
                                                      add_generation_prompt=gen, **kwargs)
        except InputError as e:
            raise InputError(f"{where}: {e}") from None
        except Exception as e:  # jinja raise_exception / TemplateError: the row is bad for this template
            raise InputError(f"{where}: the chat template refused this conversation: "
                             f"{type(e).__name__}: {e}") from None

    def text(self, messages, where: str = "chat", *, gen: bool = False) -> str:
        """The template's text of ``messages`` (offsets and generation modes)."""
        return self._apply(messages, where, gen=gen, tokenize=False)

    def _ids(self, messages, where, *, gen: bool) -> list[int]:
        return _token_ids(self._apply(messages, where, gen=gen, tokenize=True))

    def prompt_ids(self, messages: Sequence[Mapping], where: str = "chat", *, gen: bool = True) -> list[int]:
        """Token ids of ``messages`` (reasoning normalised) with / without the generation prompt."""
        return self._ids(self.normalise(messages), where, gen=gen)

    def normalise(self, messages: Sequence[Mapping]) -> list[dict]:
        """Reasoning in the form the template reads: ``reasoning_content`` when the template
        mentions it (inline ``<think>…</think>`` in content is split out), else inlined as
        ``<think>\\n…\\n</think>\\n\\n`` before the content (never dropped)."""
        out = []
        for m in messages:
            m = dict(m)
            if m.get("role") == "assistant":
                reasoning = m.get("reasoning_content")
                if self.knows_reasoning and not reasoning and "</think>" in m.get("content", ""):
                    m["reasoning_content"], m["content"] = split_think(m["content"])
                elif not self.knows_reasoning and reasoning:
                    m["content"] = f"<think>\n{reasoning.strip()}\n</think>\n\n{m['content']}"
                    del m["reasoning_content"]
            out.append(m)
        return out

    def __call__(self, messages: Sequence[Mapping], where: str = "chat") -> tuple[list[int], list[float]]:
        """``messages`` -> (ids [S], loss_mask [S] of 0/1 floats). InputError names ``where``."""
        messages = self.normalise(messages)
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if not turns:
            raise InputError(f"{where}: no assistant turn, so nothing to train on "
                             "(every row needs at least one assistant message)")
        if self.mode == "generation":
            return self._by_generation_blocks(messages, where)
        if self.mode == "offsets":
            return self._by_offsets(messages, turns, where)
        return self._by_prefixes(messages, turns, where)

    # ------------------------------------------------------------------ modes
    def _by_generation_blocks(self, messages, where):
        try:
            out = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                     return_assistant_tokens_mask=True, **self.kwargs)
        except Exception as e:
            raise InputError(f"{where}: the chat template refused this conversation: "
                             f"{type(e).__name__}: {e}") from None
        ids, mask = _token_ids(out["input_ids"]), [float(m) for m in out["assistant_masks"]]
        if not any(mask):
            raise InputError(f"{where}: the template's {{% generation %}} blocks mark no token")
        return ids, mask

    def _prompt_parts(self, messages, i, where, render):
        """(Q, G): ``messages[:i]`` rendered without generation prompt, and the generation
        prompt that follows it. InputError when the template adds none."""
        if i == 0:
            prompt = render([], gen=True)
            return prompt[:0], prompt
        plain, prompt = render(messages[:i], gen=False), render(messages[:i], gen=True)
        if prompt[: len(plain)] != plain or len(prompt) <= len(plain):
            raise InputError(f"{where}: the chat template ignores add_generation_prompt (it writes no "
                             f"assistant header after message {i}), so assistant turns cannot be "
                             "located; use a template with a generation prompt")
        return plain, prompt[len(plain):]

    def _end_string(self, where) -> str:
        """The special token a template writes right after an assistant's content (probe)."""
        if self._end is None:
            msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
            text = self.text(msgs, f"{where} (probe conversation)")
            at = text.rfind(_PROBE)
            tail = text[at + len(_PROBE):] if at >= 0 else ""
            enc = self.tokenizer(tail, add_special_tokens=False, return_offsets_mapping=True)
            special = set(getattr(self.tokenizer, "all_special_tokens", ())) | set(
                self.tokenizer.get_added_vocab() if hasattr(self.tokenizer, "get_added_vocab") else ())
            first = tail[slice(*enc["offset_mapping"][0])] if enc["input_ids"] else ""
            if first not in special:
                raise InputError(f"{where}: the chat template closes assistant turns with no special "
                                 f"token (after the content it writes {tail[:20]!r}), so the end of a "
                                 "turn cannot be located")
            self._end = first
        return self._end

    def _by_offsets(self, messages, turns, where):
        text = self.text(messages, where)
        end_token = self._end_string(where)
        spans = []
        for i in turns:
            plain, gen = self._prompt_parts(messages, i, where, lambda m, gen: self.text(m, where, gen=gen))
            if not text.startswith(plain):
                raise InputError(f"{where}: the chat template renders messages 1..{i} differently "
                                 f"once later messages follow, so assistant message {i + 1} cannot be placed")
            start = len(plain) + self._header_length(messages, i, plain, gen, text[len(plain):], where)
            stop = text.find(end_token, start)
            if stop < 0:
                raise InputError(f"{where}: assistant message {i + 1} has no {end_token!r} after it "
                                 "in the rendered conversation")
            spans.append((start, stop + len(end_token)))
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = [int(t) for t in enc["input_ids"]]
        starts = [a for a, _ in enc["offset_mapping"]]
        mask = [1.0 if any(s <= a < e for s, e in spans) else 0.0 for a in starts]
        for (s, e), i in zip(spans, turns):
            if not any(s <= a < e for a in starts):
                raise InputError(f"{where}: assistant message {i + 1} renders to no token")
        return ids, mask

    def _header_length(self, messages, i: int, plain: str, gen: str, rest: str, where: str) -> int:
        """Characters of prompt before assistant message i's generated text ``rest``.

        ``gen`` (the generation prompt) when ``rest`` starts with it; else the longest
        generation prompt of the other thinking settings that it starts with (a turn rendered
        with its reasoning under ``thinking=False``); else the longest prefix of ``gen`` ending
        at one of its token boundaries (an earlier turn rendered without the think block that
        the generation prompt opens)."""
        if rest.startswith(gen):
            return len(gen)
        fits = []
        for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
            if kwargs == self.kwargs:
                continue
            try:
                alt = self._apply(messages[:i], where, gen=True, tokenize=False, kwargs=kwargs)
            except InputError:
                continue
            if alt.startswith(plain) and len(alt) > len(plain) and rest.startswith(alt[len(plain):]):
                fits.append(len(alt) - len(plain))
        if fits:
            return max(fits)
        common = 0
        while common < min(len(gen), len(rest)) and gen[common] == rest[common]:
            common += 1
        enc = self.tokenizer(gen, add_special_tokens=False, return_offsets_mapping=True)
        cuts = [e for _, e in enc["offset_mapping"] if 0 < e <= common]
        if not cuts:
            raise InputError(f"{where}: assistant message {i + 1} does not start with the template's "
                             f"generation prompt {gen!r}, so it cannot be placed")
        return max(cuts)

    def _by_prefixes(self, messages, turns, where):
        ids = self._ids(messages, where, gen=False)
        mask = [0.0] * len(ids)
        render = lambda m, gen: self._ids(m, where, gen=gen)  # noqa: E731
        for k, i in enumerate(turns):
            plain, gen = self._prompt_parts(messages, i, where, render)
            n = len(plain)
            if ids[:n] != plain:
                raise InputError(f"{where}: the chat template is not prefix-stable at message {i + 1} "
                                 "(this tokenizer gives no character offsets; use a fast tokenizer)")
            b = 0
            while b < min(len(gen), len(ids) - n) and gen[b] == ids[n + b]:
                b += 1
            if b == 0:
                raise InputError(f"{where}: assistant message {i + 1} does not start with the "
                                 "template's generation prompt, so it cannot be placed")
            stop = len(ids) if i == len(messages) - 1 else len(render(messages[: i + 1], False))
            if i < len(messages) - 1 and ids[:stop] != render(messages[: i + 1], False):
                raise InputError(f"{where}: the chat template is not prefix-stable after message {i + 1} "
                                 "(this tokenizer gives no character offsets; use a fast tokenizer)")
            mask[n + b: stop] = [1.0] * (stop - n - b)
        return ids, mask


def render_chat(tokenizer, messages: Sequence[Mapping], *, thinking: bool | None = None,
                where: str = "chat") -> tuple[list[int], list[float]]:
    """Tokenize one conversation with ``tokenizer``'s chat template; loss_mask 1 exactly on the
    assistant-generated tokens (module docstring). ``thinking``: ``enable_thinking`` (None: the
    template's default). Returns (ids [S], loss_mask [S])."""
    return ChatRenderer(tokenizer, thinking=thinking)(messages, where)


def chat_to_tokens(tokenizer, messages: list[dict]) -> tuple[list[int], list[float]]:
    """``render_chat`` with the template's default thinking setting (kept for older callers)."""
    return render_chat(tokenizer, messages)


def iter_chat_rows(path, tokenizer, *, thinking: bool | None = None) -> Iterator[tuple[str, list[int], list[float]]]:
    """Yield ``("file:line", ids, loss_mask)`` for each conversation of a chat JSONL file."""
    renderer = ChatRenderer(tokenizer, thinking=thinking)
    for where, rec in iter_jsonl(path, "data file"):
        ids, mask = renderer(to_messages(rec, where), where)
        yield where, ids, mask


def read_chat_jsonl(path, tokenizer, max_length: int, overlong: str = "truncate", *,
                    thinking: bool | None = None, vocab_size: int | None = None):
    """Chat JSONL (``messages`` or ShareGPT ``conversations`` rows) -> TokenSequences."""
    from dspark_jax.data.sources import TokenSequences, fit_sequence

    seqs, wheres = [], []
    for where, ids, mask in iter_chat_rows(path, tokenizer, thinking=thinking):
        fit_sequence(ids, mask, max_length, overlong, where)
        seqs.append((ids, mask))
        wheres.append(where)
    return TokenSequences(seqs, max_length, vocab_size, overlong, name=str(path), wheres=wheres)
