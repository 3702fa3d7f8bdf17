"""Actor base: lifecycle, heartbeat, the one error handler.

Contract of every actor process:
  consumes  ``Work`` messages from its pipe; reads its input slot and ledger row
  produces  its output slot, then the ledger commit (``STATE = to_state``), then ``Done``
  waits for Work (blocking on the pipe, beating every ``runtime.heartbeat_s``)
  unblocked by the supervisor dispatching Work or sending ``Stop``
  on restart starts from nothing: attaches to the same shared buffers and waits for
            Work; the supervisor has already put back whatever the dead one held.

Lifecycle::

    spawned -> attaching (attach()) -> idle <-> working (work(w), commit, Done, after_commit(w))
            -> draining (drain()) -> exit 0
                      Escalate        -> ActorError(raised=e) -> exit 1 -> the job stops
                      other exception -> ActorError           -> exit 1 -> restart

An actor is a class with ``attach``, ``work``, ``after_commit`` and ``drain``. What it
gets: its rings and the ledger (``ActorContext``, the same for every stage) and
``self.spec``, the stage's frozen dataclass of what this role needs (its config, its
shared buffers).
Work that can take longer than ``runtime.hang_timeout_s`` calls ``self.beat()`` now and
then: the supervisor kills an actor whose heartbeat is older than that, which is how a
hung actor is told apart from a slow one.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import enum
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .channels import Ring
from .ledger import Ledger
from .messages import ActorError, Done, Note, ProtocolError, Ready, Starting, Stop, Work
from .trace import Tracer, Window, part_path


class Shutdown(Exception):
    """The expected end of an actor: the supervisor said Stop."""


class Escalate(Exception):
    """An error that restarting this actor cannot fix (it would meet the same state
    again). The supervisor does not restart the actor: it stops the job and hands the
    exception to its caller (``JobResult.raised``), which decides what happens next.
    Subclasses must pickle: keep their constructor to one message argument."""


class Phase(enum.IntEnum):
    SPAWNED = 0
    ATTACHING = 1
    IDLE = 2
    WORKING = 3
    DRAINING = 4
    EXITED = 5


class HB(enum.IntEnum):
    PID = 0
    PHASE = 1
    BEAT = 2        # time.monotonic() of the last sign of life (system-wide clock)
    DONE = 3        # Work items completed by this incarnation
    WIP = 4         # beats inside Work (progress within a long step)
    BATCH = 5       # batch id in hand, -1 when idle
    BUSY = 6        # seconds spent on Work items, over every incarnation of this actor
    WORK_T0 = 7     # time.monotonic() when the Work item in hand began, 0 when idle
    GPU_MB = 8      # CUDA memory the caching allocator holds, MiB (0 without CUDA)
    GPU_PEAK_MB = 9             # this incarnation's peak of CUDA memory allocated, MiB
    GPU_RESERVED_PEAK_MB = 10   # ... and of CUDA memory the caching allocator held, MiB


class Heartbeats:
    """Shared float64 table, one row per actor number, written by that actor only."""

    def __init__(self, table: torch.Tensor):
        self.table = table
        self._a = table.numpy()

    @classmethod
    def allocate(cls, n_actors: int) -> "Heartbeats":
        t = torch.zeros(n_actors, len(HB), dtype=torch.float64)
        t[:, HB.BATCH] = -1
        return cls(t.share_memory_())

    def __getstate__(self):
        return {"table": self.table}

    def __setstate__(self, state):
        self.__init__(state["table"])

    def reset(self, n: int, pid: int) -> None:
        r = self._a[n]
        busy = r[HB.BUSY]       # the actor's, not the incarnation's: busy fractions span restarts
        r[:] = 0
        r[HB.BUSY] = busy
        r[HB.PID] = pid
        r[HB.BATCH] = -1
        r[HB.BEAT] = time.monotonic()

    def row(self, n: int) -> dict:
        r = self._a[n]
        return {"pid": int(r[HB.PID]), "phase": Phase(int(r[HB.PHASE])), "beat": float(r[HB.BEAT]),
                "done": int(r[HB.DONE]), "wip": int(r[HB.WIP]), "batch": int(r[HB.BATCH]),
                "gpu_mb": float(r[HB.GPU_MB]), "gpu_peak_mb": float(r[HB.GPU_PEAK_MB]),
                "gpu_reserved_peak_mb": float(r[HB.GPU_RESERVED_PEAK_MB])}

    def busy(self, n: int, now: float) -> float:
        """Seconds actor ``n`` has spent working up to ``now``, the item in hand included."""
        r = self._a[n]
        t0 = r[HB.WORK_T0]
        return float(r[HB.BUSY] + (max(0.0, now - t0) if t0 else 0.0))

    def bump(self, n: int) -> None:
        """One more beat inside a Work item."""
        self.set(n, wip=self._a[n, HB.WIP] + 1)

    def set(self, n: int, **cols) -> None:
        r = self._a[n]
        for k, v in cols.items():
            r[HB[k.upper()]] = v
        r[HB.BEAT] = time.monotonic()


@dataclass(frozen=True)
class ActorContext:
    """Everything a child gets at spawn (pickled once; tensors travel as fds)."""

    actor_id: str
    number: int
    index: int                         # within its stage
    parent_pid: int
    conn: object                       # multiprocessing Connection to the supervisor
    ledger: Ledger
    heartbeats: Heartbeats
    heartbeat_s: float
    num_threads: int
    to_state: int
    in_ring: Optional[Ring] = None
    out_ring: Optional[Ring] = None
    spec: Any = None                   # the stage's spec
    trace_dir: Optional[str] = None    # the run dir when tracing, else None
    trace_window: Optional[Window] = None
    faults: tuple = ()                 # (number, FaultConfig) aimed at this actor
    fired: Optional[torch.Tensor] = None   # shared int8 [all faults]: 1 once fired
    work_times: Optional[torch.Tensor] = None
    """Shared float64 [batches, stages]: seconds the stage's ``work`` took on each batch."""
    stage: int = 0                     # this actor's column in ``work_times``
    rank: int = 0
    """Within a gang (``Stage.gang``): rank 0 is the actor the ledger knows; ranks
    above it do every Work item alongside it (their collectives need them) and
    commit nothing. ``number`` is then the rank's own heartbeat row."""
    gang: int = 1
    rendezvous: Optional[str] = None
    """A gang's ``tcp://host:port`` for its process group: new at every (re)start."""


