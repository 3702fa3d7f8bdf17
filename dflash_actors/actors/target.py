"""target.i: the frozen target LLM; batch slot in, feature slot out.

Contract:
  consumes  ``Work(b)`` for LOADED batches (any free target takes the next one, so
            targets run as far ahead of the drafters as the feature ring allows)
  produces  feature slot ``out_slot``: the batch's packed fields copied over (so the
            batch slot can be freed) plus ``hidden[:T]`` = the selected layers'
            outputs, concatenated; the base then commits FEATURED
  waits for a free feature slot (reserved by the supervisor before dispatch)
  on restart reloads the target; whatever it held is put back to LOADED, its batch slot
            untouched, and recomputed by whichever target is free.
"""

from __future__ import annotations

import torch

from ..batching import Batch
from ..models.target import load_target
from .base import Actor

BATCH_FIELDS = ("input_ids", "position_ids", "loss_mask", "cu_seqlens", "sample_ids")


class Target(Actor):
    def attach(self) -> None:
        a = self.ctx.args
        self.device = torch.device(a["devices"][self.ctx.index])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model = load_target(a["cfg"], self.device)
        self.in_ring.pin()
        self.out_ring.pin()

    def work(self, w) -> None:
        meta = self.ledger.meta(w.batch_id)
        src, dst = self.in_ring.slot(w.in_slot), self.out_ring.slot(w.out_slot)
        T, B = meta.n_tokens, meta.n_samples
        for name in BATCH_FIELDS:
            n = B + 1 if name == "cu_seqlens" else B if name == "sample_ids" else T
            dst[name][:n].copy_(src[name][:n])
        batch = Batch.from_buffers(self.in_ring.batch_buffers(w.in_slot), meta)
        features = self.model.features(batch.to(self.device, non_blocking=True))
        dst["hidden"][:T].copy_(features)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # the slot must be complete before the commit
