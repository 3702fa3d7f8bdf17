"""A group of actors with no processes (``runtime.group.Group``): the supervisor's
decisions tested alone, in milliseconds, as Ray Train tests its controller against a
worker group of dummies.

Each actor is a record that does its Work at once, in the group's ``wait``: it commits
the batch's next ledger state and reports Done, as a real actor does, and beats its
heartbeat rows (a gang's every rank) while it lives. A script of fates makes it go wrong:

  ``fates[(actor_id, b)]``  what the Work for batch b does, once (a replacement that gets
                            b again does it): "die" (killed by SIGKILL), "raise" (an
                            ``Escalate``, which the actor reports before it exits 1),
                            "hang" (it stops beating and working; health must find it);
                            of a gang, "rank dies" (its rank 1 is killed: the gang must
                            end as one) or "rank hangs" (rank 1 stops beating; rank 0
                            waits for it, as in a collective)
  ``start_failures[id]``    its first n starts exit 1 with an error before Ready

With ``server=True`` the actors fork from a fork server, which ``server_fates[b]``
strikes when the Work for batch b is first handed out: "die" (killed by SIGKILL: every
actor dies with it, as by its parent-death signal) or "stop" (SIGSTOP: the actors go
on, but the next fork fails as one that timed out). ``replace_failures``: the first n
replacement servers do not start.

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
from dflash_actors.runtime.forking import ForkServerError
from dflash_actors.runtime.group import GroupContext, Woke
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
    def __init__(self, ctx: GroupContext, fates: Optional[dict] = None, start_failures: Optional[dict] = None,
                 server: bool = False, server_fates: Optional[dict] = None, replace_failures: int = 0):
        self.ctx, self.children, self.log = ctx, ctx.children, ctx.log
        self.fates = dict(fates or {})
        self.start_failures = dict(start_failures or {})
        self.server_fates = dict(server_fates or {})
        self.replace_failures = replace_failures
        self.starts = {c.actor_id: 0 for c in self.children}
        self.start_method = "forkserver" if server else "memory"
        self.server: Optional[FakeProcess] = FakeProcess() if server else None
        self.server_stopped = False
        self._lost: Optional[str] = None
        """Why the server was lost, until ``wait`` reports it."""
        self.work_seen: list[tuple[str, int]] = []
        """(actor, batch) of every Work item an actor received, in order."""

    @classmethod
    def factory(cls, **script):
        """For ``Supervisor(group=...)``."""
        return lambda ctx, forkserver: cls(ctx, **script)

    @property
    def server_pid(self) -> Optional[int]:
        return self.server.pid if self.server is not None else None

    def start(self) -> Optional[str]:
        if self.server is not None:
            self.log("forkserver", pid=self.server.pid, reason="actors fork from a server (in memory)")
        return None

    def close(self) -> None:
        pass

    # -- the fork server -------------------------------------------------------

    def _strike_server(self, fate: str) -> None:
        if fate == "stop":
            self.server_stopped = True
            return
        assert fate == "die", fate
        self.server.kill()
        for c in self.children:
            for p in self._procs(c):
                p.kill()    # the parent-death signal
        self._lost = f"the fork server (pid {self.server.pid}) killed by SIGKILL"

    def drop_server(self) -> None:
        self.server.kill()
        self._lost = None

    def replace_server(self, reason: str) -> int:
        if self.replace_failures:
            self.replace_failures -= 1
            raise RuntimeError("the new server did not start (told to)")
        self.server, self.server_stopped = FakeProcess(), False
        self.log("forkserver", pid=self.server.pid, reason=reason)
        return self.server.pid

    def use_spawn(self) -> None:
        self.server, self.start_method = None, "spawn"

    def bury(self, c: Child) -> None:
        for p in self._procs(c):
            p.kill()
        self._clear(c)

    # -- the actors ------------------------------------------------------------

    def spawn(self, c: Child, reason: str) -> None:
        if self.server is not None and (self.server_stopped or self.server.exitcode is not None):
            how = "is stopped and did not fork within" if self.server_stopped else "did not fork within"
            raise ForkServerError(f"the fork server (pid {self.server.pid}) {how} {self.ctx.cfg.fork_timeout_s:g}s")
        c.proc, c.conn = FakeProcess(), None
        c.ready, c.rank0_ready, c.hung, c.error = False, False, None, None
        self.ctx.heartbeats.reset(c.number, c.proc.pid)
        for f in c.followers:
            f.proc, f.ready, f.hung, f.error = FakeProcess(), False, None, None
            self.ctx.heartbeats.reset(f.number, f.proc.pid)
        c.spawned_at = time.monotonic()
        c.starting = StartPhase("fork", since=c.spawned_at, last=c.spawned_at)
        self.starts[c.actor_id] += 1
        ranks = {"ranks": [p.pid for p in self._procs(c)]} if c.followers else {}
        self.log("spawn", actor=c.actor_id, pid=c.proc.pid, reason=reason, **ranks)

    def send(self, c: Child, msg) -> None:
        if c.proc is not None and c.proc.exitcode is None:
            c.proc.inbox.append(msg)

    def kill(self, c: Child, rank: Optional[Rank]) -> None:
        (rank.proc if rank is not None else c.proc).kill()

    def wait(self, timeout: float, wake) -> Woke:
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
            else:
                first = next((f for f in c.followers if f.proc.exitcode is not None), None)
                if first is not None:
                    ended.append((c, first))
        if self._lost is not None:
            lost, self._lost = self._lost, None
            return Woke(woken, [], lost)
        if not (woken or ended or busy):
            time.sleep(min(timeout, 0.005))     # nothing happened: as a real wait would, not a spin
        return Woke(woken, ended, None)

    def _act(self, c: Child, p: FakeProcess) -> bool:
        """What ``c`` does between two waits; whether it did anything."""
        hb = self.ctx.heartbeats
        for q, n in [(p, c.number)] + [(f.proc, f.number) for f in c.followers]:
            if not q.silent:
                hb.set(n)
        if not c.ready:
            if self.starts[c.actor_id] <= self.start_failures.get(c.actor_id, 0):
                self._fail(c, p, ActorError(c.actor_id, "RuntimeError", "cannot attach (told to)", ""))
                return True
            c.ready, c.rank0_ready, c.starting, c.ready_at = True, True, None, time.time()
            for f in c.followers:
                f.ready = True
            self.ctx.dispatcher.on_ready(c.number)
            self.log("ready", actor=c.actor_id, pid=p.pid)
            return True
        if any(f.proc.silent for f in c.followers):
            return False    # rank 0 waits in a collective for a rank that hangs
        acted = bool(p.inbox)
        while p.inbox and p.exitcode is None and not p.silent:
            msg = p.inbox.pop(0)
            if isinstance(msg, Stop):
                p.exitcode = 0
                break
            assert isinstance(msg, Work), msg
            b = msg.batch_id
            self.work_seen.append((c.actor_id, b))
            if b in self.server_fates:
                self._strike_server(self.server_fates.pop(b))
                if p.exitcode is not None:
                    break
            fate = self.fates.pop((c.actor_id, b), None)
            if fate == "die":
                p.kill()
            elif fate == "raise":
                err = Escalate(f"batch {b} cannot be made (told to)")
                self._fail(c, p, ActorError(c.actor_id, "Escalate", str(err), "", raised=err))
            elif fate == "hang":
                p.silent = True
                p.inbox.insert(0, msg)
            elif fate == "rank dies":
                c.followers[0].proc.kill()
                p.inbox.insert(0, msg)
                break
            elif fate == "rank hangs":
                c.followers[0].proc.silent = True
                p.inbox.insert(0, msg)
                break
            else:
                assert fate is None, fate
                self.ctx.ledger.commit(b, c.stage.to_state)
                self.ctx.dispatcher.on_done(c.number, b)
        return acted

    def _fail(self, c: Child, p: FakeProcess, error: ActorError) -> None:
        c.last_error = c.error = error
        self.log("actor_error", actor=c.actor_id, reason=error.one_line())
        p.exitcode = 1

    def reap(self, c: Child, first: Optional[Rank]) -> str:
        """As the real group's: a gang's other ranks killed; the rank that ended first is
        the cause unless rank 0 was killed or hung before it."""
        cause = exit_cause(c.proc.exitcode, c.hung, c.error)
        if first is not None and not (c.proc.exitcode is not None and (c.hung or c.proc.exitcode < 0)):
            cause = f"rank {first.rank} " + exit_cause(first.proc.exitcode, first.hung, first.error)
        for q in self._procs(c):
            q.kill()
        self._clear(c)
        return cause

    def stop(self, reason: str, wake) -> None:
        for c in self.children:
            if c.proc is not None:
                self.send(c, Stop(reason))
                if c.proc.silent or any(f.proc.silent for f in c.followers):
                    c.proc.kill()
                elif c.proc.exitcode is None:
                    self._act(c, c.proc)    # it finishes the Work already queued, then stops
                    c.proc._end(0)
                self.log("exit", actor=c.actor_id, reason=f"exit code {c.proc.exitcode}")
                self._clear(c)

    @staticmethod
    def _procs(c: Child) -> list[FakeProcess]:
        return [p for p in [c.proc] + [f.proc for f in c.followers] if p is not None]

    @staticmethod
    def _clear(c: Child) -> None:
        c.proc = None
        for f in c.followers:
            f.proc = None
