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
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch


def build_optimizer(params, train) -> torch.optim.AdamW:
    """AdamW over ``params`` with ``train.lr`` and ``train.weight_decay``."""
    return torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay)


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
    ``restore`` would rebuild them (moments created as zeros if no step came yet)."""
    step = float(sched.last_epoch + 1)
    for p in params:
        p.grad = None
        st = opt.state[p]
        if not st:
            st.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        st["step"] = torch.tensor(step)
    # Not sched.step(): with no optimizer step before it, torch warns about the order.
    set_position(opt, sched, sched.last_epoch + 1)


def restore(opt, sched, params: list[torch.Tensor], version: int, exp_avg, exp_avg_sq) -> None:
    """Put AdamW and the LR schedule where ``version`` steps leave them, given the
    moments after those steps (``params`` already hold the weights of ``version``)."""
    if version == 0:
        return
    for p, m, v in zip(params, exp_avg, exp_avg_sq):
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
