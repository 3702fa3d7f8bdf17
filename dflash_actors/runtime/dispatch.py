"""Moves batch ids through the stages: the supervisor's routing and recovery logic.

A ``Stage`` is one transition of the ledger (``from_state -> to_state``) served by
``count`` actors of one role, reading ``in_ring`` and writing ``out_ring``. Stages
chain: stage i+1 consumes what stage i produces; the last stage's ``to_state`` is the
final one (committed). The ``Dispatcher`` lives in the supervisor process only, and it
alone takes and frees slots, so free lists need no lock and survive any actor's death.

Rules, chosen so that restarts never change what a consumer sees:
  * ready batches of a stage are dispatched lowest id first, and each stage reserves its
    output slots in that order, so the lowest unfinished batch always holds or gets a
    slot (no ring can fill up with later batches while an earlier one waits);
  * a routed stage sends batch b to its actor ``route(b)``, each actor in increasing
    b; after a death that actor's cursor goes back to the lowest batch put back, so the
    replacement resumes the same sequence. The route is the caller's rule (the
    training job's is ``Schedule.drafter_of``), asked, never re-derived here;
  * a stage with a ``barrier`` sends batch b only once every batch below
    ``barrier(b)`` has reached the final state; an ``early`` one, once every such
    batch is through the stage for good, and its actor waits by itself for the rest
    (the training job's drafters wait this way for the weights of their step, which
    the last stage publishes: see ``Stage.early``);
  * a stage with a ``gather`` sends batch b only once every batch of ``gather(b)``
    (a range of ids) has reached the stage: groups move through the stages together,
    as in a lock-step loop (the training job's ``runtime.schedule: lockstep``);
  * each actor holds at most ``credit`` dispatched batches (prefetch depth);
  * recovery (``on_death``) reads the ledger, not the dead actor's messages: see
    ``ledger`` for settle vs put back;
  * a routed stage may keep its results in the actor's memory until a ``durable``
    batch (the training job's drafters under ``runtime.grad_durability: step`` keep a
    step's running gradient sum on their device). What such an actor finished since
    its last durable batch dies with it: those batches go back to the first stage and
    are made again from the start (``redo``), and no later stage takes them before
    they are durable;
  * a redone batch comes back below batches that already hold slots, which breaks the
    rule that the lowest batch always gets a slot (every ring may be full of later
    batches waiting for it). So when a stage cannot reserve an output slot for its
    lowest ready batch, the highest later batch idling in that ring gives its slot up
    and goes back to the first stage too (``evicted``); in a run without redone
    batches no later batch ever holds a slot the lowest one needs, so this never fires.
"""

from __future__ import annotations

import bisect
import enum
import heapq
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .channels import RingSpec
from .ledger import Col, Ledger
from .messages import ProtocolError, Work


def _first_unset(flags, start: int) -> int:
    """The lowest index from ``start`` on whose flag is not set (``len(flags)`` if none)."""
    while start < len(flags) and flags[start]:
        start += 1
    return start


def in_order(b: int) -> int:
    """The route of a one-actor stage that takes every batch in increasing id."""
    return 0


@dataclass(frozen=True)
class Stage:
    role: str
    actor: type
    """An ``actor.Actor`` subclass, importable by spawned children."""
    from_state: int
    to_state: int
    count: int = 1
    in_ring: Optional[str] = None
    out_ring: Optional[str] = None
    route: Optional[Callable[[int], int]] = None
    """Batch id -> index of the actor that must take it (each in increasing id);
    None: any free actor takes the lowest ready batch."""
    barrier: Optional[Callable[[int], int]] = None
    """Batch id -> the id below which every batch must be final before it goes out."""
    early: bool = False
    """With a barrier: batch b goes out once every batch below ``barrier(b)`` is through
    this stage for good (done here and durable: nothing but the later stages stands
    between it and the final state), not once they are final. The actor then waits
    by itself, on shared memory, for what the later stages publish
    (``actor.Actor.ready``). The training job's drafters do so: the optimizer's
    commit reaching the supervisor, and the supervisor's Work reaching the drafter,
    were two process wake-ups on every step's critical chain; the weight version
    the drafter waits for is written before either. Nothing later may have an input
    ring: a batch past this stage never goes back (so no actor of it can wait on a
    batch that must come through it again)."""
    gather: Optional[Callable[[int], range]] = None
    """Batch id -> its group: no batch of the group goes out before all have arrived."""
    durable: Optional[Callable[[int], bool]] = None
    """Routed stages: batch id -> whether its result outlives the actor that made it
    (None: every result does). Results since an actor's last durable batch are redone
    after its death."""
    credit: int = 2
    gang: int = 1
    """Processes per actor: above 1, each actor is a gang of that many ranks (a
    tensor-parallel target). Every rank gets the same Work in the same order; rank 0
    alone writes the output, commits and says Done; the death or hang of any rank
    kills and restarts them all, as one restart (``supervisor``)."""
    spec: Any = None
    """What every actor of this stage receives as ``self.spec``: a frozen dataclass of
    what the role needs, pickled once per spawn (shared tensors travel as fds)."""


