"""What a training job tells its user at the end (``monitor`` does it while it runs):
``finish`` writes ``summary.json`` and ``losses.json``, prints the summary as one JSON
line on stdout and a readable line, with the per-stage accounting, on stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ..train.checkpoint import latest_checkpoint
from ..train.metrics import finite, read_steps


def _tokens(steps: list[dict]) -> int:
    return int(sum(s["tokens"] for s in steps))


def finish(run_dir: Path, reason: str, step: int, total_steps: int, resumed_from: int, step_stats: torch.Tensor,
           wall_s: float, restarts: dict[str, int], rollbacks: int, verbose: bool, stages: dict,
           extra: dict | None = None) -> dict:
    """Write and print the run's summary (with ``extra``'s keys, e.g. ``cluster``); returns it."""
    steps = read_steps(step_stats)
    tokens = _tokens(steps)
    last = steps[-1] if steps else {}
    ckpt = latest_checkpoint(run_dir)
    summary = {
        "result": reason, "step": step, "total_steps": total_steps, "steps_this_run": len(steps),
        "resumed_from": resumed_from, "tokens": tokens, "tokens_per_s": round(tokens / wall_s, 1),
        "wall_s": round(wall_s, 2), "loss": last.get("loss"), "simulated_tau": last.get("tau"),
        "restarts": sum(restarts.values()), "restarts_by_actor": {k: v for k, v in restarts.items() if v},
        "rollbacks": rollbacks, "checkpoint": str(ckpt) if ckpt else None,
        "skipped_steps": [resumed_from + i for i, s in enumerate(steps) if s["skipped"]],
        "stages": stages, **(extra or {}),
    }
    summary["loss"], summary["simulated_tau"] = finite(summary["loss"]), finite(summary["simulated_tau"])
    # Strict JSON: a skipped step's NaN loss is written as null, not as a bare NaN.
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
    (run_dir / "losses.json").write_text(json.dumps([finite(s["loss"]) for s in steps], allow_nan=False))
    print(json.dumps(summary), flush=True)
    if verbose:
        loss = f"{summary['loss']:.4f}" if summary["loss"] is not None else "-"
        tau = f"{summary['simulated_tau']:.3f}" if summary["simulated_tau"] is not None else "-"
        print(f"{reason}: step {step}/{total_steps}, loss {loss}, simulated tau {tau}, "
              f"{summary['tokens_per_s']:.0f} tokens/s, {summary['wall_s']:.1f} s, "
              f"{summary['restarts']} restarts; checkpoint {summary['checkpoint']}", file=sys.stderr)
        for line in stage_lines(stages):
            print(line, file=sys.stderr)
        cluster = summary.get("cluster")
        if cluster:
            print(f"  node {cluster['rank']} of {cluster['nodes']}: replicas {cluster.get('replicas', '-')}; "
                  f"cross-node exchange {1e3 * (cluster['reduce_s_mean'] or 0):.1f} ms per step"
                  + ("; checkpoints are node 0's" if cluster["rank"] else ""), file=sys.stderr)
    return summary


def stage_lines(stages: dict) -> list[str]:
    """``  target    2 actors  busy 83%  4210 tok/s  0.91 TFLOP/s  MFU 12.0%`` per stage."""
    out = []
    for role, st in stages.items():
        line = (f"  {role:<10} {st['actors']} actor{'s' if st['actors'] > 1 else ' '}  "
                f"busy {100 * st['busy_fraction']:3.0f}%  "
                f"{st['tokens_per_s'] or 0:8.0f} tok/s at full use")
        if "tflops" in st:
            line += f"  {st['tflops']:.3g} TFLOP/s per device"
            line += f"  MFU {100 * st['mfu']:.1f}%" if st.get("mfu") is not None else ""
        out.append(line)
    return out
