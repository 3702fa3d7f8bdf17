"""What the pipeline buys: pipelined against lock-step against the bound, per topology.

    python -m benchmarks.bench_pipeline [--topologies 1-1,2-2,3-1,1-3] [--epochs 2]

Every run is the real training job (real processes, rings, ledger, optimizer) under
simulated compute (``benchmarks.simulated``: target 3x the drafter per token). For each
topology it runs the pipelined schedule and the lock-step one, reads both traces, and
reports:
  * steady tokens/s of each (from the first optimizer publish to the last);
  * the bound: the slowest stage at the stage costs the pipelined trace measured
    (``costmodel.bound_batches_per_s``: the drafter stage includes the optimizer step it
    waits for), ``efficiency = pipelined / bound``, ``speedup = pipelined / lockstep``
    and the ideal speedup those costs allow; the control overhead per batch is what
    the pipelined run took beyond the bound;
  * each stage's busy fraction in both schedules;
  * bytes per batch through each buffer, at this machine's measured copy bandwidth;
  * a paper projection for Qwen3-8B- and Qwen3.6-27B-shaped targets, and the advised
    topology for 4 and 8 devices from the measured 2-2 costs.
Prints one JSON line (``make bench`` renders it as a table).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from benchmarks import harness, simulated
from dflash_actors.config import parse_topology
from dflash_actors.train import costmodel

GOAL_EFFICIENCY = 0.95
GOAL_SPEEDUP_OF_IDEAL = 0.95
TFLOPS = 400.0          # assumed sustained bf16 TFLOP/s per H200 (about 40% of its dense peak)


def copy_gb_per_s(mib: int = 64, repeats: int = 7) -> float:
    """This machine's memcpy bandwidth between two tensors (median of ``repeats``)."""
    src = torch.ones(mib << 18)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return src.numel() * 4 / statistics.median(times) / 1e9


def topology_record(topology: str, tmp: Path, epochs: int) -> tuple[dict, simulated.Measured]:
    n, m = parse_topology(topology)
    runs = {s: simulated.run(simulated.sim_config(tmp / f"{topology}-{s}", topology, s, epochs))
            for s in ("pipelined", "lockstep")}
    p, lock = runs["pipelined"], runs["lockstep"]
    c = p.costs
    bound = costmodel.bound_batches_per_s(c, n, m, 1)
    rec = {
        "topology": topology,
        "pipelined_tokens_per_s": round(p.tokens_per_s, 1),
        "lockstep_tokens_per_s": round(lock.tokens_per_s, 1),
        "bound_tokens_per_s": round(bound * c.tokens_per_batch, 1),
        "efficiency": round(p.batches_per_s / bound, 3),
        "speedup": round(p.tokens_per_s / lock.tokens_per_s, 3),
        "ideal_speedup": round(costmodel.ideal_speedup(c, n, m, 1), 3),
        "overhead_ms_per_batch": round((1 / p.batches_per_s - 1 / bound) * 1e3, 2),
        "bottleneck": costmodel.bottleneck(c, n, m, 1),
        "stage_ms": {"loader": round(c.loader_s * 1e3, 2), "target": round(c.target_s * 1e3, 2),
                     "drafter": round(c.drafter_s * 1e3, 2), "optimizer_per_step": round(c.optimizer_s * 1e3, 2)},
        "busy": {stage: {"pipelined": p.busy.get(stage), "lockstep": lock.busy.get(stage)} for stage in p.busy},
        "gap_ms": p.gaps_ms,
        "chain_ms": p.chain_ms,
    }
    return rec, p


def bytes_record(p: simulated.Measured, gbps: float) -> dict:
    """Bytes copied per batch through each buffer in these runs, and their time at ``gbps``."""
    copied = {
        "features": 2 * p.costs.tokens_per_batch * simulated.FEATURE_WIDTH * 4,  # target writes, drafter reads
        "gradients": 2 * p.param_bytes,     # the running sum: loaded and committed by the drafter
        "weights": p.param_bytes,           # loaded by a drafter once per step (grad_accum 1: per batch)
    }
    return {"copy_gb_per_s": round(gbps, 2),
            "per_batch": {k: {"bytes": int(v), "ms": round(v / gbps / 1e6, 3)} for k, v in copied.items()}}


def main(argv=None) -> dict:
    ap = harness.parser(__doc__)
    ap.add_argument("--topologies", default="1-1,2-2,3-1,1-3")
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args(argv)
    hf_logging.disable_progress_bar()
    records, measured = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for topology in args.topologies.split(","):
            rec, p = topology_record(topology, Path(tmp), args.epochs)
            records.append(rec)
            measured[topology] = p
            harness.say(f"{topology}: {rec}")
    ref = measured.get("2-2") or next(iter(measured.values()))
    # The advice counts the control plane: two supervisor hops per step on the drafter
    # chain, each about what the last gradient's Done takes to reach the optimizer.
    hops = [r["chain_ms"]["drafter_to_optimizer"] for r in records if r["chain_ms"]["drafter_to_optimizer"]]
    control_s = 2 * statistics.median(hops) / 1e3 if hops else 0.0
    w = costmodel.Workload()
    out = {
        "bench": "pipeline",
        "simulated": {"target_us_per_token": simulated.TARGET_US_PER_TOKEN,
                      "drafter_us_per_token": simulated.DRAFTER_US_PER_TOKEN,
                      "feature_width": simulated.FEATURE_WIDTH, "epochs": args.epochs,
                      "tokens_per_batch": round(ref.costs.tokens_per_batch, 1)},
        "pipeline": records,
        "goals_met": {"efficiency": all(r["efficiency"] >= GOAL_EFFICIENCY for r in records),
                      "speedup": all(r["speedup"] >= GOAL_SPEEDUP_OF_IDEAL * r["ideal_speedup"] for r in records)},
        "bytes": bytes_record(ref, copy_gb_per_s()),
        "projection": [costmodel.project(costmodel.SHAPES[name], w, TFLOPS) for name in ("qwen3-8b", "qwen3.6-27b")],
        "control_ms_per_step": round(control_s * 1e3, 2),
        "advice": {str(d): costmodel.explain(replace(ref.costs, control_s=control_s), d, 1) for d in (4, 8)},
        # The same bound with each target a gang of 2 devices (topology.target_tp), split ideally.
        "advice_target_tp_2": {str(d): costmodel.explain(replace(ref.costs, control_s=control_s), d, 1, tp=2)
                               for d in (4, 8)},
    }
    return harness.emit(out, args.save)


if __name__ == "__main__":
    main()