class Actor:
    """Subclass and override ``work`` (and ``attach``/``drain`` when needed)."""

    FAULT_POINTS: tuple[str, ...] = ("work", "commit")
    """Where ``runtime.faults`` can strike; subclasses that call ``fault_point`` at
    points of their own add them."""
    PRELOAD: tuple[str, ...] = ()
    """Modules the actor imports late (in ``attach``) that the fork server should import
    up front (``runtime.start_method: forkserver``); its own module always is."""

    def __init__(self, ctx: ActorContext):
        self.ctx = ctx
        self.spec = ctx.spec
        self.ledger = ctx.ledger
        self.in_ring = ctx.in_ring
        self.out_ring = ctx.out_ring
        path = part_path(ctx.trace_dir, ctx.actor_id) if ctx.trace_dir else None
        self.tracer = Tracer(path, ctx.number + 1, ctx.trace_window)

    def span(self, name: str, batch: int = -1, **args):
        """``with self.span("forward", w.batch_id):`` marks a phase of the work in the
        trace (a no-op when tracing is off)."""
        return self.tracer.span(name, batch, **args)

    def attach(self) -> None:
        """Load what the actor needs (models, files); shared buffers are already mapped."""

    def work(self, w: Work) -> None:
        """Fill ``out_ring.slot(w.out_slot)`` from the input; return when the payload is
        complete (CUDA writers synchronize first). The base commits the ledger after."""
        raise NotImplementedError

    def ready(self, w: Work) -> bool:
        """Whether the inputs of ``w`` that its stage leaves to the actor to wait for are
        there (``dispatch.Stage.early``: what the later stages publish in shared
        memory). ``work`` starts only once this says yes; the wait is not work (not in
        its span nor its time) and ends early on ``Stop``."""
        return True

    def after_commit(self, w: Work) -> None:
        """Work that may follow the commit of ``w`` (its Done is already sent, so the
        next stage can start): the batch is final, and a kill in here loses nothing the
        ledger needs. Whatever this does, the actor must be able to redo on restart."""

    def drain(self) -> None:
        """Flush before an orderly exit."""

    def starting(self, phase: str, done: Optional[int] = None, total: Optional[int] = None) -> None:
        """Say what ``attach`` is doing now (``status.json`` shows it); call again with
        counts as a long phase advances. A phase that says nothing for
        ``hang_timeout_s`` shows as stuck."""
        self.ctx.conn.send(Starting(self.ctx.actor_id, phase, done, total))

    def report(self, event: str, **fields) -> None:
        """Record ``event`` in the supervisor's ``events.log``."""
        self.ctx.conn.send(Note(self.ctx.actor_id, event, fields))

    def poison(self, w: Work) -> None:
        """Make the output of ``w`` non-finite (fault kind ``nan``); actors with a
        numeric output override this."""
        raise NotImplementedError(f"{self.ctx.actor_id} has no numeric output to make non-finite")

    def fault_point(self, where: str, batch: int) -> None:
        """Inject the configured fault due at ``where`` for ``batch``, if any (once)."""
        for i, f in self.ctx.faults:
            if f.at == where and batch >= f.at_batch and not self.ctx.fired[i]:
                self.ctx.fired[i] = 1
                self.report("fault", kind=f.kind, at=where, batch=batch,
                            reason=f"injected by runtime.faults[{i}]")
                _inject(self, f.kind)

    def beat(self) -> None:
        """Progress inside a long ``work``: keeps the hang detector off."""
        self.ctx.heartbeats.bump(self.ctx.number)

    @contextlib.contextmanager
    def beating(self, limit_s: Optional[float] = None):
        """Beat from a thread while one long blocking call runs (a multi-GB checkpoint
        write has no loop to beat from). Inside it a hang is not seen, so give the call
        ``limit_s``, the longest it may take: past it the beats stop, and the hang
        detector ends the call ``hang_timeout_s`` later (None: no limit)."""
        with every(self.ctx.heartbeat_s, self.beat, until_s=limit_s):
            yield


