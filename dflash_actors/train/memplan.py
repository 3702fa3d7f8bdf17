"""The memory plan: what every process of a run holds on every device, known before
anything starts, from shapes alone (a target's ``config.json`` is enough).

For each device of the topology, the parts each process puts there:

    target.i     weights in the target's dtype (a gang rank: its 1/K), the forward's
                 peak at the largest batch (traced), a CUDA context
    drafter.j    fp32 weights and their gradient sum, the frozen embeddings and head,
                 the batch's features on its device (unless the ring is there), the
                 step's peak at its micro-batch (traced), a CUDA context
    optimizer.0  fp32 weights, and its step's peak (traced): the gradient sum, both
                 AdamW moments and the multi-tensor temporaries
    supervisor   the shared host state (rings, double-buffered weights and moments,
                 gradient sums, the target's shared weights, the feature cache), a CUDA
                 ring and a context on its GPU, the multi-node link's buffer
    evaluator    at its start, a whole target and its forward (then released), the
                 drafter and the head

The traced figures come from ``train.memtrace``. A GPU's need is checked against its
memory less ``HEADROOM`` (the caching allocator's fragmentation and the kernels'
workspaces, which no trace sees); the host's against its RAM.

The plan also decides what the config leaves to it, best first: the drafter's
micro-batch (``train.drafter_block_tokens``: the whole batch when it fits, else the
largest power-of-two multiple of the block size that fits every drafter's GPU, no
smaller than one whole sequence), then activation checkpointing
(``train.checkpoint_layers``, only when even one sequence does not fit without it), the
optimizer's device (``runtime.optimizer_device``) and, with ``feature_transport: auto``,
the feature ring's: each where it leaves the drafters the largest micro-batch, a GPU
before the host. What does not fit anywhere becomes one line naming the key to change.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import psutil
import torch

from ..data.batching import ring_fields
from ..models import loss as L
from ..models.drafter import dflash2_fields
from ..models.target import resolve_dtype
from ..runtime.channels import RingSpec
from . import memtrace

GIB = 2 ** 30
CUDA_CONTEXT = GIB // 2
"""A process's CUDA context with cuBLAS's workspace on a GPU it uses (0.3-0.6 GiB on an H100)."""
HEADROOM = 0.08
"""Of each GPU's memory, kept out of the plan for the caching allocator and kernel workspaces."""
HOST_HEADROOM = 0.15
"""Of the host's memory, left to the system, page cache and the processes' own interpreters."""


@dataclass(frozen=True)
class Part:
    process: str
    what: str
    nbytes: int
    key: str
    """The config key that moves or shrinks it."""


