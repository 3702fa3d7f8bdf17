"""loader.0: turns planned batch ids into packed batches in batch slots.

Contract:
  consumes  ``Work(b)`` for PLANNED batches, lowest id first; reads nothing shared
  produces  batch b, packed (``batching.assemble``), in batch slot ``out_slot``, and its
            shape in the ledger row; the base then commits LOADED
  waits for a free batch slot (the supervisor only dispatches when one is reserved)
  on restart reopens the dataset (a memory map: milliseconds) and re-plans epochs on
            demand; plans are pure functions of (seed, epoch), so whatever the dead
            loader held is simply assembled again, identically.
"""

from __future__ import annotations

from ..batching import assemble
from ..data import open_dataset
from ..schedule import Plans
from .base import Actor


class Loader(Actor):
    def attach(self) -> None:
        a = self.ctx.args
        self.cfg, self.schedule, self.start = a["cfg"], a["schedule"], a["start"]
        self.dataset = open_dataset(self.cfg.data, progress=False, path=a["train_path"])
        self.plans = Plans(self.cfg, self.dataset.lengths)

    def work(self, w) -> None:
        epoch, b = self.schedule.locate(self.start + w.batch_id)
        meta = assemble(self.dataset, self.plans[epoch].batch(b), self.out_ring.batch_buffers(w.out_slot))
        self.ledger.set_meta(w.batch_id, meta)
