"""``launch.py`` runs and their plans: ``--plan-only``, a launch stopped by time, steady rates read
from ``metrics.jsonl``, and each process's planned memory beside what it measured.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

from .common import ROOT, mib_gib, sig


def with_sets(cmd: list[str], sets: list[str]) -> list[str]:
    for s in sets:
        cmd = cmd + ["--set", s]
    return cmd


def plan_only(topology: str, sets: list[str], log: Path, timeout_s: float = 180.0) -> dict:
    """``launch.py --plan-only --json`` for a launch of ``topology`` with these ``--set``s:
    the memory plan that launch resolves before it spawns (``problem`` set where a device
    does not fit), or ``{"error": ...}``. Its output goes to ``log``."""
    cmd = with_sets([sys.executable, "launch.py", "--plan-only", "--json", "--topology", topology], sets)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"launch.py --plan-only timed out after {timeout_s:.0f} s"}
    log.write_text(proc.stdout + proc.stderr)
    lines = proc.stdout.strip().splitlines()
    with contextlib.suppress(ValueError, IndexError):
        plan = json.loads(lines[-1])
        if isinstance(plan, dict):
            return plan
    return {"error": f"launch.py --plan-only exit {proc.returncode}: {last_error(log)}"}


def step_part(plan: dict, process: str = "drafter.0") -> dict:
    """The plan's part for ``process``'s drafter step at its peak (traced), or {}."""
    for dev in plan.get("memory_plan") or []:
        for p in dev["parts"]:
            if p["process"] == process and p["key"] == "train.drafter_block_tokens":
                return {"device": dev["device"], **p}
    return {}


def plan_brief(plan: dict) -> dict:
    """What the plan decided, for the section's line (the whole plan is in its log)."""
    out = {k: plan.get(k) for k in ("drafter_block_tokens", "checkpoint_layers", "optimizer_device",
                                    "feature_device", "problem")}
    if plan.get("error"):
        out["error"] = plan["error"]
    out["drafter_step_peak_gib"] = step_part(plan).get("gib")
    return out


def planned(plan: dict, process: str, device: str) -> tuple[float | None, float | None]:
    """``(GiB, of which CUDA context GiB)`` the plan gives ``process`` on ``device``."""
    total = next((p["gib"] for p in plan.get("processes") or [] if (p["process"], p["device"]) == (process, device)),
                 None)
    context = None
    for dev in plan.get("memory_plan") or []:
        if dev["device"] == device:
            context = sum(p["gib"] for p in dev["parts"] if p["process"] == process and p["what"] == "CUDA context")
    return total, context or None


def plan_vs_measured(plan: dict, status: dict) -> list[dict]:
    """One row per process and device of the plan: its planned peak (a CUDA context
    included, ``context_gib`` of it) beside the peaks the process reported in
    ``status.json`` (allocated and reserved on its current device, which is the planned
    GPU in these one-GPU runs; null on the host, which no process reports); then a row
    for each process that allocated GPU memory the plan did not give it."""
    processes = {"supervisor": status.get("supervisor") or {}, **(status.get("actors") or {})}
    rows, on_gpu = [], set()
    for p in plan.get("processes") or []:
        st = processes.get(p["process"])
        gpu = p["device"].startswith("cuda") and st is not None
        if gpu:
            on_gpu.add(p["process"])
        rows.append({"process": p["process"], "device": p["device"], "planned_gib": p["gib"],
                     "context_gib": planned(plan, p["process"], p["device"])[1],
                     "measured_peak_gib": mib_gib(st.get("gpu_peak_mb")) if gpu else None,
                     "reserved_peak_gib": mib_gib(st.get("gpu_reserved_peak_mb")) if gpu else None})
    for name, st in processes.items():
        if name not in on_gpu and st.get("gpu_peak_mb"):
            rows.append({"process": name, "device": "cuda, not planned", "planned_gib": None, "context_gib": None,
                         "measured_peak_gib": mib_gib(st["gpu_peak_mb"]),
                         "reserved_peak_gib": mib_gib(st.get("gpu_reserved_peak_mb"))})
    return rows


def run_launch(cmd: list[str], log: Path, limit_s: float, grace_s: float) -> tuple[int, bool]:
    """Run ``cmd`` (a launch) with its output in ``log``; at ``limit_s - grace_s`` send it
    SIGTERM (it checkpoints, writes its summary and stops), at ``limit_s`` SIGKILL (its
    actors die with it). Same process group as ours, so an outer ``timeout`` reaches it.
    Returns ``(exit code, timed out)``."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=max(1.0, limit_s - grace_s)), False
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return proc.returncode, True


def read_jsonl(path: Path, kind: str) -> list[dict]:
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if rec.get("kind") == kind:
                    out.append(rec)
    return out


def steady(steps: list[dict], skip: int = 2) -> dict:
    """Rate over the steps after the first ``skip`` (fewer when the run had few): their
    tokens over the time from the end of the last skipped step to the end of the last
    one, and each stage's busy seconds in them. A resumed run logs some steps twice;
    the later line counts."""
    by_step = {}
    for s in steps:
        by_step[s["step"]] = s
    steps = [by_step[k] for k in sorted(by_step)]
    if len(steps) < 2:
        return {}
    skip = max(1, min(skip, len(steps) - 1))
    base, counted = steps[skip - 1], steps[skip:]
    span = counted[-1]["time"] - base["time"]
    if span <= 0:
        return {}
    tokens = sum(s["tokens"] for s in counted)
    busy: dict[str, float] = {}
    for s in counted:
        for role, st in (s.get("stages") or {}).items():
            busy[role] = busy.get(role, 0.0) + (st.get("busy_s") or 0.0)
    return {"steps": len(counted), "skipped_steps": skip, "tokens": tokens, "seconds": round(span, 3),
            "tokens_per_s": sig(tokens / span), "step_s": sig(span / len(counted)),
            "busy_s": {k: round(v, 3) for k, v in busy.items()}}


def stage_view(summary: dict, rate: dict) -> dict:
    """Per stage: the summary's busy fraction, TFLOP/s and MFU (over the whole run), and
    the MFU over the steady steps alone. The latter assumes FLOPs proportional to tokens
    (the batches are alike here): MFU x (busy s per token, whole run) / (busy s per token, steady)."""
    out = {}
    total_tokens = summary.get("tokens") or 0
    for role, st in (summary.get("stages") or {}).items():
        row = {k: st.get(k) for k in ("busy_fraction", "tokens_per_s", "tflops", "mfu")}
        busy_steady = (rate.get("busy_s") or {}).get(role)
        if st.get("mfu") and busy_steady and total_tokens and st.get("busy_s"):
            per_token_all = st["busy_s"] / total_tokens
            per_token_steady = busy_steady / rate["tokens"]
            row["steady_mfu"] = sig(st["mfu"] * per_token_all / per_token_steady)
        out[role] = row
    return out


def last_error(log: Path, lines: int = 60) -> str | None:
    """The last line of ``log`` that reads like an error, else its last non-empty line."""
    if not log.is_file():
        return None
    text = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    pat = re.compile(r"error|Error|Exception|FAILED|Traceback|Killed|refused|not found|No such")
    for x in reversed(text[-lines:]):
        if pat.search(x):
            return x[:400]
    return text[-1][:400] if text else None
