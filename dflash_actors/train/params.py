"""Supervisor-owned shared state of the drafter side: weights, AdamW state, gradients.

Weights and optimizer state are double-buffered; a single int64 ``version`` is the
commit point. Version v lives in buffer ``v % 2``; the optimizer builds v+1 in the other
buffer and only then stores ``version = v+1``::

    weights     [2, P] f32   buffer v%2 = weights after v optimizer steps
    exp_avg     [2, P] f32   AdamW first moment   (same buffer rule)
    exp_avg_sq  [2, P] f32   AdamW second moment
    applied     [2]  int64   batches the steps up to this version consumed, each counted
                             by its drafter's sum (a skipped step consumes its batches
                             too); same buffer rule; carried across resumes by checkpoints,
                             so a run that trained every batch exactly once ends with it
                             equal to its batch count
    version     [1]  int64   commit point; written last, by the optimizer only

A killed optimizer leaves at worst a half-written *inactive* buffer, which its
replacement simply rebuilds from the active one. A replacement that finds the active
state itself untrustworthy (``problem``: impossible version, non-finite values) makes
the job roll back to its last checkpoint instead (``actors.optimizer.RollbackRequired``).
Drafters only ever read buffer v%2 for the version their batch needs, and the optimizer
cannot build v+1 before every drafter has finished with v (it needs all their
gradients), so no reader meets a writer.

Each drafter j accumulates the gradient of its batches of a step in its own pair of
buffers, with a header naming the last batch included::

    grads       [M, 2, P] f32
    grad_head   [M] int64    (last_batch + 1) << 21 | count << 1 | active buffer;  0 = nothing yet

``count`` is how many batches the sum holds. Under ``runtime.grad_durability: batch`` a
drafter commits after every batch (a step's first starts the count at 1); under
``step`` it keeps the sum on its device and commits once, on its last batch of the
step, with the count of the whole step. A commit writes the sum into the inactive
buffer, then flips the header (its commit point); the drafter then commits GRAD_DONE
in the ledger. Killed in between, its replacement sees
the header already names b and does not add b twice; and the optimizer checks that
each sum holds exactly the step's batches, both the last one and how many, before it
uses it, so a batch added twice or lost would stop the job rather than train it.

P is the drafter's parameter count, flattened in ``named_parameters`` order.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ..runtime.channels import page_lock


@dataclass(frozen=True)
class ParamLayout:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, module: torch.nn.Module) -> "ParamLayout":
        named = list(module.named_parameters())
        return cls(tuple(n for n, _ in named), tuple(tuple(p.shape) for _, p in named))

    @property
    def numel(self) -> int:
        return sum(_numel(s) for s in self.shapes)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a flat [P] tensor, in layout order."""
        out, off = [], 0
        for s in self.shapes:
            n = _numel(s)
            out.append(flat[off:off + n].view(s))
            off += n
        return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _shared(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype).share_memory_()


_FENCE = threading.Lock()
_FENCE.acquire()        # held for the process's life: ``fence`` only releases and retakes it


def fence() -> None:
    """Orders this process's memory accesses before the call against those after it, as
    other cores see them. A drafter now reads the published ``version`` with no pipe
    message in between (``Drafter.ready``), and a weakly ordered CPU (Arm: Grace) may
    otherwise show the version store before the last weight stores, or satisfy a weight
    load before the version load. A lock's release (a store-release) followed by its
    acquire (a load-acquire) is ordered both ways, and orders what comes before the
    release before what comes after the acquire. On x86 it costs a few nanoseconds and
    changes nothing: stores are not reordered with stores, nor loads with loads."""
    _FENCE.release()
    _FENCE.acquire()


