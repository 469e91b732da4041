"""Small file helpers shared by every command: atomic file/directory writes, line-numbered JSONL reading."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import IO, Iterator

from dspark_jax.errors import InputError


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
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yield f
        os.chmod(tmp, mode)  # mkstemp makes 0600; outputs are shareable artefacts
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(dst, *, force: bool = False, make_parents: bool = False,
               mode: int | None = None) -> Iterator[Path]:
    """Yield a fresh temp dir next to ``dst``; on success it replaces ``dst`` (a rename).

    Refuses an existing ``dst`` unless ``force`` (InputError); ``make_parents`` creates the
    parent directory, else it must exist; ``mode`` chmods the new directory. On any error
    the temp dir is removed and ``dst`` is left untouched.
    """
    dst = Path(dst).absolute()
    if (dst.exists() or dst.is_symlink()) and not force:
        raise InputError(f"{dst}: destination exists; pass --force to replace it")
    if make_parents:
        dst.parent.mkdir(parents=True, exist_ok=True)
    if not dst.parent.is_dir():
        raise InputError(f"{dst.parent}: parent directory of the destination does not exist")
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
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
        raise


def write_text(path, text: str, *, force: bool = True) -> Path:
    """``text`` to ``path``, atomically."""
    with atomic_open(path, force=force) as f:
        f.write(text)
    return Path(path)


def write_json(path, data, *, force: bool = True, indent: int | None = 2) -> Path:
    """``data`` as JSON (plus a newline), atomically."""
    with atomic_open(path, force=force) as f:
        json.dump(data, f, indent=indent)
        f.write("\n")
    return Path(path)


def iter_jsonl(path, what: str = "JSONL file") -> Iterator[tuple[str, object]]:
    """Yield ``("file:line", record)`` for each non-blank line of a JSONL file.

    A missing file or a malformed line raises InputError naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what} {str(path)!r} does not exist")
    try:
        f = path.open("r", encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot read {what} {str(path)!r}: {e.strerror}") from None
    with f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: malformed JSONL line ({e.msg} at column {e.colno})") from None
            yield where, record
