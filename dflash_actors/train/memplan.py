"""The memory plan: what every process of a run holds on every device, known before
anything starts, from shapes alone (a target's ``config.json`` is enough).

For each device of the topology, the parts each process puts there (``memparts``: one
function per process), summed and checked against the device's memory.

The traced figures come from a ``TraceSource``: for a run, ``tracecache.RunTraces``
(``train.memtrace``'s traces of the real code, kept on disk). A GPU's need is checked
against its memory less ``HEADROOM`` (the caching allocator's fragmentation and the
kernels' workspaces, which no trace sees); the host's against its RAM.

The plan also decides what the config leaves to it, best first: the drafter's
micro-batch (``train.drafter_block_tokens``: the whole batch when it fits, else the
largest power-of-two multiple of the block size that fits every drafter's GPU, no
smaller than one whole sequence), then activation checkpointing
(``train.checkpoint_layers``, only when even one sequence does not fit without it), then
where the parts that can move go (``MOVABLE``): the optimizer (``runtime.optimizer_device``),
the feature ring (``runtime.feature_transport: auto``) and the evaluator (``eval.device:
auto``), each where it leaves the drafters the largest micro-batch, a GPU before the host.
The drafters' micro-batch is chosen from their own devices' room, so a plan that does not
fit elsewhere still shows what it would choose on the devices that fit. What does not fit
anywhere becomes one line naming the key to change: the drafter's micro-batch, else the
part that could move away, else the parts a smaller batch shrinks (a target's forward),
else the device's largest part.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Optional

import psutil
import torch

from .memparts import (
    GIB,
    MOVABLE,
    BatchShape,
    Inputs,
    Part,
    Parts,
    Placement,
    TraceSource,
    device_kind,
    fixed_parts,
    micro_batch,
    simulated,
)

HEADROOM = 0.08
"""Of each GPU's memory, kept out of the plan for the caching allocator and kernel workspaces."""
HOST_HEADROOM = 0.15
"""Of the host's memory, left to the system, page cache and the processes' own interpreters."""
LINE_SLACK = 1.2
"""A step's peak is nearly linear in its block tokens, but the line through two small
micro-batches misses the whole batch's by up to this factor (the head's chunks and the
transients do not scale exactly): within it, the whole batch is traced to confirm."""


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
    eval_device: Optional[str]
    """Where the evaluator runs; None: no evaluator (``eval.every`` 0)."""
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
                 f"feature ring on {self.feature_device}"
                 + ("" if self.eval_device is None else f", evaluator on {self.eval_device}")]
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
            "eval_device": self.eval_device, "notes": list(self.notes), "problem": self.problem,
        }


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def _size(n: int) -> str:
    """GiB, or MiB below one GiB (a tiny run's parts are not all zeros)."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2 ** 20:.1f} MiB"


def _round(n: int) -> float:
    return round(n / GIB, 3)


def _group(parts: Parts, have: dict) -> tuple[DevicePlan, ...]:
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


def _steps_fit(tr: TraceSource, inp: Inputs, room: dict, shape: tuple[int, int, int], ckpt: bool) -> bool:
    if simulated(inp.cfg):
        return all(r is None or r >= 0 for r in room.values())
    for dev, left in room.items():
        if left is None:
            continue
        per = tr.step(device_kind(dev), *shape, ckpt).peak
        if per * inp.drafters.count(dev) > left:
            return False
    return True


def _choose_step(tr: TraceSource, inp: Inputs, room: dict) -> Optional[tuple[Optional[int], bool]]:
    """``(block tokens or None for the whole batch, checkpointing)``, best first (module
    docstring), or None when nothing fits.

    A step's peak grows about linearly with its block tokens, and a trace costs time in
    proportion to them (the head's chunks), so a line through two small micro-batches
    says which sizes are worth tracing: the whole batch only when it might fit, then the
    largest size the line allows, confirmed by its trace and the next size's."""
    cfg, B, s = inp.cfg, inp.cfg.drafter.block_size, inp.shape
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
        if b >= whole_tokens or budget == math.inf or simulated(cfg):
            return lambda tokens: 0.0       # small enough to trace whatever it needs
        kind = device_kind(inp.drafters[0])
        pa, pb = (tr.step(kind, *micro_batch(s, t, B), ckpt).peak for t in (a, b))
        return lambda tokens: pa + (pb - pa) * (tokens - a) / (b - a)

    for ckpt in ckpts:
        if fixed_tokens is not None:
            if fits(fixed_tokens, ckpt):
                return fixed_tokens, ckpt
            continue
        predict = line(ckpt)
        if predict(whole_tokens) <= LINE_SLACK * budget and fits(None, ckpt):
            return None, ckpt
        # Powers of two times the block, below the whole batch; without checkpointing no
        # smaller than one sequence's blocks (the second lever comes first below that).
        floor = row_tokens if (not ckpt and len(ckpts) == 2) else B
        ladder = []
        size = B
        while size < whole_tokens:
            if size >= floor:
                ladder.append(size)
            size *= 2
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


def _with_steps(inp: Inputs, tr: TraceSource, pl: Placement, tokens: Optional[int],
                ckpt: bool) -> tuple[DevicePlan, ...]:
    """Every device's plan for these choices: the fixed parts and each drafter's step."""
    parts = fixed_parts(inp, tr, pl)
    shape = (inp.shape.rows, inp.shape.length, inp.shape.anchors) if tokens is None else \
        micro_batch(inp.shape, tokens, inp.cfg.drafter.block_size)
    what = "whole batch" if tokens is None else f"micro-batches of {tokens} block tokens"
    for j, dev in enumerate(inp.drafters):
        if simulated(inp.cfg):
            continue
        t = tr.step(device_kind(dev), *shape, ckpt)
        parts.append((dev, Part(f"drafter.{j}", f"step at its peak: {what}, {shape[0]} x {shape[1]} tokens, "
                                f"{shape[2]} anchors a row{', layers checkpointed' if ckpt else ''} (traced; "
                                f"{_gib(t.saved)} GiB kept for the backward)", t.peak,
                                "train.drafter_block_tokens")))
    return _group(parts, inp.have)


def _overflow(devs: tuple[DevicePlan, ...]) -> int:
    return sum(max(0, d.need - d.usable) for d in devs if d.usable is not None)


def placements(inp: Inputs) -> list[Placement]:
    """Every placement the config allows: each ``auto`` among the GPUs, targets' first
    (they do not train), then the drafters', then the host."""
    cfg = inp.cfg
    anywhere = [*dict.fromkeys(d for d in (*inp.targets, *inp.drafters) if d.startswith("cuda")), "cpu"]
    opts = anywhere if cfg.runtime.optimizer_device == "auto" else [cfg.runtime.optimizer_device]
    evals = [None] if not cfg.eval.every else anywhere if cfg.eval.device == "auto" else [cfg.eval.device]
    return [Placement(o, r, e) for r, o, e in itertools.product(inp.ring_choices, opts, evals)]


def left_to_plan(inp: Inputs) -> set[str]:
    """The ``MOVABLE`` keys the plan places itself."""
    cfg = inp.cfg
    return {key for key, auto in (("runtime.optimizer_device", cfg.runtime.optimizer_device == "auto"),
                                  ("runtime.feature_transport", len(inp.ring_choices) > 1),
                                  ("eval.device", cfg.eval.device == "auto")) if auto}


def make_plan(inp: Inputs, traces: TraceSource) -> MemoryPlan:
    """The plan for ``inp`` from ``traces``' figures (module docstring).

    Each placement's drafter step is chosen from the drafters' own devices' room (the
    smallest step only where not even that fits them). The placement that overflows
    least wins, which is one that fits wherever one does; among equals, the best step,
    then a GPU before the host, then the least crowded device. A plan that does not fit
    so shows what it would choose on the devices that do, not a step shrunk for a
    device whose problem is elsewhere."""
    cfg, tr = inp.cfg, traces
    smallest = (cfg.train.drafter_block_tokens or cfg.drafter.block_size, cfg.train.checkpoint_layers != "off")
    best = None
    for pl in placements(inp):
        step = _choose_step(tr, inp, _room(_group(fixed_parts(inp, tr, pl), inp.have), inp.drafters))
        tokens, ckpt = step or smallest
        devs = _with_steps(inp, tr, pl, tokens, ckpt)
        spare = tuple(sorted(d.usable - d.need for d in devs if d.usable is not None))
        rank = (-_overflow(devs), not ckpt, math.inf if tokens is None else tokens, pl.optimizer != "cpu",
                pl.ring != "cpu", pl.evaluator not in (None, "cpu"), spare)
        if best is None or rank > best[0]:
            best = (rank, pl, tokens, ckpt, devs)
    _, pl, tokens, ckpt, devs = best
    settings = {}
    if cfg.train.drafter_block_tokens is None and tokens is not None:
        settings["train.drafter_block_tokens"] = tokens
    if cfg.train.checkpoint_layers == "auto" and ckpt:
        settings["train.checkpoint_layers"] = "on"
    if pl.evaluator is not None and cfg.eval.device == "auto":
        settings["eval.device"] = pl.evaluator
    notes = list(inp.notes)
    if tokens is not None and not simulated(cfg):
        notes.append(f"a batch of up to {inp.shape.blocks * cfg.drafter.block_size} block tokens runs in "
                     f"micro-batches of {tokens}: the same gradient, at float rounding")
    return MemoryPlan(devs, tokens, ckpt, pl.optimizer, pl.ring, pl.evaluator, settings, tuple(notes),
                      _problem(devs, left_to_plan(inp)))


def _problem(devs: tuple[DevicePlan, ...], placed: set[str]) -> Optional[str]:
    """The line for the first device that does not fit: the smallest part that could
    move away and make room (one the plan did not place itself: ``placed``), else its
    largest part, with the key that changes it."""
    for d in devs:
        if d.fits:
            continue
        over = d.need - d.usable
        by_key: dict[str, list[Part]] = {}
        for p in d.parts:
            by_key.setdefault(p.key, []).append(p)
        total = {key: sum(p.nbytes for p in ps) for key, ps in by_key.items()}
        movable = [(total[key], key, by_key[key][0]) for key in MOVABLE
                   if key not in placed and total.get(key, 0) >= over]
        step, hint = by_key.get("train.drafter_block_tokens"), ""
        if step and total["train.drafter_block_tokens"] >= over:
            n, key, part = total["train.drafter_block_tokens"], "train.drafter_block_tokens", step[0]
            what = f"{part.process}'s micro-batch holds {_gib(n)} GiB at its peak"
        elif movable:
            n, key, part = min(movable, key=lambda m: m[0])
            what, hint = f"{part.process} ({_gib(n)} GiB here) could go elsewhere", "auto lets the plan place it; "
        elif total.get("batching.token_budget", 0) >= over:
            # Before the largest part: a target's weights name topology.target_tp, which a
            # family the split plan cannot split refuses (tensor_parallel.check), while a
            # smaller batch shrinks its forward on any target.
            n, key, part = total["batching.token_budget"], "batching.token_budget", by_key["batching.token_budget"][0]
            what = f"{part.process}'s {part.what.split(' (')[0]} holds {_gib(n)} GiB"
        else:
            part = max(d.parts, key=lambda p: p.nbytes)
            n, key = part.nbytes, part.key
            what = f"its largest part is {part.process}'s {part.what.split(' (')[0]} ({_gib(n)} GiB)"
        kept = HOST_HEADROOM if d.device == "cpu" else HEADROOM
        return (f"memory plan: {d.device} needs {_gib(d.need)} GiB but has {_gib(d.usable)} GiB usable "
                f"({_gib(d.have)} GiB less {kept:.0%}); {what}: change {key} "
                f"({hint}python launch.py --plan-only shows every part)")
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
                gpu_memory_gib: Optional[float] = None, traces: Optional[TraceSource] = None) -> MemoryPlan:
    """The plan of a run of ``cfg`` on these devices (``make_plan``), from ``traces``
    (default: the run's own, ``tracecache.RunTraces``)."""
    devices = {*targets, *drafters, *ring_choices, "cpu"}
    for want in (cfg.eval.device if cfg.eval.every else "auto", cfg.runtime.optimizer_device):
        if want != "auto":
            devices.add(want)
    inp = Inputs(cfg, tuple(targets), tuple(drafters), tuple(ring_choices), target_config, list(layer_ids), shape,
                 device_memory(sorted(devices), gpu_memory_gib))
    if gpu_memory_gib is not None:
        inp.notes.append(f"planned for GPUs of {gpu_memory_gib:g} GiB (--gpu-memory); this host not checked")
    if traces is None:
        from .tracecache import RunTraces
        traces = RunTraces(cfg, target_config, layer_ids)
    return make_plan(inp, traces)
