"""The actors' processes: start them, read their pipes, signal and stop them.

The supervisor decides (restart, give up, stop, kill a hung actor, replace the fork
server or give it up for spawn); this room carries it out on real processes, and is
the only one that touches them. It reports what happened (messages, ends, the fork
server's loss) and decides nothing. A gang (``Stage.gang`` k > 1) is one actor of k
processes and is handled here as one: every rank gets the same Work and Stop in the
same order, the actor is Ready once every rank is, and the end of any rank ends them
all (``reap``). So the supervisor sees actors, not ranks.

The fork server, where actors fork from one (``runtime.start_method: forkserver``),
belongs here too: the group starts it, forks from it, and reports it lost when it
ends or serves no fork in time (``wait``'s ``server_lost``, ``spawn``'s
``ForkServerError``); the supervisor then has it dropped, its actors buried
(``bury``) and a new one started (``replace_server``) or spawn used from then on
(``use_spawn``). What actors say is fed to the dispatcher (Ready, Done) and the events
log as it is read.

A group is built from a ``GroupContext``: what it needs of the job, frozen, and
nothing of the supervisor. ``Group`` is what the supervisor needs of a group;
``tests/support/memgroup.py`` is one with no processes at all, for testing the
decisions alone.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Protocol

import psutil
import torch
import torch.multiprocessing as tmp

from . import forking
from .actor import ActorContext, Heartbeats
from .boot import Deferred, boot
from .channels import Ring
from .children import Child, Rank, StartPhase, exit_cause, free_port
from .config import RuntimeConfig
from .dispatch import Dispatcher
from .ledger import Ledger
from .messages import ActorError, Done, Note, Ready, Starting, Stop
from .trace import Window
from .wakeup import Wakeup

TERM_WAIT_S = 2.0
"""After SIGTERM, before SIGKILL; and after SIGKILL, the most a process is waited for
(one that has not ended by then is stuck in the kernel: it ends with the kill pending
and runs none of its own code again, so it counts as ended)."""

Ended = tuple[Child, Optional[Rank]]
"""An actor one of whose processes ended: the actor, and the rank above 0 that ended
first (None: rank 0, or no gang)."""


@dataclass(frozen=True)
class GroupContext:
    """What a group needs of its job: the actors' records (one per actor, filled with
    each incarnation), the shared buffers every actor attaches to, and where what the
    actors say goes (the dispatcher, the events log)."""
    cfg: RuntimeConfig
    run_dir: Path
    children: list[Child]
    dispatcher: Dispatcher
    ledger: Ledger
    heartbeats: Heartbeats
    rings: dict[str, Ring]
    num_threads: int
    window: Window
    fired: torch.Tensor
    """Which injected faults have fired (shared: a replacement does not fire them again)."""
    work_times: torch.Tensor
    log: Callable[..., None]


class Woke(NamedTuple):
    """What a ``Group.wait`` saw."""
    woken: bool
    """The wakeup socket was poked (a signal, a request from another thread)."""
    ended: list[Ended]
    """Actors whose processes ended (none when the server is lost: ``bury`` them all)."""
    server_lost: Optional[str]
    """Why the fork server is lost, if it is: it ended."""


class Group(Protocol):
    """What the supervisor asks of its actors' processes."""
    children: list[Child]
    start_method: str

    @property
    def server_pid(self) -> Optional[int]: ...

    def start(self) -> Optional[str]:
        """Start the fork server, where there is one; None, or why it is lost already."""

    def spawn(self, c: Child, reason: str) -> None:
        """Start ``c`` (every rank of a gang). Raises ``forking.ForkServerError`` when
        the fork server serves no fork: it is lost."""

    def wait(self, timeout: float, wake: Wakeup) -> Woke:
        """Block until something happens or ``timeout`` passes; read every message that
        came."""

    def reap(self, c: Child, first: Optional[Rank]) -> str:
        """After ``c`` ended: every rank ended and reaped, its last messages read. Returns
        its exit cause; ``c.error`` is the error that caused it, if one did."""

    def kill(self, c: Child, rank: Optional[Rank]) -> None:
        """SIGKILL ``c``'s process (``rank``: that rank's, which ends the gang); its end
        is reported by ``wait``."""

    def bury(self, c: Child) -> None:
        """After the fork server is lost: every rank of ``c`` killed, reaped and read."""

    def drop_server(self) -> None:
        """Kill the lost fork server (a stopped or hung one too: its actors go with it)."""

    def replace_server(self, reason: str) -> int:
        """A new fork server with the first one's settings (``reason`` for the events
        log); its pid. Raises if it will not start."""

    def use_spawn(self) -> None:
        """Give the fork server up: actors start with spawn from now on."""

    def send(self, c: Child, msg) -> None: ...

    def stop(self, reason: str, wake: Wakeup) -> None:
        """Stop every live actor: ``Stop``, join until ``grace_s``, SIGTERM, SIGKILL."""

    def close(self) -> None:
        """Release what the group itself started (its fork server)."""


