"""Small file helpers shared by every command: atomic file/directory writes, line-numbered JSONL reading."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import IO, Any, Iterable, Iterator

from dspark_jax.errors import InputError, warn


def _tmp_prefix(path: Path) -> str:
    """Name prefix of this process's temporaries for ``path``: ``.<name>.tmp-<pid>-``."""
    return f".{path.name}.tmp-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's live process
        return True
    return True


def remove_stale_temps(path) -> list[Path]:
    """Remove the temporaries an interrupted writer of ``path`` left next to it (``atomic_dir``
    / ``atomic_open``: ``.<name>.tmp-<pid>-*`` of a process no longer running, and the
    pid-less ``.<name>.tmp-<hex>`` of older versions); one warning line each. Returns them."""
    path = Path(path).absolute()
    if not path.parent.is_dir():
        return []
    removed = []
    for p in path.parent.glob(f".{path.name}.tmp-*"):
        rest = p.name[len(f".{path.name}.tmp-"):]
        pid = rest.split("-", 1)[0]
        if "-" in rest and pid.isdigit() and _alive(int(pid)):
            continue  # a writer at work
        try:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        except OSError:
            continue
        warn(f"removed {p}, the incomplete output of an interrupted earlier run")
        removed.append(p)
    return removed


@contextlib.contextmanager
def atomic_open(path, *, force: bool = True, mode: int = 0o644) -> Iterator[IO[str]]:
    """Write a text file atomically: a temp file next to ``path``, renamed on success.

    With ``force=False`` an existing ``path`` is refused (InputError). On any
    error the temp file is removed and ``path`` is untouched.
    """
    path = Path(path)
    if path.exists() and not force:
        raise InputError(f"{path}: exists; pass --force to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(path), dir=str(path.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yield f
        os.chmod(tmp, mode)  # mkstemp makes 0600; outputs are shareable artefacts
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(dst, *, force: bool = False, make_parents: bool = True,
               mode: int | None = None) -> Iterator[Path]:
    """Yield a fresh temp dir next to ``dst``; on success it replaces ``dst`` (a rename).

    Refuses an existing ``dst`` unless ``force`` (InputError); ``make_parents`` (default)
    creates missing parent directories, else the parent must exist; ``mode`` chmods the new
    directory. On any error the temp dir (and the parents it created) are removed and
    ``dst`` is left untouched.
    """
    dst = Path(dst).absolute()
    if (dst.exists() or dst.is_symlink()) and not force:
        raise InputError(f"{dst}: destination exists; pass --force to replace it")
    created = []
    if make_parents:
        parent = dst.parent
        while not parent.exists() and parent != parent.parent:
            created.append(parent)
            parent = parent.parent
        if parent.exists() and not parent.is_dir():
            raise InputError(f"{parent}: not a directory (a parent of the destination {dst})")
        dst.parent.mkdir(parents=True, exist_ok=True)
    if not dst.parent.is_dir():
        raise InputError(f"{dst.parent}: parent directory of the destination does not exist")
    remove_stale_temps(dst)
    tmp = dst.parent / f"{_tmp_prefix(dst)}{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if mode is not None:
            tmp.chmod(mode)
        yield tmp
        if dst.exists() or dst.is_symlink():
            old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(dst, old)
            os.replace(tmp, dst)
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
            else:
                old.unlink()
        else:
            os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in created:  # innermost first
            try:
                d.rmdir()
            except OSError:
                break
        raise


def json_safe(x):
    """JSON-safe copy of ``x``: NaN/inf floats (NumPy scalars too) -> None, recursively."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if getattr(x, "ndim", None) == 0 and hasattr(x, "item"):  # a NumPy / JAX scalar
        return json_safe(x.item())
    return x


def dumps(x, **kw) -> str:
    """``json.dumps`` for our outputs: strict JSON (non-finite numbers written as null)."""
    return json.dumps(json_safe(x), allow_nan=False, **kw)


def write_text(path, text: str, *, force: bool = True) -> Path:
    """``text`` to ``path``, atomically."""
    with atomic_open(path, force=force) as f:
        f.write(text)
    return Path(path)


def write_jsonl(path, rows: Iterable[Any], *, force: bool = True) -> Path:
    """One JSON object per line, written atomically (``atomic_open``)."""
    with atomic_open(path, force=force) as f:
        for row in rows:
            f.write(dumps(row) + "\n")
    return Path(path)


def write_json(path, data, *, force: bool = True, indent: int | None = 2) -> Path:
    """``data`` as JSON (plus a newline), atomically."""
    with atomic_open(path, force=force) as f:
        f.write(dumps(data, indent=indent))
        f.write("\n")
    return Path(path)


def _named_paths(inputs) -> list[tuple[str, str]]:
    """``inputs`` as (name, path) pairs: a mapping {flag: path} or an iterable of paths or pairs;
    None / empty paths are skipped."""
    items = inputs.items() if isinstance(inputs, dict) else inputs
    pairs = []
    for item in items:
        name, value = item if isinstance(item, tuple) else ("input", item)
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if v not in (None, ""):
                pairs.append((name, str(v)))
    return pairs


def check_not_input(path, inputs, *, flag: str = "--out") -> None:
    """Refuse (InputError naming both) an output ``path`` that is one of ``inputs``, contains
    one, or lies inside one: whatever ``--force`` says, a command never writes over its inputs.
    Paths are compared after resolving symlinks."""
    resolved = Path(os.path.realpath(Path(path).absolute()))
    for name, other in _named_paths(inputs):
        real = Path(os.path.realpath(Path(other).absolute()))
        if resolved == real:
            how = "is"
        elif resolved in real.parents:
            how = "contains"
        elif real in resolved.parents:
            how = "lies inside"
        else:
            continue
        raise InputError(f"{flag} {str(path)!r} {how} the input {name} {other!r}; "
                         "choose another destination (inputs are never overwritten, even with --force)")


def check_output(path, *, force: bool = False, kind: str = "file", flag: str = "--out",
                 inputs=(), marker: str | tuple[str, ...] | None = None) -> Path:
    """Validate an output path before any work starts; returns it as a Path.

    ``kind`` is "file" or "dir" (what the command writes there). Refused (InputError, one
    line naming ``flag`` and the path): an output that is, contains or lies inside one of
    ``inputs`` ({flag: path} or paths; ``check_not_input``) with or without ``force``; a file
    output that is an existing directory (or a dir output that is an existing file); an
    existing path without ``force``; a parent that is not a writable directory. With
    ``marker`` (a run directory: train's ``run.json``; a name or a tuple of names) an existing
    directory is accepted without ``force`` when it is empty or holds a ``marker`` (one of
    ours), else refused even with ``force``.
    """
    path = Path(path)
    shown = f"{flag} {str(path)!r}"
    check_not_input(path, inputs, flag=flag)
    if kind == "file" and path.is_dir():
        raise InputError(f"{shown} is a directory; give a file path")
    if kind == "dir" and path.exists() and not path.is_dir():
        raise InputError(f"{shown} is a file; give a directory path")
    if marker is not None and path.is_dir():
        try:
            entries = [p.name for p in path.iterdir()]
        except OSError as e:
            raise InputError(f"{shown}: cannot list it ({e.strerror})") from None
        markers = (marker,) if isinstance(marker, str) else tuple(marker)
        if entries and not set(markers) & set(entries):
            raise InputError(f"{shown} is a non-empty directory without {markers[0]} (not one of ours: "
                             f"holds {', '.join(sorted(entries)[:3])}{', ...' if len(entries) > 3 else ''}); "
                             "choose an empty or new directory")
    elif (path.exists() or path.is_symlink()) and not force:
        raise InputError(f"{shown} already exists (destination exists: pass --force to replace it)")
    resolved = path.absolute().resolve()
    parent = resolved.parent if not (marker is not None and resolved.is_dir()) else resolved
    while not parent.exists():  # the command creates missing parents
        parent = parent.parent
    if not parent.is_dir():
        raise InputError(f"{shown}: {str(parent)!r} is not a directory")
    try:  # a probe file: os.access cannot see every refusal (read-only mounts for root, /proc)
        if not os.access(parent, os.W_OK | os.X_OK):
            raise PermissionError
        fd, probe = tempfile.mkstemp(prefix=".dspark-probe-", dir=str(parent))
        os.close(fd)
        os.unlink(probe)
    except OSError:
        raise InputError(f"{shown}: directory {str(parent)!r} is not writable") from None
    return path


def iter_jsonl(path, what: str = "JSONL file") -> Iterator[tuple[str, object]]:
    """Yield ``("file:line", record)`` for each non-blank line of a JSONL file.

    A missing file, a line that is not UTF-8 or a malformed line raises InputError naming
    the file and line (1-based).
    """
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{what} {str(path)!r} is a directory, not a JSONL file")
    if not path.is_file():
        raise InputError(f"{what} {str(path)!r} does not exist")
    try:
        f = path.open("rb")
    except OSError as e:
        raise InputError(f"cannot read {what} {str(path)!r}: {e.strerror}") from None
    with f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"{where}: not valid UTF-8 (byte {e.start + 1} of the line)") from None
            if lineno == 1 and line.startswith("\ufeff"):
                line = line[1:]
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: malformed JSONL line ({e.msg} at column {e.colno})") from None
            yield where, record
