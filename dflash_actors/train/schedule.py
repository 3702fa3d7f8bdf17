"""The run's batch schedule: one batch id space over all epochs, and who does what.

Every epoch is planned from ``(seed, epoch)``; its batches after the last full optimizer
step are dropped (the reference does the same), so a step always consumes exactly
``A*M`` batches and batch ids run contiguously through the epochs::

    batch id b :   0 .. n_0-1 | n_0 .. n_0+n_1-1 | ...      n_e = steps_e * A * M
    (epoch, i) :   (0, 0..)   | (1, 0..)         | ...      i = position in plan_e
    step       :   b // (A*M)       drafter: b % M       weights used: version = step

Across ``topology.nodes`` = K machines (``cluster``) the math is that of one machine
with K*M drafters: global batch g goes to global drafter ``g mod K*M``, and node k owns
drafters k*M .. k*M+M-1. Each node runs an ordinary pipeline over *local* ids (its
ledger, rings and drafters see a schedule of A*M batches per step) that map onto the
global ids its drafters consume, in the same order::

    local l = s*A*M + a*M + j   <->   global g = s*A*K*M + a*K*M + k*M + j

``locate`` answers for the global id (the plan, the anchors' seeds), so a node's
batches are exactly the ones a single machine would give those drafters.

Batch b is row b of the ledger in every run, resumed or not (a resumed run starts at
``first_of_step(version)``), and this class is the only place that turns a batch id
into its epoch, step or drafter: the dispatcher, the drafters, the optimizer, the
checkpoint and the reference all ask it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..data.batching import EpochPlan, plan_for


@dataclass(frozen=True)
class Schedule:
    per_step: int                 # A * M
    num_drafters: int             # M
    steps_per_epoch: tuple[int, ...]
    nodes: int = 1                # K: machines sharing each step
    node: int = 0                 # which of them this schedule is

    @classmethod
    def from_config(cls, cfg, lengths: np.ndarray, node: int | None = None) -> "Schedule":
        """The schedule of node ``node``; None: the whole run as one machine with all
        ``topology.nodes * num_drafters`` drafters (what the reference trains)."""
        return cls.from_epoch_sizes(cfg, [len(plan_for(cfg, lengths, e)) for e in range(cfg.train.epochs)], node)

    @classmethod
    def from_epoch_sizes(cls, cfg, batches: list[int], node: int | None = None) -> "Schedule":
        """``from_config`` from the number of batches each epoch's plan holds."""
        nodes, m = cfg.topology.nodes, cfg.topology.num_drafters
        per_all = cfg.train.grad_accum * m * nodes
        steps = tuple(n // per_all for n in batches)
        if cfg.train.max_steps:     # cut at the cap; epochs left without a step are not part of the run
            left, capped = cfg.train.max_steps, []
            for n in steps:
                if left == 0:
                    break
                capped.append(min(n, left))
                left -= capped[-1]
            steps = tuple(capped)
        if node is None or nodes == 1:
            return cls(per_all, m * nodes, steps)
        if not 0 <= node < nodes:
            raise ValueError(f"node {node} of {nodes}")
        return cls(cfg.train.grad_accum * m, m, steps, nodes, node)

    @property
    def batches_per_step(self) -> int:
        """Batches one step consumes on all nodes together."""
        return self.per_step * self.nodes

    def global_id(self, b: int) -> int:
        """This node's batch ``b`` as the run's batch id (the same id on one node)."""
        if self.nodes == 1:
            return b
        s, r = divmod(b, self.per_step)
        a, j = divmod(r, self.num_drafters)
        return (s * self.per_step + a * self.num_drafters) * self.nodes + self.node * self.num_drafters + j

    @property
    def total_steps(self) -> int:
        return sum(self.steps_per_epoch)

    @property
    def total_batches(self) -> int:
        return self.total_steps * self.per_step

    def locate(self, b: int) -> tuple[int, int]:
        """Batch id -> (epoch, position in that epoch's plan), by its global id."""
        b, first = self.global_id(b), 0
        for e, steps in enumerate(self.steps_per_epoch):
            n = steps * self.batches_per_step
            if b < first + n:
                return e, b - first
            first += n
        raise IndexError(f"batch {b} is past the end of the run ({self.total_steps * self.batches_per_step} batches)")

    def epoch_of_step(self, step: int) -> int:
        """The epoch step ``step`` belongs to (``len(steps_per_epoch)`` once all are done)."""
        return self.locate(self.first_of_step(step))[0] if step < self.total_steps else len(self.steps_per_epoch)

    def step_of(self, b: int) -> int:
        return b // self.per_step

    def first_of_step(self, step: int) -> int:
        """The first batch of ``step``: where a run resumed at weight version ``step``
        starts, and the batch below which everything is committed once version
        ``step`` is."""
        return step * self.per_step

    def first_of_own_step(self, b: int) -> int:
        return self.first_of_step(self.step_of(b))

    def step_batches(self, b: int) -> range:
        """Every batch of b's step (a lock-step group)."""
        first = self.first_of_own_step(b)
        return range(first, first + self.per_step)

    def drafter_of(self, b: int) -> int:
        return b % self.num_drafters

    def drafter_batches(self, step: int, j: int) -> range:
        """The batches drafter j sums for ``step``, in the order it sums them."""
        return range(self.first_of_step(step) + j, self.first_of_step(step + 1), self.num_drafters)

    def previous_for_drafter(self, b: int) -> int | None:
        """The batch drafter ``drafter_of(b)`` adds just before b in the same step (None:
        b is its first, so its running sum starts from zero)."""
        prev = b - self.num_drafters
        return prev if prev >= self.first_of_own_step(b) else None

    def is_last_for_drafter(self, b: int) -> bool:
        """b is the last batch its drafter adds in its step (its sum is then complete)."""
        return b + self.num_drafters >= self.first_of_step(self.step_of(b) + 1)

    def is_last_of_step(self, b: int) -> bool:
        return b == self.first_of_step(self.step_of(b) + 1) - 1


class Plans:
    """Epoch plans computed on first use (a loader touches one epoch at a time)."""

    def __init__(self, cfg, lengths: np.ndarray):
        self.cfg, self.lengths = cfg, lengths
        self._plans: dict[int, EpochPlan] = {}

    def __getitem__(self, epoch: int) -> EpochPlan:
        if epoch not in self._plans:
            self._plans[epoch] = plan_for(self.cfg, self.lengths, epoch)
        return self._plans[epoch]
