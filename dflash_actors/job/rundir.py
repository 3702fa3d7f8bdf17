"""The run directory: checked before anything is written, held by one job at a time.

``check`` refuses a run directory that is a file or that cannot be written (a read-only
mount, no write permission) before the minutes of loading that the first write would
otherwise follow; so is one holding, where the job keeps a file it writes while it
runs (``RUN_FILES``), something it cannot write: a directory, a dangling symlink into
a missing directory, a file that cannot be opened for append (found without writing).
``resume_config`` says which config a ``--resume`` builds on.

``RunDirLock`` is an exclusive ``flock`` on ``<run_dir>/.lock``, taken by the job's
parent once its input is checked and held for the job's life: two jobs in one directory
would write the same checkpoints, status and logs. The lock belongs to the open file,
so the kernel drops it when the holder dies, kill -9 included: no stale lock, nothing
to clean up. The file holds the holder's pid, for the message of the job refused.
Actors never hold it: the spawn start method closes every descriptor it does not pass
(and Python opens files non-inheritable), so a lock outliving its job is impossible.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = ".lock"
SAVED_CONFIG = "config.yaml"
RUN_FILES = {"events.log": "append", "metrics.jsonl": "append", "status.json": "rename"}
"""The files written while the job runs, by how: appended to (``events.EventLog``, the
monitor, the evaluator), or replaced by a rename (``files.write_atomically``), which
only a directory at the path stops. One that fails mid-run stops the job."""


class RunDirError(ValueError):
    """A run directory this job cannot use; the message says why."""


def check(run_dir: str | Path) -> None:
    """Raise RunDirError unless ``run_dir`` is, or can be created as, a writable directory
    whose ``RUN_FILES`` can be written."""
    p = Path(run_dir)
    if p.exists() and not p.is_dir():
        raise RunDirError(f"runtime.run_dir: {p} is a file, not a directory")
    home = p
    while not home.exists():        # where it will be created
        home = home.parent
    if not home.is_dir():
        raise RunDirError(f"runtime.run_dir: {home} is a file, not a directory")
    if not os.access(home, os.W_OK | os.X_OK):
        inside = "" if home == p else f" (to create {p} in)"
        raise RunDirError(f"runtime.run_dir: {home} is not writable{inside}")
    for name, how in RUN_FILES.items():
        why = _unwritable(p / name, how)
        if why:
            raise RunDirError(f"runtime.run_dir: cannot write {p / name} ({why}); "
                              "move it away, or choose another --run-dir")


def _unwritable(f: Path, how: str) -> str | None:
    """Why the job could not write ``f`` ``how`` (``RUN_FILES``), or None if it can."""
    if how == "rename":     # replaces a file or a symlink, whatever it points to
        return "a directory" if f.is_dir() and not f.is_symlink() else None
    if f.is_dir():
        return "a directory"
    if f.exists():
        try:    # opens without writing; non-blocking, so that a FIFO refuses rather than hangs
            os.close(os.open(f, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC))
        except OSError as e:
            return e.strerror
    elif f.is_symlink():    # dangling: the first append creates its target
        home = Path(os.path.realpath(f)).parent
        if not home.is_dir():
            return f"a symlink to {os.readlink(f)}, in a directory that does not exist"
        if not os.access(home, os.W_OK | os.X_OK):
            return f"a symlink to {os.readlink(f)}, in a directory that is not writable"
    return None


def resume_config(run_dir: str | Path, given: str | None) -> str | None:
    """The config file a ``--resume`` of ``run_dir`` builds on: ``given`` (an explicit
    ``--config``), else the run's own ``config.yaml``, so that the original ``--config``,
    ``--topology`` and ``--set`` need not be repeated (those given now apply on top).
    None when the run has no config.yaml (written before it was kept): the default."""
    p = Path(run_dir)
    saved = p / SAVED_CONFIG
    if not p.exists():
        raise RunDirError(f"--resume: {p} does not exist")
    if not p.is_dir():
        raise RunDirError(f"--resume: {p} is a file, not a run directory")
    # Imported here: it brings torch, which launch.py loads only after the fork server
    # has started (job.forkserver).
    from ..train.checkpoint import list_checkpoints
    if not saved.is_file() and not list_checkpoints(p):
        raise RunDirError(f"--resume: {p} is not a run directory (no config.yaml, no complete checkpoint)")
    if given is not None:
        return given
    return str(saved) if saved.is_file() else None


class RunDirLock:
    """Exclusive hold on a run directory; ``acquire`` creates the directory if needed."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise RunDirError(f"runtime.run_dir: cannot create {self.path} ({e.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirError(f"runtime.run_dir: {self.path.parent} is in use by another job (pid {holder}); "
                              "wait for it to end or stop it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        """Unlock; the file stays (removing it would let a newcomer lock a file that a
        third job already opened, and both would hold "the" lock)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
