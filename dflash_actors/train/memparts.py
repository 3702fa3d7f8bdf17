"""What each process of a run holds on each device: the memory plan's parts, one
function per process, sized from the run's shapes and a ``TraceSource``'s figures.

    supervisor   the shared host state (rings, double-buffered weights and moments,
                 gradient sums, the target's shared weights, the feature cache), a CUDA
                 ring, the multi-node link's buffer
    target.i     weights in the target's dtype (a gang rank: its share of what the
                 tensor-parallel plan splits, and all it keeps whole), the forward's
                 peak at the largest batch (traced)
    drafter.j    fp32 weights and their gradient sum, the frozen embeddings and head,
                 the batch's features on its device (unless the ring is there); its
                 step's peak depends on the micro-batch, which the plan chooses
                 (``memplan``)
    optimizer.0  fp32 weights, and its step's peak (traced): the gradient sum, both
                 AdamW moments and the multi-tensor temporaries
    evaluator    at its start, a whole target and its forward (then released), the
                 drafter and the head
    each         a CUDA context on every GPU it uses, which moves with it

Where the parts that can move go (``MOVABLE``) is a ``Placement``; the plan tries each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

import numpy as np
import torch

from ..data.batching import ring_fields
from ..models.target import resolve_dtype
from ..runtime.channels import RingSpec
from .memtrace import StepTrace

GIB = 2 ** 30
"""The plan's unit: what ``torch.cuda`` and ``--gpu-memory`` count in."""
GB = 10 ** 9
"""``target.feature_cache_gb``'s unit."""
FP32 = 4
"""Bytes of a drafter parameter: its weights, gradients and AdamW moments are fp32 everywhere."""
CUDA_CONTEXT = GIB // 2
"""A process's CUDA context with cuBLAS's workspace on a GPU it uses (0.3-0.6 GiB on an H100)."""
SHARED_STATE = 2 * 3 * FP32
"""Bytes a drafter parameter takes in the shared host store (``train.params.WeightStore``):
weights and both AdamW moments, double-buffered (the version flip is the commit point)."""
SHARED_GRAD_SUM = 2 * FP32
"""Bytes a drafter parameter takes in each drafter's shared gradient sum
(``train.params.GradAccumulators``): fp32, double-buffered."""
DRAFTER_STATE = 2 * FP32
"""Bytes a drafter parameter takes on a drafter's device: its weights and the running
gradient sum in ``.grad``."""
MOVABLE = ("eval.device", "runtime.optimizer_device", "runtime.feature_transport")
"""Keys that move a part to another device rather than shrink it; each takes ``auto``
(the plan then places the part)."""


@dataclass(frozen=True)
class Part:
    process: str
    what: str
    nbytes: int
    key: str
    """The config key that moves or shrinks it."""


