"""optimizer.0: owns the drafter weights; sums gradients, steps AdamW, publishes versions.

Contract:
  consumes  ``Work(b)`` for GRAD_DONE batches in increasing b (one actor). For all but
            the last batch of a step there is nothing to do: the batch's gradient
            already sits in its drafter's committed running sum. On the last batch of
            step s it reads every drafter's sum for s.
  produces  step s (``optim.reduce_and_step``, the reference's step math); the step's
            metrics row; then weights + moments of version s+1 in the inactive buffer
            and the version store (commit point), which is what the drafters, already
            holding their batches of step s+1, wait for (``Drafter.ready``). The base
            then commits COMMITTED; only after that (``after_commit``, while the
            drafters work) comes the checkpoint of every ``train.checkpoint_every``-th
            version.
            A step whose loss or summed gradient is not finite is skipped
            (``optim.skip_step``: no update, the schedule moves on) and logged
            (``bad_step``); more than ``train.max_bad_steps`` in a row stop the job
            (``NonFiniteStop``) before that version is published.
  waits for nothing on one machine: its Work arrives only once the batch is GRAD_DONE
            and durable (under ``grad_durability: step`` a drafter's batches of a step
            come only once its sum is committed, so none it takes can still be redone).
            Across machines (``cluster``) it then asks the node's link for step s
            (``Exchange``) and waits, beating, for the sum over every node's drafters
            and every node's stats rows: the step it takes is the single-machine one.
            Only node 0 writes checkpoints.
  on restart reloads weights, AdamW moments and the schedule position from the active
            buffer. A step whose version is already committed is not redone; a step
            killed before its commit is redone from the same inputs, identically; a
            checkpoint the kill interrupted is written before the next step. If the
            active state itself is untrustworthy (``WeightStore.problem``) it raises
            ``RollbackRequired``: restarting would only meet the same state again, so
            the supervisor stops the job and the job rolls back to its last checkpoint.
"""

from __future__ import annotations

import errno
import math
import sys
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from ..cluster.exchange import ClusterError, Exchange
from ..config import Config
from ..models.drafter_start import drafter_shell
from ..models.head import target_info
from ..runtime.actor import Actor, Escalate
from ..runtime.messages import ProtocolError
from ..train.checkpoint import save_checkpoint, trainer_state, verified_checkpoint
from ..train.metrics import bad_run, fold_step, write_step
from ..train.optim import build_optimizer, build_scheduler, reduce_and_step, restore
from ..train.params import GradAccumulators, WeightStore
from ..train.schedule import Schedule

CHECKPOINT_FLOOR_BYTES_PER_S = 10e6
"""A checkpoint write (or the hash of one already there) slower than this is taken for
hung: it beats for at most its bytes at this rate plus ``hang_timeout_s``. A stuck
filesystem then ends in a restart instead of a job that waits forever."""


class RollbackRequired(Escalate):
    """The committed weights or optimizer state cannot be trusted."""


class ClusterLost(Escalate):
    """The node's link gave up on the step's exchange: the run stops on this node."""


class NonFiniteStop(Escalate):
    """Too many steps in a row were skipped for non-finite values: restarting would
    meet the same batches again, so the job stops (its checkpoint is the last good state)."""


@dataclass(frozen=True)
class OptimizerSpec:
    SECTIONS: ClassVar[tuple[str, ...]] = ("data", "batching", "target", "drafter", "train", "topology", "runtime",
                                           "eval", "monitor")
    """The config sections ``cfg`` carries (``Config.carrying``): all of them, since each
    checkpoint records the run's whole config and its hash (``checkpoint.trainer_state``)."""
    cfg: Config
    schedule: Schedule
    device: str
    first_step: int
    """The weight version this run started from (a committed version below it is impossible)."""
    weights: WeightStore
    grads: GradAccumulators
    batch_stats: torch.Tensor
    step_stats: torch.Tensor
    """``metrics.step_table``: row s gets step s's metrics."""
    exchange: Optional[Exchange] = None
    """Across machines: where the link puts each step's cross-node sum (None: one machine)."""