@dataclass(frozen=True)
class DevicePlan:
    device: str
    have: Optional[int]
    """Its memory in bytes; None: not checked (the host of another machine)."""
    parts: tuple[Part, ...]

    @property
    def need(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def usable(self) -> Optional[int]:
        if self.have is None:
            return None
        return int(self.have * (1 - (HOST_HEADROOM if self.device == "cpu" else HEADROOM)))

    @property
    def fits(self) -> bool:
        return self.usable is None or self.need <= self.usable


@dataclass(frozen=True)
class MemoryPlan:
    devices: tuple[DevicePlan, ...]
    drafter_block_tokens: Optional[int]
    """Resolved; None: the whole batch in one pass."""
    checkpoint_layers: bool
    optimizer_device: str
    feature_device: str
    settings: dict
    """Config changes that record what the plan chose (``Config.updated``)."""
    notes: tuple[str, ...] = ()
    problem: Optional[str] = None
    """One line: what does not fit where, and the key to change."""

    def table(self) -> str:
        """The plan for a terminal: per device its need against its memory, then its parts."""
        mb = "whole batch" if self.drafter_block_tokens is None else f"{self.drafter_block_tokens} block tokens"
        lines = [f"memory plan: drafter micro-batches of {mb}, layer checkpointing "
                 f"{'on' if self.checkpoint_layers else 'off'}, optimizer on {self.optimizer_device}, "
                 f"feature ring on {self.feature_device}"]
        for d in self.devices:
            if d.have is None:
                room = "not checked"
            else:
                kept = HOST_HEADROOM if d.device == "cpu" else HEADROOM
                room = f"of {_gib(d.usable)} GiB usable ({_gib(d.have)} GiB less {kept:.0%})"
            lines.append(f"  {d.device:<8} needs {_size(d.need):>11} {room}{'' if d.fits else '  DOES NOT FIT'}")
            for p in d.parts:
                lines.append(f"    {_size(p.nbytes):>11}  {p.process:<12} {p.what}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def as_json(self) -> dict:
        """``memory_plan``: per device ``{device, need_gib, have_gib, usable_gib, fits, parts}``;
        ``processes``: each process's planned peak per device; and what the plan chose."""
        peaks: dict[tuple[str, str], int] = {}
        for d in self.devices:
            for p in d.parts:
                peaks[p.process, d.device] = peaks.get((p.process, d.device), 0) + p.nbytes
        return {
            "memory_plan": [{"device": d.device, "need_gib": _round(d.need),
                             "have_gib": None if d.have is None else _round(d.have),
                             "usable_gib": None if d.usable is None else _round(d.usable), "fits": d.fits,
                             "parts": [{"process": p.process, "what": p.what, "gib": _round(p.nbytes),
                                        "key": p.key} for p in d.parts]} for d in self.devices],
            "processes": [{"process": proc, "device": dev, "gib": _round(n)} for (proc, dev), n in peaks.items()],
            "drafter_block_tokens": self.drafter_block_tokens, "checkpoint_layers": self.checkpoint_layers,
            "optimizer_device": self.optimizer_device, "feature_device": self.feature_device,
            "notes": list(self.notes), "problem": self.problem,
        }


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def _size(n: int) -> str:
    """GiB, or MiB below one GiB (a tiny run's parts are not all zeros)."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2 ** 20:.1f} MiB"


def _round(n: int) -> float:
    return round(n / GIB, 3)


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


class _Traces:
    """``memtrace`` results of one plan, each shape traced once, and kept in
    ``data.cache_dir`` (keyed by the target's config, the trace's arguments, torch's and
    transformers' versions and the traced code's own text), so that a run planned again
    (a resume, the next demo, a test suite's hundred jobs) reads them instead."""

    def __init__(self, inp: Inputs):
        self.inp = inp
        cfg = inp.cfg
        self.B = cfg.drafter.block_size
        self.teacher = cfg.train.loss == "distill"
        self.simulate = cfg.runtime.simulate.enabled
        self.cache = Path(cfg.data.cache_dir) / "memtrace"
        self.done: dict[str, object] = {}
        fields = dflash2_fields(cfg.drafter)
        self.arch = {} if fields is None else {"dflash2": fields}     # a DFlash's keys as before

    def _cached(self, name: str, **kwargs):
        """``memtrace``'s function ``name`` of the target's config and ``kwargs``."""
        key = json.dumps([name, {k: str(v) for k, v in sorted(kwargs.items())}])
        if key in self.done:
            return self.done[key]
        digest = hashlib.sha256("\0".join((_code_version(), self.inp.target_config.to_json_string(), key))
                                .encode()).hexdigest()[:24]
        path = self.cache / f"{digest}.json"
        try:
            value = json.loads(path.read_text())
        except (OSError, ValueError):
            out = getattr(memtrace, name)(self.inp.target_config, **kwargs)
            value = dataclasses.asdict(out) if isinstance(out, memtrace.StepTrace) else out
            try:
                self.cache.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(value))
                tmp.replace(path)
            except OSError:
                pass        # a read-only cache: the plan is only traced again next time
        self.done[key] = memtrace.StepTrace(**value) if isinstance(value, dict) else value
        return self.done[key]

    def step(self, device_type: str, rows: int, ctx: int, anchors: int, ckpt: bool) -> memtrace.StepTrace:
        cfg, inp = self.inp.cfg, self.inp
        cuda = device_type == "cuda"
        compute = cfg.train.compute_dtype
        return self._cached(
            "trace_drafter_step", layers=cfg.drafter.num_layers, block_size=self.B,
            feature_layers=len(inp.layer_ids), head_dtype=resolve_dtype(cfg.target.dtype, torch.device(device_type)),
            autocast_bf16=(cuda and compute != "float32") or (not cuda and compute == "bfloat16"), cuda=cuda,
            rows=rows, ctx_len=ctx, anchors=anchors, checkpoint_layers=ckpt,
            head_loss="checkpointed" if cfg.train.head_loss == "checkpointed" else "fused", loss=cfg.train.loss,
            **self.arch)

    def forward(self, device_type: str, rows: int, length: int) -> memtrace.StepTrace:
        return self._cached("trace_target_forward",
                            dtype=resolve_dtype(self.inp.cfg.target.dtype, torch.device(device_type)), rows=rows,
                            length=length, layer_ids=self.inp.layer_ids, teacher=self.teacher)

    def target_numel(self) -> int:
        """The target's parameters (each counted once: tied embeddings too)."""
        return self._cached("target_numel")

    def drafter_numel(self) -> int:
        cfg = self.inp.cfg
        return self._cached("drafter_numel", layers=cfg.drafter.num_layers, block_size=self.B,
                            feature_layers=len(self.inp.layer_ids), **self.arch)

    def optimizer(self) -> memtrace.StepTrace:
        cfg = self.inp.cfg
        return self._cached("trace_optimizer_step", layers=cfg.drafter.num_layers, block_size=self.B,
                            feature_layers=len(self.inp.layer_ids), drafters=cfg.topology.num_drafters,
                            **self.arch)


@functools.cache
def _code_version() -> str:
    """What a trace's result depends on besides its arguments: the libraries' versions
    and the text of the code it runs."""
    import transformers

    from ..data import batching
    from ..models import blocks, dflash2, drafter, head_loss, target
    from . import optim
    parts = [torch.__version__, transformers.__version__]
    for module in (memtrace, L, blocks, head_loss, drafter, dflash2, target, batching, optim):
        parts.append(hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest())
    return ":".join(parts)


def _kind(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "cpu"


def _dtype_bytes(cfg, device: str) -> int:
    return resolve_dtype(cfg.target.dtype, torch.device(_kind(device))).itemsize


def fixed_parts(inp: Inputs, tr: _Traces, optimizer: str, ring: str) -> list[tuple[str, Part]]:
    """``(device, part)`` for everything but the drafters' step activations."""
    cfg, top, P = inp.cfg, inp.cfg.topology, tr.drafter_numel()
    H, V = int(inp.target_config.hidden_size), int(inp.target_config.vocab_size)
    width = (len(inp.layer_ids) + tr.teacher) * H
    tied = bool(getattr(inp.target_config, "tie_word_embeddings", False))
    out: list[tuple[str, Part]] = []
    contexts: dict[str, set] = {}

    def add(device, process, what, nbytes, key):
        out.append((device, Part(process, what, int(nbytes), key)))
        if device.startswith("cuda"):
            contexts.setdefault(device, set()).add(process)

    # the supervisor's shared host memory
    b, r = cfg.batching, cfg.runtime
    feat_dtype = "bfloat16" if _dtype_bytes(cfg, inp.targets[0]) == 2 else "float32"
    slot = RingSpec("batch", 1, ring_fields(b.token_budget, b.max_samples)).slot_bytes
    add("cpu", "supervisor", f"batch ring ({r.batch_slots} slots)", r.batch_slots * slot, "runtime.batch_slots")
    slot = RingSpec("features", 1, ring_fields(b.token_budget, b.max_samples, width, feat_dtype)).slot_bytes
    add(ring, "supervisor", f"feature ring ({r.feature_slots} slots)", r.feature_slots * slot,
        "runtime.feature_slots" if len(inp.ring_choices) == 1 else "runtime.feature_transport")
    add("cpu", "supervisor", "drafter weights and AdamW moments, double-buffered (fp32)", 6 * 4 * P,
        "drafter.num_layers")
    add("cpu", "supervisor", f"gradient sums of {top.num_drafters} drafters, double-buffered (fp32)",
        2 * 4 * P * top.num_drafters, "topology.num_drafters")
    if cfg.target.feature_cache == "memory":
        add("cpu", "supervisor", "feature cache", cfg.target.feature_cache_gb * 1e9, "target.feature_cache_gb")
    if top.nodes > 1 and inp.drafters[0].startswith("cuda") and cfg.runtime.collective_backend != "gloo":
        add(inp.drafters[0], "supervisor", "cross-node gradient chain buffer (fp32)", 4 * P,
            "runtime.collective_backend")

    numel = 0 if tr.simulate else tr.target_numel()
    weights = numel * _dtype_bytes(cfg, inp.targets[0])     # as the job shares them: in the first target's dtype
    gang = top.target_tp
    for i, dev in enumerate(inp.targets):
        name = f"target.{i // gang}" + (f" rank {i % gang}" if gang > 1 else "")
        if tr.simulate:
            add(dev, name, "simulated features", cfg.batching.token_budget * width * _dtype_bytes(cfg, dev),
                "runtime.simulate")
            continue
        shared_in_place = dev == "cpu" and _shares(cfg, weights)
        if not shared_in_place:
            add(dev, name, f"weights ({str(resolve_dtype(cfg.target.dtype, torch.device(_kind(dev))))[6:]})"
                + (f", 1/{gang} of them" if gang > 1 else ""), numel * _dtype_bytes(cfg, dev) / gang,
                "topology.target_tp")
        s = inp.shape
        f = tr.forward(_kind(dev), s.target_rows, s.target_length)
        add(dev, name, f"forward at {s.target_rows} x {s.target_length} tokens (traced)"
            + (", counted whole" if gang > 1 else ""), f.peak, "batching.token_budget")
    if weights and _shares(cfg, weights):
        add("cpu", "supervisor", "target weights, shared (target.share_weights)", weights, "target.share_weights")

    head = V * H * (1 if tied else 2)
    for j, dev in enumerate(inp.drafters):
        name = f"drafter.{j}"
        add(dev, name, "weights and gradient sum (fp32)", 2 * 4 * P, "drafter.num_layers")
        add(dev, name, "target's embeddings and head (frozen)", head * _dtype_bytes(cfg, dev), "target.dtype")
        if ring != dev:
            add(dev, name, "the batch's features, copied from the ring",
                cfg.batching.token_budget * width * _dtype_bytes(cfg, inp.targets[0]), "batching.token_budget")

    add(optimizer, "optimizer.0", "weights (fp32)", 4 * P, "runtime.optimizer_device")
    add(optimizer, "optimizer.0", "its step: gradient sum, AdamW moments and temporaries (traced)",
        tr.optimizer().peak, "runtime.optimizer_device")

    if cfg.eval.every:
        dev = cfg.eval.device
        if not tr.simulate:
            add(dev, "evaluator", "a whole target while it computes the held-out features (then released)",
                numel * _dtype_bytes(cfg, dev), "eval.device")
            # One sequence at a time: the targets' trace per row, its length's share
            # counted as if quadratic (a dense causal mask), which bounds it from above.
            s, kind = inp.shape, _kind(inp.targets[0])
            f = tr.forward(kind, s.target_rows, s.target_length).peak / s.target_rows
            f *= max(1.0, s.longest / s.target_length) ** 2 * _dtype_bytes(cfg, dev) / _dtype_bytes(cfg, kind)
            add(dev, "evaluator", f"its forward at 1 x {s.longest} tokens (from the targets' trace)", f,
                "eval.device")
        add(dev, "evaluator", "drafter (fp32) and the target's embeddings and head",
            4 * P + head * _dtype_bytes(cfg, dev), "eval.device")

    if ring.startswith("cuda"):
        # Every process that opens the ring's IPC handle gets a context on its GPU.
        readers = ["supervisor", *(f"target.{i}" for i in range(top.num_targets)),
                   *(f"drafter.{j}" for j in range(top.num_drafters))]
        contexts.setdefault(ring, set()).update(readers)
    for dev, procs in contexts.items():
        for proc in sorted(procs):
            out.append((dev, Part(proc, "CUDA context", CUDA_CONTEXT, "topology")))
    return out


def _shares(cfg, weights: int) -> bool:
    """Whether the job will put the target's weights in shared host memory (its own rule)."""
    from ..models import shared_weights
    try:
        share, _ = shared_weights.decide(cfg.target.share_weights, weights, cfg.topology.num_targets,
                                         ranks=cfg.topology.target_tp)
    except ValueError:
        return cfg.target.share_weights == "on"
    return share


def _group(parts: list[tuple[str, Part]], have: dict) -> tuple[DevicePlan, ...]:
    order, by = [], {}
    for dev, part in parts:
        if dev not in by:
            order.append(dev)
            by[dev] = []
        by[dev].append(part)
    order.sort(key=lambda d: (d != "cpu", int(d[5:]) if d.startswith("cuda:") else -1))
    return tuple(DevicePlan(d, have.get(d), tuple(by[d])) for d in order)


def _room(devs: tuple[DevicePlan, ...], drafters: tuple[str, ...]) -> dict[str, Optional[int]]:
    """Bytes each drafter device has left for its drafters' step activations."""
    out = {}
    for d in devs:
        if d.device in drafters:
            out[d.device] = None if d.usable is None else d.usable - d.need
    return out


def _steps_fit(tr: _Traces, inp: Inputs, room: dict, shape: tuple[int, int, int], ckpt: bool) -> bool:
    if tr.simulate:
        return all(r is None or r >= 0 for r in room.values())
    for dev, left in room.items():
        if left is None:
            continue
        per = tr.step(_kind(dev), *shape, ckpt).peak
        if per * inp.drafters.count(dev) > left:
            return False
    return True


def _choose_step(tr: _Traces, inp: Inputs, room: dict) -> Optional[tuple[Optional[int], bool]]:
    """``(block tokens or None for the whole batch, checkpointing)``, best first (module
    docstring), or None when nothing fits.

    A step's peak grows about linearly with its block tokens, and a trace costs time in
    proportion to them (the head's chunks), so a line through two small micro-batches
    says which sizes are worth tracing: the whole batch only when it might fit, then the
    largest size the line allows, confirmed by its trace and the next size's."""
    cfg, B, s = inp.cfg, tr.B, inp.shape
    fixed_tokens = cfg.train.drafter_block_tokens
    ckpts = {"on": [True], "off": [False], "auto": [False, True]}[cfg.train.checkpoint_layers]
    whole_tokens = s.blocks * B
    row_tokens = min(s.anchors, max(1, s.longest - 1)) * B
    left = [r / inp.drafters.count(d) for d, r in room.items() if r is not None]
    budget = min(left) if left else math.inf

    def fits(tokens, ckpt):
        shape = (s.rows, s.length, s.anchors) if tokens is None else micro_batch(s, tokens, B)
        return _steps_fit(tr, inp, room, shape, ckpt)

    def line(ckpt):
        a, b = row_tokens, 2 * row_tokens
        if b >= whole_tokens or budget == math.inf or tr.simulate:
            return lambda tokens: 0.0       # small enough to trace whatever it needs
        kind = _kind(inp.drafters[0])
        pa, pb = (tr.step(kind, *micro_batch(s, t, B), ckpt).peak for t in (a, b))
        return lambda tokens: pa + (pb - pa) * (tokens - a) / (b - a)

    for ckpt in ckpts:
        if fixed_tokens is not None:
            if fits(fixed_tokens, ckpt):
                return fixed_tokens, ckpt
            continue
        predict = line(ckpt)
        if predict(whole_tokens) <= 1.2 * budget and fits(None, ckpt):
            return None, ckpt
        # Powers of two times the block, below the whole batch; without checkpointing no
        # smaller than one sequence's blocks (the second lever comes first below that).
        floor = row_tokens if (not ckpt and len(ckpts) == 2) else B
        ladder = [B << k for k in range(40) if floor <= (B << k) < whole_tokens]
        if not ladder:
            continue
        i = max([k for k, g in enumerate(ladder) if predict(g) <= budget], default=0)
        if fits(ladder[i], ckpt):
            while i + 1 < len(ladder) and fits(ladder[i + 1], ckpt):
                i += 1
            return ladder[i], ckpt
        for g in reversed(ladder[:i]):
            if fits(g, ckpt):
                return g, ckpt
    return None


def _with_steps(inp: Inputs, tr: _Traces, opt: str, ring: str, tokens: Optional[int],
                ckpt: bool) -> tuple[DevicePlan, ...]:
    """Every device's plan for these choices: the fixed parts and each drafter's step."""
    parts = fixed_parts(inp, tr, opt, ring)
    shape = (inp.shape.rows, inp.shape.length, inp.shape.anchors) if tokens is None else \
        micro_batch(inp.shape, tokens, tr.B)
    what = "whole batch" if tokens is None else f"micro-batches of {tokens} block tokens"
    for j, dev in enumerate(inp.drafters):
        if tr.simulate:
            continue
        t = tr.step(_kind(dev), *shape, ckpt)
        parts.append((dev, Part(f"drafter.{j}", f"step at its peak: {what}, {shape[0]} x {shape[1]} tokens, "
                                f"{shape[2]} anchors a row{', layers checkpointed' if ckpt else ''} (traced; "
                                f"{_gib(t.saved)} GiB kept for the backward)", t.peak,
                                "train.drafter_block_tokens")))
    return _group(parts, inp.have)


def _overflow(devs: tuple[DevicePlan, ...]) -> int:
    return sum(max(0, d.need - d.usable) for d in devs if d.usable is not None)


def make_plan(inp: Inputs) -> MemoryPlan:
    """The plan for ``inp`` (module docstring)."""
    cfg, tr = inp.cfg, _Traces(inp)
    want = cfg.runtime.optimizer_device
    if want != "auto":
        opt_choices = [want]
    else:
        # Targets' GPUs first: they do not train. Then the drafters', then the host.
        opt_choices = [*dict.fromkeys(d for d in (*inp.targets, *inp.drafters) if d.startswith("cuda")), "cpu"]
    smallest = (cfg.train.drafter_block_tokens or tr.B, cfg.train.checkpoint_layers != "off")
    best, closest = None, None
    for ring in inp.ring_choices:
        for opt in opt_choices:
            devs = _group(fixed_parts(inp, tr, opt, ring), inp.have)
            step = None
            if all(d.fits for d in devs if d.device not in inp.drafters):
                step = _choose_step(tr, inp, _room(devs, inp.drafters))
            if step is None:
                # Kept to show, should nothing fit: the choice that overflows least.
                over = _overflow(_with_steps(inp, tr, opt, ring, *smallest))
                if closest is None or over < closest[0]:
                    closest = (over, opt, ring)
                continue
            tokens, ckpt = step
            # Then the least crowded device: ties in the step go where the most is left.
            spare = tuple(sorted(d.usable - d.need for d in _with_steps(inp, tr, opt, ring, tokens, ckpt)
                                 if d.usable is not None))
            score = (not ckpt, math.inf if tokens is None else tokens, opt != "cpu", ring != "cpu", spare)
            if best is None or score > best[0]:
                best = (score, opt, ring, tokens, ckpt)
    if best is None:
        _, opt, ring = closest
        tokens, ckpt = smallest
    else:
        _, opt, ring, tokens, ckpt = best
    devs = _with_steps(inp, tr, opt, ring, tokens, ckpt)
    settings = {}
    if cfg.train.drafter_block_tokens is None and tokens is not None:
        settings["train.drafter_block_tokens"] = tokens
    if cfg.train.checkpoint_layers == "auto" and ckpt:
        settings["train.checkpoint_layers"] = "on"
    notes = list(inp.notes)
    if tokens is not None and not tr.simulate:
        notes.append(f"a batch of up to {inp.shape.blocks * tr.B} block tokens runs in micro-batches of "
                     f"{tokens}: the same gradient, at float rounding")
    return MemoryPlan(devs, tokens, ckpt, opt, ring, settings, tuple(notes), _problem(devs))


MOVABLE = ("eval.device", "runtime.optimizer_device", "runtime.feature_transport")
"""Keys that move a part to another device rather than shrink it."""


def _problem(devs: tuple[DevicePlan, ...]) -> Optional[str]:
    """The line for the first device that does not fit: the smallest part that could
    move away and make room, else its largest part, with the key that changes it."""
    for d in devs:
        if d.fits:
            continue
        over = d.need - d.usable
        by_key: dict[str, list[Part]] = {}
        for p in d.parts:
            by_key.setdefault(p.key, []).append(p)
        total = {key: sum(p.nbytes for p in ps) for key, ps in by_key.items()}
        movable = [(total[key], key, by_key[key][0]) for key in MOVABLE if total.get(key, 0) >= over]
        step = by_key.get("train.drafter_block_tokens")
        if step and total["train.drafter_block_tokens"] >= over:
            n, key, part = total["train.drafter_block_tokens"], "train.drafter_block_tokens", step[0]
            what = f"{part.process}'s micro-batch holds {_gib(n)} GiB at its peak"
        elif movable:
            n, key, part = min(movable, key=lambda m: m[0])
            what = f"{part.process} ({_gib(n)} GiB here) could go elsewhere"
        else:
            part = max(d.parts, key=lambda p: p.nbytes)
            n, key = part.nbytes, part.key
            what = f"its largest part is {part.process}'s {part.what.split(' (')[0]} ({_gib(n)} GiB)"
        kept = HOST_HEADROOM if d.device == "cpu" else HEADROOM
        return (f"memory plan: {d.device} needs {_gib(d.need)} GiB but has {_gib(d.usable)} GiB usable "
                f"({_gib(d.have)} GiB less {kept:.0%}); {what}: change {key} "
                "(python launch.py --plan-only shows every part)")
    return None


def device_memory(devices, gpu_memory_gib: Optional[float] = None) -> dict:
    """Bytes of each device: ``--gpu-memory`` for every GPU when given (and the host is
    then another machine's: not checked), else what this machine has."""
    out = {}
    for d in devices:
        if d == "cpu":
            out[d] = None if gpu_memory_gib is not None else psutil.virtual_memory().total
        elif gpu_memory_gib is not None:
            out[d] = int(gpu_memory_gib * GIB)
        else:
            out[d] = torch.cuda.get_device_properties(int(d[5:])).total_memory
    return out


def plan_memory(cfg, targets, drafters, ring_choices, target_config, layer_ids, shape: BatchShape,
             gpu_memory_gib: Optional[float] = None) -> MemoryPlan:
    """The plan of a run of ``cfg`` on these devices (``make_plan``)."""
    devices = {*targets, *drafters, *ring_choices, "cpu"}
    if cfg.eval.every:
        devices.add(cfg.eval.device)
    want = cfg.runtime.optimizer_device
    if want != "auto":
        devices.add(want)
    inp = Inputs(cfg, tuple(targets), tuple(drafters), tuple(ring_choices), target_config, list(layer_ids), shape,
                 device_memory(sorted(devices), gpu_memory_gib))
    if gpu_memory_gib is not None:
        inp.notes.append(f"planned for GPUs of {gpu_memory_gib:g} GiB (--gpu-memory); this host not checked")
    return make_plan(inp)

