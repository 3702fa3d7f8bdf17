"""drafter.j: one data-parallel replica of the DFlash drafter; features in, gradients out.

Contract:
  consumes  ``Work(b)`` for FEATURED batches with ``Schedule.drafter_of(b) == j``, in
            increasing b; reads feature slot ``in_slot`` (host or device memory,
            ``runtime.feature_transport``) and weight version ``s = Schedule.step_of(b)``
            from the shared ``WeightStore``
  produces  batch b's stats row, and b's gradient added into this drafter's running
            sum for step s (made in micro-batches of ``train.drafter_block_tokens``,
            ``train.drafter_step``: the memory plan sizes them to the device).
            Where that sum lives is ``runtime.grad_durability``:
              batch  in shared memory (``GradAccumulators``, header flip = commit
                     point), loaded to the device and stored back for every batch
              step   on the device, in ``p.grad``; stored into ``GradAccumulators``
                     once, on the drafter's last batch of the step
            the base then commits GRAD_DONE and the feature slot is freed
  waits for weight version s (``ready``): the supervisor sends batch b once every
            batch of the steps before s has its gradient durably summed (the stage's
            ``barrier``, ``early`` in the pipelined schedule; in lock-step, once they
            are committed), and the drafter waits on the shared version itself, which
            the optimizer publishes before its commit reaches the supervisor. The
            wait is not in the batch's work time; a Stop ends it (nothing committed)
  on restart rebuilds the module (cheap: weights come from the store); a batch the
            header already names is not added again. With ``batch`` the next batch
            continues from the committed running sum; with ``step`` the sum of the
            current step died with the process, so the supervisor sends this
            drafter's batches of the step since its last commit back to the loader
            (the stage is ``durable`` only on the last batch) and they are made and
            added again, in the same order: either way the sum is bit-identical to
            one never interrupted.
Under ``runtime.simulate`` forward and backward are a wait: the features are still
copied out of the slot (and their stamp checked), and every gradient still written.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..config import Config
from ..data.batching import FEATURES, Batch, BatchMeta
from ..models.drafter_start import drafter_shell
from ..models.head import load_head
from ..models.loss import Objective
from ..runtime.actor import Actor
from ..runtime.messages import ProtocolError
from ..train.drafter_step import drafter_step, step_options
from ..train.metrics import write_batch
from ..train.params import GradAccumulators, WeightStore
from ..train.schedule import Schedule
from ..train.simulate import SimulatedCompute, fake_backward, no_stats, stamp_problem, wait


@dataclass(frozen=True)
class DrafterSpec:
    SECTIONS: ClassVar[tuple[str, ...]] = ("data", "batching", "target", "drafter", "train", "topology", "runtime")
    """The config sections ``cfg`` carries (``Config.carrying``), all its stage reads: the
    model builders take the tree (the drafter's shape follows its target's, and so the
    target's path and, for the tiny one, the synthetic data). Not eval nor monitor."""
    cfg: Config
    schedule: Schedule
    devices: tuple[str, ...]
    """Drafter j runs on ``devices[j]``."""
    weights: WeightStore
    grads: GradAccumulators
    batch_stats: torch.Tensor
    """``metrics.batch_table``: row b gets batch b's stats."""


class Drafter(Actor):
    spec: DrafterSpec
    FAULT_POINTS = (*Actor.FAULT_POINTS, "wait")
    """``wait``: while it waits for the weights of its batch's step (``ready``)."""

    def attach(self) -> None:
        self.j = self.ctx.index
        self.device = torch.device(self.spec.devices[self.j])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.starting("load the target's embeddings and head")
        self.head = load_head(self.spec.cfg, self.device)
        self.starting("build drafter")
        self.model = drafter_shell(self.spec.cfg, self.head)
        self.params = list(self.model.parameters())
        self.objective = Objective.from_config(self.spec.cfg)
        self.version = -1
        self.nan_batch = -1
        self.keep_sum = self.spec.cfg.runtime.grad_durability == "step"
        self.sum_through = -1
        """The last batch in ``p.grad`` (``step`` durability; -1: none)."""
        self.sim = SimulatedCompute.from_config(self.spec.cfg)
        if self.sim is not None:
            like = self.in_ring.slot(0)[FEATURES]
            self.sink = torch.empty(like.shape, dtype=like.dtype, device=self.device)
        self.in_ring.pin(self.device)
        self.spec.grads.pin(self.device)
        self.spec.weights.pin(self.device, moments=False)
        self.cold = self.device.type == "cuda"
        """The next batch is this process's first on a GPU: it compiles flex attention."""

    def ready(self, w) -> bool:
        """Version ``step_of(b)`` is published (or b was added before a kill, and needs
        no weights). It cannot be later: that step needs b's gradient."""
        b = w.batch_id
        return self.spec.weights.version >= self.spec.schedule.step_of(b) or self.spec.grads.last_batch(self.j) >= b

    def poison(self, w) -> None:
        self.nan_batch = w.batch_id

    def _load_weights(self, s: int) -> None:
        store = self.spec.weights
        if store.version != s:
            raise ProtocolError(f"{self.ctx.actor_id}: batch of step {s} but weights are at v{store.version}")
        if self.version != s:
            store.load_params(self.params, s)
            self.version = s

    def work(self, w) -> None:
        b, sched, acc = w.batch_id, self.spec.schedule, self.spec.grads
        if acc.last_batch(self.j) >= b:
            return      # added before a kill; only the ledger commit was lost
        with self.span("weights", b):
            self._load_weights(sched.step_of(b))
        with self.span("gradient load", b):
            count = self._running_sum(b)
        meta = BatchMeta(*self.ledger.meta(b))
        slot = self.in_ring.slot(w.in_slot)
        batch = Batch.from_slot(slot, meta).to(self.device)
        # A GPU's first batch compiles flex attention and its block mask, cold: minutes
        # with no loop to beat from, so it beats for up to 10 minutes past the hang timeout.
        cold, self.cold = self.cold, False
        compiling = self.beating(self.spec.cfg.runtime.hang_timeout_s + 600) if cold else contextlib.nullcontext()
        with self.span("drafter forward/backward", b, tokens=meta.n_tokens), compiling:
            stats = self._train(b, batch, slot[FEATURES][:meta.n_tokens])
        if self.nan_batch == b:     # runtime.faults kind "nan": the optimizer must catch it
            for p in self.params:
                p.grad.fill_(float("nan"))
        write_batch(self.spec.batch_stats, b, stats, meta.n_tokens)
        self.sum_through = b
        if not self.keep_sum or sched.is_last_for_drafter(b):
            with self.span("gradient commit", b):
                acc.commit(self.j, b, [p.grad for p in self.params], count)
        if self.device.type == "cuda":
            # Kernels may still read the slot (in place, when the feature ring is on
            # this GPU); it is freed, and rewritten by a target, once we commit.
            torch.cuda.synchronize(self.device)

    def _running_sum(self, b: int) -> int:
        """Make p.grad this step's running sum before batch b (None for the drafter's
        first batch of the step); how many batches it will hold with b."""
        acc, sched = self.spec.grads, self.spec.schedule
        prev = sched.previous_for_drafter(b)
        if prev is None:
            for p in self.params:
                p.grad = None
            return 1
        # The sum so far ends at prev: on the device (step), or committed (batch).
        have = self.sum_through if self.keep_sum else acc.last_batch(self.j)
        if have != prev:
            raise ProtocolError(f"{self.ctx.actor_id}: batch {b} follows {prev}, but the running sum ends at {have}")
        if not self.keep_sum:
            for p, g in zip(self.params, acc.active(self.j)):
                p.grad = g.to(self.device, copy=True)
        return (b - sched.first_of_own_step(b)) // sched.num_drafters + 1

    def _train(self, b: int, batch: Batch, slot_features: torch.Tensor):
        """Forward and backward of batch b (gradients added into p.grad); its stats."""
        n = len(slot_features)
        if self.sim is not None:
            features = self.sink[:n]
            features.copy_(slot_features)
            problem = stamp_problem(features, n, b)
            if problem:
                raise ProtocolError(f"{self.ctx.actor_id}: feature slot of batch {b} holds {problem}")
            wait(self.sim.drafter_s(n))
            fake_backward(self.params)
            return no_stats(self.spec.cfg.drafter.block_size)
        epoch, i = self.spec.schedule.locate(b)
        return drafter_step(self.model, self.head, slot_features.to(self.device), batch, self.objective,
                            epoch=epoch, batch_id=i, **step_options(self.spec.cfg))