@dataclass(frozen=True)
class BatchShape:
    """The batches the plan is sized for: the one with the most padded block tokens (the
    drafter's whole-batch pass), the one with the most padded tokens (the target's
    forward), the longest sequence and its most anchors (a micro-batch's rows)."""

    rows: int
    length: int
    anchors: int
    target_rows: int
    target_length: int
    longest: int

    @property
    def blocks(self) -> int:
        """Padded blocks of the whole-batch pass."""
        return self.rows * self.anchors

    @classmethod
    def of_plan(cls, cfg, lengths: np.ndarray, plan) -> "BatchShape":
        """From an epoch's plan of the dataset's ``lengths``."""
        counts = np.diff(plan.offsets).astype(np.int64)
        longest = plan.max_lens.astype(np.int64)
        anchors = np.minimum(cfg.train.num_anchors, np.maximum(longest - 1, 1))
        b, t = int(np.argmax(counts * anchors)), int(np.argmax(counts * longest))
        return cls(int(counts[b]), int(longest[b]), int(anchors[b]), int(counts[t]), int(longest[t]),
                   int(longest.max()))

    @classmethod
    def of_config(cls, cfg) -> "BatchShape":
        """The worst the batching keys allow: every batch full of the sequence length
        that makes the most blocks (short sequences carry one anchor per token)."""
        b, n, L = cfg.batching, cfg.train.num_anchors, cfg.data.max_seq_len
        best = None
        for length in {min(L, n + 1), L}:
            rows = max(1, min(b.max_samples, b.token_budget // length))
            cand = (rows * min(n, length - 1), rows, length)
            best = max(best or cand, cand)
        _, rows, length = best
        t_rows = max(1, min(b.max_samples, b.token_budget // L))
        return cls(rows, length, min(n, length - 1), t_rows, L, L)


def micro_batch(shape: BatchShape, tokens: int, block_size: int) -> tuple[int, int, int]:
    """``(rows, context length, anchors per row)`` of the largest micro-batch
    ``split_anchors`` can make under a budget of ``tokens`` block tokens: rows of the
    longest sequence with its most anchors, or a run of one row's anchors, with as much
    context as the budget lets a micro-batch have (conservative: context costs about a
    sixth of a block token)."""
    per_row = min(shape.anchors, shape.longest - 1) if shape.longest > 1 else 1
    if per_row * block_size >= tokens:
        return 1, shape.longest, max(1, tokens // block_size)
    ctx = max(tokens, shape.longest)
    rows = max(1, min(tokens // (per_row * block_size), ctx // shape.longest))
    return rows, max(shape.longest, -(-ctx // rows)), per_row


@dataclass
class Inputs:
    """What the plan is made from."""

    cfg: object
    targets: tuple[str, ...]
    drafters: tuple[str, ...]
    ring_choices: tuple[str, ...]
    """Where the feature ring may go (``runtime.feature_transport``; reachable devices)."""
    target_config: object
    layer_ids: list[int]
    shape: BatchShape
    have: dict
    """device -> bytes, or None: not checked."""
    notes: list = field(default_factory=list)


class TraceSource(Protocol):
    """The traced figures the plan reads (``tracecache.RunTraces`` for a run): peaks in
    bytes beyond the weights, gradients and inputs a step starts with."""

    def step(self, device_type: str, rows: int, ctx: int, anchors: int, ckpt: bool) -> StepTrace:
        """A drafter's step on one micro-batch of ``rows`` x ``ctx`` tokens, ``anchors`` a row."""

    def forward(self, device_type: str, rows: int, length: int) -> StepTrace:
        """A target's forward on ``rows`` x ``length`` tokens."""

    def optimizer(self, device_type: str) -> StepTrace:
        """The optimizer's step on a device of this kind."""

    def target_numel(self) -> int:
        """The target's parameters."""

    def target_rank_numel(self, ranks: int) -> int:
        """The target's parameters each rank of a gang of ``ranks`` holds (what the
        tensor-parallel plan splits, over ``ranks``, and all it keeps whole)."""

    def drafter_numel(self) -> int:
        """The drafter's parameters."""


@dataclass(frozen=True)
class Placement:
    """Where the parts that can move go (``MOVABLE``)."""

    optimizer: str
    ring: str
    evaluator: Optional[str]
    """None: no evaluator."""


Parts = list[tuple[str, Part]]
"""``(device, part)`` pairs."""


def device_kind(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "cpu"


def dtype_bytes(cfg, device: str) -> int:
    return resolve_dtype(cfg.target.dtype, torch.device(device_kind(device))).itemsize


def simulated(cfg) -> bool:
    return cfg.runtime.simulate.enabled


def _width(inp: Inputs) -> int:
    """A token's feature row: the captured layers (and the teacher's last, for distillation)."""
    return (len(inp.layer_ids) + (inp.cfg.train.loss == "distill")) * int(inp.target_config.hidden_size)


def _head_numel(inp: Inputs) -> int:
    """The target's embeddings and head (one matrix when tied)."""
    c = inp.target_config
    return int(c.vocab_size) * int(c.hidden_size) * (1 if getattr(c, "tie_word_embeddings", False) else 2)


def _target_bytes(inp: Inputs, tr: TraceSource) -> int:
    """The target's weights as the job shares them: in the first target's dtype."""
    return 0 if simulated(inp.cfg) else tr.target_numel() * dtype_bytes(inp.cfg, inp.targets[0])


def _part(device: str, process: str, what: str, nbytes: float, key: str) -> tuple[str, Part]:
    return device, Part(process, what, int(nbytes), key)


def supervisor_parts(inp: Inputs, tr: TraceSource, pl: Placement) -> Parts:
    """The shared state the supervisor allocates: host memory, and the ring where it goes."""
    cfg, top, P = inp.cfg, inp.cfg.topology, tr.drafter_numel()
    b, r = cfg.batching, cfg.runtime
    feat_dtype = "bfloat16" if dtype_bytes(cfg, inp.targets[0]) == 2 else "float32"
    batch = RingSpec("batch", 1, ring_fields(b.token_budget, b.max_samples)).slot_bytes
    feature = RingSpec("features", 1, ring_fields(b.token_budget, b.max_samples, _width(inp), feat_dtype)).slot_bytes
    out = [
        _part("cpu", "supervisor", f"batch ring ({r.batch_slots} slots)", r.batch_slots * batch,
              "runtime.batch_slots"),
        _part(pl.ring, "supervisor", f"feature ring ({r.feature_slots} slots)", r.feature_slots * feature,
              "runtime.feature_slots" if len(inp.ring_choices) == 1 else "runtime.feature_transport"),
        _part("cpu", "supervisor", "drafter weights and AdamW moments, double-buffered (fp32)", SHARED_STATE * P,
              "drafter.num_layers"),
        _part("cpu", "supervisor", f"gradient sums of {top.num_drafters} drafters, double-buffered (fp32)",
              SHARED_GRAD_SUM * P * top.num_drafters, "topology.num_drafters")]
    if cfg.target.feature_cache == "memory":
        out.append(_part("cpu", "supervisor", "feature cache", cfg.target.feature_cache_gb * GB,
                         "target.feature_cache_gb"))
    if top.nodes > 1 and inp.drafters[0].startswith("cuda") and cfg.runtime.collective_backend != "gloo":
        out.append(_part(inp.drafters[0], "supervisor", "cross-node gradient chain buffer (fp32)", FP32 * P,
                         "runtime.collective_backend"))
    weights = _target_bytes(inp, tr)
    if weights and _shares(cfg, weights):
        out.append(_part("cpu", "supervisor", "target weights, shared (target.share_weights)", weights,
                         "target.share_weights"))
    return out


def target_parts(inp: Inputs, tr: TraceSource, pl: Placement) -> Parts:
    """Each target (a gang: each rank): its weights, unless read in place from the shared
    host copy, and its forward at the batch with the most tokens."""
    cfg, s, gang = inp.cfg, inp.shape, inp.cfg.topology.target_tp
    # A rank holds its share of what the split plan splits and every weight it keeps whole.
    numel = 0 if simulated(cfg) else tr.target_numel() if gang == 1 else tr.target_rank_numel(gang)
    shared = _target_bytes(inp, tr)
    out = []
    for i, dev in enumerate(inp.targets):
        name = f"target.{i // gang}" + (f" rank {i % gang}" if gang > 1 else "")
        if simulated(cfg):
            out.append(_part(dev, name, "simulated features", cfg.batching.token_budget * _width(inp)
                             * dtype_bytes(cfg, dev), "runtime.simulate"))
            continue
        if not (dev == "cpu" and _shares(cfg, shared)):
            dtype = str(resolve_dtype(cfg.target.dtype, torch.device(device_kind(dev))))[len("torch."):]
            out.append(_part(dev, name, f"weights ({dtype})" + (f", a rank's share of {gang}" if gang > 1 else ""),
                             numel * dtype_bytes(cfg, dev), "topology.target_tp"))
        f = tr.forward(device_kind(dev), s.target_rows, s.target_length)
        out.append(_part(dev, name, f"forward at {s.target_rows} x {s.target_length} tokens (traced)"
                         + (", counted whole" if gang > 1 else ""), f.peak, "batching.token_budget"))
    return out


def drafter_parts(inp: Inputs, tr: TraceSource, pl: Placement) -> Parts:
    """Each drafter's state; its step's peak depends on the micro-batch (``_with_steps``)."""
    cfg, P = inp.cfg, tr.drafter_numel()
    out = []
    for j, dev in enumerate(inp.drafters):
        name = f"drafter.{j}"
        out.append(_part(dev, name, "weights and gradient sum (fp32)", DRAFTER_STATE * P, "drafter.num_layers"))
        out.append(_part(dev, name, "target's embeddings and head (frozen)", _head_numel(inp) * dtype_bytes(cfg, dev),
                         "target.dtype"))
        if pl.ring != dev:
            out.append(_part(dev, name, "the batch's features, copied from the ring", cfg.batching.token_budget
                             * _width(inp) * dtype_bytes(cfg, inp.targets[0]), "batching.token_budget"))
    return out


def optimizer_parts(inp: Inputs, tr: TraceSource, pl: Placement) -> Parts:
    key = "runtime.optimizer_device"
    return [_part(pl.optimizer, "optimizer.0", "weights (fp32)", FP32 * tr.drafter_numel(), key),
            _part(pl.optimizer, "optimizer.0", "its step: gradient sum, AdamW moments and temporaries (traced)",
                  tr.optimizer(device_kind(pl.optimizer)).peak, key)]


def evaluator_parts(inp: Inputs, tr: TraceSource, pl: Placement) -> Parts:
    """At its start a whole target and one sequence's forward (then released), then the
    drafter and the target's embeddings and head."""
    dev, cfg, key = pl.evaluator, inp.cfg, "eval.device"
    if dev is None:
        return []
    out = []
    if not simulated(cfg):
        out.append(_part(dev, "evaluator", "a whole target while it computes the held-out features (then released)",
                         tr.target_numel() * dtype_bytes(cfg, dev), key))
        # One sequence at a time: the targets' trace per row, its length's share counted
        # as if quadratic (a dense causal mask), which bounds it from above.
        s, kind = inp.shape, device_kind(inp.targets[0])
        f = tr.forward(kind, s.target_rows, s.target_length).peak / s.target_rows
        f *= max(1.0, s.longest / s.target_length) ** 2 * dtype_bytes(cfg, dev) / dtype_bytes(cfg, kind)
        out.append(_part(dev, "evaluator", f"its forward at 1 x {s.longest} tokens (from the targets' trace)", f, key))
    out.append(_part(dev, "evaluator", "drafter (fp32) and the target's embeddings and head",
                     FP32 * tr.drafter_numel() + _head_numel(inp) * dtype_bytes(cfg, dev), key))
    return out


def context_parts(inp: Inputs, pl: Placement, parts: Parts) -> Parts:
    """A CUDA context for each process on each GPU it uses. It moves with the process: its
    key is the one key of all that process's parts there when that key moves them
    (``MOVABLE``), else ``topology``."""
    keys: dict[tuple[str, str], set] = {}
    for dev, p in parts:
        if dev.startswith("cuda"):
            keys.setdefault((dev, p.process), set()).add(p.key)
    if pl.ring.startswith("cuda"):
        # Every process that opens the ring's IPC handle gets a context on its GPU.
        top = inp.cfg.topology
        for proc in ("supervisor", *(f"target.{i}" for i in range(top.num_targets)),
                     *(f"drafter.{j}" for j in range(top.num_drafters))):
            keys.setdefault((pl.ring, proc), set()).add("runtime.feature_transport")
    out = []
    for dev in dict.fromkeys(d for d, _ in keys):
        for (d, proc), ks in sorted(keys.items()):
            if d == dev:
                key = next(iter(ks)) if len(ks) == 1 and next(iter(ks)) in MOVABLE else "topology"
                out.append(_part(dev, proc, "CUDA context", CUDA_CONTEXT, key))
    return out


def fixed_parts(inp: Inputs, tr: TraceSource, pl: Placement) -> Parts:
    """``(device, part)`` for everything but the drafters' step activations."""
    parts = [*supervisor_parts(inp, tr, pl), *target_parts(inp, tr, pl), *drafter_parts(inp, tr, pl),
             *optimizer_parts(inp, tr, pl), *evaluator_parts(inp, tr, pl)]
    return parts + context_parts(inp, pl, parts)


def _shares(cfg, weights: int) -> bool:
    """Whether the job will put the target's weights in shared host memory (its own rule)."""
    from ..models import shared_weights
    try:
        share, _ = shared_weights.decide(cfg.target.share_weights, weights, cfg.topology.num_targets,
                                         ranks=cfg.topology.target_tp)
    except ValueError:
        return cfg.target.share_weights == "on"
    return share
