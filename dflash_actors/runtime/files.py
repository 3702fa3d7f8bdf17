"""Files and directories that no reader sees half-written.

``write_atomically(path, write)`` is the one way this project replaces a file or a
directory that another process may read meanwhile (status.json, the trace, datasets,
the tiny target, checkpoints): ``write(tmp)`` fills a temporary sibling, which one
``os.replace`` then puts in place. A reader sees the old version or the new one,
never a mix; a writer killed halfway leaves only its temporary, named after its pid.

``cannot_write`` is the line a job stops with when one of the files it keeps writing
while it runs (events.log, status.json, metrics.jsonl) fails: the run's state is fine,
only its record is not, so it ends with a checkpoint and can be resumed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Optional


def write_atomically(path: str | Path, write: Callable[[Path], object], *, tmp: Optional[Path] = None,
                     durable: bool = False, keep_existing: bool = False) -> Path:
    """Put what ``write(tmp)`` makes at ``path``; returns ``path``.

    ``tmp``: the temporary's name (default ``<name>.tmp<pid>`` beside ``path``).
    ``durable``: fsync every file written and both directories, so that the new
    version also survives a power cut (checkpoints). ``keep_existing``: a directory
    several processes may build at once from the same inputs (a cache): the first one
    in place stays and a later builder discards its own; otherwise an existing
    directory is replaced. A ``write`` that raises removes the temporary and re-raises.
    """
    path = Path(path)
    tmp = tmp or path.with_name(f"{path.name}.tmp{os.getpid()}")
    _remove(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        write(tmp)
        if durable:
            fsync_tree(tmp)
    except BaseException:
        _remove(tmp)
        raise
    if tmp.is_dir() and path.is_dir() and not keep_existing:
        shutil.rmtree(path)     # os.replace cannot put a directory over a non-empty one
    try:
        os.replace(tmp, path)
    except OSError:
        if not (keep_existing and path.is_dir()):
            raise
        _remove(tmp)            # another builder was first
    if durable:
        fsync_dir(path.parent)
    return path


def cannot_write(path: str | Path, err: OSError) -> str:
    """``cannot write <path>: <why>; ...``: the reason a job stops with."""
    return f"cannot write {path}: {err.strerror or err}; resume with --resume once it is writable"


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root`` (or ``root`` itself, a file) and every directory."""
    if root.is_file():
        with open(root, "rb") as f:
            os.fsync(f.fileno())
        return
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(dirpath)


def fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists() or p.is_symlink():
        p.unlink(missing_ok=True)
