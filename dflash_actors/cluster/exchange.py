"""What the optimizer actor and the node's ``Link`` share: one block of shared memory.

The optimizer asks for step s's cross-node sum and waits; the link thread in the
supervisor process answers (``link``). Nothing else crosses between the two.
"""

from __future__ import annotations

import time

import torch


class ClusterError(RuntimeError):
    """A node was lost or the replicas differ: the run stops on every node."""


class Exchange:
    """Shared memory between the optimizer actor and the node's Link.

    head  [4] int64   requested step + 1 (optimizer), reduced step + 1 (link), failed
                      (link: the exchange is abandoned), batches in the reduced step
    total [P] f32     the reduced step's gradient sum over all K*M drafters
    rows  [K*M*A, C]  the step's batch stats rows, in global drafter order
    """

    REQ, DONE, FAILED, COUNT = range(4)

    def __init__(self, head: torch.Tensor, total: torch.Tensor, rows: torch.Tensor):
        self.head, self.total, self.rows = head, total, rows

    @classmethod
    def allocate(cls, numel: int, rows: int, cols: int) -> "Exchange":
        return cls(torch.zeros(4, dtype=torch.int64).share_memory_(), torch.zeros(numel).share_memory_(),
                   torch.zeros(rows, cols, dtype=torch.float64).share_memory_())

    def __getstate__(self):
        return (self.head, self.total, self.rows)

    def __setstate__(self, state):
        self.__init__(*state)

    def request(self, step: int) -> None:
        self.head[self.REQ] = step + 1

    def requested(self) -> int:
        return int(self.head[self.REQ]) - 1

    def done(self, step: int) -> bool:
        return int(self.head[self.DONE]) == step + 1

    @property
    def failed(self) -> bool:
        return bool(self.head[self.FAILED])

    @property
    def count(self) -> int:
        return int(self.head[self.COUNT])

    def wait(self, step: int, poll_s: float = 0.001) -> None:
        """Until step ``step`` is reduced; ClusterError once the link gave up."""
        while not self.done(step):
            if self.failed:
                raise ClusterError(f"step {step}: the cross-node exchange was abandoned (a node was lost)")
            time.sleep(poll_s)
