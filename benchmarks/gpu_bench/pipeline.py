"""Section 2c and its preparation: the pipeline's target saved, its plan made, then ``launch.py
1-1`` on one device to steady steps.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path

from .common import PLAN_FILE, QWEN3_8B, building_on, emit, error_line, read_json, write_json
from .launches import (
    last_error,
    plan_brief,
    plan_only,
    plan_vs_measured,
    read_jsonl,
    run_launch,
    stage_view,
    steady,
    with_sets,
)

PIPE_TARGET_LAYERS = 12
"""2c's target: Qwen3-8B's shape with this many layers (module docstring)."""


PIPE_TARGET_DIR = Path("/tmp/gpu-q8-12l")


PIPE_SAMPLES = 400
"""Synthetic samples of 2c: 50 steps of 8, more than 200 s hold; the run is stopped by time
(``--smoke``: 80, which two CPU cores finish)."""


def save_model(model, path: Path) -> None:
    """``save_pretrained`` (safetensors) under a temporary name, then renamed: a save the
    time limit cuts short leaves no directory a later section would try to load."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)
    model.save_pretrained(tmp)
    os.replace(tmp, path)


def _build_and_save_pipe_target(path: str) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with building_on(torch.device("cuda:0"), torch.bfloat16):
        lm = Qwen3ForCausalLM(Qwen3Config(**{**QWEN3_8B, "num_hidden_layers": PIPE_TARGET_LAYERS}))
    save_model(lm, Path(path))


def save_pipe_target(path: Path) -> float:
    """2c's random bf16 target saved at ``path`` unless it is there; built on cuda:0 in a
    child process, so that this one holds no GPU memory while the launch runs. Seconds."""
    if (path / "config.json").is_file():
        return 0.0
    t = time.perf_counter()
    p = multiprocessing.get_context("spawn").Process(target=_build_and_save_pipe_target, args=(str(path),))
    p.start()
    p.join()
    if p.exitcode != 0:
        raise RuntimeError(f"building and saving the pipeline's target exited {p.exitcode} (its traceback is above)")
    return round(time.perf_counter() - t, 1)


def pipeline_sets(target_dir: Path | None, device: str, smoke: bool) -> list[str]:
    """``--set`` overrides of 2c (and of 2b's plan): the cut 8B-shaped target loaded by
    the target actor, a 5-layer drafter, 8 x ~2048-token batches of synthetic data (one
    a step), no evaluation, a hang timeout past the first batch's compilation, and 4
    threads an actor (16 cores, four actors: the plan may put the optimizer's AdamW
    over 1e9 parameters on the host)."""
    sets = [f"topology.target_devices=[{device}]", f"topology.drafter_devices=[{device}]",
            "train.epochs=1", "train.checkpoint_every=0", "eval.every=0", "runtime.hang_timeout_s=300",
            "monitor.console=lines", "monitor.tensorboard=false", "data.synthetic.heldout_samples=0",
            f"data.synthetic.num_samples={80 if smoke else PIPE_SAMPLES}"]
    if target_dir is not None:
        sets.append(f"target.path={target_dir}")
    # A cache of its own: ``prepare`` makes the data while other sections fill theirs.
    if smoke:
        return sets + ["data.cache_dir=/tmp/gpu-bench-smoke-cache-pipe"]
    return sets + ["target.share_weights=off", "train.num_threads=4", "drafter.num_layers=5", "drafter.block_size=16",
                   "batching.token_budget=16384", "data.max_seq_len=2048", "train.num_anchors=512",
                   "data.synthetic.prompt_len=[64, 128]", "data.synthetic.completion_len=[1920, 1984]",
                   "data.cache_dir=/tmp/gpu-cache-pipe"]


