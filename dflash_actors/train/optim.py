"""The step math: AdamW, the learning-rate schedule, and one optimizer step from the
drafters' gradient sums. The optimizer actor and the reference trainer both call this
module, so their agreement checks the orchestration; ``tests/unit/test_optim.py``
checks the math itself against an update worked out by hand.

One step, from M drafter sums of A batches each::

    g = copy(g_0) + g_1 + ... + g_{M-1}      (drafter order: fixed, so bit-reproducible;
                                              one shard on the device at a time)
    g /= A*M;  clip ||g|| to grad_clip;  AdamW step;  LR scheduler step

The LR follows linear warmup over ``ceil(warmup_ratio * total)`` steps, then a cosine
to 0, or (``train.lr_schedule: wsd``) the peak until the last ``ceil(decay_ratio *
total)`` steps, which fall linearly to 0. AdamW uses torch's default betas and eps.

A step whose summed gradient (or loss) is not finite is skipped: weights and moments
stay as they are, while the LR schedule and AdamW's step counter still advance. The
step keeps its place in the schedule, so version v is still "after v steps" and
``restore`` rebuilds the same state after a restart; the skip only drops that step's
update, which a NaN would otherwise spread into every weight.

``train.optimizer: muon`` replaces AdamW on the drafter's weight matrices with
``torch.optim.Muon`` and keeps AdamW for the rest, as speculators 0.9.0 does
(``speculators/train/optimizers.py``): a parameter takes Muon iff it is 2-D, both sides
above 1, and not embedding-like (speculators excludes by name ``embed_tokens``,
``lm_head``, ``codebook``, ``markov_w1/w2``; here the modules that own such tables mark
them, ``keep_off_muon``, since the step sees tensors, not names). On our drafters that
puts every linear weight on Muon (attention, MLP, ``fc``, the DFlash2 kernel and hidden
projections) and the norms, the 3-D conv kernels and the selector's codebooks on AdamW.
Both run as one ``MuonAdamW`` whose two param groups (AdamW's first) the one LR schedule
scales alike, and whose state the optimizer actor publishes as it publishes AdamW's
(``MuonAdamW`` says how a momentum buffer fits the two moment buffers).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from ..models.marks import OFF_MUON


def takes_muon(p: torch.Tensor) -> bool:
    """Muon's share (speculators' rule): a matrix with both sides above 1, unmarked.
    ``[1, N]`` and ``[N, 1]`` weights are vectors, which Muon cannot orthogonalise."""
    return p.ndim == 2 and min(p.shape) > 1 and not getattr(p, OFF_MUON, False)


def build_optimizer(params, train) -> torch.optim.Optimizer:
    """AdamW over ``params`` with ``train.lr`` and ``train.weight_decay``; with
    ``train.optimizer: muon`` a ``MuonAdamW`` (a config without the key: AdamW)."""
    if getattr(train, "optimizer", "adamw") == "muon":
        return MuonAdamW(params, train)
    return torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay)


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` over ``takes_muon`` parameters and ``torch.optim.AdamW`` over
    the rest, stepped as one optimizer: its ``param_groups`` are the two optimizers' own
    group dicts (AdamW's first, so ``param_groups[0]["lr"]`` is still the logged lr) and
    its ``state`` is the one dict both write, so ``LambdaLR``, ``state_dict`` and the
    callers' ``opt.state[p]`` see both. Muon takes ``train.muon_lr`` (None: ``train.lr``,
    speculators' resolution), ``muon_weight_decay``, ``muon_momentum``, ``muon_ns_steps``
    and ``muon_adjust_lr`` (torch's ``adjust_lr_fn``; speculators' default
    ``match_rms_adamw`` scales the lr by ``0.2 * sqrt(max(A, B))`` so that an AdamW lr
    carries over); Nesterov momentum and the Newton-Schulz coefficients are torch's.

    A Muon parameter's state is its ``momentum_buffer``. The optimizer actor publishes
    every parameter's ``exp_avg`` and ``exp_avg_sq`` into the shared moment buffers,
    so after each step a Muon state also holds ``exp_avg``, the momentum buffer itself
    (no copy), and ``exp_avg_sq``, a zero that takes no memory (a broadcast scalar);
    ``restore`` rebuilds the buffer from ``exp_avg``. The checkpoint and the shared
    layout stay AdamW's, the momentum exact in fp32, so a resume is bit-identical."""

    def __init__(self, params, train):
        params = list(params)
        muon = [p for p in params if takes_muon(p)]
        rest = [p for p in params if not takes_muon(p)]
        self.inner: list[torch.optim.Optimizer] = []
        if rest:
            self.inner.append(torch.optim.AdamW(rest, lr=train.lr, weight_decay=train.weight_decay))
        if muon:
            self.inner.append(torch.optim.Muon(
                muon, lr=train.lr if train.muon_lr is None else train.muon_lr, weight_decay=train.muon_weight_decay,
                momentum=train.muon_momentum, ns_steps=train.muon_ns_steps, adjust_lr_fn=train.muon_adjust_lr))
        self.muon_params, self.muon_ids = muon, frozenset(id(p) for p in muon)
        super().__init__([g for o in self.inner for g in o.param_groups], {})
        self._share()

    def _share(self) -> None:
        """Point the inner optimizers at this one's groups and state (again after
        ``load_state_dict``, which replaces both)."""
        i = 0
        for o in self.inner:
            o.param_groups = self.param_groups[i:i + len(o.param_groups)]
            i += len(o.param_groups)
            o.state = self.state
        for p in self.muon_params:
            st = self.state.get(p)
            if st and "momentum_buffer" in st:     # a loaded buffer is a new tensor: alias it again
                st.update(muon_state(st["momentum_buffer"]))

    def is_muon(self, p: torch.Tensor) -> bool:
        return id(p) in self.muon_ids

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure")
        for o in self.inner:
            o.step()
        for p in self.muon_params:
            st = self.state.get(p)
            if st and "exp_avg" not in st:     # Muon made the buffer in this step
                st.update(muon_state(st["momentum_buffer"]))

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._share()


