"""The single-process reference trainer: the oracle the actor pipeline must match bit
for bit on CPU, and the lock-step baseline of the benchmarks.

Its config is resolved exactly as the job resolves its own: the job's preflight
(``job.preflight``: data, devices, target, schedule) and memory plan, for the config's
own topology (node 0's), whose ``settings`` are then written in (``preflight.resolved``).
So the drafter trains in the micro-batches and with the layer checkpointing the plan
picks for the job's drafter devices (``train.drafter_block_tokens``,
``train.checkpoint_layers``), and a config the job would refuse (a plan that does not
fit, a device that is missing) is refused here too. The reference computes on the
device of the job's first drafter (``topology.drafter_devices``, or the default
placement), the target's forwards included, and emulates the M drafter shards there one
after another; it never spawns an actor. On CPU every actor and the optimizer compute
there too; on GPUs, where the promise is "equal within tolerance", the reference's
optimizer steps on that device wherever the plan put the job's. Its summary
(``reference.json``) records the resolved keys (``resolved``).

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

``launch.py reference --job RUN_DIR`` is the reference of a job that ran: it trains on
the config the job recorded (``RUN_DIR/config.yaml``, already resolved by the job's
plan; ``--set`` applies on top) and compares its final weights with the job's
checkpoint of the same step. A recorded config is a fixed point of the resolution where
the job ran; if this machine's plan would resolve it otherwise (a key the job's plan
left at its default, such as whole batches, that the plan here sets), the reference
would take other steps than the job did, so it refuses: one line naming the key, exit
2, nothing trained. The comparison is in the summary's ``job`` (``identical``: every
trained tensor equal, bit for bit; None without a verified checkpoint at the
reference's last step); exit status 1 when they differ, which on CPU breaks the promise
and on GPUs is expected (``max_abs_diff`` says by how much).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ..config import Config, ConfigError, add_config_args, config_from_args, load_config
from ..console import first_line
from ..data.batching import Batch, BatchBuffers, assemble
from ..eval.tau import evaluate_drafter
from ..models.drafter import DFlashDrafter
from ..models.drafter_start import build_drafter
from ..models.loss import BlockStats, Objective
from ..models.target import load_target
from ..prepare.regenerate import ensure_target_text
from ..runtime.channels import dtype_name
from ..train import feature_cache
from ..train.checkpoint import verified_checkpoint
from ..train.drafter_step import drafter_step, step_options
from ..train.optim import build_optimizer, build_scheduler, reduce_and_step
from ..train.schedule import Plans, Schedule
from ..train.simulate import feature_width
from . import rundir
from .preflight import Preflight, preflight, resolved

PLANNED = ("train.drafter_block_tokens", "train.checkpoint_layers")
"""The keys the memory plan may decide, as the reference's summary records them."""


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
    resolved: dict = field(default_factory=dict)    # the PLANNED keys and the plan's settings, as trained

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.wall_s, 1e-9)


def _value(cfg: Config, key: str):
    """The value of a dotted config key."""
    return functools.reduce(getattr, key.split("."), cfg)


def resolve(cfg: Config, run_dir: str | Path | None = None, progress: bool = True,
            pre: Optional[Preflight] = None) -> tuple[Config, Preflight]:
    """``(cfg as the job resolves it, its preflight)``: the job's own ``preflight`` of
    node 0 (or ``pre``, when the caller made it) with its plan's settings written in.
    ``run_dir``, the reference's own, takes the place of the job's (``runtime.run_dir``:
    the preflight checks that it can be written)."""
    if run_dir is not None:
        cfg = cfg.updated({"runtime.run_dir": str(run_dir)})
    pre = pre or preflight(cfg, progress=progress)
    return resolved(cfg, pre), pre


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
                    on_step=None, cache_root: str | Path | None = None,
                    pre: Optional[Preflight] = None) -> ReferenceResult:
    """Train a drafter in the exact order the actor pipeline follows, on ``cfg`` as the
    job resolves it (module docstring; ``resolve``: ConfigError where the job would
    refuse it). ``on_step(step, drafter, target, metrics)``, if given, runs after each
    optimizer step (the recipe bench measures held-out acceptance there); it must not
    change the drafter. With ``target.feature_cache: disk`` the features are kept under
    ``cache_root`` (default ``run_dir``), as a job keeps them under its run directory."""
    cfg, pre = resolve(cfg, run_dir, progress, pre)
    torch.set_num_threads(cfg.train.num_threads)
    device = pre.devices.drafters[0]
    target = load_target(cfg, device)
    dataset = pre.dataset
    drafter = build_drafter(cfg, target)
    params = list(drafter.parameters())
    # The whole run as one machine: all topology.nodes * M shards (the preflight's is node 0's).
    schedule = Schedule.from_config(cfg, dataset.lengths)
    n_steps = schedule.total_steps
    opt = build_optimizer(params, cfg.train)
    sched = build_scheduler(opt, cfg.train, n_steps)
    plans = Plans(cfg, dataset.lengths)
    cache = None
    if cfg.target.feature_cache != "off":
        cache = feature_cache.in_process(cfg, dataset, plans, feature_width(cfg, target), dtype_name(target.dtype),
                                         cache_root if cache_root is not None else run_dir, target.layer_ids)
    buf = BatchBuffers.allocate(cfg.batching.token_budget, cfg.batching.max_samples)
    result = ReferenceResult(state_dict={}, resolved={**{k: _value(cfg, k) for k in PLANNED}, **pre.plan.settings})
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
            "final_tau": r.metrics[-1]["tau"] if r.metrics else None, "resolved": r.resolved,
            **({"feature_cache": r.feature_cache} if r.feature_cache is not None else {})}


