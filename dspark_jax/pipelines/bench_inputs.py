"""What ``bench`` is asked: curves (drafters x policies), concurrencies, SLAs, prompts, and the
round tables / logs of projected mode, each checked before any model is loaded or compiled.

A drafter is named by the user (``--draft NAME=DIR``) or by its directory (``DIR``: its name,
or its parent's when the name is a generic ``export`` / ``draft``); bench never asks which
kind it is, so every kind the decode round serves is benched the same way. Its fingerprint
(``fingerprint``: the config.json bytes and the weight files' sizes) ties logs to it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Sequence

from dspark_jax.errors import ConfigError, InputError

AR = "ar"
SCHEDULERS = ("scheduler", "scheduler-async")
GENERIC_NAMES = ("export", "draft", "drafter", "model")


@dataclasses.dataclass(frozen=True)
class Drafter:
    """A curve's drafter: a checkpoint directory, or (``path`` None) a name of an acceptance
    profile (projected mode: no weights, the round table carries the costs)."""

    name: str
    path: Path | None
    fingerprint: str | None


def fingerprint(draft_dir: Path) -> str:
    """16 hex digits identifying a drafter checkpoint: its config.json and weight-file sizes."""
    h = hashlib.sha256()
    cfg = draft_dir / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for f in sorted(draft_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def parse_drafters(specs: Sequence[str], profiles: Sequence[str] | None = None) -> list[Drafter]:
    """``--draft`` values (``DIR`` or ``NAME=DIR``) -> Drafters with distinct names. With
    ``profiles`` (the names of an ``--acceptance`` profile) each value must be one of them."""
    out: list[Drafter] = []
    for spec in specs or ():
        if profiles is not None:
            if spec not in profiles:
                raise InputError(f"--draft {spec!r}: with --acceptance name a drafter of the "
                                 f"profile ({', '.join(profiles)})")
            out.append(Drafter(spec, None, None))
            continue
        name, sep, path = spec.partition("=")
        path = Path(path if sep else spec)
        if not path.is_dir():
            raise InputError(f"--draft {spec!r}: {str(path)!r} is not a directory")
        if not sep:
            p = path.resolve()
            name = p.parent.name if p.name in GENERIC_NAMES and p.parent.name else p.name
        if not name or name == AR or "/" in name:
            raise InputError(f"--draft {spec!r}: the name {name!r} is reserved or empty; "
                             "give --draft NAME=DIR")
        if any(d.name == name for d in out):
            raise InputError(f"--draft {spec!r}: two drafters named {name!r}; "
                             "give --draft NAME=DIR")
        out.append(Drafter(name, path, fingerprint(path)))
    return out


def parse_verify(text: str) -> list[str]:
    """``--verify`` list -> policy specs, each parsed (an unknown one: ConfigError, one line)."""
    from dspark_jax.decode.policies import parse_policy

    specs = [s.strip() for s in text.split(",") if s.strip()]
    if not specs:
        raise InputError("--verify: give at least one policy (full, fixed:K, threshold, scheduler, "
                         "scheduler-async)")
    for s in specs:
        name = s.partition(":")[0]
        if name in SCHEDULERS:
            if name == "scheduler" and s != name:
                raise ConfigError(f"--verify {s!r}: scheduler takes no options")
            continue
        try:
            parse_policy(s)
        except ConfigError as e:
            raise ConfigError(f"--verify: {e}") from None
    if len(set(specs)) != len(specs):
        raise InputError(f"--verify {text!r}: a policy is listed twice")
    return specs


def parse_ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{flag} must be comma-separated ints, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise InputError(f"{flag} must be ints >= 1, got {text!r}")
    return sorted(set(vals))


def parse_floats(text: str | None, flag: str) -> list[float]:
    if not text:
        return []
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{flag} must be comma-separated numbers, got {text!r}") from None
    if min(vals) <= 0:
        raise InputError(f"{flag} values must be > 0, got {text!r}")
    return vals


def curve_names(drafters: Sequence[Drafter], verify: Sequence[str]) -> list[str]:
    """``ar`` then ``<drafter>/<policy>`` for every drafter and policy."""
    return [AR] + [f"{d.name}/{v}" for d in drafters for v in verify]


def check_baseline(baseline: str, names: Sequence[str]) -> str:
    if baseline not in names:
        raise InputError(f"--baseline {baseline!r} is not a curve of this run; "
                         f"curves: {list(names)}")
    return baseline


def model_signature(cfg) -> dict:
    """The target fields a round table records (``decode.profile._table_meta``'s ``model``)."""
    return {"num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size}


def read_json(path, flag: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{flag} {str(p)!r} is not a file")
    try:
        obj = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{flag} {str(p)!r}: invalid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise InputError(f"{flag} {str(p)!r}: expected a JSON object")
    return obj


def check_round_table(obj: dict, path, target_cfg, block_size: int | None, drafter: Drafter | None):
    """Projected mode: the table must describe this target (its ``model`` fields) and, for a
    drafter, this block size and a width set of the drafter's round (max width G+1); the
    drafter's fingerprint when the table records one. InputError (one line) otherwise."""
    where = f"--round-table {str(path)!r}"
    model = obj.get("model")
    if isinstance(model, dict):
        want = model_signature(target_cfg)
        bad = {k: (model.get(k), v) for k, v in want.items() if model.get(k) not in (None, v)}
        if bad:
            k, (got, v) = next(iter(bad.items()))
            raise InputError(f"{where} was made for another target ({k} {got}, this target {v})")
    if drafter is None:
        return
    if obj.get("block_size") not in (None, block_size):
        raise InputError(f"{where} is for block size {obj['block_size']}; drafter "
                         f"{drafter.name!r} proposes {block_size}")
    widths = obj.get("widths") or []
    if not widths or max(widths) != block_size + 1:
        raise InputError(f"{where}: widths {widths} are not a width set of drafter "
                         f"{drafter.name!r} (its round verifies up to {block_size + 1} tokens)")
    fp = obj.get("draft_fingerprint")
    if fp is not None and fp != drafter.fingerprint:
        raise InputError(f"{where} was measured with another drafter (fingerprint {fp}, "
                         f"{drafter.name!r} is {drafter.fingerprint})")


def pair_files(files: Sequence[str], drafters: Sequence[Drafter], flag: str) -> list:
    """One file per drafter, in --draft order (a single file serves a single drafter; AR-only
    runs take one file for the AR cost)."""
    n = max(len(drafters), 1)
    if len(files) != n:
        raise InputError(f"{flag}: give one file per --draft ({n}), in the same order; "
                         f"got {len(files)}")
    return list(files)
