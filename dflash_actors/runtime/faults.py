"""Faults aimed at the supervisor's own process (``runtime.faults`` entries naming
``supervisor``), and the check of every entry against the actors a job will have.

An actor's faults fire inside the actor (``actor``); these fire in the supervisor, at
points it and its caller name (``SUPERVISOR_POINTS``, plus the training job's), and once
per run directory: the struck job is resumed on the same config, so its events.log is
what says a fault has already fired.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Callable

from .actor import Actor
from .config import ConfigError

SUPERVISOR = "supervisor"
"""The name ``runtime.faults`` gives the supervisor's own process."""

SUPERVISOR_POINTS = ("gang",)
"""Where a fault can strike the supervisor itself: ``gang``, just after it has spawned a
gang's ranks, while they form; its caller may add points of its own (the training job:
``share_weights``). Kind ``sigkill`` only; once per run directory (``strike_self``)."""


def check_faults(faults, actors: dict[str, type], supervisor_points: tuple[str, ...] = SUPERVISOR_POINTS) -> None:
    """``runtime.faults`` against the actors (id -> class) a job will have: ConfigError
    naming the entry if one names no actor, a point its actor lacks, or a kind it cannot do."""
    for i, f in enumerate(faults):
        key, cls = f"runtime.faults[{i}]", actors.get(f.actor)
        if f.actor == SUPERVISOR:
            if f.at not in supervisor_points:
                raise ConfigError(f"{key}.at: the supervisor has fault points {list(supervisor_points)} (got {f.at!r})")
            if f.kind != "sigkill":
                raise ConfigError(f"{key}.kind: the supervisor can only be struck with sigkill (got {f.kind!r})")
            continue
        if cls is None:
            raise ConfigError(f"{key}.actor: no actor {f.actor!r} (actors: {', '.join(sorted(actors))}, "
                              f"{SUPERVISOR})")
        if f.at not in cls.FAULT_POINTS:
            raise ConfigError(f"{key}.at: {f.actor} has fault points {list(cls.FAULT_POINTS)} (got {f.at!r})")
        if f.kind in ("slow", "nan") and f.at != "work":
            raise ConfigError(f"{key}.at: kind {f.kind!r} applies to a whole work item, so only at 'work' "
                              f"(got {f.at!r})")
        if f.kind == "nan" and cls.poison is Actor.poison:
            raise ConfigError(f"{key}.kind: {f.actor} has no numeric output to make non-finite")


def strike_self(faults, where: str, progress: int, run_dir: Path, log: Callable[..., None]) -> None:
    """SIGKILL this process if a ``runtime.faults`` entry aimed at the supervisor is due at
    ``where`` (``progress``: batches committed, against its ``at_batch``), logging it
    first through ``log`` (an ``EventLog.log``). Once per run directory, not per
    supervisor as an actor's fault: the struck job is resumed on the same config, and
    its events.log says what already fired."""
    due = [i for i, f in enumerate(faults) if f.actor == SUPERVISOR and f.at == where and progress >= f.at_batch]
    if not due:
        return
    fired = set()
    path = Path(run_dir) / "events.log"
    for line in path.read_text().splitlines() if path.is_file() else ():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "fault" and e.get("actor") == SUPERVISOR:
            fired.add(e.get("index"))
    for i in due:
        if i not in fired:
            log("fault", actor=SUPERVISOR, index=i, kind="sigkill", at=where, batch=progress,
                reason=f"injected by runtime.faults[{i}]")
            os.kill(os.getpid(), signal.SIGKILL)
