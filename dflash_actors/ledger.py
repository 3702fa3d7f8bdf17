"""The batch ledger: a shared int64 table, one row per batch id of the run.

States (a batch only moves forward, except when the supervisor puts it back)::

    PLANNED --loader--> LOADED(batch slot) --target--> FEATURED(feature slot)
            --drafter--> GRAD_DONE(step) --optimizer--> COMMITTED

Columns::

    STATE      last durable state; written only by the actor that completes the
               transition, as its last act (one aligned 8-byte store: the commit point)
    SLOT       slot of the ring that holds the data of STATE (-1: none)
    NEXT_SLOT  slot reserved for the transition in progress (-1: none)
    OWNER      actor number doing the transition in progress (-1: nobody)
    ATTEMPT    how many times the transition in progress has been dispatched
    N_SAMPLES, N_TOKENS, MAX_LEN   the batch's shape (batching.BatchMeta), written by
               the loader before it commits LOADED, so any later stage reads it here

Single writer per column at any moment, so no lock (a lock held by a process that is
``kill -9``ed would never be released): the supervisor writes SLOT, NEXT_SLOT, OWNER
and ATTEMPT (on dispatch and on settling); the owner writes the shape columns and then
STATE. The payload is written before STATE, and the reader learns of STATE through a
pipe message or a process death, both of which order memory; so whoever sees the new
STATE also sees the payload.

Recovery after the death of actor X (``owned_by(X)``): a row whose STATE already is the
transition's target was finished and only the Done message was lost, so it is settled
as if Done had arrived; any other row is put back: OWNER and NEXT_SLOT cleared, the
reserved slot freed, the batch queued again for the same transition. The input slot
was never freed (its data is still needed), so nothing is lost and nothing runs twice.
"""

from __future__ import annotations

import enum

import numpy as np
import torch

from .batching import BatchMeta


class State(enum.IntEnum):
    PLANNED = 0
    LOADED = 1
    FEATURED = 2
    GRAD_DONE = 3
    COMMITTED = 4


class Col(enum.IntEnum):
    STATE = 0
    SLOT = 1
    NEXT_SLOT = 2
    OWNER = 3
    ATTEMPT = 4
    N_SAMPLES = 5
    N_TOKENS = 6
    MAX_LEN = 7


class Ledger:
    """Views a shared ``[n_batches, len(Col)]`` int64 tensor; pickles to children as
    that tensor (one fd), so every process reads and writes the same rows."""

    def __init__(self, table: torch.Tensor):
        if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != len(Col):
            raise ValueError(f"ledger table must be int64 [n, {len(Col)}] (got {table.dtype} {tuple(table.shape)})")
        self.table = table
        self._a = table.numpy()

    @classmethod
    def allocate(cls, n_batches: int) -> "Ledger":
        t = torch.empty(n_batches, len(Col), dtype=torch.int64)
        t[:] = -1
        t[:, Col.STATE] = State.PLANNED
        t[:, Col.ATTEMPT] = 0
        return cls(t.share_memory_())

    def __getstate__(self):
        return {"table": self.table}

    def __setstate__(self, state):
        self.__init__(state["table"])

    def __len__(self) -> int:
        return len(self._a)

    # -- the owner's side ------------------------------------------------------

    def state(self, b: int) -> State:
        return State(int(self._a[b, Col.STATE]))

    def commit(self, b: int, state: State) -> None:
        self._a[b, Col.STATE] = int(state)

    def set_meta(self, b: int, meta: BatchMeta) -> None:
        self._a[b, Col.N_SAMPLES] = meta.n_samples
        self._a[b, Col.N_TOKENS] = meta.n_tokens
        self._a[b, Col.MAX_LEN] = meta.max_len

    def meta(self, b: int) -> BatchMeta:
        r = self._a[b]
        return BatchMeta(int(r[Col.N_SAMPLES]), int(r[Col.N_TOKENS]), int(r[Col.MAX_LEN]))

    def get(self, b: int, col: Col) -> int:
        return int(self._a[b, col])

    # -- the supervisor's side -------------------------------------------------

    def assign(self, b: int, owner: int, next_slot: int) -> int:
        """Record a dispatch; returns the attempt number (1 = first)."""
        r = self._a[b]
        r[Col.NEXT_SLOT] = next_slot
        r[Col.OWNER] = owner
        r[Col.ATTEMPT] += 1
        return int(r[Col.ATTEMPT])

    def settle(self, b: int) -> int:
        """After the owner committed: the reserved slot becomes the batch's slot.
        Returns the old slot, which the caller frees."""
        r = self._a[b]
        old = int(r[Col.SLOT])
        r[Col.SLOT] = r[Col.NEXT_SLOT]
        r[Col.NEXT_SLOT] = -1
        r[Col.OWNER] = -1
        r[Col.ATTEMPT] = 0
        return old

    def put_back(self, b: int) -> int:
        """Undo a dispatch whose owner died before committing. Returns the reserved
        slot, which the caller frees; ATTEMPT is kept, so retries stay countable."""
        r = self._a[b]
        reserved = int(r[Col.NEXT_SLOT])
        r[Col.NEXT_SLOT] = -1
        r[Col.OWNER] = -1
        return reserved

    def owned_by(self, owner: int) -> list[int]:
        """Batch ids with a transition in progress by ``owner``, lowest first."""
        return np.flatnonzero(self._a[:, Col.OWNER] == owner).tolist()

    def counts(self) -> dict[str, int]:
        states = np.bincount(self._a[:, Col.STATE], minlength=len(State))
        return {s.name.lower(): int(states[s]) for s in State}
