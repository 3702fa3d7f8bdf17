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
over and writes the features, which are whole on every rank. At the job's first start
of a gang its self-check compares rank 0's features with the unsplit model too, when
that is small enough (``UNSPLIT_CHECK_BYTES``), and says which it did (event
``self_check``). A dead or hung rank takes the gang with it.
Under ``runtime.simulate`` the forward is a wait and the features a stamped tensor of
the slot's width kept in device memory (``simulate``); every copy stays (the cache is
refused there: there are no features to keep).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..config import Config
from ..data.batching import FEATURES, Batch, BatchMeta, copy_batch
from ..models.shared_weights import SharedWeights
from ..runtime.actor import Actor, Escalate
from ..train.feature_cache import FeatureCache
from ..train.schedule import Schedule
from ..train.simulate import SimulatedCompute, stamp, wait

UNSPLIT_CHECK_BYTES = 4 * 2**30
"""A gang's rank 0 checks against the unsplit model only up to this size: it loads and
runs that model on the CPU, in the way of the job's first start."""


class SelfCheckFailed(Escalate):
    """The features would be wrong on every restart: stop the job before training."""


@dataclass(frozen=True)
class TargetSpec:
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
    """Gangs: a shared int8 flag, 1 once a gang's features have matched the unsplit
    model's in this job; later starts check against their own forward only."""


class Target(Actor):
    spec: TargetSpec
    FAULT_POINTS = (*Actor.FAULT_POINTS, "cache")
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
            from ..models.target import SelfCheckError, load_target, self_check
            if ctx.gang > 1:
                from ..models import tensor_parallel
                self.starting(f"join the gang of {ctx.gang} ranks")
                tensor_parallel.join(ctx.rendezvous, ctx.rank, ctx.gang, self.device,
                                     self.spec.cfg.runtime.start_timeout_s)
                self.starting("load target weights (this rank's shard)")
            elif self.spec.weights is None:
                self.starting("load target weights")
            else:
                self.starting("copy shared weights to device" if self.device.type == "cuda" else "map shared weights")
            self.model = load_target(self.spec.cfg, self.device,
                                     lambda done, total: self.starting("load target weights", done, total),
                                     weights=self.spec.weights, world=ctx.gang)
            in_place = self.spec.weights is not None and self.device.type == "cpu"
            if self.spec.cfg.target.self_check and not (in_place and self.spec.weights.checked.item()):
                self.starting("self-check features")
                try:
                    self_check(self.model, reference=self._unsplit() if ctx.gang > 1 and ctx.rank == 0 else None)
                    if ctx.gang > 1 and ctx.rank == 0 and self.spec.unsplit_checked is not None:
                        self.spec.unsplit_checked.fill_(1)
                except SelfCheckError as e:
                    raise SelfCheckFailed(str(e)) from None
                if in_place:
                    self.spec.weights.checked.fill_(1)
        else:
            like = self.out_ring.slot(0)[FEATURES]
            self.fake = torch.zeros(like.shape, dtype=like.dtype, device=self.device)
        self.in_ring.pin()
        self.out_ring.pin()
        if self.spec.cache is not None and self.device.type == "cuda":
            self.spec.cache.pin()

    def _unsplit(self):
        """A gang's rank 0: the whole target on the CPU for the self-check, when it takes
        at most ``UNSPLIT_CHECK_BYTES`` and ``SHARE_FRACTION`` of the host's available
        memory, else None (the check is then against the split model's own forward); the
        event ``self_check`` says which."""
        import psutil

        from ..models import shared_weights
        from ..models.target import ensure_target, load_target, resolve_dtype
        cfg = self.spec.cfg
        if self.spec.unsplit_checked is not None and self.spec.unsplit_checked.item():
            # The same checkpoint, split by the same code: the first start's match holds.
            self.report("self_check", against="the split model's own forward",
                        reason="a gang of this job matched the unsplit model at its first start")
            return None
        dtype = resolve_dtype(cfg.target.dtype, self.device)
        need, free = shared_weights.weight_bytes(ensure_target(cfg), dtype), psutil.virtual_memory().available
        if need > min(UNSPLIT_CHECK_BYTES, shared_weights.SHARE_FRACTION * free):
            self.report("self_check", against="the split model's own forward",
                        reason=f"the unsplit target needs {need / 2**30:.1f} GiB: more than a CPU check at every "
                               f"start can afford ({UNSPLIT_CHECK_BYTES / 2**30:.0f} GiB) or "
                               f"{shared_weights.SHARE_FRACTION:.0%} of the {free / 2**30:.1f} GiB available")
            return None
        self.report("self_check", against="the unsplit model and the split model's own forward",
                    reason=f"the unsplit target ({need / 2**30:.2f} GiB) fits in host memory")
        return load_target(cfg.updated({"target.dtype": str(dtype).removeprefix("torch.")}), "cpu")

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
        if self.spec.cache is None:
            with self.span("target forward", b, tokens=meta.n_tokens):
                features = self._forward(batch, meta.n_tokens, b)
        else:
            with self.span("cached features", b, tokens=meta.n_tokens):
                features = self.spec.cache.features(
                    self.spec.schedule.global_id(b), src["sample_ids"][:meta.n_samples].numpy(),
                    src["cu_seqlens"][:meta.n_samples + 1].numpy(), batch, self.model.features, self.device,
                    self.ctx.index, midway=lambda: self.fault_point("cache", b))
        out = dst[FEATURES][:meta.n_tokens]
        with self.span("feature copy", b, bytes=out.numel() * out.element_size()):
            out.copy_(features)
            # The slot must be complete before the commit: on our device, and on the
            # ring's when the feature ring lives on another GPU (peer to peer).
            for dev in {self.device, out.device}:
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)

    def _forward(self, batch: Batch, n_tokens: int, b: int) -> torch.Tensor:
        if self.sim is None:
            return self.model.features(batch)
        wait(self.sim.target_s(n_tokens))
        stamp(self.fake, n_tokens, b)
        return self.fake[:n_tokens]
