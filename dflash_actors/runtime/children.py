"""The supervisor's record of each actor: its process, pipe and start-up state, and a
gang's other ranks (``Stage.gang``). One record per actor for the job's life; a restart
fills it with the new incarnation."""

from __future__ import annotations

import collections
import signal
import socket
from dataclasses import dataclass, field
from typing import Optional

import psutil

from .dispatch import Stage
from .messages import ActorError
from .policy import RestartPolicy


@dataclass
class StartPhase:
    """An actor's newest start-up phase until it is Ready (``messages.Starting``):
    what health reads to tell a slow start from a hung one, and status.json shows."""
    name: str
    since: float
    """When the phase began (monotonic)."""
    last: float
    """When any rank last showed progress in it (monotonic)."""
    done: Optional[int] = None
    total: Optional[int] = None


@dataclass
class Rank:
    """A gang's rank above 0 (``Stage.gang``): its own process, pipe and heartbeat row."""
    rank: int
    number: int
    """Its heartbeat row, after every actor's."""
    proc: Optional[object] = None
    conn: Optional[object] = None
    ready: bool = False
    hung: Optional[str] = None
    error: Optional[ActorError] = None


@dataclass
class Child:
    actor_id: str
    number: int
    stage: Stage
    index: int
    proc: Optional[object] = None
    conn: Optional[object] = None
    spawned_at: float = 0.0
    ready: bool = False
    ready_at: Optional[float] = None
    """Unix time of this incarnation's Ready: the monitor's rates count from the last actor's."""
    hung: Optional[str] = None
    restarts: int = 0
    policy: Optional[RestartPolicy] = None
    last_error: Optional[ActorError] = None
    """Kept across restarts, for the give-up line; ``error`` is this incarnation's."""
    error: Optional[ActorError] = None
    starting: Optional[StartPhase] = None
    """Until Ready: the newest start-up phase."""
    stuck: Optional[str] = None
    ps: Optional[psutil.Process] = None
    busy: collections.deque = field(default_factory=collections.deque)
    """(monotonic, busy seconds) samples of the last ``status.BUSY_WINDOW_S``."""
    followers: list = field(default_factory=list)
    """A gang's ranks 1..k-1 (``Rank``); the fields above are rank 0's, and ``ready``
    means every rank is."""
    rank0_ready: bool = False


def exit_cause(code: Optional[int], hung: Optional[str], error: Optional[ActorError]) -> str:
    """Why a process ended, in one phrase: hung, a signal, its error, or its exit code."""
    if hung:
        return hung
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    if error is not None:
        return error.one_line()
    return f"exit code {code}"


def free_port() -> int:
    """A local TCP port free now, for a gang's rendezvous (its rank 0 binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
