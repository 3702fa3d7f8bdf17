"""Every message that crosses a pipe, as a frozen dataclass.

Each actor has one duplex pipe to the supervisor and no other channel: the supervisor
routes all work, so a killed actor takes down only its own pipe (an ``mp.Queue`` whose
reader dies holding the queue's lock would block every other reader forever). Messages
carry only ints and short strings (a few hundred bytes pickled); tensors stay in the
shared slots of ``channels`` and batch state stays in the ``ledger``.

Supervisor -> actor::

    Work(batch_id, in_slot, out_slot)            do one transition of batch_id
    Stop(reason)                                 finish the Work already sent, then exit 0

Actor -> supervisor::

    Ready(actor_id, pid)                         attached, entering the work loop
    Done(actor_id, batch_id)                     the ledger already records the new state
    Note(actor_id, event, fields)                an event for events.log (a skipped step, a fault)
    Starting(actor_id, phase, done, total)       a startup phase, before Ready
    ActorError(actor_id, exc_type, message, traceback_text, raised)   sent once, then exit 1

Liveness does not travel here: each actor writes its heartbeat and progress counters
into a shared table (``actor.Heartbeats``) that the supervisor reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class ProtocolError(RuntimeError):
    """What a message or the ledger says contradicts what its reader knows (a batch
    Done twice, a slot freed twice, weights of the wrong version): a bug, not a fault.
    No restart fixes one: raised in the supervisor it ends the run; raised in an actor
    it stops the job at once, like an ``actor.Escalate`` error (``JobResult.raised``)."""


@dataclass(frozen=True)
class Work:
    """Move ``batch_id`` one stage on: read ``in_slot`` (-1: the stage has no input
    ring), write ``out_slot`` (-1: no output ring)."""

    batch_id: int
    in_slot: int
    out_slot: int


@dataclass(frozen=True)
class Stop:
    """Orderly end: the actor finishes the Work queued before this message, runs its
    ``drain`` hook, then exits 0."""

    reason: str


@dataclass(frozen=True)
class Ready:
    """The actor attached to every shared buffer and waits for Work."""

    actor_id: str
    pid: int


@dataclass(frozen=True)
class Done:
    """``batch_id`` reached the actor's output state; the ledger row already says so
    (the ledger, not this message, is the commit point: see ``ledger``)."""

    actor_id: str
    batch_id: int


@dataclass(frozen=True)
class Note:
    """Something the actor saw that the supervisor should record in ``events.log``
    (the supervisor is its one writer); ``fields`` holds ints, floats and short strings."""

    actor_id: str
    event: str
    fields: dict


@dataclass(frozen=True)
class Starting:
    """What the actor is doing before Ready: a startup phase (loading a model, opening
    data), with counts when it has them. The supervisor shows the newest one in
    ``status.json`` and calls the actor stuck when none has come for ``hang_timeout_s``."""

    actor_id: str
    phase: str
    done: Optional[int] = None
    total: Optional[int] = None


@dataclass(frozen=True)
class ActorError:
    """An exception escaped the actor; it exits non-zero right after sending this.
    ``raised`` is the exception itself when it is an ``actor.Escalate`` or a
    ``ProtocolError`` (both pickle: one message argument): the supervisor hands it to
    its caller instead of restarting the actor."""

    actor_id: str
    exc_type: str
    message: str
    traceback_text: str
    raised: Optional[BaseException] = None

    def one_line(self) -> str:
        """``Type: message (file:line in func)``, the innermost frame of the traceback."""
        where = ""
        for line in reversed(self.traceback_text.splitlines()):
            s = line.strip()
            if s.startswith('File "'):
                path, _, rest = s[6:].partition('", line ')
                lineno, _, func = rest.partition(", in ")
                where = f" ({path.rsplit('/', 1)[-1]}:{lineno} in {func})"
                break
        msg = self.message.splitlines()[0] if self.message else ""
        return f"{self.exc_type}: {msg}{where}"