class WeightStore:
    """Double-buffered weights + AdamW moments with a version commit point."""

    def __init__(self, layout: ParamLayout, weights, exp_avg, exp_avg_sq, version, applied):
        self.layout = layout
        self.weights, self.exp_avg, self.exp_avg_sq, self.version_t = weights, exp_avg, exp_avg_sq, version
        self.applied_t = applied

    @classmethod
    def allocate(cls, layout: ParamLayout) -> "WeightStore":
        P = layout.numel
        return cls(layout, _shared(2, P), _shared(2, P), _shared(2, P), _shared(1, dtype=torch.int64),
                   _shared(2, dtype=torch.int64))

    def __getstate__(self):
        return (self.layout, self.weights, self.exp_avg, self.exp_avg_sq, self.version_t, self.applied_t)

    def __setstate__(self, state):
        self.__init__(*state)

    def pin(self, device, moments: bool) -> None:
        """Page-lock the weights, and with ``moments`` the AdamW moments (the optimizer
        writes them every step; drafters only read weights), in this process, so the
        per-step publish and load copy at full PCIe speed; a no-op unless ``device`` is CUDA."""
        if torch.device(device).type == "cuda":
            page_lock([self.weights, *((self.exp_avg, self.exp_avg_sq) if moments else ())], "weights")

    @property
    def version(self) -> int:
        v = int(self.version_t[0])
        fence()         # the weights of v are read after v is (see ``fence``)
        return v

    def problem(self, first: int, last: int) -> str | None:
        """Why the committed state cannot be trusted, or None. A kill cannot cause any of
        this (see the module docstring); memory corruption or a bug can."""
        v = self.version
        if not first <= v <= last:
            return f"committed version {v} is outside this run's [{first}, {last}]"
        b = v % 2
        for name, t in (("weights", self.weights[b]), ("exp_avg", self.exp_avg[b]), ("exp_avg_sq", self.exp_avg_sq[b])):
            if not torch.isfinite(t).all():
                return f"{name} of version {v} hold non-finite values"
        if (self.exp_avg_sq[b] < 0).any():
            return f"exp_avg_sq of version {v} has negative entries"
        return None

    def applied(self, version: int) -> int:
        """How many batches the steps up to ``version`` consumed."""
        if version != self.version:
            raise RuntimeError(f"batch count of v{version} requested but v{self.version} is committed")
        return int(self.applied_t[version % 2])

    def load_params(self, params: list[torch.Tensor], version: int) -> None:
        """Copy weights of ``version`` into ``params`` (any device)."""
        if version != self.version:
            raise RuntimeError(f"weights v{version} requested but v{self.version} is committed")
        with torch.no_grad():
            for p, w in zip(params, self.layout.views(self.weights[version % 2])):
                p.copy_(w, non_blocking=False)

    def moments_flat(self, version: int) -> tuple[torch.Tensor, torch.Tensor]:
        """AdamW moments of ``version`` as flat ``[P]`` views of the shared buffers."""
        if version != self.version:
            raise RuntimeError(f"moments v{version} requested but v{self.version} is committed")
        return self.exp_avg[version % 2], self.exp_avg_sq[version % 2]

    def moments(self, version: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-parameter views of ``moments_flat``."""
        return tuple(self.layout.views(t) for t in self.moments_flat(version))

    def publish(self, version: int, params: list[torch.Tensor], exp_avg: list[torch.Tensor] | None,
                exp_avg_sq: list[torch.Tensor] | None, midway=None, applied: int = 0) -> None:
        """Write state ``version`` (holding ``applied`` batches) into its buffer, then
        commit it (the version store). ``midway()`` runs between the two (where an
        injected fault tests the commit point)."""
        b = version % 2
        self.applied_t[b] = applied
        with torch.no_grad():
            for dst, src in zip(self.layout.views(self.weights[b]), params):
                dst.copy_(src)
            for flat, srcs in ((self.exp_avg[b], exp_avg), (self.exp_avg_sq[b], exp_avg_sq)):
                if srcs is None:
                    flat.zero_()
                else:
                    for dst, src in zip(self.layout.views(flat), srcs):
                        dst.copy_(src)
        if midway is not None:
            midway()
        fence()         # every store of the state before the version's (see ``fence``)
        self.version_t[0] = version


class GradAccumulators:
    """Per-drafter double-buffered gradient sums with a batch-id header."""

    def __init__(self, layout: ParamLayout, grads: torch.Tensor, head: torch.Tensor):
        self.layout, self.grads, self.head = layout, grads, head

    @classmethod
    def allocate(cls, layout: ParamLayout, num_drafters: int) -> "GradAccumulators":
        return cls(layout, _shared(num_drafters, 2, layout.numel), _shared(num_drafters, dtype=torch.int64))

    def __getstate__(self):
        return (self.layout, self.grads, self.head)

    def __setstate__(self, state):
        self.__init__(*state)

    def pin(self, device) -> None:
        """Page-lock the sums in this process, so that loading and committing them run
        at full PCIe speed; a no-op unless ``device`` (the drafter's or optimizer's) is CUDA."""
        if torch.device(device).type == "cuda":
            page_lock([self.grads], "gradient sums")

    def last_batch(self, j: int) -> int:
        """The last batch drafter j's active buffer includes (-1: none)."""
        return (int(self.head[j]) >> _BATCH_SHIFT) - 1

    def count(self, j: int) -> int:
        """How many batches drafter j's active sum holds."""
        return (int(self.head[j]) >> 1) & _COUNT_MASK

    def active_flat(self, j: int) -> torch.Tensor:
        """Drafter j's committed running sum as one flat ``[P]`` view."""
        return self.grads[j, int(self.head[j]) & 1]

    def active(self, j: int) -> list[torch.Tensor]:
        return self.layout.views(self.active_flat(j))

    def commit(self, j: int, batch_id: int, grads: list[torch.Tensor], count: int = 1) -> None:
        """Store the running sum that now holds ``count`` batches, the last of them
        ``batch_id``, then flip the header."""
        head = int(self.head[j])
        b = 1 - (head & 1)
        if count > _COUNT_MASK:
            raise ValueError(f"a gradient sum holds at most {_COUNT_MASK} batches")
        with torch.no_grad():
            for dst, src in zip(self.layout.views(self.grads[j, b]), grads):
                dst.copy_(src)
        self.head[j] = (batch_id + 1) << _BATCH_SHIFT | count << 1 | b


_BATCH_SHIFT = 21
_COUNT_MASK = (1 << (_BATCH_SHIFT - 1)) - 1