class ProcessGroup:
    """The real group: one OS process per actor (k per gang)."""

    def __init__(self, ctx: GroupContext, forkserver: Optional[forking.ForkServerStarter]):
        """``forkserver``: one its caller started (and stops); None: the group starts its
        own when ``runtime.start_method`` resolves to forkserver."""
        self.ctx, self.cfg, self.children, self.log = ctx, ctx.cfg, ctx.children, ctx.log
        self.start_method = forking.resolve(self.cfg.start_method)
        self._mp = tmp.get_context("spawn")     # pipes; and the processes under spawn
        self._own_server = forkserver is None
        self._server = None if self.start_method != "forkserver" else forkserver or forking.ForkServerStarter()
        if self._server is not None:
            self._server.set_timeouts(self.cfg.start_timeout_s, self.cfg.fork_timeout_s)
        self._forker_pid = os.getpid()   # the process each actor is forked from

    @property
    def server_pid(self) -> Optional[int]:
        server = self._server   # read once: another thread may be asking while it is replaced
        return server.pid if server is not None else None

    def start(self) -> Optional[str]:
        if self._server is None:
            return None
        return self._start_forkserver()

    def close(self) -> None:
        if self._server is not None and self._own_server:
            self._server.stop()

    # -- starting --------------------------------------------------------------

    def spawn(self, c: Child, reason: str) -> None:
        """Start ``c``: one process, or a gang's every rank (rank 0 first), with a new
        rendezvous: a collective group does not outlive any of its ranks."""
        s = c.stage
        rendezvous = f"tcp://127.0.0.1:{free_port()}" if s.gang > 1 else None
        c.ready, c.rank0_ready, c.hung, c.error = False, False, None, None
        for f in c.followers:
            f.ready, f.hung, f.error = False, None, None
        c.proc, c.conn = self._start(c, c.number, 0, rendezvous)
        for f in c.followers:
            f.proc, f.conn = self._start(c, f.number, f.rank, rendezvous)
        proc = c.proc
        c.spawned_at = time.monotonic()
        first = "fork" if self.start_method == "forkserver" else "start process, import"
        c.starting = StartPhase(first, since=c.spawned_at, last=c.spawned_at)
        try:
            c.ps = psutil.Process(proc.pid)
        except psutil.Error:
            c.ps = None     # gone already; its sentinel says so
        ranks = {"ranks": [proc.pid] + [f.proc.pid for f in c.followers]} if c.followers else {}
        self.log("spawn", actor=c.actor_id, pid=proc.pid, reason=reason, **ranks)

    def _start(self, c: Child, number: int, rank: int, rendezvous: Optional[str]):
        """One process of ``c`` (``rank`` of its gang, heartbeat row ``number``) and the
        supervisor's end of its pipe."""
        parent_conn, child_conn = self._mp.Pipe(duplex=True)
        s, x = c.stage, self.ctx
        ctx = ActorContext(
            actor_id=c.actor_id, number=number, index=c.index, parent_pid=os.getpid(),
            conn=child_conn, ledger=x.ledger, heartbeats=x.heartbeats,
            heartbeat_s=self.cfg.heartbeat_s, num_threads=x.num_threads, to_state=s.to_state,
            in_ring=x.rings[s.in_ring] if s.in_ring else None,
            out_ring=x.rings[s.out_ring] if s.out_ring else None, spec=s.spec,
            # Rank 0 is the actor its track and faults name; the others only follow it.
            trace_dir=str(x.run_dir) if self.cfg.trace and rank == 0 else None, trace_window=x.window,
            faults=tuple((i, f) for i, f in enumerate(self.cfg.faults) if f.actor == c.actor_id) if rank == 0 else (),
            fired=x.fired, work_times=x.work_times, stage=x.dispatcher.stages.index(s),
            rank=rank, gang=s.gang, rendezvous=rendezvous)
        Process = self._server.Process if self._server is not None else self._mp.Process
        name = c.actor_id if rank == 0 else f"{c.actor_id}.rank{rank}"
        proc = Process(target=boot, args=(self._forker_pid, Deferred((s.actor, ctx))), name=name, daemon=True)
        try:
            proc.start()
        except BaseException:
            parent_conn.close()
            raise
        finally:
            child_conn.close()
        return proc, parent_conn

    def _start_forkserver(self) -> Optional[str]:
        """Start the fork server every actor of this run is forked from, with its
        imports: torch, each stage's actor module and what the actors name in
        ``PRELOAD``; or use the one the caller started, saying what it lacks (an actor
        imports that itself, on every start). The first actors wait for the imports
        (their "fork" phase); restarts do not. Returns why the server is lost, if the
        caller's died before the job began."""
        modules = ["torch"]
        for stage in self.ctx.dispatcher.stages:
            modules += [stage.actor.__module__, *stage.actor.PRELOAD]
        modules = list(dict.fromkeys(modules))
        if self._own_server:
            self._forker_pid = self._server.start(modules, os.getpid())
            self.log("forkserver", pid=self._forker_pid, preload=modules,
                     reason="actors fork from a server that imported these once")
            return None
        self._forker_pid = self._server.pid
        if not self._server.alive():
            return (f"the fork server started at launch (pid {self._forker_pid}) "
                    f"{self._server.ended_how()} before the job began")
        self.log("forkserver", pid=self._forker_pid, preload=list(self._server.preload[1:]),
                 not_preloaded=[m for m in modules if m not in self._server.preload],
                 reason="actors fork from the server started at launch, whose imports overlapped the checks")
        return None

    # -- the fork server's loss --------------------------------------------------

    def drop_server(self) -> None:
        self._server.stop(wait_s=0.0)

    def replace_server(self, reason: str) -> int:
        self._forker_pid = self._server.restart()
        self.log("forkserver", pid=self._forker_pid, preload=list(self._server.preload[1:]), reason=reason)
        return self._forker_pid

    def use_spawn(self) -> None:
        self._server.stop(wait_s=0.0)
        self._server, self.start_method, self._forker_pid = None, "spawn", os.getpid()

    def bury(self, c: Child) -> None:
        """Every rank of ``c`` killed (the parent-death signal is on its way; this does
        not wait for it), reaped, read."""
        procs = [p for p in [c.proc] + [f.proc for f in c.followers] if p is not None]
        for p in procs:
            p.kill()
        for p in procs:
            p.join(TERM_WAIT_S)
        self._read(c)
        self._close_followers(c)
        self._close(c)

    # -- reading ---------------------------------------------------------------

    def wait(self, timeout: float, wake: Wakeup) -> Woke:
        ready = wait(self._waitables(wake), timeout)
        # Messages first: a Done or ActorError sent just before death must count.
        for c in self.children:
            if c.conn is not None and c.conn in ready:
                self._read(c)
            for f in c.followers:
                if f.conn is not None and f.conn in ready:
                    self._read_follower(c, f)
        woken = wake.reader in ready
        ended = []
        for c in self.children:
            if c.proc is None:
                continue
            if c.proc.sentinel in ready:
                ended.append((c, None))
            else:
                first = next((f for f in c.followers if f.proc is not None and f.proc.sentinel in ready), None)
                if first is not None:
                    ended.append((c, first))
        server = self._server
        # Its actors die with it (their parent-death signal), often seen before its own
        # sentinel: then they died of its loss, not each of its own.
        if server is not None and (server.sentinel in ready or (ended and not server.alive())):
            return Woke(woken, [], f"the fork server (pid {server.pid}) {server.ended_how()}")
        return Woke(woken, ended, None)

    def _waitables(self, wake: Wakeup) -> list:
        objs = [wake.reader]
        if self._server is not None and self._server.sentinel is not None:
            objs.append(self._server.sentinel)
        for c in self.children:
            if c.proc is not None:
                objs += [c.conn, c.proc.sentinel]
            for f in c.followers:
                if f.proc is not None:
                    objs += [f.conn, f.proc.sentinel]
        return objs

    @staticmethod
    def _pending(conn):
        """The messages waiting on ``conn``, until none is; none more once its process is
        gone (its sentinel says how)."""
        while True:
            try:
                if not conn.poll():
                    return
                msg = conn.recv()
            except (EOFError, OSError):
                return
            yield msg

    def _read(self, c: Child) -> None:
        for msg in self._pending(c.conn):
            if isinstance(msg, Done):
                self.ctx.dispatcher.on_done(c.number, msg.batch_id)
            elif isinstance(msg, Starting):
                now = time.monotonic()
                if c.starting is None or c.starting.name != msg.phase:
                    c.starting = StartPhase(msg.phase, since=now, last=now)
                    self.log("starting", actor=c.actor_id, phase=msg.phase)
                c.starting.done, c.starting.total, c.starting.last = msg.done, msg.total, now
            elif isinstance(msg, Ready):
                c.rank0_ready = True
                self._gang_ready(c)
            elif isinstance(msg, Note):
                self.log(msg.event, actor=c.actor_id, **msg.fields)
            elif isinstance(msg, ActorError):
                c.last_error = c.error = msg
                self.log("actor_error", actor=c.actor_id, reason=msg.one_line(), traceback=msg.traceback_text)
            else:
                raise TypeError(f"{c.actor_id} sent {msg!r}")

    def _gang_ready(self, c: Child) -> None:
        """``c`` is ready once every rank of it is: then it gets Work."""
        if c.ready or not c.rank0_ready or not all(f.ready for f in c.followers):
            return
        c.ready, c.starting, c.ready_at = True, None, time.time()
        self.ctx.dispatcher.on_ready(c.number)
        self.log("ready", actor=c.actor_id, pid=c.proc.pid, startup_s=round(time.monotonic() - c.spawned_at, 3))

    def _read_follower(self, c: Child, f: Rank) -> None:
        """A gang rank above 0 says Ready, what it starts, notes and its error; no Done."""
        for msg in self._pending(f.conn):
            if isinstance(msg, Ready):
                f.ready = True
                self._gang_ready(c)
            elif isinstance(msg, Note):
                self.log(msg.event, actor=c.actor_id, rank=f.rank, **msg.fields)
            elif isinstance(msg, ActorError):
                f.error = msg
                self.log("actor_error", actor=c.actor_id, rank=f.rank, reason=msg.one_line(),
                         traceback=msg.traceback_text)
            elif isinstance(msg, Starting):
                # Rank 0 speaks for the gang's start; a follower's counts still show
                # that the gang is not hung.
                if c.starting is not None:
                    c.starting.last = time.monotonic()
            else:
                raise TypeError(f"{c.actor_id} rank {f.rank} sent {msg!r}")

    # -- ending ----------------------------------------------------------------

    def reap(self, c: Child, first: Optional[Rank]) -> str:
        blame = self._end_gang(c, first) if c.followers else None
        self._read(c)
        c.proc.join(TERM_WAIT_S)
        cause = exit_cause(c.proc.exitcode, c.hung, c.error)
        if blame is not None:
            # Its error decides (an Escalate there stops the job), not the one rank 0
            # raised when the collective lost that rank.
            cause, error = blame
            if error is not None:
                c.last_error = c.error = error
        self._close(c)
        return cause

    def _end_gang(self, c: Child, first: Optional[Rank]) -> Optional[tuple[str, Optional[ActorError]]]:
        """After one rank of a gang ended: every other rank killed (its collectives cannot
        go on) and reaped. Returns the cause and error of ``first``, the rank above 0 that
        ended first, when it is the cause: a rank that errs because a peer vanished from
        its collective is not, when rank 0 was killed or hung before it."""
        blame = None
        if first is not None:
            self._read_follower(c, first)
            first.proc.join(TERM_WAIT_S)
            if not (c.proc.exitcode is not None and (c.hung or c.proc.exitcode < 0)):
                blame = f"rank {first.rank} " + exit_cause(first.proc.exitcode, first.hung, first.error), first.error
        for p in [c.proc] + [f.proc for f in c.followers]:
            if p is not None and p.exitcode is None:
                p.kill()
        for f in c.followers:
            if f.proc is not None:
                f.proc.join(TERM_WAIT_S)
        self._close_followers(c)
        return blame

    def _close_followers(self, c: Child) -> None:
        """Each ended rank above 0: its last messages read, its pipe and sentinel closed."""
        for f in c.followers:
            if f.proc is not None:
                self._read_follower(c, f)
                self._close(f)

    @staticmethod
    def _close(p: Child | Rank) -> None:
        """An ended process's pipe and sentinel closed: a long run restarts many times.
        (One killed but still in the kernel keeps its sentinel until it is collected.)"""
        p.conn.close()
        if p.proc.exitcode is not None:
            p.proc.close()
        p.proc, p.conn = None, None

    def kill(self, c: Child, rank: Optional[Rank]) -> None:
        # Through the process object: SIGKILL ends a stopped process too, and one that
        # has ended already is skipped (its pid may be another's by now).
        (rank.proc if rank is not None else c.proc).kill()

    def send(self, c: Child, msg) -> None:
        """To the actor; to a gang, to every rank in the same order (they run the same
        Work together)."""
        for conn in [c.conn] + [f.conn for f in c.followers]:
            try:
                if conn is not None:
                    conn.send(msg)
            except OSError:
                pass  # it died after we looked; its sentinel brings the recovery

    def stop(self, reason: str, wake: Wakeup) -> None:
        """Stop, join until grace_s, SIGTERM, SIGKILL. Done messages that arrive while
        the actors finish are still settled, so the ledger ends consistent."""
        wake.drain()   # the signal that began this stop, if any, is not a second one
        live = [c for c in self.children if c.proc is not None]
        for c in live:
            self.send(c, Stop(reason))
        live = self._join(live, time.monotonic() + self.cfg.grace_s, wake)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for c in live:
                self.log("escalate", actor=c.actor_id, reason=f"still running, sending {sig.name}")
                # Through the process object: one that has ended meanwhile is skipped, not
                # an error (its pid may already be reaped, or another's).
                (c.proc.terminate if sig == signal.SIGTERM else c.proc.kill)()
            live = self._join(live, time.monotonic() + TERM_WAIT_S, wake)
        self._stop_followers(time.monotonic() + TERM_WAIT_S)
        for c in self.children:
            if c.proc is not None:
                c.proc.join(TERM_WAIT_S)
                self._read_settling(c)   # what it sent between our last read and its exit
                self.log("exit", actor=c.actor_id, reason=f"exit code {c.proc.exitcode}")
                self._close(c)

    def _stop_followers(self, until: float) -> None:
        """Gang ranks above 0, once rank 0 has stopped: they had the same Stop after the
        same Work, so they end by themselves; one still running (in a collective rank 0
        left) is killed at ``until``."""
        for c in self.children:
            for f in c.followers:
                if f.proc is None:
                    continue
                f.proc.join(max(0.0, until - time.monotonic()))
                if f.proc.exitcode is None:
                    self.log("escalate", actor=c.actor_id, rank=f.rank, reason="still running, sending SIGKILL")
                    f.proc.kill()
                    f.proc.join(TERM_WAIT_S)
                self._close(f)

    def _join(self, live: list[Child], until: float, wake: Wakeup) -> list[Child]:
        """Wait for ``live`` to exit until ``until``; a new SIGINT/SIGTERM cuts it short
        (a second Ctrl-C means: do not wait for the grace period)."""
        while live:
            left = until - time.monotonic()
            if left <= 0:
                break
            ready = wait([wake.reader] + [c.conn for c in live] + [c.proc.sentinel for c in live], left)
            if wake.reader in ready:
                wake.drain()
                self.log("hurry", reason="signal received while stopping; skipping the rest of the wait")
                break
            for c in live:
                if c.conn in ready:
                    self._read_settling(c)
            live = [c for c in live if c.proc.exitcode is None]
        return live

    def _read_settling(self, c: Child) -> None:
        try:
            self._read(c)
        except Exception as e:   # noqa: BLE001 - shutting down; record it and carry on
            self.log("error", actor=c.actor_id, reason=f"while stopping: {type(e).__name__}: {e}")


GroupFactory = Callable[[GroupContext, Optional[forking.ForkServerStarter]], Group]
"""Called with the group's context and the supervisor's ``forkserver`` argument:
``ProcessGroup``, or a test's group with no processes."""
