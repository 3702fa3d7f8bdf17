"""The supervisor: owns every shared buffer, spawns the actors, watches, restarts.

State machine of the job::

    RUNNING --all batches committed----> STOPPING("finished") --> DONE
    RUNNING --SIGINT/SIGTERM-----------> STOPPING(signal)      --> STOPPED
    RUNNING --restart intensity--------> STOPPING(error)       --> FAILED
    RUNNING --an actor raised Escalate-> STOPPING(error)       --> FAILED, result.raised
            or a ProtocolError

STOPPING: no new Work; ``Stop`` to every actor, which finishes the Work already queued;
join until ``grace_s``; SIGTERM; SIGKILL.

When an actor dies, the dispatcher first recovers its in-flight batches from the
ledger; then its ``policy.RestartPolicy`` decides: RESTART it alone, GIVE_UP (a crash
loop: the job fails with one line naming the actor, its exit cause and its last
traceback), or RAISE (an ``actor.Escalate`` error, or a ``ProtocolError``, a bug: the
job stops and the caller gets the exception; the training job rolls back after the
former and fails after the latter). An actor counts as dead when its process
exits (sentinel), and as hung, then killed, when its heartbeat is older than
``hang_timeout_s`` (before Ready: when no rank has shown start-up progress, a new phase
or a count in one, for ``start_timeout_s``: a big shard on slow storage is slow, not hung,
as long as its load keeps counting).

A gang (``Stage.gang`` k > 1: a tensor-parallel target) is one actor of k processes:
each rank has its own pipe, sentinel and heartbeat row, every rank gets the same Work
and Stop in the same order, rank 0 alone sends Done, and the actor is Ready once every
rank is. The death or hang of any rank kills the others and restarts all k, as one
restart of the actor; each start gets a new rendezvous for the gang's process group.

Actors forked from the fork server (``runtime.start_method: forkserver``) die with it.
When it dies, or fails to fork within ``runtime.fork_timeout_s`` (stopped, hung), every
actor's batches are recovered and all of them restart from a new server with the first
one's settings: one restart event, counted as ``forkserver`` in ``JobResult.restarts``
and charged to the server's own restart intensity, not to the actors'; past it, the
job goes on with spawn (``_server_lost``).

The loop blocks in ``multiprocessing.connection.wait`` on process sentinels, actor pipes
and a signal wakeup socket, with a timeout equal to the next deadline (status write or
hang check). Every decision goes to ``<run_dir>/events.log`` (``events.EventLog``);
``<run_dir>/status.json`` is rewritten atomically about once a second. With
``runtime.trace`` the supervisor traces its own message handling and dispatch, and
merges every actor's spans into ``<run_dir>/trace.json`` when the run ends (``trace``). The supervisor
must run in the main thread: signal handlers live there, and the children's
parent-death signal fires when the spawning thread exits.

Use::

    stages = [Stage("load", Loader, 0, 1, out_ring="batch", spec=LoaderSpec(...)),
              Stage("work", Worker, 1, 2, count=4, in_ring="batch", route=lambda b: b % 4)]
    sup = Supervisor(runtime, stages, [RingSpec("batch", 4, fields)], n_batches, meta_cols=2)
    result = sup.run()           # returns when every batch is committed, or on a stop
    sys.exit(result.exit_code)   # 0 done, 130 stopped by a signal, 1 failed (result.reason)

The training job's wiring (``dflash_actors.job.wiring``) is the real example.
"""

from __future__ import annotations

import collections
import enum
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable, Optional

import psutil
import torch
import torch.multiprocessing as tmp

from . import forking
from .actor import Actor, ActorContext, Heartbeats, gpu_memory
from .boot import Deferred, boot
from .channels import Ring, RingSpec
from .config import ConfigError, RuntimeConfig
from .dispatch import Dispatcher, Stage
from .events import EventLog
from .files import cannot_write, write_atomically
from .ledger import Ledger
from .messages import ActorError, Done, Note, Ready, Starting, Stop
from .policy import Decision, RestartPolicy
from .trace import SUPERVISOR_TRACK, Tracer, Window, clear, merge, part_path

STATUS_FILE = "status.json"
"""In the run directory: the runtime's block is ``status()``; a caller's ``on_status``
adds its own (the training job's schema: ``dflash_actors/observe/status.py``)."""
STATUS_PERIOD_S = 1.0
TERM_WAIT_S = 2.0       # after SIGTERM, before SIGKILL
BUSY_WINDOW_S = 30.0    # status.json's busy_pct_30s


FIRST_FORK_FLOOR_S = 30.0
"""The least a new fork server is given for its first fork (its imports come first)."""


class JobState(enum.Enum):
    RUNNING = "running"
    STOPPING = "stopping"
    DONE = "done"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass
class JobResult:
    state: JobState
    reason: str
    """``finished``, the signal name, or the one-line error."""
    traceback: Optional[str] = None
    committed: list[int] = field(default_factory=list)
    """Batch ids in the order the last stage committed them."""
    restarts: dict[str, int] = field(default_factory=dict)
    raised: Optional[BaseException] = None
    """The ``Escalate`` or ``ProtocolError`` that stopped the job (decision RAISE), for the caller."""

    @property
    def exit_code(self) -> int:
        return {JobState.DONE: 0, JobState.STOPPED: 130}.get(self.state, 1)