def muon_state(buf: torch.Tensor) -> dict:
    """A Muon parameter's state from its momentum buffer ``buf`` (``MuonAdamW``)."""
    return {"momentum_buffer": buf, "exp_avg": buf, "exp_avg_sq": buf.new_zeros(()).expand(buf.shape)}


def _is_muon(opt, p: torch.Tensor) -> bool:
    return isinstance(opt, MuonAdamW) and opt.is_muon(p)


def lr_factor(step: int, total_steps: int, warmup_ratio: float, kind: str = "cosine",
              decay_ratio: float = 0.2) -> float:
    """Multiplier of the base LR at ``step``: linear warmup, then cosine to 0 (``kind``
    cosine) or flat until the last ``ceil(decay_ratio * total)`` steps and linear to 0
    over them (wsd)."""
    warmup = math.ceil(warmup_ratio * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if kind == "wsd":
        decay = math.ceil(decay_ratio * total_steps)
        start = max(warmup, total_steps - decay)
        return 1.0 if step < start else max(0.0, (total_steps - step) / max(1, total_steps - start))
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))


def build_scheduler(opt, train, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, total_steps, train.warmup_ratio, train.lr_schedule, train.decay_ratio))


def reduce_and_step(params: list[torch.Tensor], shard_grads: Iterable[Sequence[torch.Tensor]], opt, sched,
                    batches: int, grad_clip: float, loss: float = 0.0) -> float:
    """Sum shard gradients in shard order onto the parameters' devices, average over
    ``batches``, clip, step; returns the pre-clip gradient norm. The shards (on any
    device, never modified) are read one at a time: from a generator, the device holds
    the sum and at most one shard. A non-finite norm or ``loss`` skips the update
    (``skip_step``); the returned norm then says why (``math.isfinite``)."""
    shards = iter(shard_grads)
    grads = [g.to(p.device, copy=True) for p, g in zip(params, next(shards))]
    for shard in shards:
        for g, s in zip(grads, shard):
            g.add_(s.to(g.device))
    for p, g in zip(params, grads):
        p.grad = g.div_(batches)
    # .item(), not float(): the memory plan traces this step on fake CUDA tensors, whose
    # float() needs a CUDA device guard that a CPU build lacks (train.memtrace).
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip).item()
    if not (math.isfinite(norm) and math.isfinite(loss)):
        skip_step(opt, sched, params)
        return norm if not math.isfinite(norm) else math.nan
    opt.step()
    sched.step()
    return norm


def skip_step(opt, sched, params: list[torch.Tensor]) -> None:
    """Advance the schedule and AdamW's step counter without an update, exactly as
    ``restore`` would rebuild them (moments created as zeros if no step came yet; a
    Muon buffer likewise, and Muon counts no steps)."""
    step = float(sched.last_epoch + 1)
    for p in params:
        p.grad = None
        st = opt.state[p]
        if _is_muon(opt, p):
            if not st:
                st.update(muon_state(torch.zeros_like(p)))
            continue
        if not st:
            st.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        st["step"] = torch.tensor(step)
    # Not sched.step(): with no optimizer step before it, torch warns about the order.
    set_position(opt, sched, sched.last_epoch + 1)


def restore(opt, sched, params: list[torch.Tensor], version: int, exp_avg, exp_avg_sq) -> None:
    """Put AdamW and the LR schedule where ``version`` steps leave them, given the
    moments after those steps (``params`` already hold the weights of ``version``). A
    Muon parameter's momentum buffer is its ``exp_avg`` (``MuonAdamW``)."""
    if version == 0:
        return
    for p, m, v in zip(params, exp_avg, exp_avg_sq):
        if _is_muon(opt, p):
            opt.state[p] = muon_state(m.to(p.device, copy=True))
            continue
        opt.state[p] = {"step": torch.tensor(float(version)), "exp_avg": m.to(p.device, copy=True),
                        "exp_avg_sq": v.to(p.device, copy=True)}
    # Setting the position is exactly an unbroken run's (calling sched.step() here
    # would warn: no optimizer step came first).
    set_position(opt, sched, version)


def set_position(opt, sched, version: int) -> None:
    """The LR schedule at ``version``: LambdaLR's lr is closed-form in ``last_epoch``."""
    sched.last_epoch = version
    for group, base, factor in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * factor(version)
