"""target.i: the frozen target LLM; batch slot in, feature slot out.

Contract:
  consumes  ``Work(b)`` for LOADED batches (any free target takes the next one, so
            targets run as far ahead of the drafters as the feature ring allows)
  produces  feature slot ``out_slot``: the batch's packed fields copied over (so the
            batch slot can be freed) plus the features ``[:T]`` = the selected layers'
            outputs, concatenated; the slot is in host memory or on a GPU
            (``runtime.feature_transport``); the base then commits FEATURED
  waits for a free feature slot (reserved by the supervisor before dispatch)
  on start checks its features against the model's plain forward (``target.self_check``);
            a mismatch raises ``SelfCheckFailed`` and stops the job before training
            (once per job on CPU with shared weights: every start computes on the
            bytes the first one checked, ``models.shared_weights``)
  on restart reloads the target (maps the job's shared copy of its weights with
            ``target.share_weights``, else reads the checkpoint); whatever it held is
            put back to LOADED, its batch slot untouched, and recomputed by whichever
            target is free.
With ``target.feature_cache`` (``train.feature_cache``) the features of samples seen in
an earlier batch come from the job's cache instead (a batch entirely cached skips the
forward), and the samples this batch is the first to hold are stored there: rows, then
a per-sample flag (fault point ``cache``, between the two). An entry that should be
there and is not is recomputed here, by assembling its first batch from the dataset,
never waited for; the cache outlives a target's restart.
With ``topology.target_tp`` K > 1 a target actor is a gang of K processes
(``runtime.dispatch.Stage.gang``): every rank joins the gang's process group, loads its
shard (``models.tensor_parallel``) and runs every batch; rank 0 alone copies the batch
over and writes the features, which are whole on every rank. With ``target.share_weights``
every rank slices its shard from the job's shared unsplit copy instead of the
checkpoint's files (``models.shared_weights``). At the job's first start of a gang its
self-check also compares the split layers with the checkpoint's own, rebuilt unsplit
on rank 0 (``tensor_parallel.check_split``), at any size, and says so (event
``self_check``). A dead or hung rank takes the gang with it. Fault points ``join``
(before the gang's rendezvous) and ``load`` (before the weights are read or mapped)
strike during start-up (their batch: how many batches the targets have featured).
Under ``runtime.simulate`` the forward is a wait and the features a stamped tensor of
the slot's width kept in device memory (``simulate``); every copy stays (the cache is
refused there: there are no features to keep).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from ..config import Config
from ..data.batching import FEATURES, Batch, BatchMeta, copy_batch
from ..models.shared_weights import SharedWeights
from ..runtime.actor import Actor, Escalate
from ..train.feature_cache import FeatureCache
from ..train.schedule import Schedule
from ..train.simulate import SimulatedCompute, stamp, wait


class SelfCheckFailed(Escalate):
    """The features would be wrong on every restart: stop the job before training."""


@dataclass(frozen=True)
class TargetSpec:
    SECTIONS: ClassVar[tuple[str, ...]] = ("data", "batching", "target", "drafter", "train", "topology", "runtime")
    """The config sections ``cfg`` carries (``Config.carrying``), all its stage reads: the
    model builders take the tree (the tiny target is fitted to the synthetic data; the
    drafter's taps and a distilling loss pick the layers; gangs and simulated compute read
    topology and runtime). Not eval nor monitor."""
    cfg: Config
    devices: tuple[str, ...]
    """Rank r of target i runs on ``devices[i * K + r]`` (K = ``topology.target_tp``)."""
    schedule: Schedule
    """This node's: the cache plans in the run's (global) batch ids."""
    cache: Optional[FeatureCache] = None
    weights: Optional[SharedWeights] = None
    """The target's weights in shared host memory (``target.share_weights``), or None:
    each actor reads the checkpoint."""
    unsplit_checked: Optional[torch.Tensor] = None
    """Gangs: a shared int8 flag, 1 once a gang's split has matched the checkpoint's
    unsplit layers in this job; later starts check against their own forward only."""


class Target(Actor):
    spec: TargetSpec
    FAULT_POINTS = (*Actor.FAULT_POINTS, "cache", "join", "load")
    PRELOAD = ("dflash_actors.models.target",)

    def attach(self) -> None:
        ctx = self.ctx
        self.device = torch.device(self.spec.devices[ctx.index * ctx.gang + ctx.rank])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.sim = SimulatedCompute.from_config(self.spec.cfg)
        if self.sim is None:
            # Imported here: transformers costs seconds of every start, which a
            # simulated target (and its restarts) need not pay.
            from ..models.self_check import SelfCheckError, self_check
            from ..models.target import load_target
            shared = self.spec.weights is not None
            if ctx.gang > 1:
                from ..models import tensor_parallel
                self.starting(f"join the gang of {ctx.gang} ranks")
                self.fault_point("join", self.ledger.past(ctx.to_state))
                tensor_parallel.join(ctx.rendezvous, ctx.rank, ctx.gang, self.device,
                                     self.spec.cfg.runtime.start_timeout_s)
                phase = "slice this rank's shard from shared weights" if shared else "load this rank's shard"
            elif not shared:
                phase = "load target weights"
            else:
                phase = "copy shared weights to device" if self.device.type == "cuda" else "map shared weights"
            self.starting(phase)
            self.fault_point("load", self.ledger.past(ctx.to_state))
            self.model = load_target(self.spec.cfg, self.device, lambda done, total: self.starting(phase, done, total),
                                     weights=self.spec.weights, world=ctx.gang)
            in_place = shared and self.device.type == "cpu" and ctx.gang == 1
            if self.spec.cfg.target.self_check and not (in_place and self.spec.weights.checked.item()):
                self.starting("self-check features")
                try:
                    self_check(self.model)
                    if ctx.gang > 1:
                        self._check_split()
                except SelfCheckError as e:
                    raise SelfCheckFailed(str(e)) from None
                if in_place:
                    self.spec.weights.checked.fill_(1)
        else:
            like = self.out_ring.slot(0)[FEATURES]
            self.fake = torch.zeros(like.shape, dtype=like.dtype, device=self.device)
        self.in_ring.pin(self.device)
        self.out_ring.pin(self.device)
        if self.spec.cache is not None and self.device.type == "cuda":
            self.spec.cache.pin()

    def _check_split(self) -> None:
        """A gang's check against the checkpoint's unsplit layers
        (``tensor_parallel.check_split``), at the job's first start of a gang: later
        starts split the same files with the same code (event ``self_check``)."""
        from ..models import tensor_parallel
        from ..models.target import ensure_target
        flag = self.spec.unsplit_checked
        if flag is not None and flag.item():
            if self.ctx.rank == 0:
                self.report("self_check", against="the split model's own forward",
                            reason="a gang of this job matched the checkpoint's unsplit layers at its first start")
            return
        against = tensor_parallel.check_split(self.model, ensure_target(self.spec.cfg), self.ctx.rank)
        if self.ctx.rank == 0:
            self.report("self_check", against=f"{against} and the split model's own forward",
                        reason="the first start of a gang in this job")
            if flag is not None:
                flag.fill_(1)

    def work(self, w) -> None:
        b = w.batch_id
        meta = BatchMeta(*self.ledger.meta(b))
        if self.ctx.rank > 0:
            # A follower runs the forward for its collectives and keeps nothing: rank 0
            # writes the features. Rank 0 commits, and the loader may refill the batch
            # slot, as soon as the last collective is done, while this rank still packs
            # its copy of the result: so it works on its own copy of the batch.
            batch = Batch.from_slot(self.in_ring.slot(w.in_slot), meta)
            batch = Batch(*(t.clone() for t in (batch.input_ids, batch.position_ids, batch.loss_mask,
                                                batch.cu_seqlens)), batch.max_len)
            self._forward(batch.to(self.device), meta.n_tokens, b)
            return
        src, dst = self.in_ring.slot(w.in_slot), self.out_ring.slot(w.out_slot)
        copy_batch(src, dst, meta)
        batch = Batch.from_slot(src, meta).to(self.device, non_blocking=True)
        out = dst[FEATURES][:meta.n_tokens]
        if self.spec.cache is None:
            with self.span("target forward", b, tokens=meta.n_tokens):
                features = self._forward(batch, meta.n_tokens, b, out)
        else:
            with self.span("cached features", b, tokens=meta.n_tokens):
                features = self.spec.cache.features(
                    self.spec.schedule.global_id(b), src["sample_ids"][:meta.n_samples].numpy(),
                    src["cu_seqlens"][:meta.n_samples + 1].numpy(), batch, self.model.features, self.device,
                    self.ctx.index, midway=lambda: self.fault_point("cache", b))
        with self.span("feature copy", b, bytes=out.numel() * out.element_size()):
            if features is not out:
                out.copy_(features)
            # The slot must be complete before the commit: on our device, and on the
            # ring's when the feature ring lives on another GPU (peer to peer).
            for dev in {self.device, out.device}:
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)

    def _forward(self, batch: Batch, n_tokens: int, b: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The batch's features; a real forward writes them into ``out`` when given
        (each layer's rows as it ends, with no whole-batch copy), a simulated one does not."""
        if self.sim is None:
            return self.model.features(batch, out=out)
        wait(self.sim.target_s(n_tokens))
        stamp(self.fake, n_tokens, b)
        return self.fake[:n_tokens]
