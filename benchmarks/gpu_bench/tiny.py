"""Section 3: the tiny default config 2-2 over the CUDA feature ring against the reference.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .common import ROOT, emit, read_json, sig
from .launches import last_error, plan_brief, plan_only, plan_vs_measured, with_sets


def tiny_sets(smoke: bool) -> list[str]:
    """The default config for one epoch of 256 samples (17 steps: what is checked is the
    data plane and the result, which fewer steps show as well, and in less time)."""
    return ["train.epochs=1", "monitor.console=lines", "monitor.tensorboard=false", "data.synthetic.num_samples=256",
            "data.cache_dir=/tmp/gpu-bench-smoke-cache" if smoke else "data.cache_dir=/tmp/gpu-cache"]


def devices_sets(device: str, n: int) -> list[str]:
    devs = ", ".join([device] * n)
    return [f"topology.target_devices=[{devs}]", f"topology.drafter_devices=[{devs}]"]


def bench_tiny(work: Path, limit_s: float, smoke: bool, out: str | None = None) -> dict:
    """The tiny default target 2-2 (all on one device; on a GPU the feature ring is there
    too, shared by CUDA IPC) and the single-process reference, side by side; equal within
    tolerance on CUDA (not bits); each process's memory beside its plan."""
    end = time.monotonic() + limit_s
    device = "cpu" if smoke else "cuda:0"
    run, ref = Path("/tmp/gpu-2-2"), Path("/tmp/gpu-ref")
    for d in (run, ref):
        shutil.rmtree(d, ignore_errors=True)
    sets = tiny_sets(smoke)
    plan = plan_only("2-2", sets + devices_sets(device, 2), work / "tiny_plan.log")
    result = {"section": "tiny", "plan": plan_brief(plan)}
    cmds = {"pipeline_2_2": with_sets([sys.executable, "launch.py", "--topology", "2-2", "--run-dir", str(run)],
                                      sets + devices_sets(device, 2)),
            "reference_2_2": with_sets([sys.executable, "launch.py", "reference", "--topology", "2-2",
                                        "--run-dir", str(ref)], sets + devices_sets(device, 2))}
    procs = {k: subprocess.Popen(c, cwd=ROOT, stdout=open(work / f"tiny_{k}.log", "w"), stderr=subprocess.STDOUT)
             for k, c in cmds.items()}
    for k, p in procs.items():
        try:
            result[f"{k}_rc"] = p.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            result[f"{k}_rc"] = p.wait()
            result.setdefault("error", f"{k} timed out after {limit_s:.0f} s")
    summary, reference = read_json(run / "summary.json"), read_json(ref / "reference.json")
    losses = []
    with contextlib.suppress(OSError, ValueError):
        losses = json.loads((run / "losses.json").read_text())
    a, b = (losses[-1] if losses else None), reference.get("final_loss")
    rel = abs(a - b) / max(abs(b), 1e-12) if a is not None and b is not None else None
    result.update(steps=summary.get("step"), final_loss=a, reference_final_loss=b, rel_diff=sig(rel),
                  match=rel is not None and rel < 2e-2, tokens_per_s=summary.get("tokens_per_s"),
                  reference_tokens_per_s=reference.get("tokens_per_s"))
    result["stages"] = {k: v for k, v in (summary.get("stages") or {}).items() if k in ("target", "drafter")}
    result["plan_vs_measured"] = plan_vs_measured(plan, read_json(run / "status.json"))
    for k in procs:
        if result[f"{k}_rc"] != 0:
            result.setdefault("error", f"{k} exit {result[f'{k}_rc']}: {last_error(work / f'tiny_{k}.log')}")
    emit(result, out)
    return result
