"""The batch ledger: a shared int64 table, one row per batch id of the run.

A batch id is the batch's position in the whole run; row b is batch b, in every process
and in every checkpoint. Each stage of the pipeline moves a row from its ``from_state``
to its ``to_state`` (small ints, in increasing order: a batch only moves forward,
except when the supervisor puts it back). A resumed run allocates every row of the run
and marks those below its resume point as already in the final state, so ids never
shift.

Columns::

    STATE      last durable state; written only by the actor that completes the
               transition, as its last act (one aligned 8-byte store: the commit point)
    SLOT       slot of the ring that holds the data of STATE (-1: none)
    NEXT_SLOT  slot reserved for the transition in progress (-1: none)
    OWNER      actor number doing the transition in progress (-1: nobody)
    META ...   ``meta_cols`` ints the first producer writes before it commits (the
               batch's shape, for example), so any later stage reads them here

Single writer per column at any moment, so no lock (a lock held by a process that is
``kill -9``ed would never be released): the supervisor writes SLOT, NEXT_SLOT and OWNER
(on dispatch and on settling); the owner writes META and then STATE. The payload is
written before STATE, and the reader learns of STATE through a pipe message or a
process death, both of which order memory; so whoever sees the new STATE also sees the
payload.

A batch that nobody holds may also be sent back to the first state (``restart``) by
the supervisor: its result lived in a dead actor's memory, or its slot is needed by a
lower batch. Then STATE is written by the supervisor, the one time it is.

Recovery after the death of actor X (``owned_by(X)``): a row whose STATE already is the
transition's target was finished and only the Done message was lost, so it is settled
as if Done had arrived; any other row is put back: OWNER and NEXT_SLOT cleared, the
reserved slot freed, the batch queued again for the same transition. The input slot
was never freed (its data is still needed), so nothing is lost and nothing runs twice.
"""

from __future__ import annotations

import enum
from typing import Sequence

import numpy as np
import torch


class Col(enum.IntEnum):
    STATE = 0
    SLOT = 1
    NEXT_SLOT = 2
    OWNER = 3
    META = 4        # first of the meta columns


class Ledger:
    """Views a shared ``[n_batches, META + meta_cols]`` int64 tensor; pickles to children
    as that tensor (one fd), so every process reads and writes the same rows."""

    def __init__(self, table: torch.Tensor):
        if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] < Col.META:
            raise ValueError(f"ledger table must be int64 [n, >= {int(Col.META)}] "
                             f"(got {table.dtype} {tuple(table.shape)})")
        self.table = table
        self._a = table.numpy()

    @classmethod
    def allocate(cls, n_batches: int, meta_cols: int = 0, initial: int = 0,
                 done: int | None = None, done_below: int = 0) -> "Ledger":
        """Every row in state ``initial``, except rows below ``done_below``, which start
        in state ``done`` (the part of the run a resumed job has already committed)."""
        if done_below and done is None:
            raise ValueError("done_below needs the done state")
        t = torch.full((n_batches, Col.META + meta_cols), -1, dtype=torch.int64)
        t[:, Col.STATE] = initial
        t[:done_below, Col.STATE] = done if done is not None else initial
        return cls(t.share_memory_())

    def __getstate__(self):
        return {"table": self.table}

    def __setstate__(self, state):
        self.__init__(state["table"])

    def __len__(self) -> int:
        return len(self._a)

    # -- the owner's side ------------------------------------------------------

    def state(self, b: int) -> int:
        return int(self._a[b, Col.STATE])

    def commit(self, b: int, state: int) -> None:
        self._a[b, Col.STATE] = int(state)

    def set_meta(self, b: int, values: Sequence[int]) -> None:
        if len(values) != self._a.shape[1] - Col.META:
            raise ValueError(f"ledger holds {self._a.shape[1] - Col.META} meta columns, got {len(values)} values")
        self._a[b, Col.META:] = values

    def meta(self, b: int) -> tuple[int, ...]:
        return tuple(int(v) for v in self._a[b, Col.META:])

    def get(self, b: int, col: Col) -> int:
        return int(self._a[b, col])

    # -- the supervisor's side -------------------------------------------------

    def assign(self, b: int, owner: int, next_slot: int) -> None:
        """Record a dispatch."""
        r = self._a[b]
        r[Col.NEXT_SLOT] = next_slot
        r[Col.OWNER] = owner

    def settle(self, b: int) -> int:
        """After the owner committed: the reserved slot becomes the batch's slot.
        Returns the old slot, which the caller frees."""
        r = self._a[b]
        old = int(r[Col.SLOT])
        r[Col.SLOT] = r[Col.NEXT_SLOT]
        r[Col.NEXT_SLOT] = -1
        r[Col.OWNER] = -1
        return old

    def put_back(self, b: int) -> int:
        """Undo a dispatch whose owner died before committing. Returns the reserved
        slot, which the caller frees."""
        r = self._a[b]
        reserved = int(r[Col.NEXT_SLOT])
        r[Col.NEXT_SLOT] = -1
        r[Col.OWNER] = -1
        return reserved

    def restart(self, b: int, state: int) -> int:
        """Send a batch nobody holds back to ``state`` (the first): its result is lost
        or its slot is needed by a lower batch (``dispatch``: redo, eviction). The
        supervisor writes STATE here, which is safe because no actor owns the row.
        Returns the slot its data was in, which the caller frees."""
        r = self._a[b]
        if r[Col.OWNER] != -1:
            raise ValueError(f"batch {b} is held by actor {int(r[Col.OWNER])}; only an idle batch restarts")
        old = int(r[Col.SLOT])
        r[Col.SLOT] = -1
        r[Col.STATE] = int(state)
        return old

    def owned_by(self, owner: int) -> list[int]:
        """Batch ids with a transition in progress by ``owner``, lowest first."""
        return np.flatnonzero(self._a[:, Col.OWNER] == owner).tolist()

    def past(self, state: int) -> int:
        """How many rows are at ``state`` or beyond: a stage's progress."""
        return int((self._a[:, Col.STATE] >= int(state)).sum())

    def counts(self, n_states: int) -> list[int]:
        """How many rows are in each state ``0 .. n_states-1``."""
        return np.bincount(self._a[:, Col.STATE], minlength=n_states).tolist()
