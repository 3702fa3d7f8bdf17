"""What a training job tells its user: the live view while it runs, the summary after.

While it runs, ``Progress`` is the supervisor's status hook: once a second it adds the
training position (step, loss, simulated tau, lr, tokens) to ``status.json`` and moves
the progress bar. At the end, ``finish`` writes ``summary.json`` and ``losses.json``,
prints the summary as one JSON line on stdout and a readable line on stderr.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from .checkpoint import latest_checkpoint
from .metrics import read_steps


def _tokens(steps: list[dict]) -> int:
    return int(sum(s["tokens"] for s in steps))


class Progress:
    def __init__(self, step_stats: torch.Tensor, weights, first_step: int, total_steps: int, enabled: bool):
        self.step_stats, self.weights, self.total_steps = step_stats, weights, total_steps
        self.bar = tqdm(total=total_steps, initial=first_step, unit="step", desc="train", disable=not enabled,
                        dynamic_ncols=True)

    def __call__(self, status: dict) -> None:
        steps = read_steps(self.step_stats)
        last = steps[-1] if steps else {}
        step = self.weights.version
        status["training"] = {"step": step, "total_steps": self.total_steps, "loss": last.get("loss"),
                              "simulated_tau": last.get("tau"), "lr": last.get("lr"), "tokens": _tokens(steps)}
        self.bar.update(step - self.bar.n)
        if steps:
            restarts = sum(a["restarts"] for a in status["actors"].values())
            self.bar.set_postfix(loss=f"{last['loss']:.4f}", tau=f"{last['tau']:.2f}", restarts=restarts,
                                 refresh=False)

    def close(self) -> None:
        self.bar.close()


def finish(run_dir: Path, reason: str, step: int, total_steps: int, resumed_from: int, step_stats: torch.Tensor,
           wall_s: float, restarts: dict[str, int], rollbacks: int, verbose: bool) -> dict:
    """Write and print the run's summary; returns it."""
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
    }
    summary["loss"], summary["simulated_tau"] = _finite(summary["loss"]), _finite(summary["simulated_tau"])
    # Strict JSON: a skipped step's NaN loss is written as null, not as a bare NaN.
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
    (run_dir / "losses.json").write_text(json.dumps([_finite(s["loss"]) for s in steps], allow_nan=False))
    print(json.dumps(summary), flush=True)
    if verbose:
        loss = f"{summary['loss']:.4f}" if summary["loss"] is not None else "-"
        tau = f"{summary['simulated_tau']:.3f}" if summary["simulated_tau"] is not None else "-"
        print(f"{reason}: step {step}/{total_steps}, loss {loss}, simulated tau {tau}, "
              f"{summary['tokens_per_s']:.0f} tokens/s, {summary['wall_s']:.1f} s, "
              f"{summary['restarts']} restarts; checkpoint {summary['checkpoint']}", file=sys.stderr)
    return summary


def _finite(x):
    return x if x is None or math.isfinite(x) else None
