"""The supervisor: owns every shared buffer, spawns the actors, watches, restarts.

State machine of the job::

    RUNNING --all batches committed----> STOPPING("finished") --> DONE
    RUNNING --request_finish(reason)---> STOPPING(reason)      --> DONE (early: a plateau)
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
exits (sentinel), and as hung, then killed, by ``health``'s rules (a silent heartbeat,
or no start-up progress: a big shard on slow storage is slow, not hung, while it counts).

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
and the ``wakeup`` socket, until the next deadline (status write or hang check). Every
decision goes to ``<run_dir>/events.log``; ``status.json`` (``status``) is rewritten
about once a second; with ``runtime.trace`` every span goes to ``trace.json``
(``trace``). It runs in the main thread: signal handlers live there, and the children's
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

import json
import os
import signal
import sys
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable, Optional

import psutil
import torch
import torch.multiprocessing as tmp

from . import forking, status
from .actor import ActorContext, Heartbeats, gpu_memory
from .boot import Deferred, boot
from .channels import Ring, RingSpec
from .children import Child, Rank, exit_cause, free_port
from .config import RuntimeConfig
from .dispatch import Dispatcher, Stage
from .events import EventLog
from .faults import SUPERVISOR_POINTS, check_faults, strike_self
from .files import cannot_write, write_atomically
from .health import Health
from .ledger import Ledger
from .messages import ActorError, Done, Note, Ready, Starting, Stop
from .outcome import JobResult, JobState
from .policy import Decision, RestartPolicy
from .trace import SUPERVISOR_TRACK, Tracer, Window, clear, merge, part_path
from .wakeup import Wakeup

STATUS_PERIOD_S = 1.0   # between status.json writes (``status``)
TERM_WAIT_S = 2.0       # after SIGTERM, before SIGKILL



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
        self.children: list[Child] = []
        for stage in stages:
            for k in range(stage.count):
                self.children.append(Child(f"{stage.role}.{k}", len(self.children), stage, k,
                                            policy=RestartPolicy(runtime.max_restarts, runtime.restart_window_s)))
        rows = len(self.children)
        for c in self.children:
            c.followers = [Rank(r, rows + r - 1) for r in range(1, c.stage.gang)]
            rows += c.stage.gang - 1
        self.heartbeats = Heartbeats.allocate(rows)
        self.health = Health(runtime, self.heartbeats, self._log)
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
            self._server.set_timeouts(runtime.start_timeout_s, runtime.fork_timeout_s)
        self._server_policy = RestartPolicy(runtime.max_restarts, runtime.restart_window_s)
        self.forkserver_restarts = 0
        """Times the fork server was lost and replaced (or given up for spawn)."""
        self._forker_pid = os.getpid()   # the process each actor is forked from
        self._stop_signal: Optional[str] = None
        self._failure: Optional[str] = None
        self._finish_early: Optional[str] = None
        self._events: Optional[EventLog] = None
        self._wake: Optional[Wakeup] = None
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
        self._wake = Wakeup(self.request_stop)
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
            self._wake.close()
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
        if self._wake is not None:      # None: not running yet
            self._wake.poke()

    def request_finish(self, reason: str) -> None:
        """End the job as done before its last batch (exit 0), from any thread: what the
        evaluator asks once the held-out curve stops rising (``eval.plateau``)."""
        self._finish_early = self._finish_early or reason
        if self._wake is not None:
            self._wake.poke()

    # -- the loop --------------------------------------------------------------

    def _loop(self) -> JobResult:
        next_status = 0.0
        while True:
            now = time.monotonic()
            if self._failure and self.state is JobState.RUNNING:
                return self._stopping(JobResult(JobState.FAILED, self._failure))
            if self._stop_signal and self.state is JobState.RUNNING:
                return self._stopping(JobResult(JobState.STOPPED, self._stop_signal))
            if self._finish_early and self.state is JobState.RUNNING:
                return self._stopping(JobResult(JobState.DONE, self._finish_early))
            if self.dispatcher.finished():
                return self._stopping(JobResult(JobState.DONE, "finished"))
            if now >= next_status:
                self._write_status()
                next_status = now + STATUS_PERIOD_S
            self.health.check_hangs(self.children, now)
            failure = None
            timeout = max(0.0, min(next_status, self.health.next_deadline(self.children)) - time.monotonic())
            ready = wait(self._waitables(), timeout)
            t_woke = time.monotonic()
            if self._wake.reader in ready:
                self._wake.drain()
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

    def _spawn(self, c: Child, reason: str) -> None:
        """Start ``c``: one process, or a gang's every rank (rank 0 first), with a new
        rendezvous: a collective group does not outlive any of its ranks. A fork server
        that fails to fork takes every actor with it (``_server_lost``), ``c`` included."""
        try:
            self._spawn_now(c, reason)
        except forking.ForkServerError as e:
            self._server_lost(str(e))

    def _spawn_now(self, c: Child, reason: str) -> None:
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

    def _start(self, c: Child, number: int, rank: int, rendezvous: Optional[str]):
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

    def _bury(self, c: Child, cause: str) -> None:
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

    def _read(self, c: Child) -> None:
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

    def _gang_ready(self, c: Child) -> None:
        """``c`` is ready once every rank of it is: then it gets Work."""
        if c.ready or not c.rank0_ready or not all(f.ready for f in c.followers):
            return
        c.ready, c.starting, c.ready_at = True, None, time.time()
        self.dispatcher.on_ready(c.number)
        self._log("ready", actor=c.actor_id, pid=c.proc.pid, startup_s=round(time.monotonic() - c.spawned_at, 3))

    def _read_follower(self, c: Child, f: Rank) -> None:
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

    def _end_gang(self, c: Child, first: Optional[Rank]) -> Optional[tuple[str, Optional[ActorError]]]:
        """After one rank of a gang ended: every other rank killed (its collectives cannot
        go on) and reaped. Returns the cause and error of ``first``, the rank above 0 that
        ended first, when it is the cause: a rank that errs because a peer vanished from
        its collective is not, when rank 0 was killed or hung before it."""
        blame = None
        if first is not None:
            self._read_follower(c, first)
            first.proc.join()
            if not (c.proc.exitcode is not None and (c.hung or c.proc.exitcode < 0)):
                blame = f"rank {first.rank} " + exit_cause(first.proc.exitcode, first.hung, first.error), first.error
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

    def _on_exit(self, c: Child, first: Optional[Rank] = None) -> Optional[JobResult]:
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

    def _exit_cause(self, c: Child) -> str:
        return exit_cause(c.proc.exitcode, c.hung, c.error)

    def _send(self, c: Child, msg) -> None:
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
        self._wake.drain()   # the signal that began this stop, if any, is not a second one
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

    def _join(self, live: list[Child], until: float) -> list[Child]:
        """Wait for ``live`` to exit until ``until``; a new SIGINT/SIGTERM cuts it short
        (a second Ctrl-C means: do not wait for the grace period)."""
        while live:
            left = until - time.monotonic()
            if left <= 0:
                break
            ready = wait([self._wake.reader] + [c.conn for c in live] + [c.proc.sentinel for c in live], left)
            if self._wake.reader in ready:
                self._wake.drain()
                self._log("hurry", reason="signal received while stopping; skipping the rest of the wait")
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
            self._log("error", actor=c.actor_id, reason=f"while stopping: {type(e).__name__}: {e}")

    # -- waiting ---------------------------------------------------------------

    def _waitables(self) -> list:
        objs = [self._wake.reader]
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
        """The runtime's block of status.json (``status``)."""
        now = time.monotonic()
        running = self.state is JobState.RUNNING
        actors = {c.actor_id: status.actor_entry(c, self.heartbeats, self.dispatcher.held(c.number), now, running)
                  for c in self.children}
        rss, cpu = status.usage(self._ps)
        return {"time": round(time.time(), 3), "state": self.state.value, "reason": self.reason,
                "supervisor_pid": os.getpid(), "start_method": self.start_method,
                "forkserver_pid": self._server.pid if self._server is not None else None,
                "forkserver_restarts": self.forkserver_restarts,
                "supervisor_started": self._ps.create_time(),
                "supervisor": {"rss_mb": rss, "cpu_pct": cpu, **status.gpu_fields(gpu_memory())},
                "stuck_after_s": self.cfg.stuck_s, "hang_timeout_s": self.cfg.hang_timeout_s,
                "actors": actors, "rings": self.dispatcher.occupancy(),
                "batches": {**status.batch_counts(self.dispatcher.state_names, self.ledger),
                            "committed_this_run": len(self.dispatcher.committed),
                            "total": len(self.ledger)}}

    def _write_status(self) -> None:
        self.health.check_stuck(self.children, time.monotonic())
        block = self.status()
        if self.on_status is not None:
            self.on_status(block)
        path = self.run_dir / status.STATUS_FILE
        try:
            write_atomically(path, lambda tmp: tmp.write_text(json.dumps(block, indent=1)))
        except OSError as e:    # a full disk, a directory put in its place: stop, as events.log does
            self.request_failure(cannot_write(path, e))
        # Steady training logs no decision for minutes: look at events.log as often as at
        # status.json, so that a broken one stops the job now, not at the next decision.
        self._events.probe()


