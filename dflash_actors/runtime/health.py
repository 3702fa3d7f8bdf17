"""Is each actor alive? Hang and stuck detection from heartbeats and start-up progress.

Hung (to be killed): a ready actor, or any rank of a ready gang, whose heartbeat is
older than ``hang_timeout_s``; an actor not yet ready that has shown no start-up
progress (a new phase, or a count in one) for ``start_timeout_s``, counted from its
spawn: the moments between the fork and its first word are covered too. Stuck (only
shown, in status.json and one events.log line when it begins and ends): a heartbeat
older than ``stuck_s``, or a start-up phase silent for ``hang_timeout_s``.

This room reports and touches nothing: ``hung`` returns who should be killed and why;
the supervisor marks them, logs the decision and has its group kill them, and the
process's end brings the restart decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .actor import Heartbeats
from .children import Child, Rank
from .config import RuntimeConfig


@dataclass(frozen=True)
class Hung:
    """A process to kill: ``child``'s, or its gang's ``rank`` above 0 (which takes the
    gang down)."""
    child: Child
    rank: Optional[Rank]
    reason: str


def progressed_at(c: Child) -> float:
    """When ``c``, not yet ready, last showed start-up progress (any rank's)."""
    return c.starting.last if c.starting is not None else c.spawned_at


class Health:
    def __init__(self, cfg: RuntimeConfig, heartbeats: Heartbeats, log: Callable[..., None]):
        self.cfg, self.heartbeats, self.log = cfg, heartbeats, log

    def hung(self, children: list[Child], now: float) -> list[Hung]:
        """Every live process that is hung and not already being killed."""
        out = []
        for c in children:
            if c.proc is None or c.hung:
                continue
            reason = self.hang_reason(c, now)
            if reason:
                out.append(Hung(c, None, reason))
                continue
            for f in c.followers if c.ready else ():
                age = now - self.heartbeats.row(f.number)["beat"]
                if f.proc is not None and not f.hung and age > self.cfg.hang_timeout_s:
                    out.append(Hung(c, f, f"rank {f.rank}: no heartbeat for {age:.1f}s "
                                          f"(hang_timeout_s={self.cfg.hang_timeout_s:g})"))
        return out

    def hang_reason(self, c: Child, now: float) -> Optional[str]:
        if not c.ready:
            idle = now - progressed_at(c)
            if idle > self.cfg.start_timeout_s:
                phase = f" in {c.starting.name!r}" if c.starting else ""
                return (f"not ready: no start-up progress{phase} for {idle:.1f}s, {now - c.spawned_at:.1f}s after "
                        f"spawn (start_timeout_s={self.cfg.start_timeout_s:g})")
            return None
        age = now - self.heartbeats.row(c.number)["beat"]
        if age > self.cfg.hang_timeout_s:
            return f"no heartbeat for {age:.1f}s (hang_timeout_s={self.cfg.hang_timeout_s:g})"
        return None

    def next_deadline(self, children: list[Child]) -> float:
        """The soonest moment a live process could turn out hung (monotonic)."""
        deadlines = []
        for c in children:
            if c.proc is None or c.hung:
                continue
            if c.ready:
                for n in [c.number] + [f.number for f in c.followers if f.proc is not None and not f.hung]:
                    deadlines.append(self.heartbeats.row(n)["beat"] + self.cfg.hang_timeout_s)
            else:
                deadlines.append(progressed_at(c) + self.cfg.start_timeout_s)
        # A beat may have moved on since we read it; the check itself rereads.
        return min(deadlines, default=float("inf")) + 0.01

    def check_stuck(self, children: list[Child], now: float) -> None:
        """Name the live actors that look stuck (``Child.stuck``, logged when that begins
        and ends). Stuck is not hung: nothing is killed for it."""
        for c in children:
            reason = None
            if c.proc is not None and not c.hung:
                if c.ready:
                    age = now - self.heartbeats.row(c.number)["beat"]
                    if age > self.cfg.stuck_s:
                        reason = f"no heartbeat for {age:.1f} s"
                elif c.starting is not None and now - c.starting.last > self.cfg.hang_timeout_s:
                    reason = f"no progress in {c.starting.name!r} for {now - c.starting.last:.0f} s"
            if reason and not c.stuck:
                self.log("stuck", actor=c.actor_id, reason=reason)
            elif c.stuck and not reason:
                self.log("unstuck", actor=c.actor_id, reason="alive again" if c.proc is not None else "gone")
            c.stuck = reason
