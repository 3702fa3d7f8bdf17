"""What a target's death costs the training job's throughput.

The training job at 2-2 under simulated compute (``benchmarks.simulated``): ``target.0``
is killed with SIGKILL a third of the way in, by pid from status.json, as a user would.
From the trace: the steady rate before the kill, the lowest rate after it
(``throughput_dip`` = that / steady, over windows of 4 steps), ``recovery_s``, from the
kill until a window runs at >= 90% of steady again, and ``restart_s``, from the kill to
the replacement's Ready. One JSON line; seconds.

How long a restart takes, kill -9 to Ready per role and split into detection, respawn
and start-up, is ``bench_startup``'s (it measured the same thing on a toy job here too
until 2026-12-07).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import harness, simulated

WINDOW_STEPS = 4


def _kill_when(run_dir: Path, actor: str, fraction: float, log: list, done: threading.Event) -> None:
    """SIGKILL ``actor`` once status.json reports ``fraction`` of the steps done (a user's kill -9)."""
    while not done.is_set():
        try:
            status = json.loads((run_dir / "status.json").read_text())
        except (OSError, ValueError):
            status = {}
        pid = status.get("actors", {}).get(actor, {}).get("pid")
        training = status.get("training") or {}
        if pid and training.get("step", 0) >= fraction * training.get("total_steps", 1e9):
            os.kill(pid, signal.SIGKILL)
            log.append(time.monotonic())
            return
        time.sleep(0.05)


def simulated_kill(tmp: Path, epochs: int = 4) -> dict:
    run_dir = tmp / "sim"
    kills, done = [], threading.Event()
    t = threading.Thread(target=_kill_when, args=(run_dir, "target.0", 1 / 3, kills, done), daemon=True)
    t.start()
    try:
        m = simulated.run(simulated.sim_config(run_dir, "2-2", epochs=epochs))
    finally:
        done.set()
    if not kills:
        return {"error": "the run ended before the kill"}
    kill = (kills[0] - m.origin_s) * 1e6
    ends = sorted(s["ts"] + s["dur"] for s in m.spans if s["name"] == "publish")
    rates = [(ends[i], WINDOW_STEPS / (ends[i] - ends[i - WINDOW_STEPS]) * 1e6) for i in range(WINDOW_STEPS, len(ends))]
    steady = statistics.median(r for t_, r in rates if t_ < kill)
    after = [(t_, r) for t_, r in rates if t_ >= kill]
    lowest = min(range(len(after)), key=lambda i: after[i][1])
    back = next((t_ for t_, r in after[lowest:] if r >= 0.9 * steady), None)
    ready = [e["mono"] for e in harness.events(run_dir) if e.get("actor") == "target.0" and e["event"] == "ready"][1:]
    return {"steady_steps_per_s": round(steady, 2), "throughput_dip": round(after[lowest][1] / steady, 3),
            "recovery_s": round((back - kill) / 1e6, 2) if back is not None else None,
            "restart_s": round(ready[0] - kills[0], 2) if ready else None}


def main(argv=None) -> int:
    args = harness.parser(__doc__).parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        sim = simulated_kill(Path(d))
    harness.emit({"bench": "restart", "simulated_target_kill": sim}, args.save)
    return 1 if "error" in sim else 0


if __name__ == "__main__":
    sys.exit(main())
