"""drafter.j: one data-parallel replica of the DFlash drafter; features in, gradients out.

Contract:
  consumes  ``Work(b)`` for FEATURED batches with ``b % M == j``, in increasing b (an
            ordered stage); reads feature slot ``in_slot`` and weight version
            ``s = b // (A*M)`` from the shared ``WeightStore``
  produces  batch b's stats row, then its gradient added into this drafter's running
            sum for step s (``GradAccumulators``: header flip = commit point); the base
            then commits GRAD_DONE and the feature slot is freed
  waits for weight version s to be committed by the optimizer (polling the version
            word every millisecond while beating: it is an int in shared memory, and
            the optimizer publishes it without a message); gives up, uncommitted, when
            the job is stopping
  on restart rebuilds the module (cheap: weights come from the store); a batch the
            header already names is not added again, and the next batch continues
            from the committed running sum, so the sum is bit-identical to one never
            interrupted.
"""

from __future__ import annotations

import time

import torch

from ..batching import Batch
from ..dispatch import ProtocolError
from ..metrics import write_batch
from ..models.drafter import build_drafter
from ..models.head import load_head
from ..models.loss import batch_loss, decay_gamma
from .base import Actor, Shutdown

VERSION_POLL_S = 0.001


class Drafter(Actor):
    def attach(self) -> None:
        a = self.ctx.args
        self.cfg, self.schedule, self.start = a["cfg"], a["schedule"], a["start"]
        self.j = self.ctx.index
        self.device = torch.device(a["devices"][self.j])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.head = load_head(self.cfg, self.device)
        self.model = build_drafter(self.cfg, self.head)
        self.params = list(self.model.parameters())
        self.store, self.acc = self.ctx.shared["weights"], self.ctx.shared["grads"]
        self.stats, self.stopping = self.ctx.shared["batch_stats"], self.ctx.shared["stopping"]
        self.gamma = decay_gamma(self.cfg)
        self.version = -1
        self.in_ring.pin()

    def _await_version(self, s: int) -> None:
        while (v := self.store.version) < s:
            if self.stopping[0]:
                # The optimizer is stopping too, so version s may never come; leave the
                # batch uncommitted (FEATURED) rather than hold up the shutdown.
                raise Shutdown("job stopping while waiting for weights")
            time.sleep(VERSION_POLL_S)
            self.beat()
        if v != s:
            raise ProtocolError(f"{self.ctx.actor_id}: batch of step {s} but weights are at v{v}")
        if self.version != s:
            self.store.load_params(self.params, s)
            self.version = s

    def work(self, w) -> None:
        g = self.start + w.batch_id
        sched, M = self.schedule, self.schedule.num_drafters
        if self.acc.last_batch(self.j) >= g:
            return      # added before a kill; only the ledger commit was lost
        s = sched.step_of(g)
        self._await_version(s)
        if sched.is_first_for_drafter(g):
            for p in self.params:
                p.grad = None
        else:
            if self.acc.last_batch(self.j) != g - M:
                raise ProtocolError(f"{self.ctx.actor_id}: batch {g} follows {self.acc.last_batch(self.j)}, "
                                    f"expected {g - M}")
            for p, acc in zip(self.params, self.acc.active(self.j)):
                p.grad = acc.to(self.device, copy=True)
        meta = self.ledger.meta(w.batch_id)
        slot = self.in_ring.slot(w.in_slot)
        batch = Batch.from_buffers(self.in_ring.batch_buffers(w.in_slot), meta).to(self.device)
        features = slot["hidden"][:meta.n_tokens].to(self.device)
        epoch, b = sched.locate(g)
        t = self.cfg.train
        loss, stats = batch_loss(self.model, self.head, features, batch, num_anchors=t.num_anchors,
                                 gamma=self.gamma, seed=t.seed, epoch=epoch, batch_id=b)
        loss.backward()
        write_batch(self.stats, w.batch_id, stats, meta.n_tokens)
        self.acc.commit(self.j, g, [p.grad for p in self.params])
