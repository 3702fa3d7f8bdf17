"""Rings of typed tensor slots in shared memory: the data plane between actors.

The supervisor allocates every ring once, before it spawns anything, and hands the
tensors to each child in its spawn arguments (torch passes one fd per storage; the
default ``file_descriptor`` strategy unlinks the segment at creation, so nothing of a
CPU ring is ever named in /dev/shm and the memory goes when the last process holding it
exits; a CUDA ring leaves one name while the supervisor lives, below).
Actors attach; they never allocate or free shared buffers, so killing any actor leaves
every buffer intact, and a slot's bytes stay valid until the supervisor hands the slot
to the next writer.

Layout (one ring; every field is one tensor with a leading slot dimension; the
fields are the caller's: ``batching.ring_fields`` for the training job)::

                       slot 0          slot 1                slot S-1
    input_ids    [S, T]        int64   |t t t . . .|  |t t t t t . .|  ...
    position_ids [S, T]        int64   |0 1 2 . . .|  |0 1 0 1 2 . .|
    ...
    hidden       [S, T, W]     bf16/f32

A slot holds the batch's *shape* nowhere: it lives in the batch's ledger row (its meta
columns), written by the slot's producer before it commits.

Protocol (all decisions by the supervisor, which alone owns the free lists)::

    supervisor                      producer stage              consumer stage
    take free slot s of ring R
    Work(b, in_slot, out_slot=s) -> write slot s of R
                                    ledger[b].state = NEXT   (commit point)
                                 <- Done(b)
    free b's old slot; ledger[b].slot = s
    Work(b, in_slot=s, ...)   ------------------------------>  read slot s of R ...
                                                               ledger[b].state = NEXT
                                 <------------------------------ Done(b)
    free slot s of R

A slot is freed only after the state that no longer needs it is recorded, and slots of
a dead actor are reclaimed from the ledger (``dispatch``), never from what it said.

Placement: a CPU ring is page-locked (``pin``, ``cudaHostRegister`` on the shared pages)
by each process whose device is a GPU, the one that copies it to or from there; a CPU
actor never pins (that would give it a CUDA context). A ring may also live on a GPU: the
supervisor allocates it and outlives every consumer, which is what torch's CUDA IPC
requires, and a writer to a CUDA slot synchronizes its stream before it commits, as a
reader does before it commits (the slot is then reused). (The training job's feature
ring lives there under ``runtime.feature_transport: cuda``; ``tests/integration/
test_runtime_gpu.py`` exercises both placements.)

What a CUDA ring leaves in /dev/shm: sharing it makes torch create one *named*
ref-counter file, ``torch_<supervisor pid>_*``, which the supervisor keeps mapped as
long as it lives (its consumers, ended by ``os._exit`` or a kill, never release their
counts) and torch unlinks when the supervisor exits normally; a killed supervisor leaves
it behind. Nothing else may unlink it while the supervisor lives: torch aborts the
process when, closing the file at exit, it cannot unlink it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"int64": torch.int64, "int32": torch.int32, "int8": torch.int8,
          "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Slot field dtypes by name: specs carry names, which pickle small and read well."""


def dtype_name(dtype: torch.dtype) -> str:
    """The name ``FieldSpec.dtype`` takes for ``dtype``."""
    return next(name for name, d in DTYPES.items() if d == dtype)


@dataclass(frozen=True)
class FieldSpec:
    name: str
    shape: tuple[int, ...]
    """Per slot; the ring adds the leading slot dimension."""
    dtype: str


@dataclass(frozen=True)
class RingSpec:
    name: str
    n_slots: int
    fields: tuple[FieldSpec, ...]
    device: str = "cpu"

    @property
    def slot_bytes(self) -> int:
        n = 0
        for f in self.fields:
            numel = 1
            for d in f.shape:
                numel *= d
            n += numel * torch.empty((), dtype=DTYPES[f.dtype]).element_size()
        return n


class Ring:
    """One ring's tensors. Built by ``allocate`` in the supervisor; pickled to children
    (spawn args), where it arrives already attached to the same memory."""

    def __init__(self, spec: RingSpec, tensors: dict[str, torch.Tensor]):
        self.spec = spec
        self.tensors = tensors
        self._pinned = False

    @classmethod
    def allocate(cls, spec: RingSpec) -> "Ring":
        if spec.device != "cpu" and not torch.cuda.is_available():
            raise RuntimeError(f"ring {spec.name}: device {spec.device} needs CUDA")
        tensors = {}
        for f in spec.fields:
            shape, dtype = (spec.n_slots, *f.shape), DTYPES[f.dtype]
            if spec.device == "cpu":
                # Straight into a shared segment (zero pages): zeros().share_memory_() would
                # fill private memory, then copy it, holding twice the ring for a while.
                numel = 1
                for d in shape:
                    numel *= d
                storage = torch.UntypedStorage._new_shared(numel * torch.empty((), dtype=dtype).element_size())
                tensors[f.name] = torch.empty(0, dtype=dtype).set_(storage, 0, shape)
            else:
                # CUDA tensors travel by IPC handle when pickled.
                tensors[f.name] = torch.zeros(shape, dtype=dtype, device=spec.device)
        return cls(spec, tensors)

    def __getstate__(self):
        return {"spec": self.spec, "tensors": self.tensors}

    def __setstate__(self, state):
        self.__init__(state["spec"], state["tensors"])

    def slot(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.spec.n_slots:
            raise IndexError(f"ring {self.spec.name}: slot {i} of {self.spec.n_slots}")
        return {k: t[i] for k, t in self.tensors.items()}

    def pin(self, device) -> None:
        """Page-lock a CPU ring for fast async copies between it and ``device``, the
        calling actor's. Registration is per process, so each actor calls it after
        attaching; a no-op unless ``device`` is CUDA, and for CUDA rings."""
        if self._pinned or self.spec.device != "cpu" or torch.device(device).type != "cuda":
            return
        page_lock(self.tensors.values(), f"ring {self.spec.name}")
        self._pinned = True

    @property
    def nbytes(self) -> int:
        return self.spec.n_slots * self.spec.slot_bytes


def page_lock(tensors, what: str) -> None:
    """Page-lock shared CPU tensors for this process (``cudaHostRegister``), so copies
    between them and a GPU run at full PCIe speed instead of through a staging buffer.
    A no-op without CUDA. It creates a CUDA context: callers decide by their device
    (``Ring.pin``), so a CPU actor on a GPU host gets none."""
    if not torch.cuda.is_available():
        return
    cudart = torch.cuda.cudart()
    for t in tensors:
        err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if int(getattr(err, "value", err)) != 0:
            raise RuntimeError(f"{what}: cudaHostRegister failed ({err})")
