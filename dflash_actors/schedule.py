"""The run's batch schedule: global batch ids over all epochs, and who does what.

Every epoch is planned from ``(seed, epoch)``; its batches after the last full optimizer
step are dropped (the reference does the same), so a step always consumes exactly
``A*M`` batches and global batch ids run contiguously through the epochs::

    global id g:   0 .. n_0-1 | n_0 .. n_0+n_1-1 | ...      n_e = steps_e * A * M
    epoch, b   :   (0, 0..)   | (1, 0..)         | ...      b = position in plan_e
    step       :   g // (A*M)     drafter: g % M     weights used: version = step

A resumed run starts at the first batch of its checkpoint's step; the ledger then covers
ids ``[start, total)`` only (row r is batch ``start + r``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .batching import EpochPlan, plan_for


def batches_per_step(cfg) -> int:
    """A * M: the batches one optimizer step consumes."""
    return cfg.train.grad_accum * cfg.topology.num_drafters


@dataclass(frozen=True)
class Schedule:
    per_step: int                 # A * M
    num_drafters: int
    steps_per_epoch: tuple[int, ...]

    @classmethod
    def from_config(cls, cfg, lengths: np.ndarray) -> "Schedule":
        per = batches_per_step(cfg)
        steps = tuple(len(plan_for(cfg, lengths, e)) // per for e in range(cfg.train.epochs))
        return cls(per, cfg.topology.num_drafters, steps)

    @property
    def total_steps(self) -> int:
        return sum(self.steps_per_epoch)

    @property
    def total_batches(self) -> int:
        return self.total_steps * self.per_step

    def locate(self, g: int) -> tuple[int, int]:
        """Global batch id -> (epoch, batch id within the epoch's plan)."""
        first = 0
        for e, steps in enumerate(self.steps_per_epoch):
            n = steps * self.per_step
            if g < first + n:
                return e, g - first
            first += n
        raise IndexError(f"batch {g} is past the end of the run ({self.total_batches} batches)")

    def step_of(self, g: int) -> int:
        return g // self.per_step

    def drafter_of(self, g: int) -> int:
        return g % self.num_drafters

    def is_last_of_step(self, g: int) -> bool:
        return (g + 1) % self.per_step == 0

    def is_first_for_drafter(self, g: int) -> bool:
        """The drafter's first batch of its step (its accumulator starts from zero)."""
        return g % self.per_step < self.num_drafters

    def last_for_drafter(self, step: int, j: int) -> int:
        """The last batch drafter j adds into its accumulator for ``step``."""
        return (step + 1) * self.per_step - self.num_drafters + j


class Plans:
    """Epoch plans computed on first use (a loader touches one epoch at a time)."""

    def __init__(self, cfg, lengths: np.ndarray):
        self.cfg, self.lengths = cfg, lengths
        self._plans: dict[int, EpochPlan] = {}

    def __getitem__(self, epoch: int) -> EpochPlan:
        if epoch not in self._plans:
            self._plans[epoch] = plan_for(self.cfg, self.lengths, epoch)
        return self._plans[epoch]
