"""Shared by the benchmarks that run the training job under simulated compute.

The costs keep the seeds' balance: a target forward costs about 3x a drafter
forward+backward per token. The feature width is scaled so that copying a batch's
features costs about the same share of the target's time here as a Qwen3-8B batch
over PCIe 5.0 does on a GPU machine (2.7 GB at 50 GB/s against ~2.4 s of forward:
about 2%), rather than the real 40 KiB/token, which on two shared CPU cores would
measure memcpy contention instead of the pipeline.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from dflash_actors.config import load_config
from dflash_actors.job.job import Job
from dflash_actors.runtime import trace
from dflash_actors.train import costmodel

ROOT = Path(__file__).resolve().parents[1]
TARGET_US_PER_TOKEN = 30.0      # about 58 ms per demo batch of ~1,930 tokens
DRAFTER_US_PER_TOKEN = 10.0
FEATURE_WIDTH = 1536            # fp32: ~6 KiB/token, ~12 MB per demo batch


def sim_config(run_dir: Path, topology: str, schedule: str = "pipelined", epochs: int = 2, extra=()):
    return load_config(ROOT / "configs/default.yaml", [
        f"runtime.run_dir={run_dir}", f"train.epochs={epochs}", "train.checkpoint_every=0",
        "runtime.simulate.enabled=true", f"runtime.simulate.target_us_per_token={TARGET_US_PER_TOKEN}",
        f"runtime.simulate.drafter_us_per_token={DRAFTER_US_PER_TOKEN}",
        f"runtime.simulate.feature_width={FEATURE_WIDTH}", f"runtime.schedule={schedule}",
        "runtime.trace=true", "runtime.trace_batches=100000", *extra], topology)


@dataclass
class Measured:
    """One simulated run, read back from its trace and its stats tables."""

    tokens_per_s: float          # steady state: from the first step's publish to the last's
    batches_per_s: float
    costs: costmodel.StageCosts  # mean span durations: what each stage costs when it works
    busy: dict[str, float]       # stage -> fraction of the steady window its actors spent in work
    gaps_ms: dict[str, float]    # stage -> median idle time between two work spans of one actor
    chain_ms: dict[str, float]   # the step's critical chain: last gradient -> step -> next drafter batch
    wall_s: float
    spans: list[dict]
    param_bytes: int             # the drafter's fp32 parameters (= one gradient sum)
    origin_s: float              # time.monotonic() of the trace's ts 0


def run(cfg) -> Measured:
    job = Job(cfg, progress=False)
    result = job.run()
    if result.exit_code:
        raise RuntimeError(f"simulated run failed: {result.reason}")
    tokens = job.shared.batch_stats[:, 4].tolist()
    path = Path(cfg.runtime.run_dir) / trace.TRACE_FILE
    return measure(trace.load(path), tokens, job.schedule, result.summary["wall_s"], job.layout.numel * 4,
                   trace.origin(path))


def _role(track: str) -> str:
    return track.split(".")[0]


def measure(spans: list[dict], batch_tokens: list[float], schedule, wall_s: float, param_bytes: int,
            origin_s: float) -> Measured:
    publish = sorted(s["ts"] + s["dur"] for s in spans if s["name"] == "publish")
    t0, t1 = publish[0], publish[-1]
    steps = len(publish)
    steady_tokens = sum(batch_tokens[schedule.first_of_step(1):schedule.first_of_step(steps)])
    window_s = (t1 - t0) / 1e6
    work = [s for s in spans if s["name"] == "work"]
    by_role: dict[str, list[dict]] = {}
    for s in work:
        by_role.setdefault(_role(s["track"]), []).append(s)
    actors = {r: len({s["track"] for s in ss}) for r, ss in by_role.items()}
    busy = {r: round(sum(_overlap(s, t0, t1) for s in ss) / ((t1 - t0) * actors[r]), 3) for r, ss in by_role.items()}
    mean = lambda r: statistics.fmean(s["dur"] for s in by_role[r]) / 1e6
    opt_s = sum(s["dur"] for s in by_role["optimizer"]) / 1e6 / steps
    costs = costmodel.StageCosts(mean("loader"), mean("target"), mean("drafter"), opt_s,
                                 sum(batch_tokens) / len(batch_tokens))
    n_batches = schedule.first_of_step(steps) - schedule.first_of_step(1)
    return Measured(steady_tokens / window_s, n_batches / window_s, costs, busy, _gaps(work, t0, t1),
                    _chain(work, schedule, steps), wall_s, spans, param_bytes, origin_s)


def _gaps(work: list[dict], t0: float, t1: float) -> dict[str, float]:
    by_track: dict[str, list[dict]] = {}
    for s in work:
        if t0 <= s["ts"] <= t1:
            by_track.setdefault(s["track"], []).append(s)
    gaps: dict[str, list[float]] = {}
    for track, ss in by_track.items():
        ss.sort(key=lambda s: s["ts"])
        gaps.setdefault(_role(track), []).extend((b["ts"] - a["ts"] - a["dur"]) / 1e3 for a, b in zip(ss, ss[1:]))
    return {r: round(statistics.median(g), 2) for r, g in gaps.items() if g}


def _chain(work: list[dict], schedule, steps: int) -> dict[str, float]:
    """Medians over steps: from the step's last drafter batch ending to the optimizer
    starting the step (one supervisor hop), and from the optimizer's commit to the first
    drafter batch of the next step starting (one hop, plus any wait for features)."""
    drafter = {s["args"]["batch"]: s for s in work if _role(s["track"]) == "drafter"}
    optimizer = {s["args"]["batch"]: s for s in work if _role(s["track"]) == "optimizer"}
    to_opt, to_next = [], []
    for step in range(1, steps - 1):
        ids = range(schedule.first_of_step(step), schedule.first_of_step(step + 1))
        if not all(b in drafter for b in ids) or ids[-1] not in optimizer:
            continue
        opt = optimizer[ids[-1]]
        to_opt.append(opt["ts"] - max(drafter[b]["ts"] + drafter[b]["dur"] for b in ids))
        nxt = [drafter[b]["ts"] for b in range(ids[-1] + 1, ids[-1] + 1 + len(ids)) if b in drafter]
        if nxt:
            to_next.append(min(nxt) - opt["ts"] - opt["dur"])
    med = lambda xs: round(statistics.median(xs) / 1e3, 2) if xs else None
    return {"drafter_to_optimizer": med(to_opt), "optimizer_to_drafter": med(to_next)}


def _overlap(span: dict, t0: float, t1: float) -> float:
    return max(0.0, min(span["ts"] + span["dur"], t1) - max(span["ts"], t0))