class Optimizer(Actor):
    spec: OptimizerSpec
    FAULT_POINTS = (*Actor.FAULT_POINTS, "publish", "checkpoint")

    def attach(self) -> None:
        spec, store = self.spec, self.spec.weights
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":
            # Before anything touches CUDA: the pinning's context, and the heartbeat's
            # gpu_mb, belong to this device, not cuda:0.
            torch.cuda.set_device(self.device)
        spec.grads.pin(self.device)
        store.pin(self.device, moments=True)
        self.starting("build drafter")
        self.model = drafter_shell(spec.cfg, target_info(spec.cfg, self.device))
        self.params = list(self.model.parameters())
        self.opt = build_optimizer(self.params, spec.cfg.train)
        self.sched = build_scheduler(self.opt, spec.cfg.train, spec.schedule.total_steps)
        problem = store.problem(spec.first_step, spec.schedule.total_steps)
        if problem:
            raise RollbackRequired(f"optimizer state inconsistent: {problem}")
        version = store.version
        self.starting("restore weights and optimizer state")
        store.load_params(self.params, version)
        restore(self.opt, self.sched, self.params, version, *store.moments(version))
        # A kill may have cut the checkpoint of this version short: write it before the
        # next step changes the state (not here: a long write would look like a hang).
        self.owed_checkpoint = version

    def work(self, w) -> None:
        sched, store, acc = self.spec.schedule, self.spec.weights, self.spec.grads
        if self.owed_checkpoint is not None:
            self._maybe_checkpoint(self.owed_checkpoint)
            self.owed_checkpoint = None
        if not sched.is_last_of_step(w.batch_id):
            return
        s = sched.step_of(w.batch_id)
        if store.version == s + 1:
            return      # committed before a kill; only the ledger commit was lost
        if store.version != s:
            raise ProtocolError(f"step {s} ends at batch {w.batch_id} but the weights are at v{store.version}")
        b = w.batch_id
        shards = [sched.drafter_batches(s, j) for j in range(sched.num_drafters)]
        for j, batches in enumerate(shards):
            if acc.last_batch(j) != batches[-1] or acc.count(j) != len(batches):
                raise ProtocolError(f"drafter.{j}'s sum holds {acc.count(j)} batches ending at "
                                    f"{acc.last_batch(j)}; step {s} needs {len(batches)} ending at {batches[-1]}")
        x = self.spec.exchange
        if x is None:
            # Read by the step, one drafter's sum at a time: the device holds the total
            # and at most one shard, not all M.
            shard_grads = (acc.active(j) for j in range(sched.num_drafters))
            stats, tokens = fold_step(self.spec.batch_stats, shards)
            count = sum(acc.count(j) for j in range(sched.num_drafters))
        else:
            x.request(s)
            with self.span("cross-node exchange", b), self.beating():
                try:
                    x.wait(s)
                except ClusterError as e:
                    raise ClusterLost(str(e)) from None
            shard_grads = [acc.layout.views(x.total)]
            a = sched.per_step // sched.num_drafters
            stats, tokens = fold_step(x.rows, [range(i, i + a) for i in range(0, len(x.rows), a)])
            count = x.count
        lr = self.opt.param_groups[0]["lr"]
        loss = stats.metrics()["loss"]
        with self.span("optimizer step", b):
            norm = reduce_and_step(self.params, shard_grads, self.opt, self.sched, sched.batches_per_step,
                                   self.spec.cfg.train.grad_clip, loss)
        skipped = not math.isfinite(norm)
        write_step(self.spec.step_stats, s, stats, lr, norm, tokens, skipped)
        if skipped:
            self._bad_step(s, loss, norm)
        states = [self.opt.state[p] for p in self.params]
        with self.span("publish", b):
            store.publish(s + 1, self.params, [st["exp_avg"] for st in states],
                          [st["exp_avg_sq"] for st in states], midway=lambda: self.fault_point("publish", b),
                          applied=store.applied(s) + count)

    def _bad_step(self, s: int, loss: float, norm: float) -> None:
        """Step s was skipped (non-finite): log it; past ``train.max_bad_steps`` in a
        row, stop the job before publishing (its version is then the last good one's)."""
        run = bad_run(self.spec.step_stats, s) + 1
        limit = self.spec.cfg.train.max_bad_steps
        self.report("bad_step", step=s, loss=str(loss), grad_norm=str(norm), in_a_row=run,
                    reason="non-finite loss or gradient; step skipped")
        if run > limit:
            first = s - run + 1
            raise NonFiniteStop(f"{run} steps in a row had a non-finite loss or gradient (steps {first}..{s}, "
                                f"train.max_bad_steps={limit}); the weights are still those from before step {first}")

    def after_commit(self, w) -> None:
        sched = self.spec.schedule
        if sched.is_last_of_step(w.batch_id):
            self._maybe_checkpoint(sched.step_of(w.batch_id) + 1)

    def _maybe_checkpoint(self, version: int) -> None:
        """Write the checkpoint of ``version`` (the committed one) if it is due and no
        checkpoint of it verifies.

        A full disk (ENOSPC, EDQUOT) is not a crash: a restart would meet the same disk
        and burn the restart budget of a healthy actor, and stopping would throw away
        the training since the last checkpoint. The write is dropped (``save_checkpoint``
        removes its temporary directory; the previous checkpoint is untouched), one
        line goes to stderr, and the next due version tries again while training goes
        on. The final checkpoint is the job's, which stops with an error if it fails."""
        cfg = self.spec.cfg
        every = cfg.train.checkpoint_every
        if not every or not version or version % every or version == self.spec.schedule.total_steps:
            return      # the final checkpoint is written by the job once actors stop
        if self.spec.schedule.node:
            return      # across machines node 0 writes them
        run_dir = cfg.runtime.run_dir
        # Weights and two moments in fp32, written (or hashed) at no less than the floor rate.
        limit_s = cfg.runtime.hang_timeout_s + 3 * 4 * self.spec.weights.layout.numel / CHECKPOINT_FLOOR_BYTES_PER_S
        with self.beating(limit_s), self.span("checkpoint", step=version):
            if verified_checkpoint(run_dir, version) is not None:   # hashes it: beating
                return
            try:
                save_checkpoint(run_dir, version, self._drafter_writer(version),
                                trainer_state(cfg, self.spec.schedule, self.spec.weights, version))
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                line = (f"checkpoint step-{version:07d} not written ({e.strerror}); "
                        f"training goes on, next try at step {version + every}")
                self.report("checkpoint_failed", step=version, reason=line)
                print(f"optimizer: {line}", file=sys.stderr, flush=True)

    def _drafter_writer(self, version: int):
        """``save_pretrained``, then the ``checkpoint`` fault point: half the files written."""
        last_batch = self.spec.schedule.first_of_step(version) - 1

        def write(path) -> None:
            self.model.save_pretrained(path)
            self.fault_point("checkpoint", last_batch)
        return write
