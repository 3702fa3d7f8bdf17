"""A group of actors with no processes (``runtime.group.Group``): the supervisor's
decisions tested alone, in milliseconds, as Ray Train tests its controller against a
worker group of dummies.

Each actor is a record that does its Work at once, in the group's ``wait``: it commits
the batch's next ledger state and reports Done, as a real actor does, and beats its
heartbeat row while it lives. A script of fates makes it go wrong:

  ``fates[(actor_id, b)]``  what the Work for batch b does, once (a replacement that gets
                            b again does it): "die" (killed by SIGKILL), "raise" (an
                            ``Escalate``, which the actor reports before it exits 1) or
                            "hang" (it stops beating and working; health must kill it)
  ``start_failures[id]``    its first n starts exit 1 with an error before Ready

Everything else is the supervisor's own: its dispatcher, ledger, health, restart
policies, events.log and status.json.
"""

from __future__ import annotations

import itertools
import signal
import time
from multiprocessing.connection import wait
from typing import Optional

from dflash_actors.runtime.actor import Escalate
from dflash_actors.runtime.children import Child, Rank, StartPhase, exit_cause
from dflash_actors.runtime.messages import ActorError, Stop, Work


class FakeProcess:
    """What the supervisor and health touch of a process: pid, exit code, kill."""
    _pids = itertools.count(1 << 30)    # above any real pid: nothing can signal it by mistake

    def __init__(self):
        self.pid = next(self._pids)
        self.exitcode: Optional[int] = None
        self.inbox: list = []
        self.silent = False

    def kill(self) -> None:
        self._end(-signal.SIGKILL)

    def terminate(self) -> None:
        self._end(-signal.SIGTERM)

    def _end(self, code: int) -> None:
        if self.exitcode is None:
            self.exitcode = code

    def join(self, timeout: Optional[float] = None) -> None:
        pass


class MemoryGroup:
    def __init__(self, sup, fates: Optional[dict] = None, start_failures: Optional[dict] = None):
        self.sup, self.children, self.log = sup, sup.children, sup.log
        self.fates = dict(fates or {})
        self.start_failures = dict(start_failures or {})
        self.starts = {c.actor_id: 0 for c in self.children}
        self.start_method, self.restarts, self.server_pid = "memory", 0, None
        self.work_seen: list[tuple[str, int]] = []
        """(actor, batch) of every Work item an actor received, in order."""

    @classmethod
    def factory(cls, **script):
        """For ``Supervisor(group=...)``."""
        return lambda sup, forkserver: cls(sup, **script)

    def start(self) -> None:
        for c in self.children:
            self.spawn(c, "initial start")

    def close(self) -> None:
        pass

    def spawn(self, c: Child, reason: str) -> None:
        c.proc, c.conn = FakeProcess(), None
        c.ready, c.hung, c.error = False, None, None
        c.spawned_at = time.monotonic()
        c.starting = StartPhase("fork", since=c.spawned_at, last=c.spawned_at)
        self.starts[c.actor_id] += 1
        self.sup.heartbeats.reset(c.number, c.proc.pid)
        self.log("spawn", actor=c.actor_id, pid=c.proc.pid, reason=reason)

    def send(self, c: Child, msg) -> None:
        if c.proc is not None and c.proc.exitcode is None:
            c.proc.inbox.append(msg)

    def wait(self, timeout: float, wake) -> tuple[bool, list[tuple[Child, Optional[Rank]]]]:
        woken = bool(wait([wake.reader], 0))
        ended, busy = [], False
        for c in self.children:
            p = c.proc
            if p is None:
                continue
            if p.exitcode is None and not p.silent:
                busy |= self._act(c, p)
            if p.exitcode is not None:
                ended.append((c, None))
        if not (woken or ended or busy):
            time.sleep(min(timeout, 0.005))     # nothing happened: as a real wait would, not a spin
        return woken, ended

    def _act(self, c: Child, p: FakeProcess) -> bool:
        """What ``c`` does between two waits; whether it did anything."""
        self.sup.heartbeats.set(c.number)
        if not c.ready:
            if self.starts[c.actor_id] <= self.start_failures.get(c.actor_id, 0):
                self._fail(c, p, ActorError(c.actor_id, "RuntimeError", "cannot attach (told to)", ""))
                return True
            c.ready, c.starting, c.ready_at = True, None, time.time()
            self.sup.dispatcher.on_ready(c.number)
            self.log("ready", actor=c.actor_id, pid=p.pid)
            return True
        acted = bool(p.inbox)
        while p.inbox and p.exitcode is None and not p.silent:
            msg = p.inbox.pop(0)
            if isinstance(msg, Stop):
                p.exitcode = 0
                break
            assert isinstance(msg, Work), msg
            b = msg.batch_id
            self.work_seen.append((c.actor_id, b))
            fate = self.fates.pop((c.actor_id, b), None)
            if fate == "die":
                p.kill()
            elif fate == "raise":
                err = Escalate(f"batch {b} cannot be made (told to)")
                self._fail(c, p, ActorError(c.actor_id, "Escalate", str(err), "", raised=err))
            elif fate == "hang":
                p.silent = True
                p.inbox.insert(0, msg)
            else:
                assert fate is None, fate
                self.sup.ledger.commit(b, c.stage.to_state)
                self.sup.dispatcher.on_done(c.number, b)
        return acted

    def _fail(self, c: Child, p: FakeProcess, error: ActorError) -> None:
        c.last_error = c.error = error
        self.log("actor_error", actor=c.actor_id, reason=error.one_line())
        p.exitcode = 1

    def reap(self, c: Child, first: Optional[Rank]) -> str:
        cause = exit_cause(c.proc.exitcode, c.hung, c.error)
        c.proc = None
        return cause

    def stop(self, reason: str, wake) -> None:
        for c in self.children:
            if c.proc is not None:
                self.send(c, Stop(reason))
                if c.proc.silent:
                    c.proc.kill()
                elif c.proc.exitcode is None:
                    self._act(c, c.proc)    # it finishes the Work already queued, then stops
                    c.proc._end(0)
                self.log("exit", actor=c.actor_id, reason=f"exit code {c.proc.exitcode}")
                c.proc = None
