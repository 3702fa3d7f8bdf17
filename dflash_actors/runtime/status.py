"""The runtime's block of ``<run_dir>/status.json``: per actor its process, state,
heartbeat, progress, what it holds, how busy it is, its memory and CPU, and its start-up
phase. The supervisor writes it about once a second; a caller adds its own keys
(``Supervisor(on_status=...)``; the training job's schema: ``observe/status.py``)."""

from __future__ import annotations

from typing import Optional

import psutil

from .actor import Heartbeats
from .children import Child, StartPhase

STATUS_FILE = "status.json"
"""In the run directory."""
BUSY_WINDOW_S = 30.0
"""status.json's ``busy_pct_30s``."""


def actor_entry(c: Child, heartbeats: Heartbeats, holds, now: float, running: bool) -> dict:
    """``c``'s entry in ``actors``; ``holds``: the ring slots it holds (``Dispatcher.held``);
    ``running``: whether the job is (a process gone then is dead, not exited)."""
    hb = heartbeats.row(c.number)
    alive = c.proc is not None and c.proc.exitcode is None
    rss, cpu = usage(c.ps) if alive else (None, None)
    return {
        "pid": c.proc.pid if c.proc is not None else None,
        "state": (hb["phase"].name.lower() if alive and c.ready else "starting" if alive
                  else "dead" if running else "exited"),
        "restarts": c.restarts,
        "heartbeat_age_s": round(now - hb["beat"], 3) if alive and hb["beat"] else None,
        "progress": {"done": hb["done"], "wip": hb["wip"]},
        "batch": hb["batch"] if hb["batch"] >= 0 else None,
        "holds": holds,
        "busy_s": round(heartbeats.busy(c.number, now), 3),
        "busy_pct_30s": busy_pct(c, heartbeats, now),
        "rss_mb": rss, "cpu_pct": cpu, **gpu_fields(hb),
        "phase": phase(c.starting, now) if alive else None,
        "ready_at": c.ready_at if alive and c.ready else None,
        **({"ranks": [c.proc.pid if alive else None] +
            [f.proc.pid if f.proc is not None and f.proc.exitcode is None else None for f in c.followers]}
           if c.followers else {}),
        "stuck": c.stuck,
    }


def batch_counts(state_names: dict[int, str], ledger) -> dict[str, int]:
    """How many batches are in each ledger state, by the states' names."""
    counts = ledger.counts(max(state_names) + 1)
    return {name: counts[s] for s, name in state_names.items()}


def busy_pct(c: Child, heartbeats: Heartbeats, now: float) -> Optional[float]:
    """Percent of the last ``BUSY_WINDOW_S`` the actor spent working (over what of the
    window has been seen yet)."""
    c.busy.append((now, heartbeats.busy(c.number, now)))
    while len(c.busy) > 2 and now - c.busy[1][0] >= BUSY_WINDOW_S:
        c.busy.popleft()
    (t0, b0), (t1, b1) = c.busy[0], c.busy[-1]
    return round(min(100.0, 100 * (b1 - b0) / (t1 - t0)), 1) if t1 - t0 > 0.5 else None


def gpu_fields(mb: dict) -> dict:
    """status.json's GPU memory of a process (``actor.gpu_memory``'s MiB, rounded; null
    where it has used no CUDA)."""
    return {key: round(mb[col], 1) if mb[col] else None
            for key, col in (("gpu_mem_mb", "gpu_mb"), ("gpu_peak_mb", "gpu_peak_mb"),
                             ("gpu_reserved_peak_mb", "gpu_reserved_peak_mb"))}


def usage(ps: Optional[psutil.Process]) -> tuple[Optional[float], Optional[float]]:
    """(RSS MiB, CPU % since the previous call) of a process; Nones if it is gone.
    RSS counts the shared buffers the process has touched, so it overlaps between actors."""
    if ps is None:
        return None, None
    try:
        with ps.oneshot():
            return round(ps.memory_info().rss / 2**20, 1), round(ps.cpu_percent(None), 1)
    except psutil.Error:
        return None, None


def phase(starting: Optional[StartPhase], now: float) -> Optional[dict]:
    if starting is None:
        return None
    return {"name": starting.name, "done": starting.done, "total": starting.total,
            "elapsed_s": round(now - starting.since, 1), "idle_s": round(now - starting.last, 1)}
