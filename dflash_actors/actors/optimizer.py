"""optimizer.0: owns the drafter weights; sums gradients, steps AdamW, publishes versions.

Contract:
  consumes  ``Work(b)`` for GRAD_DONE batches in increasing b (ordered, one actor). For
            all but the last batch of a step there is nothing to do: the batch's
            gradient already sits in its drafter's committed running sum. On the last
            batch of step s it reads every drafter's sum for s.
  produces  step s: g = sum of drafter sums in drafter order, / (A*M), clipped, AdamW
            and scheduler step (``reference.reduce_and_step``, the reference's own
            code); the step's metrics row; then weights + moments of version s+1 in
            the inactive buffer and the version store (commit point); a checkpoint
            every ``train.checkpoint_every`` steps. The base then commits COMMITTED.
  waits for nothing: its Work arrives only once the batch is GRAD_DONE.
  on restart reloads weights, AdamW moments and the schedule position from the active
            buffer. A step whose version is already committed is not redone; a step
            killed before its commit is redone from the same inputs, identically. If the
            active state itself is untrustworthy (``WeightStore.problem``) it raises the
            shared ``rollback`` flag and waits: the job restarts from its last checkpoint.
"""

from __future__ import annotations

import time

import torch

from ..checkpoint import latest_checkpoint, save_checkpoint, trainer_state
from ..dispatch import ProtocolError
from ..metrics import fold_step, write_step
from ..models.drafter import build_drafter
from ..models.head import target_info
from ..reference import build_optimizer, build_scheduler, reduce_and_step
from .base import Actor


def restore_optimizer(opt, sched, params, store, version: int) -> None:
    """Put AdamW state and the LR schedule where ``version`` steps leave them."""
    store.load_params(params, version)
    if version == 0:
        return
    exp_avg, exp_avg_sq = store.moments(version)
    for p, m, v in zip(params, exp_avg, exp_avg_sq):
        opt.state[p] = {"step": torch.tensor(float(version)), "exp_avg": m.to(p.device, copy=True),
                        "exp_avg_sq": v.to(p.device, copy=True)}
    sched.last_epoch = version - 1
    sched.step()    # LambdaLR's lr is closed-form in last_epoch: exactly the reference's


class Optimizer(Actor):
    def attach(self) -> None:
        a = self.ctx.args
        self.cfg, self.schedule, self.start = a["cfg"], a["schedule"], a["start"]
        self.device = torch.device(a["device"])
        self.model = build_drafter(self.cfg, target_info(self.cfg, self.device))
        self.params = list(self.model.parameters())
        self.store, self.acc = self.ctx.shared["weights"], self.ctx.shared["grads"]
        self.batch_stats, self.step_stats = self.ctx.shared["batch_stats"], self.ctx.shared["step_stats"]
        self.opt = build_optimizer(self.params, self.cfg)
        self.sched = build_scheduler(self.opt, self.cfg, self.schedule.total_steps)
        problem = self.store.problem(self.start // self.schedule.per_step, self.schedule.total_steps)
        if problem:
            self._request_rollback(problem)
        restore_optimizer(self.opt, self.sched, self.params, self.store, self.store.version)

    def _request_rollback(self, problem: str) -> None:
        """Ask the job to go back to its last checkpoint, then idle until it stops us:
        restarting would only meet the same state again."""
        flag = self.ctx.shared["rollback"]
        msg = problem.encode()[:len(flag) - 1]
        flag[1:1 + len(msg)] = torch.tensor(list(msg), dtype=torch.uint8)
        flag[0] = 1
        while True:
            self.beat()
            time.sleep(self.ctx.heartbeat_s)

    def work(self, w) -> None:
        g = self.start + w.batch_id
        sched = self.schedule
        if not sched.is_last_of_step(g):
            return
        s = sched.step_of(g)
        if self.store.version == s + 1:
            self._maybe_checkpoint(s + 1)    # committed before a kill; the checkpoint may not be
            return
        if self.store.version != s:
            raise ProtocolError(f"step {s} ends at batch {g} but the weights are at v{self.store.version}")
        M = sched.num_drafters
        shard_grads = []
        for j in range(M):
            if self.acc.last_batch(j) != sched.last_for_drafter(s, j):
                raise ProtocolError(f"drafter.{j}'s sum ends at batch {self.acc.last_batch(j)}, "
                                    f"step {s} needs {sched.last_for_drafter(s, j)}")
            shard_grads.append([a.to(self.device) for a in self.acc.active(j)])
        lr = self.opt.param_groups[0]["lr"]
        norm = reduce_and_step(self.params, shard_grads, self.opt, self.sched, self.cfg)
        first = s * sched.per_step - self.start
        rows = [[r for r in range(first, first + sched.per_step) if (self.start + r) % M == j] for j in range(M)]
        stats, tokens = fold_step(self.batch_stats, rows)
        write_step(self.step_stats, s - self.start // sched.per_step, stats, lr, norm, tokens)
        states = [self.opt.state[p] for p in self.params]
        self.store.publish(s + 1, self.params, [st["exp_avg"] for st in states],
                           [st["exp_avg_sq"] for st in states])
        self._maybe_checkpoint(s + 1)

    def _maybe_checkpoint(self, version: int) -> None:
        every = self.cfg.train.checkpoint_every
        if not every or version % every or version == self.schedule.total_steps:
            return      # the final checkpoint is written by the pipeline once actors stop
        last = latest_checkpoint(self.ctx.run_dir)
        if last is not None and last.name == f"step-{version:07d}":
            return
        with self.beating():
            save_checkpoint(self.ctx.run_dir, version, self.model.save_pretrained,
                            trainer_state(self.cfg, self.schedule, self.store, version))
