"""The supervisor: owns every shared buffer and the job's decisions; its ``group``
runs the actors' processes.

State machine of the job::

    RUNNING --all batches committed----> STOPPING("finished") --> DONE
    RUNNING --request_finish(reason)---> STOPPING(reason)      --> DONE (early: a plateau)
    RUNNING --SIGINT/SIGTERM-----------> STOPPING(signal)      --> STOPPED
    RUNNING --restart intensity--------> STOPPING(error)       --> FAILED
    RUNNING --an actor raised Escalate-> STOPPING(error)       --> FAILED, result.raised
            or a ProtocolError

STOPPING: no new Work; ``Stop`` to every actor, which finishes the Work already queued;
join until ``grace_s``; SIGTERM; SIGKILL (``group.ProcessGroup.stop``).

When an actor dies, the dispatcher first recovers its in-flight batches from the
ledger; then its ``policy.RestartPolicy`` decides: RESTART it alone, GIVE_UP (a crash
loop: the job fails with one line naming the actor, its exit cause and its last
traceback), or RAISE (an ``actor.Escalate`` error, or a ``ProtocolError``, a bug: the
job stops and the caller gets the exception; the training job rolls back after the
former and fails after the latter). An actor counts as dead when its process
exits, and as hung by ``health``'s rules (a silent heartbeat, or no start-up progress:
a big shard on slow storage is slow, not hung, while it counts): then it is killed
here, and its end brings the decision above.

When the fork server is lost (it ended, or served no fork in time: ``forking``), every
actor forked from it dies with it: each one's batches go back, and the server's own
``RestartPolicy`` decides, as one restart event of the server, not a death of each
actor (their restart intensity is not charged): RESTART a new server with the first
one's settings and every actor from it, or, past that intensity or when a new one will
not start, go on with spawn (``_server_lost``).

Rooms: ``group`` starts, reads, signals and stops the processes (a gang's k ranks as
one actor, the fork server) and reports what happened; ``health`` says who is hung and
stuck; ``status`` writes the runtime's block of status.json; ``faults`` holds the
faults aimed at the supervisor itself. What stays here is the loop and every decision,
which ``tests/unit/test_decisions.py`` runs against a group with no processes.

The loop blocks in the group's ``wait`` (process sentinels, actor pipes and the
``wakeup`` socket) until the next deadline (status write or hang check). Every
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
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import psutil
import torch

from . import forking, status
from .actor import Heartbeats, gpu_memory
from .channels import Ring, RingSpec
from .children import Child, Rank
from .config import RuntimeConfig
from .dispatch import Dispatcher, Stage
from .events import EventLog
from .faults import SUPERVISOR_POINTS, check_faults, strike_self
from .files import cannot_write, write_atomically
from .group import GroupContext, GroupFactory, ProcessGroup
from .health import Health, Hung
from .ledger import Ledger
from .outcome import JobResult, JobState
from .policy import Decision, RestartPolicy
from .trace import SUPERVISOR_TRACK, Tracer, Window, clear, merge, part_path
from .wakeup import Wakeup

STATUS_PERIOD_S = 1.0   # between status.json writes (``status``)


class Supervisor:
    def __init__(self, runtime: RuntimeConfig, stages: list[Stage], rings: list[RingSpec | Ring],
                 n_batches: int, *, meta_cols: int = 0, first_batch: int = 0, num_threads: int = 1,
                 on_status: Optional[Callable[[dict], None]] = None,
                 forkserver: Optional[forking.ForkServerStarter] = None,
                 supervisor_points: tuple[str, ...] = SUPERVISOR_POINTS,
                 group: GroupFactory = ProcessGroup):
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
        the supervisor, its own and its caller's (``SUPERVISOR_POINTS``). ``group``:
        makes the group that runs the actors' processes (``group.Group``); tests of
        the decisions alone pass one with no processes."""
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
        self.health = Health(runtime, self.heartbeats, self.log)
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
        self._stop_signal: Optional[str] = None
        self._failure: Optional[str] = None
        self._finish_early: Optional[str] = None
        self._events: Optional[EventLog] = None
        self._wake: Optional[Wakeup] = None
        self.window = Window(first_batch, n_batches, runtime.trace_batches)
        self.tracer = Tracer(None, SUPERVISOR_TRACK)
        self._ps = psutil.Process()
        self._server_policy = RestartPolicy(runtime.max_restarts, runtime.restart_window_s)
        self.server_restarts = 0
        """Times the fork server was lost and replaced (or given up for spawn)."""
        self.group = group(GroupContext(
            cfg=runtime, run_dir=self.run_dir, children=self.children, dispatcher=self.dispatcher,
            ledger=self.ledger, heartbeats=self.heartbeats, rings=self.rings, num_threads=num_threads,
            window=self.window, fired=self.fired, work_times=self.work_times, log=self.log), forkserver)

    # -- public ----------------------------------------------------------------

    def run(self) -> JobResult:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._events = EventLog(self.run_dir / "events.log", on_error=self.request_failure)
        if self.cfg.trace:
            clear(self.run_dir)
            self.tracer = Tracer(part_path(self.run_dir, "supervisor"), SUPERVISOR_TRACK, self.window)
        self._wake = Wakeup(self.request_stop)
        result = None
        try:
            self.log("start", reason="job begins", actors=[c.actor_id for c in self.children],
                      batches=len(self.ledger), committed_before=len(self.ledger) - self.dispatcher.remaining())
            self._start()
            result = self._loop()
        except BaseException as e:
            self.log("abort", reason=f"supervisor error: {type(e).__name__}: {e}")
            raise
        finally:
            self.group.stop(result.reason if result else "supervisor error", self._wake)
            self.group.close()
            self._wake.close()
            if result is not None:
                # After the stop: Done messages read while the actors finished count too.
                result.committed = list(self.dispatcher.committed)
                result.restarts = {c.actor_id: c.restarts for c in self.children}
                if self.server_restarts:
                    result.restarts["forkserver"] = self.server_restarts
                self.state = result.state
                self.log("end", state=result.state.value, reason=result.reason, restarts=result.restarts)
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
            for hung in self.health.hung(self.children, now):
                self._kill_hung(hung)
            failure = None
            timeout = max(0.0, min(next_status, self.health.next_deadline(self.children)) - time.monotonic())
            woken, ended, server_lost = self.group.wait(timeout, self._wake)
            t_woke = time.monotonic()
            if woken:
                self._wake.drain()
            if server_lost:
                self._server_lost(server_lost)
            for c, first, proc in [(c, first, c.proc) for c, first in ended]:
                # A fork server lost while an earlier one restarted has buried and
                # restarted this one too.
                if c.proc is proc:
                    failure = failure or self._on_exit(c, first)
            if failure:
                return self._stopping(failure)
            t0 = time.monotonic()
            evicted = len(self.dispatcher.evicted)
            sent = self.dispatcher.dispatch()
            if len(self.dispatcher.evicted) > evicted:
                self.log("evicted", batches=self.dispatcher.evicted[evicted:],
                          reason="their slots went to lower batches being redone")
            for n, w in sent:
                self.group.send(self.children[n], w)
            if sent and self.tracer.enabled:
                self.tracer.record("read messages", t_woke, t0, sent[0][1].batch_id)
                self.tracer.record("dispatch", t0, time.monotonic(), sent[0][1].batch_id,
                                   sent=[f"{w.batch_id}->{self.children[n].actor_id}" for n, w in sent])

    def _stopping(self, result: JobResult) -> JobResult:
        self.state, self.reason = JobState.STOPPING, result.reason
        self.log("stopping", reason=result.reason)
        return result

    # -- decisions -------------------------------------------------------------

    def _start(self) -> None:
        """The fork server (where there is one), then every actor."""
        lost = self.group.start()
        if lost:
            self._server_lost(lost)
        for c in self.children:
            if c.proc is None:      # a fork server lost on the way has started the rest
                self._spawn(c, "initial start")

    def _spawn(self, c: Child, reason: str) -> None:
        """Start ``c``. A fork server that fails to fork takes every actor with it
        (``_server_lost``), ``c`` included."""
        try:
            self.group.spawn(c, reason)
        except forking.ForkServerError as e:
            self._server_lost(str(e))
            return
        self._spawned(c)

    def _spawned(self, c: Child) -> None:
        """``c`` is spawned: a gang's ranks now form, the supervisor's own fault point
        ``gang`` (``faults``)."""
        if c.followers:
            strike_self(self.cfg.faults, "gang", self.committed_count(), self.run_dir, self.log)

    def _kill_hung(self, h: Hung) -> None:
        """A hung process (``health``): killed; its end brings the restart decision."""
        who = h.rank if h.rank is not None else h.child
        who.hung = f"hung: {h.reason}; killed"
        self.log("hang", actor=h.child.actor_id, pid=who.proc.pid, reason=h.reason)
        self.group.kill(h.child, h.rank)

    def _server_lost(self, cause: str) -> None:
        """The fork server died, or failed to fork in time: every actor forked from it
        dies with it (their parent-death signal is tied to it), so each one's batches go
        back and all of them start again, as one restart event of the server, not a
        death of each (their restart intensity is not charged). The new server has the
        first one's settings; past the server's restart intensity, or if a new one will
        not start, the job goes on with spawn. A new server that fails too is dealt with
        the same way."""
        while True:
            self.log("forkserver_lost", pid=self.group.server_pid, reason=cause)
            self.group.drop_server()
            for c in self.children:
                if c.proc is not None:
                    self.group.bury(c)
                    settled, put_back, redone = self.dispatcher.on_death(c.number)
                    self.log("died", actor=c.actor_id, reason=f"its fork server was lost ({cause})",
                             settled=settled, put_back=put_back, decision=Decision.RESTART.value,
                             **({"redone": redone} if redone else {}))
            self.server_restarts += 1
            line = None
            if self._server_policy.decide(time.monotonic(), None) is Decision.RESTART:
                try:
                    pid = self.group.replace_server(f"restarted after: {cause}")
                    line = f"fork server restarted (pid {pid}) after: {cause}"
                except Exception as e:  # noqa: BLE001 - whatever stops a new server, spawn remains
                    cause = f"{cause}; a new one did not start: {type(e).__name__}: {e}"
            else:
                cause = (f"{cause}; lost {self._server_policy.recent} times within {self.cfg.restart_window_s:g}s "
                         f"(max_restarts={self.cfg.max_restarts})")
            if line is None:
                self.group.use_spawn()
                line = f"fork server given up, actors start with spawn from now on: {cause}"
                self.log("forkserver_given_up", reason=cause)
            print(f"warning: {line}", file=sys.stderr, flush=True)
            try:
                for c in self.children:
                    if c.proc is None:
                        self.group.spawn(c, f"restart after its fork server was lost ({cause})")
                        self._spawned(c)
                return
            except forking.ForkServerError as e:
                cause = str(e)

    def _on_exit(self, c: Child, first: Optional[Rank] = None) -> Optional[JobResult]:
        """A child's process ended while running (for a gang: any rank's, ``first`` when
        not rank 0): recover, then restart or give up."""
        cause = self.group.reap(c, first)
        settled, put_back, redone = self.dispatcher.on_death(c.number)
        decision = c.policy.decide(time.monotonic(), c.error)
        self.log("died", actor=c.actor_id, reason=cause, settled=settled, put_back=put_back,
                 decision=decision.value, **({"redone": redone} if redone else {}))
        if decision is Decision.RAISE:
            line = f"{c.actor_id}: {c.error.one_line()}"
            self.log("raise", actor=c.actor_id, reason=line)
            return JobResult(JobState.FAILED, line, traceback=c.error.traceback_text, raised=c.error.raised)
        if decision is Decision.GIVE_UP:
            line = (f"{c.actor_id} died {c.policy.recent} times within {self.cfg.restart_window_s:g}s "
                    f"(max_restarts={self.cfg.max_restarts}); last exit: {cause}")
            if c.last_error is not None and c.last_error.one_line() not in cause:
                line += f"; last traceback: {c.last_error.one_line()}"
            self.log("give_up", actor=c.actor_id, reason=line)
            return JobResult(JobState.FAILED, line,
                             traceback=c.last_error.traceback_text if c.last_error else None)
        c.restarts += 1
        self._spawn(c, f"one_for_one restart after: {cause}")
        return None

    def committed_count(self) -> int:
        """Batches committed, this run's and those before it."""
        return len(self.ledger) - self.dispatcher.remaining()

    # -- reporting -------------------------------------------------------------

    def log(self, event: str, **fields) -> None:
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
                "supervisor_pid": os.getpid(), "start_method": self.group.start_method,
                "forkserver_pid": self.group.server_pid, "forkserver_restarts": self.server_restarts,
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


