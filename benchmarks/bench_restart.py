"""Restart latency, and what a target's death costs the training job's throughput.

1. A toy job (loader -> target -> drafter) whose target holds a tiny random Qwen3
   (transformers, 4 layers, hidden 64): the target is killed ``--kills`` times while it
   works on a batch, and the supervisor's events split each restart into detection
   (kill -> sentinel seen), respawn, and startup (spawn -> Ready: interpreter,
   imports, model build).
2. The training job at 2-2 under simulated compute (``benchmarks.simulated``):
   ``target.0`` is killed with SIGKILL a third of the way in, by pid from status.json,
   as a user would. From the trace: the steady rate before the kill, the lowest rate
   after it (``throughput_dip`` = that / steady, over windows of 4 steps) and
   ``recovery_s``, from the kill until a window runs at >= 90% of steady again.
One JSON line; seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import simulated
from dflash_actors.runtime.actor import Phase
from dflash_actors.runtime.config import RuntimeConfig, build
from tests.support.toy import toy_job

WINDOW_STEPS = 4


def _killer(sup, actor_id: str, kills: int, log: list) -> None:
    c = next(c for c in sup.children if c.actor_id == actor_id)
    while len(log) < kills and not sup.dispatcher.finished():
        hb = sup.heartbeats.row(c.number)
        proc = c.proc
        if proc is not None and c.ready and hb["pid"] == proc.pid and hb["phase"] == Phase.WORKING:
            os.kill(hb["pid"], signal.SIGKILL)
            log.append({"pid": hb["pid"], "mono": time.monotonic()})
            while not (c.ready and c.proc is not None and c.proc.pid != hb["pid"]):
                time.sleep(0.001)
            time.sleep(0.2)   # let it take work again
        time.sleep(0.001)


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
    events = [json.loads(x) for x in (run_dir / "events.log").read_text().splitlines()]
    ready = [e["mono"] for e in events if e.get("actor") == "target.0" and e["event"] == "ready"][1:]
    return {"steady_steps_per_s": round(steady, 2), "throughput_dip": round(after[lowest][1] / steady, 3),
            "recovery_s": round((back - kill) / 1e6, 2) if back is not None else None,
            "restart_s": round(ready[0] - kills[0], 2) if ready else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--model", default="qwen3-tiny", help="qwen3-tiny, or none for the plain toy target")
    a = p.parse_args(argv)
    model = None if a.model == "none" else a.model
    with tempfile.TemporaryDirectory() as d:
        sim = simulated_kill(Path(d))
        run_dir = Path(d) / "run"
        rt = build(RuntimeConfig, {"run_dir": str(run_dir), "max_restarts": a.kills + 1})
        sup, _ = toy_job(rt, n_batches=100_000, stages=3, work_s=0.02, model=model, width=192)
        kills: list = []
        t = threading.Thread(target=_killer, args=(sup, "target.0", a.kills, kills), daemon=True)

        def stop_when_done():
            t.join()
            sup.request_stop("benchmark done")

        t.start()
        threading.Thread(target=stop_when_done, daemon=True).start()
        sup.run()
        events = [json.loads(x) for x in (run_dir / "events.log").read_text().splitlines()]
    target = [e for e in events if e.get("actor") == "target.0"]
    died = [e for e in target if e["event"] == "died"]
    spawned = [e for e in target if e["event"] == "spawn"][1:]
    ready = [e for e in target if e["event"] == "ready"][1:]
    total = [r["mono"] - k["mono"] for k, r in zip(kills, ready)]
    detect = [x["mono"] - k["mono"] for k, x in zip(kills, died)]
    respawn = [s["mono"] - x["mono"] for x, s in zip(died, spawned)]
    startup = [r["startup_s"] for r in ready]
    med = lambda xs: round(statistics.median(xs), 3) if xs else None
    print(json.dumps({
        "bench": "restart", "model": a.model, "kills": len(kills),
        "restart_s_median": med(total), "restart_s_max": round(max(total), 3) if total else None,
        "detect_s_median": med(detect), "respawn_s_median": med(respawn), "startup_s_median": med(startup),
        "simulated_target_kill": sim, "cpus": os.cpu_count(),
    }))
    return 0 if len(kills) == a.kills else 1


if __name__ == "__main__":
    sys.exit(main())
