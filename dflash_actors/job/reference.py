"""The single-process reference trainer: the oracle the actor pipeline must match bit
for bit on CPU, and the lock-step baseline of the benchmarks.

Order (M = ``topology.num_drafters``, A = ``train.grad_accum``), for each step s of the
run (``schedule.Schedule``: one batch id space over all epochs):
  1. for drafter shard j = 0..M-1: zero the grads, then for every batch id b in
     ``Schedule.drafter_batches(s, j)``, in increasing b, add ``grad(loss_b)`` into
     ``.grad`` by plain autograd accumulation, in the drafter actor's micro-batches
     (``drafter_step``, ``train.drafter_block_tokens``; ``shard_gradient``);
  2. one step of the shared step math (``optim.reduce_and_step``): sum shards in j order,
     average over A*M, clip, AdamW, LR scheduler.
Batch b is position i of epoch e's plan (``Schedule.locate``); batches after the last
full step of an epoch are dropped, so every step sees exactly A*M batches. Every
batch's loss uses the weights of the step it belongs to, and its anchors are seeded by
``(train.seed, e, i, row)``: that is all the state the actors need to agree on.
With ``target.feature_cache`` on, batch b's features come from the same cache plan as
the pipeline's (``train.feature_cache``), kept in this process's memory, or (``disk``) in
the job's format under ``cache_root``, where a later reference maps them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ConfigError, add_config_args, config_from_args
from ..data.batching import Batch, BatchBuffers, assemble
from ..data.dataset import open_dataset
from ..data.synthetic import train_path
from ..eval.tau import evaluate_drafter
from ..models.drafter import DFlashDrafter, build_drafter
from ..models.loss import BlockStats, Objective
from ..models.target import load_target
from ..prepare.regenerate import ensure_target_text
from ..runtime.channels import dtype_name
from ..train import feature_cache
from ..train.drafter_step import drafter_step, step_options
from ..train.optim import build_optimizer, build_scheduler, reduce_and_step
from ..train.schedule import Plans, Schedule
from ..train.simulate import feature_width


def shard_gradient(drafter: DFlashDrafter, head, items, cfg) -> tuple[list[torch.Tensor], BlockStats]:
    """One drafter shard's summed gradient over ``items`` = ``(epoch, i, batch, features)``
    in increasing batch id: zeroed grads, then ``loss_b.backward()`` for each. ``items``
    may be a generator; each item is used before the next is drawn."""
    drafter.zero_grad(set_to_none=False)
    objective, options, total = Objective.from_config(cfg), step_options(cfg), None
    for epoch, i, batch, features in items:
        stats = drafter_step(drafter, head, features, batch, objective, epoch=epoch, batch_id=i, **options)
        total = stats if total is None else total + stats
    return [p.grad.clone() for p in drafter.parameters()], total


@dataclass
class ReferenceResult:
    state_dict: dict
    losses: list[float] = field(default_factory=list)      # per step: sum(CE*w)/sum(w) over its batches
    metrics: list[dict] = field(default_factory=list)      # per step: loss, tau, slot_acc, lr, grad_norm
    steps: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    feature_cache: dict | None = None    # FeatureCache.stats() with target.feature_cache on

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.wall_s, 1e-9)


def _featured(schedule, plans, dataset, batch_ids, buf, target, cache, device, result):
    """``(epoch, i, batch, features)`` per batch id; one buffer, so each batch is
    assembled only after the previous one has been used. With ``cache``
    (``target.feature_cache``) the features go through the same cache logic as the
    pipeline's targets, in this process's own memory, so both agree bit for bit."""
    for b in batch_ids:
        epoch, i = schedule.locate(b)
        ids = plans[epoch].batch(i)
        meta = assemble(dataset, ids, buf)
        batch = Batch.from_buffers(buf, meta).to(device)
        result.tokens += meta.n_tokens
        if cache is None:
            features = target.features(batch)
        else:
            features = cache.features(b, ids, buf.cu_seqlens[:meta.n_samples + 1], batch, target.features, device)
        yield epoch, i, batch, features


def train_reference(cfg, run_dir: str | Path | None = None, progress: bool = True,
                    on_step=None, cache_root: str | Path | None = None) -> ReferenceResult:
    """Train a drafter in the exact order the actor pipeline follows (module docstring).
    ``on_step(step, drafter, target, metrics)``, if given, runs after each optimizer step
    (the recipe bench measures held-out acceptance there); it must not change the drafter.
    With ``target.feature_cache: disk`` the features are kept under ``cache_root`` (default
    ``run_dir``), as a job keeps them under its run directory."""
    torch.set_num_threads(cfg.train.num_threads)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    target = load_target(cfg, device)
    dataset = open_dataset(cfg.data, progress=progress, path=train_path(cfg))
    dataset.check_values(target.vocab_size, progress=progress)
    drafter = build_drafter(cfg, target)
    params = list(drafter.parameters())
    schedule = Schedule.from_config(cfg, dataset.lengths)
    n_steps = schedule.total_steps
    if n_steps == 0:
        raise ConfigError(f"train: no full step fits an epoch (need {schedule.per_step} batches per step)")
    opt = build_optimizer(params, cfg.train)
    sched = build_scheduler(opt, cfg.train, n_steps)
    plans = Plans(cfg, dataset.lengths)
    cache = None
    if cfg.target.feature_cache != "off":
        cache = feature_cache.in_process(cfg, dataset, plans, feature_width(cfg, target), dtype_name(target.dtype),
                                         cache_root if cache_root is not None else run_dir, target.layer_ids)
    buf = BatchBuffers.allocate(cfg.batching.token_budget, cfg.batching.max_samples)
    result = ReferenceResult(state_dict={})
    t0 = time.perf_counter()
    for step in range(n_steps):
        lr = opt.param_groups[0]["lr"]
        shard_grads, stats = [], None
        for j in range(schedule.num_drafters):
            items = _featured(schedule, plans, dataset, schedule.drafter_batches(step, j), buf, target, cache,
                              device, result)
            grads, st = shard_gradient(drafter, target, items, cfg)
            shard_grads.append(grads)
            stats = st if stats is None else stats + st
        m = stats.metrics()
        norm = reduce_and_step(params, shard_grads, opt, sched, schedule.per_step, cfg.train.grad_clip, m["loss"])
        m |= {"lr": lr, "grad_norm": norm, "epoch": schedule.epoch_of_step(step)}
        result.losses.append(m["loss"])
        result.metrics.append(m)
        result.steps += 1
        if on_step is not None:
            on_step(result.steps, drafter, target, m)
        if progress and (result.steps % 10 == 0 or result.steps == n_steps):
            print(f"step {result.steps}/{n_steps} loss {m['loss']:.4f} tau {m['tau']:.3f} "
                  f"lr {lr:.2e} |g| {norm:.3f}", file=sys.stderr, flush=True)
    result.wall_s = time.perf_counter() - t0
    if cache is not None:
        result.feature_cache = cache.stats()
    result.state_dict = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
    if run_dir is not None:
        out = Path(run_dir)
        drafter.save_pretrained(out / "drafter")
        (out / "reference.json").write_text(json.dumps(_summary(result), indent=2))
    return result


def _summary(r: ReferenceResult) -> dict:
    return {"steps": r.steps, "tokens": r.tokens, "wall_s": round(r.wall_s, 3),
            "tokens_per_s": round(r.tokens_per_s, 1), "first_loss": r.losses[0] if r.losses else None,
            "final_loss": r.losses[-1] if r.losses else None,
            "final_tau": r.metrics[-1]["tau"] if r.metrics else None,
            **({"feature_cache": r.feature_cache} if r.feature_cache is not None else {})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="launch.py reference",
                                 description="Train a drafter in one process, in the actor pipeline's exact order.")
    add_config_args(ap)
    ap.add_argument("--run-dir", default=None, help="where to save the drafter and reference.json")
    ap.add_argument("--eval", action="store_true", help="also report held-out simulated and real tau")
    ap.add_argument("--target-text", action="store_true",
                    help="train on the target's greedy completions of the training prompts (built once, cached)")
    args = ap.parse_args(argv)
    try:
        cfg = config_from_args(args)
        if args.target_text:
            cfg = cfg.updated({"data.path": str(ensure_target_text(cfg))})
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    result = train_reference(cfg, args.run_dir)
    summary = _summary(result) | {"data": str(train_path(cfg))}
    if args.eval:
        summary["eval"] = evaluate_drafter(cfg, result.state_dict)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