def job_config(job_dir: str | Path, sets: list[str]) -> Config:
    """The config the job in ``job_dir`` recorded (resolved by its plan), ``sets`` on top."""
    saved = Path(job_dir) / rundir.SAVED_CONFIG
    if not saved.is_file():
        raise ConfigError(f"--job: {job_dir} holds no {rundir.SAVED_CONFIG} (not a job's run directory)")
    return load_config(saved, sets)


_LEFT_TO_PLAN = {("train.drafter_block_tokens", None): "whole batches",
                 ("train.checkpoint_layers", "auto"): "no layer checkpointing"}
"""What a key left to the plan trained with, where the plan kept its default."""


def same_resolution(job_dir: str | Path, recorded: Config, pre: Preflight) -> None:
    """ConfigError unless this machine's plan leaves the job's recorded config as it is
    (module docstring): a setting the plan makes here is one the job's plan did not."""
    if pre.plan.settings:
        key, here = next(iter(pre.plan.settings.items()))
        was = _value(recorded, key)
        raise ConfigError(f"{key}: the job in {job_dir} trained with {_LEFT_TO_PLAN.get((key, was), repr(was))} (its "
                          f"config.yaml, as its memory plan resolved it), but the plan here picks {here!r}, so the "
                          "reference would take other steps; run it where the job's plan fits as it did "
                          "(python launch.py --plan-only shows a plan)")


def compare_job(job_dir: str | Path, result: ReferenceResult) -> dict:
    """The job's trained weights at the reference's last step against the reference's
    (module docstring): ``identical`` None without a verified checkpoint of that step."""
    ckpt = verified_checkpoint(job_dir, result.steps)
    out = {"run_dir": str(job_dir), "step": result.steps, "checkpoint": None, "identical": None,
           "max_abs_diff": None}
    if ckpt is None:
        return out
    got = dict(DFlashDrafter.from_pretrained(ckpt).named_parameters())     # buffers are computed, not trained
    want = {k: result.state_dict[k].cpu() for k in got}
    diff = max((got[k].detach().double() - want[k].double()).abs().max().item() for k in got)
    return out | {"checkpoint": ckpt.name, "identical": all(torch.equal(got[k].detach(), want[k]) for k in got),
                  "max_abs_diff": diff}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="launch.py reference",
                                 description="Train a drafter in one process, in the actor pipeline's exact order.")
    add_config_args(ap)
    ap.add_argument("--run-dir", default=None, help="where to save the drafter and reference.json")
    ap.add_argument("--job", metavar="RUN_DIR",
                    help="the reference of the job in RUN_DIR: on its config.yaml (--set applies on top), refused "
                         "where this machine's plan would resolve it otherwise; its final weights compared with "
                         "the job's checkpoint of that step (exit 1 when they differ)")
    ap.add_argument("--eval", action="store_true", help="also report held-out simulated and real tau")
    ap.add_argument("--target-text", action="store_true",
                    help="train on the target's greedy completions of the training prompts (built once, cached)")
    # --config left out reads as None, so that --job can tell it was not given.
    args = ap.parse_args(argv, argparse.Namespace(config=None))
    try:
        if args.job is not None:
            given = [flag for flag, on in (("--config", args.config is not None),
                                           ("--topology", args.topology is not None),
                                           ("--target-text", args.target_text)) if on]
            if given:
                raise ConfigError(f"--job: trains on the job's own config.yaml; {given[0]} is not for it (--set is)")
            asked = job_config(args.job, args.overrides)
        else:
            asked = config_from_args(args)
            if args.target_text:
                asked = asked.updated({"data.path": str(ensure_target_text(asked))})
        cfg, pre = resolve(asked, args.run_dir)
        if args.job is not None:
            same_resolution(args.job, asked, pre)
    except (ValueError, OSError) as e:     # ConfigError, DatasetError, RunDirError are ValueErrors
        print(f"error: {first_line(e)}", file=sys.stderr)
        return 2
    result = train_reference(cfg, args.run_dir, pre=pre)
    summary = _summary(result) | {"data": str(pre.train_path)}
    if args.eval:
        summary["eval"] = evaluate_drafter(cfg, result.state_dict)
    if args.job is not None:
        summary["job"] = compare_job(args.job, result)
    print(json.dumps(summary))
    return 1 if summary.get("job", {}).get("identical") is False else 0


if __name__ == "__main__":
    sys.exit(main())