@contextlib.contextmanager
def every(interval_s: float, fn, first_s: Optional[float] = None, until_s: Optional[float] = None):
    """Call ``fn()`` from a thread every ``interval_s`` (the first time after
    ``first_s``, if given) while the block runs, for at most ``until_s`` seconds (None:
    all of it); it is not called once the block ends."""
    done = threading.Event()
    end = None if until_s is None else time.monotonic() + until_s

    def loop():
        wait = interval_s if first_s is None else first_s
        while not done.wait(wait) and (end is None or time.monotonic() < end):
            fn()
            wait = interval_s
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()


def actor_main(cls: type, ctx: ActorContext) -> None:
    """Process entry point, called by ``boot.boot`` once the parent-death signal is
    armed. Never returns normally: exits 0 on Stop, 1 after reporting an error."""
    # Ctrl-C reaches the whole process group; only the supervisor decides what it means.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(ctx.num_threads)
    hb, n = ctx.heartbeats, ctx.number
    hb.reset(n, os.getpid())
    actor = None
    try:
        hb.set(n, phase=Phase.ATTACHING)
        actor = cls(ctx)
        actor.attach()
        hb.set(n, phase=Phase.IDLE, **gpu_memory())
        ctx.conn.send(Ready(ctx.actor_id, os.getpid()))
        _serve(actor, ctx)
    except Shutdown:
        hb.set(n, phase=Phase.DRAINING)
        if actor is not None:
            actor.drain()
        hb.set(n, phase=Phase.EXITED, **gpu_memory())
        _exit(0)
    except BaseException as e:  # the one place errors are caught in an actor process
        hb.set(n, **gpu_memory())   # an out-of-memory's peak: what the memory plan missed
        err = ActorError(ctx.actor_id, type(e).__name__, str(e), traceback.format_exc(),
                         raised=e if isinstance(e, (Escalate, ProtocolError)) else None)
        try:
            ctx.conn.send(err)
        except OSError:
            pass  # the supervisor is gone; the exit code still tells
        _exit(1)