def prepare(work: Path, smoke: bool, out: str | None = None) -> dict:
    """2c's target saved and 2c's plan made (``launch.py --plan-only`` with 2c's very
    settings), each unless done already: gpu_check.sh runs this beside the first
    sections, and 2b and 2c call it again to read the plan. Returns the plan (or
    ``{"error": ...}``), which also goes to ``work/PLAN_FILE``."""
    plan = read_json(work / PLAN_FILE)
    if plan:
        return plan
    result: dict = {"section": "prepare"}
    target_dir = None
    if not smoke:
        try:
            result["target_save_s"] = save_pipe_target(PIPE_TARGET_DIR)
        except Exception as e:  # noqa: BLE001 - recorded; 2b still measures, 2c cannot launch
            result["error"] = error_line(e)
            emit(result, out)
            return {"error": result["error"]}
        target_dir = PIPE_TARGET_DIR
    t = time.perf_counter()
    plan = plan_only("1-1", pipeline_sets(target_dir, "cpu" if smoke else "cuda:0", smoke), work / "pipeline_plan.log")
    result.update(plan_s=round(time.perf_counter() - t, 1), plan=plan_brief(plan))
    if "error" in plan:
        result["error"] = plan["error"]
    else:
        write_json(plan, str(work / PLAN_FILE))
    emit(result, out)
    return plan


def planned_block_tokens(run_dir: Path):
    """``train.drafter_block_tokens`` as the run resolved it (its config.yaml), or None."""
    import yaml

    with contextlib.suppress(OSError, ValueError, AttributeError, yaml.YAMLError):
        return ((yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("train") or {}).get(
            "drafter_block_tokens")
    return None


def bench_pipeline(run_dir: Path, work: Path, limit_s: float, smoke: bool, out: str | None = None) -> dict:
    """2c: the launch, with what is left of ``limit_s`` once ``prepare`` has (had) its way."""
    end = time.monotonic() + limit_s
    device = "cpu" if smoke else "cuda:0"
    result: dict = {"section": "pipeline", "topology": "1-1",
                    "target": "tiny default" if smoke else f"qwen3-8b shape, {PIPE_TARGET_LAYERS} layers"}
    plan = prepare(work, smoke)
    sets = pipeline_sets(None if smoke else PIPE_TARGET_DIR, device, smoke)
    result["plan"] = plan_brief(plan)
    if plan.get("problem") or plan.get("error"):
        result["error"] = f"plan: {plan.get('problem') or plan.get('error')}"
        emit(result, out)
        return result
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = with_sets([sys.executable, "launch.py", "--topology", "1-1", "--run-dir", str(run_dir)], sets)
    left = end - time.monotonic()
    t = time.perf_counter()
    # The grace covers the final checkpoint (~12 GB) before the summary is written.
    rc, timed_out = run_launch(cmd, work / "pipeline_launch.log", left, grace_s=min(45.0, left / 4))
    result.update(rc=rc, timed_out=timed_out, wall_s=round(time.perf_counter() - t, 1))
    summary = read_json(run_dir / "summary.json")
    rate = steady(read_jsonl(run_dir / "metrics.jsonl", "step"))
    result.update(result_reason=summary.get("result"), steps=summary.get("step"),
                  total_steps=summary.get("total_steps"), loss=summary.get("loss"),
                  summary_tokens_per_s=summary.get("tokens_per_s"), summary_wall_s=summary.get("wall_s"),
                  restarts=summary.get("restarts"), steady=rate, tokens_per_s=rate.get("tokens_per_s"),
                  stages=stage_view(summary, rate), run_block_tokens=planned_block_tokens(run_dir),
                  plan_vs_measured=plan_vs_measured(plan, read_json(run_dir / "status.json")))
    # Stopped by time, the run is still a success here once it has steady steps.
    if rc != 0 and not (timed_out and rate):
        result["error"] = (f"timed out after {left:.0f} s; " if timed_out else f"exit {rc}; ") + \
            (last_error(work / "pipeline_launch.log") or "no output")
    # A checkpoint of this drafter is ~12 GB (weights and AdamW moments) of the lent machine's disk.
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    emit(result, out)
    return result