class SlotPool:
    """Free slots of one ring, lowest first."""

    def __init__(self, n_slots: int):
        self.n_slots = n_slots
        self._free = list(range(n_slots))

    def take(self) -> Optional[int]:
        return heapq.heappop(self._free) if self._free else None

    def give(self, slot: int) -> None:
        if slot < 0 or slot >= self.n_slots or slot in self._free:
            raise ProtocolError(f"slot {slot} freed twice or out of range")
        heapq.heappush(self._free, slot)

    @property
    def used(self) -> int:
        return self.n_slots - len(self._free)


class Dispatcher:
    def __init__(self, stages: list[Stage], rings: list[RingSpec], ledger: Ledger,
                 members: dict[int, tuple[int, int]]):
        """``members``: actor number -> (stage index, index within the stage)."""
        for a, b in zip(stages, stages[1:]):
            if a.to_state != b.from_state or a.out_ring != b.in_ring:
                raise ValueError(f"stage {b.role} does not consume what {a.role} produces")
        for i, st in enumerate(stages):
            if st.early and (st.barrier is None or any(later.in_ring for later in stages[i + 1:])):
                raise ValueError(f"stage {st.role}: early needs a barrier, and no later stage with an input ring")
            if st.durable is not None and (st.route is None or st is stages[-1]):
                raise ValueError(f"stage {st.role}: durable needs a route (results are redone per actor) "
                                 "and a later stage (which waits for them)")
        self.stages = stages
        self.ledger = ledger
        self.members = members
        self.final = stages[-1].to_state
        self.state_names = _state_names(stages)
        self.pools = {r.name: SlotPool(r.n_slots) for r in rings}
        self._n = len(ledger)
        self._ready: list[list[int]] = [[] for _ in stages]
        self._ready_set: list[set[int]] = [set() for _ in stages]
        stage_of_state = {s.from_state: i for i, s in enumerate(stages)}
        self._held: dict[int, list[int]] = {n: [] for n in members}
        self._live: set[int] = set()
        self.committed: list[int] = []
        """Batch ids in the order the last stage committed them, in this run."""
        self._final = [False] * self._n
        self._provisional: dict[int, list[int]] = {n: [] for n in members}
        """Batches actor n finished since its last durable one (``Stage.durable``)."""
        self._pending: set[int] = set()
        """All those batches: no later stage may take them yet."""
        self.redone: list[int] = []
        self.evicted: list[int] = []
        """Batches sent back to the first stage, in this run (for the log and tests)."""
        self._arrived: list[dict[int, int]] = [{} for _ in stages]
        """Gathering stages: group start -> how many of its batches have reached the stage."""
        for b in range(self._n):
            i = stage_of_state.get(ledger.state(b))
            if i is not None:
                self._push(i, b)
            self._final[b] = ledger.state(b) == self.final
            for k in range(len(stages) if self._final[b] else (i + 1 if i is not None else 0)):
                self._arrive(k, b)
        self._frontier = 0
        self._advance_frontier()
        # Early stages: which batches are through each for good, and the lowest that is not.
        self._through: dict[int, list[bool]] = {
            i: [ledger.state(b) >= st.to_state for b in range(self._n)] for i, st in enumerate(stages) if st.early}
        self._through_frontier = {i: 0 for i in self._through}
        for i in self._through:
            self._advance_through(i)
        # Routed stages: each actor's batch ids in order, and a cursor into them.
        self._sequence: dict[int, list[int]] = {}
        self._cursor: dict[int, int] = {}
        for i, stage in enumerate(stages):
            if stage.route is None:
                continue
            seqs: list[list[int]] = [[] for _ in range(stage.count)]
            for b in range(self._n):
                seqs[stage.route(b)].append(b)
            for n, (si, k) in members.items():
                if si == i:
                    self._sequence[n], self._cursor[n] = seqs[k], 0
                    self._skip_done(n)

    # -- events ---------------------------------------------------------------

    def on_ready(self, n: int) -> None:
        self._live.add(n)

    def on_done(self, n: int, b: int) -> None:
        i, _ = self.members[n]
        if b not in self._held[n]:
            raise ProtocolError(f"actor {n} reported batch {b}, which it does not hold")
        if self.ledger.state(b) != self.stages[i].to_state:
            names, now = self.state_names, self.ledger.state(b)
            raise ProtocolError(f"batch {b}: Done for {names[self.stages[i].to_state]} but the "
                                f"ledger says {names.get(now, now)}")
        self._settle(n, b)

    def on_death(self, n: int) -> tuple[list[int], list[int], list[int]]:
        """Recover what actor ``n`` held, from the ledger, and redo what it finished but
        had not made durable. Returns (settled, put back, redone)."""
        self._live.discard(n)
        i, _ = self.members[n]
        stage = self.stages[i]
        owned = self.ledger.owned_by(n)
        if sorted(owned) != sorted(self._held[n]):
            raise ProtocolError(f"actor {n}: ledger owns {owned}, dispatcher holds {self._held[n]}")
        settled, put_back = [], []
        for b in owned:
            if self.ledger.state(b) == stage.to_state:
                self._settle(n, b)
                settled.append(b)
            else:
                reserved = self.ledger.put_back(b)
                if stage.out_ring is not None:
                    self.pools[stage.out_ring].give(reserved)
                self._held[n].remove(b)
                self._push(i, b)
                put_back.append(b)
                if stage.route is not None:
                    self._cursor[n] = min(self._cursor[n], bisect.bisect_left(self._sequence[n], b))
        redone = self._provisional[n]
        self._provisional[n] = []
        for b in redone:
            self._pending.discard(b)
            self._restart(b, i + 1)
            self._cursor[n] = min(self._cursor[n], bisect.bisect_left(self._sequence[n], b))
        self.redone += redone
        return settled, put_back, redone

    def dispatch(self) -> list[tuple[int, Work]]:
        """Everything that can be sent now, as (actor number, Work)."""
        out: list[tuple[int, Work]] = []
        for i, stage in enumerate(self.stages):
            actors = sorted(n for n, (si, _) in self.members.items() if si == i and n in self._live)
            if stage.route is not None:
                for n in actors:
                    seq = self._sequence[n]
                    while (len(self._held[n]) < stage.credit and self._cursor[n] < len(seq)
                           and seq[self._cursor[n]] in self._ready_set[i] and self._open(i, seq[self._cursor[n]])):
                        w = self._send(i, n, seq[self._cursor[n]])
                        if w is None:
                            if self._evict_above(i, seq[self._cursor[n]]):
                                continue
                            break
                        out.append((n, w))
                        self._cursor[n] += 1
                        self._skip_done(n)
            else:
                heap = self._ready[i]
                while heap:
                    if heap[0] not in self._ready_set[i]:
                        heapq.heappop(heap)  # already dispatched (lazy deletion)
                        continue
                    free = [n for n in actors if len(self._held[n]) < stage.credit]
                    if not free or not self._open(i, heap[0]):
                        break
                    n = min(free, key=lambda m: (len(self._held[m]), m))
                    w = self._send(i, n, heap[0])
                    if w is None:
                        if self._evict_above(i, heap[0]):
                            continue
                        break
                    out.append((n, w))
        # Sent later stages first: the step's critical chain runs through the last
        # stages (the optimizer's Work opens every drafter's next step), and each send
        # is a pickle and a pipe write. The decisions above do not depend on this order.
        out.sort(key=lambda sent: -self.members[sent[0]][0])
        return out

    # -- queries --------------------------------------------------------------

    def finished(self) -> bool:
        return self._frontier == self._n

    def remaining(self) -> int:
        """Batches not yet final."""
        return self._final.count(False)

    def held(self, n: int) -> list[int]:
        return list(self._held[n])

    def occupancy(self) -> dict[str, dict]:
        return {name: {"slots": p.n_slots, "used": p.used} for name, p in self.pools.items()}

    # -- internals ------------------------------------------------------------

    def _open(self, i: int, b: int) -> bool:
        stage = self.stages[i]
        if b in self._pending:
            return False
        if stage.barrier is not None and stage.barrier(b) > (self._through_frontier[i] if stage.early
                                                             else self._frontier):
            return False
        if stage.gather is not None:
            group = stage.gather(b)
            return self._arrived[i].get(group.start, 0) == len(group)
        return True

    def _arrive(self, i: int, b: int, by: int = 1) -> None:
        """Batch b reached stage i (counted once: a put-back batch does not arrive again;
        a batch sent back to the first stage leaves, ``by=-1``, and arrives anew)."""
        if self.stages[i].gather is not None:
            start = self.stages[i].gather(b).start
            self._arrived[i][start] = self._arrived[i].get(start, 0) + by

    def _restart(self, b: int, i: int) -> None:
        """Send batch b, waiting (not held) at stage i, back to the first stage: its
        data slot is freed and the ledger row starts over."""
        slot = self.ledger.restart(b, self.stages[0].from_state)
        ring = self.stages[i].in_ring
        if ring is not None and slot >= 0:
            self.pools[ring].give(slot)
        self._ready_set[i].discard(b)     # its heap entry, if any, is dropped lazily
        for k in range(1, i + 1):
            self._arrive(k, b, by=-1)
        self._push(0, b)

    def _evict_above(self, i: int, b: int) -> bool:
        """Stage i has no free output slot for batch b: take one from the highest batch
        above b that idles in that ring (waiting for stage i+1, not held), sending it
        back to the first stage. False if there is none (the ring is busy with batches
        below b or in flight, which free their slots by themselves)."""
        idle = [c for c in self._ready_set[i + 1] if c > b and c not in self._pending]
        if not idle:
            return False
        c = max(idle)
        self._restart(c, i + 1)
        self.evicted.append(c)
        return True

    def _push(self, i: int, b: int) -> None:
        # Routed stages pick by cursor and need only the set; the others pop the heap.
        if self.stages[i].route is None:
            heapq.heappush(self._ready[i], b)
        self._ready_set[i].add(b)

    def _send(self, i: int, n: int, b: int) -> Optional[Work]:
        stage = self.stages[i]
        out_slot = -1
        if stage.out_ring is not None:
            slot = self.pools[stage.out_ring].take()
            if slot is None:
                return None
            out_slot = slot
        self._ready_set[i].discard(b)
        self._held[n].append(b)
        self.ledger.assign(b, n, out_slot)
        return Work(b, self.ledger.get(b, Col.SLOT), out_slot)

    def _settle(self, n: int, b: int) -> None:
        i, _ = self.members[n]
        stage = self.stages[i]
        old = self.ledger.settle(b)
        if stage.in_ring is not None:
            self.pools[stage.in_ring].give(old)
        self._held[n].remove(b)
        through = [b]
        if stage.durable is not None:
            if stage.durable(b):
                through += self._provisional[n]
                self._pending.difference_update(self._provisional[n])
                self._provisional[n] = []
            else:
                through = []
                self._provisional[n].append(b)
                self._pending.add(b)
        if stage.early:
            for c in through:
                self._through[i][c] = True
            self._advance_through(i)
        if i + 1 < len(self.stages):
            self._push(i + 1, b)
            self._arrive(i + 1, b)
        else:
            self.committed.append(b)
            self._final[b] = True
            self._advance_frontier()

    def _advance_frontier(self) -> None:
        """The lowest batch id not yet settled in the final state."""
        self._frontier = _first_unset(self._final, self._frontier)

    def _advance_through(self, i: int) -> None:
        """Early stage i: the lowest batch id not yet through it for good."""
        self._through_frontier[i] = _first_unset(self._through[i], self._through_frontier[i])

    def _skip_done(self, n: int) -> None:
        i, _ = self.members[n]
        to, seq = self.stages[i].to_state, self._sequence[n]
        while self._cursor[n] < len(seq) and self.ledger.state(seq[self._cursor[n]]) >= to:
            self._cursor[n] += 1


def _state_names(stages: list[Stage]) -> dict[int, str]:
    """Ledger state -> its name in messages and status.json: an enum member's name in
    lower case, else the number."""
    names = {}
    for st in stages:
        for s in (st.from_state, st.to_state):
            names[int(s)] = s.name.lower() if isinstance(s, enum.Enum) else str(int(s))
    return dict(sorted(names.items()))