def _serve(actor: Actor, ctx: ActorContext) -> None:
    """Do Work as it comes: wait until it is ``ready``, then ``work``, the ledger commit,
    Done, then ``after_commit``; beat while idle. Raises Shutdown on Stop."""
    hb, n, conn = ctx.heartbeats, ctx.number, ctx.conn
    times = ctx.work_times.numpy() if ctx.work_times is not None else None
    queued: collections.deque = collections.deque()     # read while waiting for a Work to be ready
    done = 0
    while True:
        if not queued and not conn.poll(ctx.heartbeat_s):
            hb.set(n)
            continue
        msg = queued.popleft() if queued else conn.recv()
        if isinstance(msg, Stop):
            raise Shutdown(msg.reason)
        if not isinstance(msg, Work):
            raise TypeError(f"unexpected message {msg!r}")
        if not actor.ready(msg):
            _wait_ready(actor, msg, queued)
        t0 = time.monotonic()
        hb.set(n, phase=Phase.WORKING, batch=msg.batch_id, work_t0=t0)
        b, tracer = msg.batch_id, actor.tracer
        actor.slow = actor.poisoned = False
        actor.fault_point("work", b)
        if actor.poisoned:
            actor.poison(msg)
        actor.work(msg)
        if actor.slow:      # 10x: nine more times the work's own duration, beating
            _sleep_beating(actor, 9 * (time.monotonic() - t0))
        if ctx.rank > 0:    # a gang's follower: rank 0 commits for the gang
            done += 1
            hb.set(n, phase=Phase.IDLE, batch=-1, done=done, busy=hb.busy(n, time.monotonic()), work_t0=0,
                   **gpu_memory())
            continue
        actor.fault_point("commit", b)
        t1 = time.monotonic()
        if times is not None:   # before the commit: once the batch is final, so is its time
            times[b, ctx.stage] = t1 - t0
        ctx.ledger.commit(b, ctx.to_state)
        # The span ends before Done goes out: whatever Done lets start begins after it.
        tracer.record("work", t0, t1, b)
        conn.send(Done(ctx.actor_id, b))
        actor.after_commit(msg)
        tracer.flush()
        done += 1
        hb.set(n, phase=Phase.IDLE, batch=-1, done=done, busy=hb.busy(n, time.monotonic()), work_t0=0,
               **gpu_memory())


READY_POLL_S = 50e-6
READY_POLL_SHARE = 0.05
"""``_wait_ready`` looks again after ``READY_POLL_S``, or after this share of the time it
has waited so far if longer: a wait of a few milliseconds (an optimizer step) ends
within a fraction of one, and a long one (an actor restarting) costs few wake-ups."""


def _wait_ready(actor: Actor, w: Work, queued: collections.deque) -> None:
    """Wait, beating, until ``actor.ready(w)``. Messages that come meanwhile queue up
    behind ``w``; a ``Stop`` among them ends the wait (Shutdown): the supervisor is
    stopping and may never send what ``w`` waits for, and ``w``, not committed, is
    simply not done. An actor that lists the fault point ``wait`` can be struck here."""
    ctx = actor.ctx
    actor.fault_point("wait", w.batch_id)
    t0 = beat = time.monotonic()
    with actor.span("wait", w.batch_id):
        while not actor.ready(w):
            while ctx.conn.poll():
                queued.append(ctx.conn.recv())
                if isinstance(queued[-1], Stop):
                    raise Shutdown(queued[-1].reason)
            now = time.monotonic()
            if now - beat >= ctx.heartbeat_s:
                ctx.heartbeats.set(ctx.number)
                beat = now
            time.sleep(max(READY_POLL_S, READY_POLL_SHARE * (now - t0)))


def gpu_memory() -> dict[str, float]:
    """This process's CUDA memory on its current device, MiB: what the caching allocator
    holds now (``gpu_mb``), and since the process began, the peaks of what was allocated
    (``gpu_peak_mb``, what the memory plan predicts) and of what the allocator held
    (``gpu_reserved_peak_mb``). Zeros where the process has not used CUDA yet."""
    # Only where this process already uses CUDA: initializing it here would cost
    # seconds and device memory in actors that never touch a GPU.
    if not torch.cuda.is_initialized():
        return {"gpu_mb": 0.0, "gpu_peak_mb": 0.0, "gpu_reserved_peak_mb": 0.0}
    return {"gpu_mb": torch.cuda.memory_reserved() / 2**20, "gpu_peak_mb": torch.cuda.max_memory_allocated() / 2**20,
            "gpu_reserved_peak_mb": torch.cuda.max_memory_reserved() / 2**20}


class InjectedFault(Exception):
    """The ``exception`` kind of ``runtime.faults``."""


def _inject(actor: Actor, kind: str) -> None:
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "segfault":
        ctypes.string_at(0)
    elif kind == "exit":
        _exit(3)
    elif kind == "exception":
        raise InjectedFault("injected by runtime.faults")
    elif kind == "hang":
        while True:     # no heartbeat from here on: the supervisor's hang check ends it
            time.sleep(3600)
    elif kind == "slow":
        actor.slow = True
    elif kind == "nan":
        actor.poisoned = True


def _sleep_beating(actor: Actor, seconds: float) -> None:
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(left, actor.ctx.heartbeat_s))
        actor.beat()


def _exit(code: int) -> None:
    """Exit now: the interpreter's normal teardown (torch and multiprocessing atexit
    work) takes half a second or more and holds nothing an actor needs."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