@dataclass
class _Rank:
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
class _Child:
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
    starting: Optional[dict] = None
    """Until Ready: the newest startup phase (``Starting``), with when it began and
    when it last said something (monotonic)."""
    stuck: Optional[str] = None
    ps: Optional[psutil.Process] = None
    busy: collections.deque = field(default_factory=collections.deque)
    """(monotonic, busy seconds) samples of the last ``BUSY_WINDOW_S``."""
    followers: list = field(default_factory=list)
    """A gang's ranks 1..k-1 (``_Rank``); the fields above are rank 0's, and ``ready``
    means every rank is."""
    rank0_ready: bool = False


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


class Supervisor:
    def __init__(self, runtime: RuntimeConfig, stages: list[Stage], rings: list[RingSpec | Ring],
                 n_batches: int, *, meta_cols: int = 0, first_batch: int = 0, num_threads: int = 1,
                 on_status: Optional[Callable[[dict], None]] = None,
                 forkserver: Optional[forking.ForkServerStarter] = None,
                 supervisor_points: tuple[str, ...] = SUPERVISOR_POINTS):
        """Allocates every shared buffer (rings, ledger, heartbeats); spawns nothing yet.
        ``rings``: specs, allocated here, or rings the caller allocated and hands to
        several runs (the training job's attempts: a rollback keeps its CUDA ring).
        Batch ids are ``0 .. n_batches-1``; those below ``first_batch`` count as committed
        (a resumed run). ``meta_cols``: ints per ledger row for the first stage to fill.
        ``on_status(status)`` runs before each status.json write and may add keys (the
        training job adds its step and loss, and moves its progress bar). ``forkserver``:
        a server its caller started (and stops) to fork this job's actors from, when
        ``runtime.start_method`` is forkserver; None: the supervisor starts its own.
        ``supervisor_points``: the fault points of ``runtime.faults`` entries aimed at
        the supervisor, its own and its caller's (``SUPERVISOR_POINTS``)."""
        self.cfg = runtime
        self.run_dir = Path(runtime.run_dir)
        self.rings = {r.spec.name: r for r in (x if isinstance(x, Ring) else Ring.allocate(x) for x in rings)}
        self.ledger = Ledger.allocate(n_batches, meta_cols, initial=stages[0].from_state,
                                      done=stages[-1].to_state, done_below=first_batch)
        self.num_threads = num_threads
        self.on_status = on_status
        self.children: list[_Child] = []
        for stage in stages:
            for k in range(stage.count):
                self.children.append(_Child(f"{stage.role}.{k}", len(self.children), stage, k,
                                            policy=RestartPolicy(runtime.max_restarts, runtime.restart_window_s)))
        rows = len(self.children)
        for c in self.children:
            c.followers = [_Rank(r, rows + r - 1) for r in range(1, c.stage.gang)]
            rows += c.stage.gang - 1
        self.heartbeats = Heartbeats.allocate(rows)
        self.work_times = torch.zeros(n_batches, len(stages), dtype=torch.float64).share_memory_()
        """Seconds each stage's ``work`` took on each batch (written by the actor that
        committed it): what the training job's per-step accounting reads."""
        check_faults(runtime.faults, {c.actor_id: c.stage.actor for c in self.children}, supervisor_points)
        # Which injected faults have fired: shared, so that a replacement does not fire again.
        self.fired = torch.zeros(max(1, len(runtime.faults)), dtype=torch.int8).share_memory_()
        self.dispatcher = Dispatcher(stages, [r.spec for r in self.rings.values()], self.ledger,
                                     {c.number: (stages.index(c.stage), c.index) for c in self.children})
        self.state = JobState.RUNNING
        self.reason: Optional[str] = None     # why it stops, once it does
        self.start_method = forking.resolve(runtime.start_method)
        self._mp = tmp.get_context("spawn")     # pipes; and the processes under spawn
        self._own_server = forkserver is None
        self._server = None if self.start_method != "forkserver" else forkserver or forking.ForkServerStarter()
        if self._server is not None:
            # A new server imports torch and the preloads before its first fork: seconds,
            # more on a loaded machine, and none of it the actor's start-up, so a short
            # start_timeout_s must not call it hung.
            self._server.first_fork_timeout_s = max(runtime.start_timeout_s, FIRST_FORK_FLOOR_S)
            self._server.fork_timeout_s = runtime.fork_timeout_s
        self._server_policy = RestartPolicy(runtime.max_restarts, runtime.restart_window_s)
        self.forkserver_restarts = 0
        """Times the fork server was lost and replaced (or given up for spawn)."""
        self._forker_pid = os.getpid()   # the process each actor is forked from
        self._stop_signal: Optional[str] = None
        self._failure: Optional[str] = None
        self._events: Optional[EventLog] = None
        self._window = Window(first_batch, n_batches, runtime.trace_batches)
        self.tracer = Tracer(None, SUPERVISOR_TRACK)
        self._ps = psutil.Process()

    # -- public ----------------------------------------------------------------

    def run(self) -> JobResult:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._events = EventLog(self.run_dir / "events.log", on_error=self.request_failure)
        if self.cfg.trace:
            clear(self.run_dir)
            self.tracer = Tracer(part_path(self.run_dir, "supervisor"), SUPERVISOR_TRACK, self._window)
        restore = self._install_signals()
        result = None
        try:
            self._log("start", reason="job begins", actors=[c.actor_id for c in self.children],
                      batches=len(self.ledger), committed_before=len(self.ledger) - self.dispatcher.remaining())
            if self._server is not None:
                self._start_forkserver()
            for c in self.children:
                if c.proc is None:      # a fork server lost on the way has started the rest
                    self._spawn(c, "initial start")
            result = self._loop()
        except BaseException as e:
            self._log("abort", reason=f"supervisor error: {type(e).__name__}: {e}")
            raise
        finally:
            self._stop_children(result.reason if result else "supervisor error")
            if self._server is not None and self._own_server:
                self._server.stop()
            restore()
            if result is not None:
                # After the stop: Done messages read while the actors finished count too.
                result.committed = list(self.dispatcher.committed)
                result.restarts = {c.actor_id: c.restarts for c in self.children}
                if self.forkserver_restarts:
                    result.restarts["forkserver"] = self.forkserver_restarts
                self.state = result.state
                self._log("end", state=result.state.value, reason=result.reason, restarts=result.restarts)
            self._write_status()
            self._events.close()
            if self.tracer.enabled:
                self.tracer.close()
                merge(self.run_dir, {SUPERVISOR_TRACK: "supervisor",
                                     **{c.number + 1: c.actor_id for c in self.children}})
        return result

    def request_stop(self, reason: str) -> None:
        """What SIGINT/SIGTERM do; callable from a signal handler or the main thread."""
        self._stop_signal = reason

    def request_failure(self, reason: str) -> None:
        """Stop the job as failed (exit 1), from any thread: what a lost node does."""
        self._failure = self._failure or reason
        try:
            self._wake_w.send(b"!")
        except (AttributeError, OSError):   # not running yet, or already finished
            pass

    # -- the loop --------------------------------------------------------------

    def _loop(self) -> JobResult:
        next_status = 0.0
        while True:
            now = time.monotonic()
            if self._failure and self.state is JobState.RUNNING:
                return self._stopping(JobResult(JobState.FAILED, self._failure))
            if self._stop_signal and self.state is JobState.RUNNING:
                return self._stopping(JobResult(JobState.STOPPED, self._stop_signal))
            if self.dispatcher.finished():
                return self._stopping(JobResult(JobState.DONE, "finished"))
            if now >= next_status:
                self._write_status()
                next_status = now + STATUS_PERIOD_S
            self._check_hangs(now)
            failure = None
            timeout = max(0.0, min(next_status, self._next_hang_deadline()) - time.monotonic())
            ready = wait(self._waitables(), timeout)
            t_woke = time.monotonic()
            if self._wake_r in ready:
                self._drain_wakeup()
            # Messages first: a Done or ActorError sent just before death must count.
            for c in self.children:
                if c.conn is not None and c.conn in ready:
                    self._read(c)
                for f in c.followers:
                    if f.conn is not None and f.conn in ready:
                        self._read_follower(c, f)
            if self._server is not None and self._server.sentinel in ready:
                self._server_lost(f"the fork server (pid {self._server.pid}) {self._server.ended_how()}")
                continue
            for c in self.children:
                if c.proc is None:
                    continue
                if c.proc.sentinel in ready:
                    failure = failure or self._on_exit(c)
                else:
                    first = next((f for f in c.followers if f.proc is not None and f.proc.sentinel in ready), None)
                    if first is not None:
                        failure = failure or self._on_exit(c, first)
            if failure:
                return self._stopping(failure)
            t0 = time.monotonic()
            evicted = len(self.dispatcher.evicted)
            sent = self.dispatcher.dispatch()
            if len(self.dispatcher.evicted) > evicted:
                self._log("evicted", batches=self.dispatcher.evicted[evicted:],
                          reason="their slots went to lower batches being redone")
            for n, w in sent:
                self._send(self.children[n], w)
            if sent and self.tracer.enabled:
                self.tracer.record("read messages", t_woke, t0, sent[0][1].batch_id)
                self.tracer.record("dispatch", t0, time.monotonic(), sent[0][1].batch_id,
                                   sent=[f"{w.batch_id}->{self.children[n].actor_id}" for n, w in sent])

    def _stopping(self, result: JobResult) -> JobResult:
        self.state, self.reason = JobState.STOPPING, result.reason
        self._log("stopping", reason=result.reason)
        return result

    # -- children --------------------------------------------------------------

    def _spawn(self, c: _Child, reason: str) -> None:
        """Start ``c``: one process, or a gang's every rank (rank 0 first), with a new
        rendezvous: a collective group does not outlive any of its ranks. A fork server
        that fails to fork takes every actor with it (``_server_lost``), ``c`` included."""
        try:
            self._spawn_now(c, reason)
        except forking.ForkServerError as e:
            self._server_lost(str(e))

    def _spawn_now(self, c: _Child, reason: str) -> None:
        s = c.stage
        rendezvous = f"tcp://127.0.0.1:{_free_port()}" if s.gang > 1 else None
        c.ready, c.rank0_ready, c.hung, c.error = False, False, None, None
        for f in c.followers:
            f.ready, f.hung, f.error = False, None, None
        c.proc, c.conn = self._start(c, c.number, 0, rendezvous)
        for f in c.followers:
            f.proc, f.conn = self._start(c, f.number, f.rank, rendezvous)
        proc = c.proc
        c.spawned_at = time.monotonic()
        first = "fork" if self.start_method == "forkserver" else "start process, import"
        c.starting = {"name": first, "done": None, "total": None, "since": c.spawned_at, "last": c.spawned_at}
        try:
            c.ps = psutil.Process(proc.pid)
        except psutil.Error:
            c.ps = None     # gone already; its sentinel says so
        ranks = {"ranks": [proc.pid] + [f.proc.pid for f in c.followers]} if c.followers else {}
        self._log("spawn", actor=c.actor_id, pid=proc.pid, reason=reason, **ranks)
        if c.followers:
            strike_self(self.cfg.faults, "gang", len(self.ledger) - self.dispatcher.remaining(), self.run_dir,
                        self._log)

    def _start(self, c: _Child, number: int, rank: int, rendezvous: Optional[str]):
        """One process of ``c`` (``rank`` of its gang, heartbeat row ``number``) and the
        supervisor's end of its pipe."""
        parent_conn, child_conn = self._mp.Pipe(duplex=True)
        s = c.stage
        ctx = ActorContext(
            actor_id=c.actor_id, number=number, index=c.index, parent_pid=os.getpid(),
            conn=child_conn, ledger=self.ledger, heartbeats=self.heartbeats,
            heartbeat_s=self.cfg.heartbeat_s, num_threads=self.num_threads, to_state=s.to_state,
            in_ring=self.rings[s.in_ring] if s.in_ring else None,
            out_ring=self.rings[s.out_ring] if s.out_ring else None, spec=s.spec,
            # Rank 0 is the actor its track and faults name; the others only follow it.
            trace_dir=str(self.run_dir) if self.cfg.trace and rank == 0 else None, trace_window=self._window,
            faults=tuple((i, f) for i, f in enumerate(self.cfg.faults) if f.actor == c.actor_id) if rank == 0 else (),
            fired=self.fired, work_times=self.work_times, stage=self.dispatcher.stages.index(s),
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

    def _server_lost(self, cause: str) -> None:
        """The fork server died, or failed to fork in time: every actor forked from it
        dies with it (their parent-death signal is tied to it), so each one's batches go
        back and all of them start again, as one restart event of the server, not a
        death of each (their restart intensity is not charged). The new server has the
        first one's settings (``ForkServerStarter.restart``); past the restart
        intensity, or if it will not start, the job goes on with spawn. A new server
        that fails too is dealt with the same way."""
        while True:
            self._log("forkserver_lost", pid=self._server.pid, reason=cause)
            self._server.stop(wait_s=0.0)       # a stopped or hung one is killed: its actors go with it
            for c in self.children:
                if c.proc is not None:
                    self._bury(c, f"its fork server was lost ({cause})")
            self.forkserver_restarts += 1
            line = None
            if self._server_policy.decide(time.monotonic(), None) is Decision.RESTART:
                try:
                    self._forker_pid = self._server.restart()
                    line = f"fork server restarted (pid {self._forker_pid}) after: {cause}"
                    self._log("forkserver", pid=self._forker_pid, preload=list(self._server.preload[1:]),
                              reason=f"restarted after: {cause}")
                except Exception as e:  # noqa: BLE001 - whatever stops a new server, spawn remains
                    cause = f"{cause}; a new one did not start: {type(e).__name__}: {e}"
            else:
                cause = (f"{cause}; lost {self._server_policy.recent} times within {self.cfg.restart_window_s:g}s "
                         f"(max_restarts={self.cfg.max_restarts})")
            if line is None:
                self._server.stop(wait_s=0.0)
                self._server, self.start_method, self._forker_pid = None, "spawn", os.getpid()
                line = f"fork server given up, actors start with spawn from now on: {cause}"
                self._log("forkserver_given_up", reason=cause)
            print(f"warning: {line}", file=sys.stderr, flush=True)
            try:
                for c in self.children:
                    if c.proc is None:
                        self._spawn_now(c, f"restart after its fork server was lost ({cause})")
                return
            except forking.ForkServerError as e:
                cause = str(e)

    def _bury(self, c: _Child, cause: str) -> None:
        """An actor whose fork server is gone: its every rank killed (the parent-death
        signal is on its way; this does not wait for it), reaped, read, and its batches
        recovered."""
        procs = [p for p in [c.proc] + [f.proc for f in c.followers] if p is not None]
        for p in procs:
            p.kill()
        for p in procs:
            p.join()
        self._read(c)
        for f in c.followers:
            if f.proc is not None:
                self._read_follower(c, f)
                f.conn.close()
                f.proc.close()
                f.proc, f.conn = None, None
        c.conn.close()
        c.proc.close()
        c.proc, c.conn = None, None
        settled, put_back, redone = self.dispatcher.on_death(c.number)
        self._log("died", actor=c.actor_id, reason=cause, settled=settled, put_back=put_back,
                  decision=Decision.RESTART.value, **({"redone": redone} if redone else {}))

    def _start_forkserver(self) -> None:
        """Start the fork server every actor of this run is forked from, with its
        imports: torch, each stage's actor module and what the actors name in
        ``PRELOAD``; or use the one the caller started, saying what it lacks (an actor
        imports that itself, on every start). The first actors wait for the imports
        (their "fork" phase); restarts do not."""
        modules = ["torch"]
        for stage in self.dispatcher.stages:
            modules += [stage.actor.__module__, *stage.actor.PRELOAD]
        modules = list(dict.fromkeys(modules))
        if self._own_server:
            self._forker_pid = self._server.start(modules, os.getpid())
            self._log("forkserver", pid=self._forker_pid, preload=modules,
                      reason="actors fork from a server that imported these once")
        else:
            self._forker_pid = self._server.pid
            if not self._server.alive():        # it died before this job began
                self._server_lost(f"the fork server started at launch (pid {self._forker_pid}) "
                                  f"{self._server.ended_how()} before the job began")
                return
            self._log("forkserver", pid=self._forker_pid, preload=list(self._server.preload[1:]),
                      not_preloaded=[m for m in modules if m not in self._server.preload],
                      reason="actors fork from the server started at launch, whose imports overlapped the checks")

    def _read(self, c: _Child) -> None:
        while True:
            try:
                if not c.conn.poll():
                    return
                msg = c.conn.recv()
            except (EOFError, OSError):
                return  # the process is gone; its sentinel says how
            if isinstance(msg, Done):
                self.dispatcher.on_done(c.number, msg.batch_id)
            elif isinstance(msg, Starting):
                now = time.monotonic()
                if c.starting is None or c.starting["name"] != msg.phase:
                    c.starting = {"name": msg.phase, "since": now}
                    self._log("starting", actor=c.actor_id, phase=msg.phase)
                c.starting.update(done=msg.done, total=msg.total, last=now)
            elif isinstance(msg, Ready):
                c.rank0_ready = True
                self._gang_ready(c)
            elif isinstance(msg, Note):
                self._log(msg.event, actor=c.actor_id, **msg.fields)
            elif isinstance(msg, ActorError):
                c.last_error = c.error = msg
                self._log("actor_error", actor=c.actor_id, reason=msg.one_line(),
                          traceback=msg.traceback_text)
            else:
                raise TypeError(f"{c.actor_id} sent {msg!r}")

    def _gang_ready(self, c: _Child) -> None:
        """``c`` is ready once every rank of it is: then it gets Work."""
        if c.ready or not c.rank0_ready or not all(f.ready for f in c.followers):
            return
        c.ready, c.starting, c.ready_at = True, None, time.time()
        self.dispatcher.on_ready(c.number)
        self._log("ready", actor=c.actor_id, pid=c.proc.pid, startup_s=round(time.monotonic() - c.spawned_at, 3))

    def _read_follower(self, c: _Child, f: _Rank) -> None:
        """A gang rank above 0 says Ready, what it starts, notes and its error; no Done."""
        while True:
            try:
                if not f.conn.poll():
                    return
                msg = f.conn.recv()
            except (EOFError, OSError):
                return
            if isinstance(msg, Ready):
                f.ready = True
                self._gang_ready(c)
            elif isinstance(msg, Note):
                self._log(msg.event, actor=c.actor_id, rank=f.rank, **msg.fields)
            elif isinstance(msg, ActorError):
                f.error = msg
                self._log("actor_error", actor=c.actor_id, rank=f.rank, reason=msg.one_line(),
                          traceback=msg.traceback_text)
            elif isinstance(msg, Starting):
                # Rank 0 speaks for the gang's start; a follower's counts still show
                # that the gang is not hung.
                if c.starting is not None:
                    c.starting["last"] = time.monotonic()
            else:
                raise TypeError(f"{c.actor_id} rank {f.rank} sent {msg!r}")

    def _end_gang(self, c: _Child, first: Optional[_Rank]) -> Optional[tuple[str, Optional[ActorError]]]:
        """After one rank of a gang ended: every other rank killed (its collectives cannot
        go on) and reaped. Returns the cause and error of ``first``, the rank above 0 that
        ended first, when it is the cause: a rank that errs because a peer vanished from
        its collective is not, when rank 0 was killed or hung before it."""
        blame = None
        if first is not None:
            self._read_follower(c, first)
            first.proc.join()
            if not (c.proc.exitcode is not None and (c.hung or c.proc.exitcode < 0)):
                blame = f"rank {first.rank} " + _cause(first.proc.exitcode, first.hung, first.error), first.error
        for p in [c.proc] + [f.proc for f in c.followers]:
            if p is not None and p.exitcode is None:
                p.kill()
        for f in c.followers:
            if f.proc is not None:
                f.proc.join()
                self._read_follower(c, f)
                f.conn.close()
                f.proc.close()
                f.proc, f.conn = None, None
        return blame

    def _on_exit(self, c: _Child, first: Optional[_Rank] = None) -> Optional[JobResult]:
        """A child's process ended while running (for a gang: any rank's, ``first`` when
        not rank 0): recover, then restart or give up."""
        blame = self._end_gang(c, first) if c.followers else None
        self._read(c)
        c.proc.join()
        cause = self._exit_cause(c)
        if blame is not None:
            # Its error decides (an Escalate there stops the job), not the one rank 0
            # raised when the collective lost that rank.
            cause, error = blame
            if error is not None:
                c.last_error = c.error = error
        c.conn.close()
        c.proc.close()   # its sentinel fd; a long run restarts many times
        c.proc, c.conn = None, None
        settled, put_back, redone = self.dispatcher.on_death(c.number)
        decision = c.policy.decide(time.monotonic(), c.error)
        self._log("died", actor=c.actor_id, reason=cause, settled=settled, put_back=put_back,
                  decision=decision.value, **({"redone": redone} if redone else {}))
        if decision is Decision.RAISE:
            line = f"{c.actor_id}: {c.error.one_line()}"
            self._log("raise", actor=c.actor_id, reason=line)
            return JobResult(JobState.FAILED, line, traceback=c.error.traceback_text, raised=c.error.raised)
        if decision is Decision.GIVE_UP:
            line = (f"{c.actor_id} died {c.policy.recent} times within {self.cfg.restart_window_s:g}s "
                    f"(max_restarts={self.cfg.max_restarts}); last exit: {cause}")
            if c.last_error is not None and c.last_error.one_line() not in cause:
                line += f"; last traceback: {c.last_error.one_line()}"
            self._log("give_up", actor=c.actor_id, reason=line)
            return JobResult(JobState.FAILED, line,
                             traceback=c.last_error.traceback_text if c.last_error else None)
        c.restarts += 1
        self._spawn(c, f"one_for_one restart after: {cause}")
        return None

    def _exit_cause(self, c: _Child) -> str:
        return _cause(c.proc.exitcode, c.hung, c.error)

    def _check_hangs(self, now: float) -> None:
        for c in self.children:
            if c.proc is None or c.hung:
                continue
            reason = self._hang_reason(c, now)
            if reason:
                c.hung = f"hung: {reason}; killed"
                self._log("hang", actor=c.actor_id, pid=c.proc.pid, reason=reason)
                c.proc.kill()   # SIGKILL works on a stopped process too; the sentinel follows
            for f in c.followers if c.ready else ():
                age = now - self.heartbeats.row(f.number)["beat"]
                if f.proc is not None and not f.hung and age > self.cfg.hang_timeout_s:
                    reason = f"rank {f.rank}: no heartbeat for {age:.1f}s (hang_timeout_s={self.cfg.hang_timeout_s:g})"
                    f.hung = f"hung: {reason}; killed"
                    self._log("hang", actor=c.actor_id, pid=f.proc.pid, reason=reason)
                    f.proc.kill()   # its sentinel brings down the gang

    def _hang_reason(self, c: _Child, now: float) -> Optional[str]:
        if not c.ready:
            idle = now - self._progressed_at(c)
            if idle > self.cfg.start_timeout_s:
                phase = f" in {c.starting['name']!r}" if c.starting else ""
                return (f"not ready: no start-up progress{phase} for {idle:.1f}s, {now - c.spawned_at:.1f}s after "
                        f"spawn (start_timeout_s={self.cfg.start_timeout_s:g})")
            return None
        age = now - self.heartbeats.row(c.number)["beat"]
        if age > self.cfg.hang_timeout_s:
            return f"no heartbeat for {age:.1f}s (hang_timeout_s={self.cfg.hang_timeout_s:g})"
        return None

    def _next_hang_deadline(self) -> float:
        deadlines = []
        for c in self.children:
            if c.proc is None or c.hung:
                continue
            if c.ready:
                for n in [c.number] + [f.number for f in c.followers if f.proc is not None and not f.hung]:
                    deadlines.append(self.heartbeats.row(n)["beat"] + self.cfg.hang_timeout_s)
            else:
                deadlines.append(self._progressed_at(c) + self.cfg.start_timeout_s)
        # A beat may have moved on since we read it; the check itself rereads.
        return min(deadlines, default=float("inf")) + 0.01

    @staticmethod
    def _progressed_at(c: _Child) -> float:
        """When ``c``, not yet ready, last showed start-up progress (any rank's)."""
        return c.starting["last"] if c.starting is not None else c.spawned_at

    def _send(self, c: _Child, msg) -> None:
        """To the actor; to a gang, to every rank in the same order (they run the same
        Work together)."""
        for conn in [c.conn] + [f.conn for f in c.followers]:
            try:
                if conn is not None:
                    conn.send(msg)
            except OSError:
                pass  # it died after we looked; its sentinel brings the recovery

    def _stop_children(self, reason: str) -> None:
        """Stop, join until grace_s, SIGTERM, SIGKILL. Done messages that arrive while
        the actors finish are still settled, so the ledger ends consistent."""
        self._drain_wakeup()   # the signal that began this stop, if any, is not a second one
        live = [c for c in self.children if c.proc is not None]
        for c in live:
            self._send(c, Stop(reason))
        live = self._join(live, time.monotonic() + self.cfg.grace_s)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for c in live:
                self._log("escalate", actor=c.actor_id, reason=f"still running, sending {sig.name}")
                # Through the process object: one that has ended meanwhile is skipped, not
                # an error (its pid may already be reaped, or another's).
                (c.proc.terminate if sig == signal.SIGTERM else c.proc.kill)()
            live = self._join(live, time.monotonic() + TERM_WAIT_S)
        self._stop_followers(time.monotonic() + TERM_WAIT_S)
        for c in self.children:
            if c.proc is not None:
                c.proc.join()
                self._read_settling(c)   # what it sent between our last read and its exit
                self._log("exit", actor=c.actor_id, reason=f"exit code {c.proc.exitcode}")
                c.conn.close()
                c.proc.close()
                c.proc, c.conn = None, None

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
                    self._log("escalate", actor=c.actor_id, rank=f.rank, reason="still running, sending SIGKILL")
                    f.proc.kill()
                    f.proc.join()
                f.conn.close()
                f.proc.close()
                f.proc, f.conn = None, None

    def _join(self, live: list[_Child], until: float) -> list[_Child]:
        """Wait for ``live`` to exit until ``until``; a new SIGINT/SIGTERM cuts it short
        (a second Ctrl-C means: do not wait for the grace period)."""
        while live:
            left = until - time.monotonic()
            if left <= 0:
                break
            ready = wait([self._wake_r] + [c.conn for c in live] + [c.proc.sentinel for c in live], left)
            if self._wake_r in ready:
                self._drain_wakeup()
                self._log("hurry", reason="signal received while stopping; skipping the rest of the wait")
                break
            for c in live:
                if c.conn in ready:
                    self._read_settling(c)
            live = [c for c in live if c.proc.exitcode is None]
        return live

    def _read_settling(self, c: _Child) -> None:
        try:
            self._read(c)
        except Exception as e:   # noqa: BLE001 - shutting down; record it and carry on
            self._log("error", actor=c.actor_id, reason=f"while stopping: {type(e).__name__}: {e}")

    # -- signals ---------------------------------------------------------------

    def _install_signals(self) -> Callable[[], None]:
        self._wake_r, self._wake_w = socket.socketpair()
        if threading.current_thread() is not threading.main_thread():
            return lambda: (self._wake_r.close(), self._wake_w.close())
        self._wake_w.setblocking(False)
        old_fd = signal.set_wakeup_fd(self._wake_w.fileno())
        old = {s: signal.signal(s, lambda signum, _f: self.request_stop(signal.Signals(signum).name))
               for s in (signal.SIGINT, signal.SIGTERM)}

        def restore():
            for s, h in old.items():
                signal.signal(s, h)
            signal.set_wakeup_fd(old_fd)
            self._wake_r.close()
            self._wake_w.close()
        return restore

    def _drain_wakeup(self) -> None:
        self._wake_r.setblocking(False)
        try:
            while self._wake_r.recv(512):
                pass
        except BlockingIOError:
            pass

    def _waitables(self) -> list:
        objs = [self._wake_r]
        if self._server is not None and self._server.sentinel is not None:
            objs.append(self._server.sentinel)
        for c in self.children:
            if c.proc is not None:
                objs += [c.conn, c.proc.sentinel]
            for f in c.followers:
                if f.proc is not None:
                    objs += [f.conn, f.proc.sentinel]
        return objs

    # -- reporting -------------------------------------------------------------

    def _log(self, event: str, **fields) -> None:
        self._events.log(event, **fields)
        if event in ("spawn", "ready", "died", "hang", "give_up", "raise"):
            self.tracer.instant(f"{event} {fields.get('actor', '')}".strip(), reason=fields.get("reason"))

    def status(self) -> dict:
        now = time.monotonic()
        actors = {}
        for c in self.children:
            hb = self.heartbeats.row(c.number)
            alive = c.proc is not None and c.proc.exitcode is None
            rss, cpu = _usage(c.ps) if alive else (None, None)
            actors[c.actor_id] = {
                "pid": c.proc.pid if c.proc is not None else None,
                "state": (hb["phase"].name.lower() if alive and c.ready else "starting" if alive
                          else "exited" if self.state is not JobState.RUNNING else "dead"),
                "restarts": c.restarts,
                "heartbeat_age_s": round(now - hb["beat"], 3) if alive and hb["beat"] else None,
                "progress": {"done": hb["done"], "wip": hb["wip"]},
                "batch": hb["batch"] if hb["batch"] >= 0 else None,
                "holds": self.dispatcher.held(c.number),
                "busy_s": round(self.heartbeats.busy(c.number, now), 3),
                "busy_pct_30s": self._busy_pct(c, now),
                "rss_mb": rss, "cpu_pct": cpu, **_gpu_fields(hb),
                "phase": _phase(c.starting, now) if alive else None,
                "ready_at": c.ready_at if alive and c.ready else None,
                **({"ranks": [c.proc.pid if alive else None] +
                    [f.proc.pid if f.proc is not None and f.proc.exitcode is None else None for f in c.followers]}
                   if c.followers else {}),
                "stuck": c.stuck,
            }
        rss, cpu = _usage(self._ps)
        return {"time": round(time.time(), 3), "state": self.state.value, "reason": self.reason,
                "supervisor_pid": os.getpid(), "start_method": self.start_method,
                "forkserver_pid": self._server.pid if self._server is not None else None,
                "forkserver_restarts": self.forkserver_restarts,
                "supervisor_started": self._ps.create_time(),
                "supervisor": {"rss_mb": rss, "cpu_pct": cpu, **_gpu_fields(gpu_memory())},
                "stuck_after_s": self.cfg.stuck_s, "hang_timeout_s": self.cfg.hang_timeout_s,
                "actors": actors, "rings": self.dispatcher.occupancy(),
                "batches": {**self._counts(), "committed_this_run": len(self.dispatcher.committed),
                            "total": len(self.ledger)}}

    def _busy_pct(self, c: _Child, now: float) -> Optional[float]:
        """Percent of the last ``BUSY_WINDOW_S`` the actor spent working (over what
        of the window has been seen yet)."""
        c.busy.append((now, self.heartbeats.busy(c.number, now)))
        while len(c.busy) > 2 and now - c.busy[1][0] >= BUSY_WINDOW_S:
            c.busy.popleft()
        (t0, b0), (t1, b1) = c.busy[0], c.busy[-1]
        return round(min(100.0, 100 * (b1 - b0) / (t1 - t0)), 1) if t1 - t0 > 0.5 else None

    def _check_stuck(self, now: float) -> None:
        """Name the live actors that look stuck (``status.json``, one events.log line when
        that begins and ends). Stuck is not hung: nothing is killed for it."""
        for c in self.children:
            reason = None
            if c.proc is not None and not c.hung:
                if c.ready:
                    age = now - self.heartbeats.row(c.number)["beat"]
                    if age > self.cfg.stuck_s:
                        reason = f"no heartbeat for {age:.1f} s"
                elif c.starting is not None and now - c.starting["last"] > self.cfg.hang_timeout_s:
                    reason = f"no progress in {c.starting['name']!r} for {now - c.starting['last']:.0f} s"
            if reason and not c.stuck:
                self._log("stuck", actor=c.actor_id, reason=reason)
            elif c.stuck and not reason:
                self._log("unstuck", actor=c.actor_id, reason="alive again" if c.proc is not None else "gone")
            c.stuck = reason

    def _counts(self) -> dict[str, int]:
        names = self.dispatcher.state_names
        counts = self.ledger.counts(max(names) + 1)
        return {name: counts[s] for s, name in names.items()}

    def _write_status(self) -> None:
        self._check_stuck(time.monotonic())
        status = self.status()
        if self.on_status is not None:
            self.on_status(status)
        path = self.run_dir / STATUS_FILE
        try:
            write_atomically(path, lambda tmp: tmp.write_text(json.dumps(status, indent=1)))
        except OSError as e:    # a full disk, a directory put in its place: stop, as events.log does
            self.request_failure(cannot_write(path, e))
        # Steady training logs no decision for minutes: look at events.log as often as at
        # status.json, so that a broken one stops the job now, not at the next decision.
        self._events.probe()


def _gpu_fields(mb: dict) -> dict:
    """status.json's GPU memory of a process (``actor.gpu_memory``'s MiB, rounded; null
    where it has used no CUDA)."""
    return {key: round(mb[col], 1) if mb[col] else None
            for key, col in (("gpu_mem_mb", "gpu_mb"), ("gpu_peak_mb", "gpu_peak_mb"),
                             ("gpu_reserved_peak_mb", "gpu_reserved_peak_mb"))}


def _usage(ps: Optional[psutil.Process]) -> tuple[Optional[float], Optional[float]]:
    """(RSS MiB, CPU % since the previous call) of a process; Nones if it is gone.
    RSS counts the shared buffers the process has touched, so it overlaps between actors."""
    if ps is None:
        return None, None
    try:
        with ps.oneshot():
            return round(ps.memory_info().rss / 2**20, 1), round(ps.cpu_percent(None), 1)
    except psutil.Error:
        return None, None


def _phase(starting: Optional[dict], now: float) -> Optional[dict]:
    if starting is None:
        return None
    return {"name": starting["name"], "done": starting["done"], "total": starting["total"],
            "elapsed_s": round(now - starting["since"], 1), "idle_s": round(now - starting["last"], 1)}


def _cause(code: Optional[int], hung: Optional[str], error: Optional[ActorError]) -> str:
    """Why a process ended, in one phrase: hung, a signal, its error, or its exit code."""
    if hung:
        return hung
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    if error is not None:
        return error.one_line()
    return f"exit code {code}"


def _free_port() -> int:
    """A local TCP port free now, for a gang's rendezvous (its rank 0 binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
