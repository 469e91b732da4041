"""Small file helpers shared by every command: atomic file/directory writes, line-numbered JSONL reading."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import stat
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


OUTPUT_MARKER = ".dspark-jax.json"  # written into every folder the project writes (``mark_dir``)


def path_kind(path) -> str | None:
    """What ``path`` itself is, in words for a refusal ("a symbolic link", "a FIFO", ...), from
    ``lstat`` (a link is not followed); None when nothing is there."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    for test, words in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                        (stat.S_ISREG, "a regular file"), (stat.S_ISCHR, "a character device"),
                        (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                        (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return "a special file"


def read_marker(d) -> dict | None:
    """The project's marker of folder ``d`` (``{"written_by", "what", "entries"}``), None if absent
    or unreadable (a foreign or broken marker is treated as none)."""
    try:
        m = json.loads((Path(d) / OUTPUT_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and m.get("written_by") == "dspark-jax" else None


def mark_dir(d, what: str, entries: Iterable[str] | None = None) -> Path:
    """Write the marker into folder ``d``: it was written by ``what`` (a command). ``entries``: the
    top-level names written (a folder replaced whole by ``atomic_dir``); None for a folder written
    incrementally (a run, an evaluation), whose names accumulate in the marker as it is re-marked."""
    d = Path(d)
    old = read_marker(d) or {}
    names = None if entries is None else sorted(set(entries) - {OUTPUT_MARKER})
    if names is None and old.get("entries") is not None:
        names = old["entries"]
    text = dumps({"written_by": "dspark-jax", "what": what, "entries": names}) + "\n"
    if old != json.loads(text):  # unchanged: not rewritten (a resumed run's files keep their mtimes)
        (d / OUTPUT_MARKER).write_text(text)
        (d / OUTPUT_MARKER).chmod(0o644)
    return d


def _listing(path: Path, shown: str) -> list[str]:
    try:
        return sorted(p.name for p in path.iterdir())
    except OSError as e:
        raise InputError(f"{shown}: cannot list it ({e.strerror})") from None


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def check_replaceable(path, *, kind: str = "file", force: bool = False, shown: str | None = None,
                      legacy: tuple[str, ...] = (), reuse: bool = False) -> Path:
    """The one output rule (every writing command, before any work): ``path`` is written only if
    it does not exist, or it is a regular file (``kind="file"``) / a folder this project wrote
    (``kind="dir"``: empty, or holding ``OUTPUT_MARKER`` or one of ``legacy``'s names), and then
    only with ``force`` (``reuse``: a folder of ours or an empty one is taken as is, e.g. a run to
    resume).
    Refused whatever ``force`` says, one InputError line naming the path and what it is: a symbolic
    link, a device, a FIFO, a socket; the working directory or a folder holding it; a file where a
    folder is written or the reverse; a folder of other files; a folder of ours holding names its
    marker does not list (replacing it would delete files the project did not write)."""
    path = Path(path)
    shown = shown or repr(str(path))
    what = path_kind(path)
    if what is None:
        return path
    if what not in ("a directory", "a regular file"):
        raise InputError(f"{shown} is {what}; refused (only a new path, a regular file or a folder "
                         "dspark-jax wrote is ever replaced); choose another path")
    if what == "a directory":
        real, cwd = Path(os.path.realpath(path)), Path(os.path.realpath(os.getcwd()))
        if real == cwd or real in cwd.parents:
            raise InputError(f"{shown} is {'the working directory' if real == cwd else 'a folder holding the working directory'}"
                             "; refused (it would be replaced); choose a new folder")
    if kind == "file":
        if what == "a directory":
            raise InputError(f"{shown} is a directory; give a file path")
    elif what == "a regular file":
        raise InputError(f"{shown} is a file; give a directory path")
    else:
        names = _listing(path, shown)
        marker = read_marker(path)
        if names and marker is None and not set(legacy) & set(names):
            raise InputError(f"{shown} is a folder of other files ({_few(names)}), not one dspark-jax "
                             f"wrote (no {OUTPUT_MARKER}); refused even with --force: choose a new or empty folder")
        if reuse:
            return path
        listed = (marker or {}).get("entries")
        foreign = [n for n in names if n != OUTPUT_MARKER and listed is not None and n not in listed]
        if force and foreign:
            raise InputError(f"{shown} holds files dspark-jax did not write ({_few(foreign)}); --force "
                             "would delete them: move them out or choose another folder")
    if not force:
        raise InputError(f"{shown} already exists (destination exists: pass --force to replace it)")
    return path


@contextlib.contextmanager
def atomic_open(path, *, force: bool = True, mode: int = 0o644) -> Iterator[IO[str]]:
    """Write a text file atomically: a temp file next to ``path``, renamed on success.

    With ``force=False`` an existing ``path`` is refused (InputError). On any
    error the temp file is removed and ``path`` is untouched.
    """
    path = Path(path)
    check_replaceable(path, kind="file", force=force, shown=str(path))
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
               mode: int | None = None, what: str = "dspark-jax") -> Iterator[Path]:
    """Yield a fresh temp dir next to ``dst``; on success it replaces ``dst`` (a rename).

    An existing ``dst`` is replaced only under the output rule (``check_replaceable``: a folder
    of ours, with ``force``); the new folder gets the marker listing its entries
    (``mark_dir(what=what)``). ``make_parents`` (default)
    creates missing parent directories, else the parent must exist; ``mode`` chmods the new
    directory. On any error the temp dir (and the parents it created) are removed and
    ``dst`` is left untouched.
    """
    dst = Path(dst).absolute()
    check_replaceable(dst, kind="dir", force=force, shown=str(dst))
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
        mark_dir(tmp, what, [p.name for p in tmp.iterdir()])
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
                 inputs=(), marker: str | tuple[str, ...] | None = None, reuse: bool = False) -> Path:
    """Validate an output path before any work starts; returns it as a Path.

    ``kind`` is "file" or "dir" (what the command writes there). Refused (InputError, one
    line naming ``flag`` and the path): an output that is, contains or lies inside one of
    ``inputs`` ({flag: path} or paths; ``check_not_input``) with or without ``force``; what the
    output rule refuses (``check_replaceable``: links, devices, FIFOs, sockets, the working
    directory, folders of other files, an existing path without ``force``); a parent that is not
    a writable directory. ``marker``: names (besides ``OUTPUT_MARKER``) that make a folder one
    of ours (train's ``run.json``); ``reuse``: a folder of ours is accepted without ``force``
    (the command resumes it or decides itself, e.g. a train run, an evaluation, a demo).
    """
    path = Path(path)
    shown = f"{flag} {str(path)!r}"
    check_not_input(path, inputs, flag=flag)
    legacy = () if marker is None else (marker,) if isinstance(marker, str) else tuple(marker)
    check_replaceable(path, kind=kind, force=force, shown=shown, legacy=legacy, reuse=reuse)
    resolved = path.absolute().resolve()
    parent = resolved if (reuse and resolved.is_dir()) else resolved.parent  # where the writes land
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
