"""On-policy training data: regenerate the assistant turns of a chat dataset with the target.

``regenerate`` reads a chat dataset (``data.formats``), renders each request's prompt with the
target tokenizer's chat template over the REAL history before the assistant turn it replaces
(plus the generation prompt), generates the reply with the continuous-batching engine
(``decode.engine.serve``: the target alone, or speculatively with a drafter, lossless either
way) and writes training JSONL that ``train`` reads as token data::

    {"id": record id (or 0-based row number), "turn": generated-turn index in the row,
     "input_ids": prompt + reply, "loss_mask": 0 on the prompt, 1 on the reply (stop included),
     "messages": history + {"role": "assistant", "content": reply text},
     "finish_reason": "stop" | "length", "prompt_tokens": n, "generated_tokens": m,
     "source": "file:line"[, "extra": the row's other fields]}

Requests: ``turns="last"`` regenerates the last assistant turn of each row (a row ending with
a user message: one reply to it); ``turns="all"`` one request per assistant turn (and the
trailing user message), each after the real preceding history. Output rows are in request
order (row order, then turn order).

Determinism and resume: request i samples from its own PRNG key ``fold_in(PRNGKey(seed), i)``
(``request_keys``), never from arrival order, so a row does not depend on slots, order, the
other requests or a restart. Each finished row is appended to ``OUT.partial`` (flushed and
fsynced) with its request index; a restarted run with the same arguments (fingerprint in
``OUT.partial.meta.json``) skips the journaled requests (a torn last line is dropped), then
``OUT`` is written atomically in request order, the summary next to it (``OUT.summary.json``)
and the journal removed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from dspark_jax.data.formats import Conversation, read_conversations
from dspark_jax.data.sources import reply_record
from dspark_jax.errors import InputError, warn
from dspark_jax.fileio import check_not_input, check_output, dumps, write_json, write_jsonl

TURNS = ("last", "all")
DEFAULT_TEMPERATURE = 1.0   # no generation config: sample the target's own distribution
DEFAULT_MAX_NEW_TOKENS = 512
JOURNAL_SUFFIX = ".partial"
META_SUFFIX = ".partial.meta.json"
SUMMARY_SUFFIX = ".summary.json"
FINGERPRINT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Request:
    """One reply to generate: ``index`` (request order), the row, ``turn`` (index among the
    row's generation points), ``history`` (the messages before the reply), ``prompt_ids``."""

    index: int
    conv: Conversation
    turn: int
    history: list
    prompt_ids: list


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Resolved generation settings (flags over the target's generation_config.json)."""

    temperature: float
    top_p: float
    max_new_tokens: int
    stop_token_ids: list


def paths_of(out) -> dict[str, Path]:
    """The files a run writes: ``out``, its journal, the journal's meta and the summary."""
    out = Path(out)
    return {"out": out, "journal": out.with_name(out.name + JOURNAL_SUFFIX),
            "meta": out.with_name(out.name + META_SUFFIX),
            "summary": out.with_name(out.name + SUMMARY_SUFFIX)}


def request_keys(seed: int, indices: Sequence[int]) -> np.ndarray:
    """uint32 [N, 2]: the PRNG key of each request index, ``fold_in(PRNGKey(seed), index)``."""
    import jax

    idx = np.asarray(list(indices), np.uint32)
    if idx.size == 0:
        return np.zeros((0, 2), np.uint32)
    base = jax.random.PRNGKey(seed)
    return np.asarray(jax.vmap(lambda i: jax.random.fold_in(base, i))(idx), np.uint32)


# ----------------------------------------------------------------------------- prompts


def prompt_ids(tokenizer, history: list, where: str, *, raw: bool, thinking: bool) -> list[int]:
    """The prompt of a reply after ``history``. Chat: the template with the generation prompt
    (InputError naming ``where`` when the template renders the same tokens without it). Raw
    (base LMs): the single user message as plain text."""
    from dspark_jax.data.chat import ChatRenderer
    from dspark_jax.tokenizer import encode_prompt

    if raw:
        if len(history) != 1 or history[0]["role"] != "user":
            raise InputError(f"{where}: --raw-prompt uses one user message as plain text, but "
                             f"the reply follows {len(history)} messages "
                             f"({', '.join(m['role'] for m in history)}); use the chat template "
                             "(drop --raw-prompt) or single-prompt rows")
        return encode_prompt(tokenizer, history[0]["content"], raw=True)
    if not (getattr(tokenizer, "chat_template", None) or hasattr(tokenizer, "chat_prompt")):
        raise InputError(f"{where}: the target tokenizer has no chat template; give --raw-prompt "
                         "for a base LM (single prompts only)")
    renderer = ChatRenderer(tokenizer, thinking=thinking)
    with_gen = renderer.prompt_ids(history, where, gen=True)
    without = renderer.prompt_ids(history, where, gen=False)
    if with_gen == without:
        raise InputError(f"{where}: the target's chat template renders the same tokens with and "
                         "without add_generation_prompt (it drops the generation prompt), so the "
                         "reply would not start an assistant turn; fix the template or use "
                         "--raw-prompt")
    return with_gen


def build_requests(conversations: Sequence[Conversation], tokenizer, *, turns: str, raw: bool,
                   thinking: bool) -> list[Request]:
    """The requests of ``conversations`` in order (row order, then turn order)."""
    out: list[Request] = []
    for conv in conversations:
        points = conv.generation_points()
        chosen = list(enumerate(points)) if turns == "all" else [(len(points) - 1, points[-1])]
        for turn, k in chosen:
            history = [dict(m) for m in conv.messages[:k]]
            ids = prompt_ids(tokenizer, history, conv.where, raw=raw, thinking=thinking)
            out.append(Request(len(out), conv, turn, history, ids))
    return out


# ----------------------------------------------------------------------------- settings


def generation_config(target_dir) -> dict:
    """The target's generation_config.json ({} when absent)."""
    from dspark_jax.convert.formats import read_json_object

    path = Path(target_dir) / "generation_config.json"
    return read_json_object(path, "generation_config.json") if path.is_file() else {}


def resolve_sampling(target_dir, tokenizer, *, temperature=None, top_p=None, max_new_tokens=None,
                     stop_token_ids=None) -> Sampling:
    """Flags (non-None) over the generation config (``temperature`` / ``top_p`` when it samples,
    ``do_sample: false`` meaning greedy; ``max_new_tokens``; ``eos_token_id`` as stop ids)
    over the defaults (temperature 1, top_p 1, 512 tokens)."""
    from dspark_jax.convert.checkpoint import default_stop_ids

    gc = generation_config(target_dir)
    samples = gc.get("do_sample", True) is not False
    if temperature is None:
        temperature = (float(gc.get("temperature", DEFAULT_TEMPERATURE)) if samples else 0.0)
    if top_p is None:
        top_p = float(gc.get("top_p", 1.0)) if samples else 1.0
    if max_new_tokens is None:
        max_new_tokens = int(gc.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS)
    stops = (default_stop_ids(target_dir, tokenizer) if stop_token_ids is None
             else [int(t) for t in stop_token_ids])
    temperature, top_p = float(temperature), float(top_p)
    if not (temperature >= 0 and np.isfinite(temperature)):
        raise InputError(f"--temperature must be a finite number >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise InputError(f"--top-p must be in (0, 1], got {top_p}")
    if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be a positive int, got {max_new_tokens!r}")
    top_k = gc.get("top_k")
    if samples and isinstance(top_k, int) and 0 < top_k and temperature > 0:
        warn(f"the target's generation_config.json sets top_k={top_k}; regenerate samples "
             "without top-k filtering (temperature and top-p only)")
    return Sampling(temperature, top_p, int(max_new_tokens), stops)


def _dir_identity(path) -> dict | None:
    """Path, config.json digest and weight-file sizes of a checkpoint directory (None: no dir)."""
    if path is None:
        return None
    p = Path(path).resolve()
    files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else []
    cfg = p / "config.json"
    return {"path": str(p),
            "config_sha256": hashlib.sha256(cfg.read_bytes()).hexdigest() if cfg.is_file() else None,
            "files": {f.name: f.stat().st_size for f in files}}


def fingerprint(requests: Sequence[Request], sampling: Sampling, *, target, draft, seed: int,
                turns: str, thinking: bool, raw_prompt: bool) -> dict:
    """What a resumable run must share with the run that wrote the journal. Slots and mesh are
    left out: a row does not depend on them."""
    h = hashlib.sha256()
    for r in requests:
        h.update(json.dumps([r.conv.where.rsplit(":", 1)[-1], r.turn, r.prompt_ids]).encode())
        h.update(b"\n")
    return {"version": FINGERPRINT_VERSION, "requests": len(requests),
            "prompts_sha256": h.hexdigest(), "target": _dir_identity(target),
            "draft": _dir_identity(draft), "seed": int(seed), "turns": turns,
            "thinking": bool(thinking), "raw_prompt": bool(raw_prompt),
            **dataclasses.asdict(sampling)}


# ----------------------------------------------------------------------------- journal


def read_journal(path: Path, n_requests: int) -> dict[int, dict]:
    """{request index: row} of a journal. A torn last line (a write cut by a kill: no newline)
    is cut off the file; a corrupt complete line is an InputError naming it."""
    rows: dict[int, dict] = {}
    if not path.is_file():
        return rows
    data = path.read_bytes()
    *complete, torn = data.split(b"\n")
    for n, raw in enumerate(complete, start=1):
        try:
            rec = json.loads(raw.decode("utf-8"))
            i, row = int(rec["index"]), rec["row"]
            if not (0 <= i < n_requests and isinstance(row, dict)):
                raise ValueError
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise InputError(f"{path}:{n}: corrupt journal line; pass --force to start over") from None
        rows.setdefault(i, row)
    if torn:
        with path.open("r+b") as f:
            f.truncate(len(data) - len(torn))
    return rows


class Journal:
    """Append-only, fsynced rows ``{"index": i, "row": {...}}`` of finished requests."""

    def __init__(self, path: Path):
        self.path = path
        self._f = path.open("a", encoding="utf-8")

    def append(self, index: int, row: dict) -> None:
        self._f.write(dumps({"index": index, "row": row}) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def _open_journal(files: dict, fp: dict, n_requests: int, force: bool, log) -> dict[int, dict]:
    """Rows already journaled by a run with fingerprint ``fp`` (a fresh journal otherwise);
    a journal of other arguments is refused unless ``force`` (then discarded)."""
    journal, meta = files["journal"], files["meta"]
    if journal.exists() or meta.exists():
        old = None
        if meta.is_file():
            try:
                old = json.loads(meta.read_text()).get("fingerprint")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                old = None
        if old == fp:
            rows = read_journal(journal, n_requests)
            journal.touch()
            log(f"regenerate: resuming {journal}: {len(rows)} of {n_requests} rows done")
            return rows
        if not force:
            diff = (sorted(k for k in set(fp) | set(old) if fp.get(k) != old.get(k))
                    if isinstance(old, dict) else ["missing or unreadable meta"])
            raise InputError(f"{journal} holds an unfinished run with other arguments "
                             f"(differs in: {', '.join(diff)}); rerun with the same arguments to "
                             "resume it, or pass --force to discard it")
        journal.unlink(missing_ok=True)
        meta.unlink(missing_ok=True)
    write_json(meta, {"fingerprint": fp})
    journal.touch()
    return {}


# ----------------------------------------------------------------------------- rows


def make_row(req: Request, output_ids: Sequence[int], stops: Sequence[int], tokenizer) -> dict:
    """The output row of request ``req`` whose reply is ``output_ids`` (stop token included)."""
    out = [int(t) for t in output_ids]
    stopped = bool(out) and out[-1] in set(stops)
    text = tokenizer.decode(out[:-1] if stopped else out, skip_special_tokens=True)
    conv = req.conv
    row = {"id": conv.id if conv.id is not None else conv.row, "turn": req.turn,
           **reply_record(req.prompt_ids, out),
           "messages": list(req.history) + [{"role": "assistant", "content": text}],
           "finish_reason": "stop" if stopped else "length",
           "prompt_tokens": len(req.prompt_ids), "generated_tokens": len(out),
           "source": conv.where}
    if conv.extra:
        row["extra"] = conv.extra
    return row


def summarize_rows(rows: Sequence[dict], seconds: float, session_tokens: int) -> dict:
    """Counts of the output rows plus this session's generation time and tokens/s."""
    reasons: dict[str, int] = {}
    for r in rows:
        reasons[r["finish_reason"]] = reasons.get(r["finish_reason"], 0) + 1
    return {"rows": len(rows), "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "generated_tokens": sum(r["generated_tokens"] for r in rows),
            "truncations": reasons.get("length", 0), "finish_reasons": reasons,
            "seconds": seconds, "session_generated_tokens": session_tokens,
            "tokens_per_second": session_tokens / seconds if seconds > 0 else 0.0}


# ----------------------------------------------------------------------------- pipeline


def regenerate(target, data, out, *, fmt: str = "auto", turns: str = "last", thinking: bool = False,
               raw_prompt: bool = False, temperature: float | None = None,
               top_p: float | None = None, max_new_tokens: int | None = None,
               stop_token_ids: Sequence[int] | None = None, seed: int = 0, slots: int = 8,
               mesh=None, draft=None, dtype: str | None = None,
               max_cache_len: int | None = None, force: bool = False, progress: bool = True,
               log: Callable[[str], None] = print,
               after_row: Callable[[int], None] | None = None) -> dict:
    """Regenerate the assistant turns of ``data`` with ``target``; write ``out``; the summary.

    ``temperature`` / ``top_p`` / ``max_new_tokens`` / ``stop_token_ids`` None: from the
    target's generation_config.json (see ``resolve_sampling``). ``mesh``: a spec string
    ("data=2,tensor=2"), a Mesh or None. ``draft``: a drafter directory (speculative decoding;
    top_p must be 1). ``after_row(n)`` is called after the n-th row of this session is
    journaled. Every path, row and setting is checked before the model loads.
    """
    from dspark_jax.decode.sharded import make_decode_mesh
    from dspark_jax.tokenizer import load_tokenizer

    if turns not in TURNS:
        raise InputError(f"--turns must be one of {list(TURNS)}, got {turns!r}")
    files = paths_of(out)
    target_dir = Path(target)
    if not target_dir.is_dir():
        raise InputError(f"--target {str(target)!r} is not a directory")
    if draft is not None and not Path(draft).is_dir():
        raise InputError(f"--draft {str(draft)!r} is not a directory")
    data_path = Path(data)
    if not data_path.is_file():
        raise InputError(f"--data {str(data)!r} does not exist or is not a file")
    if not force and files["out"].is_file() and files["summary"].is_file():
        raise InputError(f"--out {str(out)!r} is a finished run (its summary is "
                         f"{str(files['summary'])!r}): nothing to do. A rerun resumes only an "
                         "interrupted run; to regenerate from scratch pass --force (replaces both), "
                         "or choose another --out")
    inputs = {"--target": target, "--data": data, "--draft": draft}
    check_output(files["out"], force=force, inputs=inputs)
    check_output(files["summary"], force=force, flag="--out (its summary)", inputs=inputs)
    for key in ("journal", "meta"):
        check_not_input(files[key], inputs, flag=f"--out (its {key} {files[key].name})")
        if files[key].is_dir():
            raise InputError(f"{files[key]} (the resume journal of --out) is a directory")

    tokenizer = load_tokenizer(target_dir, required=True)
    conversations = read_conversations(data_path, fmt=fmt)
    requests = build_requests(conversations, tokenizer, turns=turns, raw=raw_prompt,
                              thinking=thinking)
    sampling = resolve_sampling(target_dir, tokenizer, temperature=temperature, top_p=top_p,
                                max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
    if draft is not None and sampling.top_p < 1.0:
        raise InputError(f"top_p={sampling.top_p} (from --top-p or the target's "
                         "generation_config.json) needs autoregressive decoding: speculative "
                         "verification against a nucleus-filtered target is not implemented; "
                         "drop --draft or pass --top-p 1")
    mesh = make_decode_mesh(mesh) if mesh is None or isinstance(mesh, str) else mesh
    fp = fingerprint(requests, sampling, target=target_dir, draft=draft, seed=seed, turns=turns,
                     thinking=thinking, raw_prompt=raw_prompt)
    done = _open_journal(files, fp, len(requests), force, log)

    todo = [r for r in requests if r.index not in done]
    seconds, session_tokens = 0.0, 0
    if todo:
        seconds, session_tokens = _generate(
            todo, done, files, sampling, tokenizer, target_dir=target_dir, draft=draft,
            dtype=dtype, seed=seed, slots=slots, mesh=mesh, max_cache_len=max_cache_len,
            progress=progress, after_row=after_row, total=len(requests))

    rows = [done[r.index] for r in requests]
    write_jsonl(files["out"], rows)
    summary = summarize_rows(rows, seconds, session_tokens)
    summary.update(resumed_rows=len(requests) - len(todo), out=str(files["out"]),
                   mode="speculative" if draft else "autoregressive", turns=turns,
                   thinking=thinking, raw_prompt=raw_prompt, seed=seed,
                   **dataclasses.asdict(sampling))
    write_json(files["summary"], summary)
    files["journal"].unlink(missing_ok=True)
    files["meta"].unlink(missing_ok=True)
    return summary


def _generate(todo: list[Request], done: dict, files: dict, sampling: Sampling, tokenizer, *,
              target_dir, draft, dtype, seed, slots, mesh, max_cache_len, progress, after_row,
              total: int) -> tuple[float, int]:
    """Serve ``todo`` through the engine, journaling each row into ``done`` as it finishes.
    Returns (seconds, generated tokens)."""
    from tqdm import tqdm

    from dspark_jax.convert.checkpoint import load_draft, load_target
    from dspark_jax.decode import engine

    tcfg, tparams = load_target(target_dir, dtype)
    dcfg = dparams = None
    max_pos, slack = tcfg.max_position_embeddings, 1
    if draft is not None:
        dcfg, dparams = load_draft(draft, dtype, target_params=tparams)
        max_pos, slack = min(max_pos, dcfg.max_position_embeddings), dcfg.block_size
    for r in todo:
        if len(r.prompt_ids) + sampling.max_new_tokens + slack > max_pos:
            raise InputError(f"{r.conv.where}: prompt of {len(r.prompt_ids)} tokens + "
                             f"max_new_tokens {sampling.max_new_tokens} exceeds the context of the "
                             f"model ({max_pos} positions); lower --max-new-tokens or drop the row")

    journal = Journal(files["journal"])
    bar = tqdm(total=total, initial=total - len(todo), desc="regenerate", unit="row",
               disable=not progress)
    t0 = time.perf_counter()
    count = [0, 0]  # rows, generated tokens of this session

    def on_result(i: int, res) -> None:
        req = todo[i]
        row = make_row(req, res.output_ids, sampling.stop_token_ids, tokenizer)
        journal.append(req.index, row)
        done[req.index] = row
        count[0] += 1
        count[1] += len(res.output_ids)
        bar.update(1)
        bar.set_postfix(tok_s=f"{count[1] / max(time.perf_counter() - t0, 1e-9):.1f}")
        if after_row is not None:
            after_row(count[0])

    try:
        engine.serve(tcfg, tparams, dcfg, dparams, [r.prompt_ids for r in todo],
                     max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                     top_p=sampling.top_p, slots=slots, seed=seed,
                     stop_token_ids=sampling.stop_token_ids, mesh=mesh,
                     max_cache_len=max_cache_len,
                     request_keys=request_keys(seed, [r.index for r in todo]),
                     on_result=on_result)
    finally:
        journal.close()
        bar.close()
    return time.perf_counter() - t0, count[1]
