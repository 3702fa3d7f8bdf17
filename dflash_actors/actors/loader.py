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

from dataclasses import dataclass
from typing import ClassVar

from ..config import Config
from ..data.batching import BatchBuffers, assemble
from ..data.dataset import open_dataset
from ..runtime.actor import Actor
from ..train.schedule import Plans, Schedule


@dataclass(frozen=True)
class LoaderSpec:
    SECTIONS: ClassVar[tuple[str, ...]] = ("data", "batching", "train", "topology")
    """The config sections ``cfg`` carries (``Config.carrying``), all its stage reads: the data
    and how it is packed, and the plans' seed, epochs and drafters per step."""
    cfg: Config
    schedule: Schedule
    train_path: str


class Loader(Actor):
    spec: LoaderSpec

    def attach(self) -> None:
        self.starting("open dataset")
        self.dataset = open_dataset(self.spec.cfg.data, progress=False, path=self.spec.train_path)
        self.plans = Plans(self.spec.cfg, self.dataset.lengths)

    def work(self, w) -> None:
        epoch, i = self.spec.schedule.locate(w.batch_id)
        out = BatchBuffers.from_tensors(self.out_ring.slot(w.out_slot))
        with self.span("assemble", w.batch_id):
            meta = assemble(self.dataset, self.plans[epoch].batch(i), out)
        self.ledger.set_meta(w.batch_id, meta.as_ints())
