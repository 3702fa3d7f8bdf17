"""Restart latency: ``kill -9`` of a working target actor to its replacement's Ready.

Runs a toy job (loader -> target -> drafter) whose target holds a tiny random Qwen3
(transformers, 4 layers, hidden 64), kills the target ``--kills`` times while it works
on a batch, and reads the supervisor's events to split each restart into detection
(kill -> sentinel seen), respawn, and startup (spawn -> Ready: interpreter, imports,
model build). One JSON line; seconds.
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

from dflash_actors.runtime.actor import Phase
from dflash_actors.runtime.config import RuntimeConfig, build
from tests.support.toy import toy_job


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--model", default="qwen3-tiny", help="qwen3-tiny, or none for the plain toy target")
    a = p.parse_args(argv)
    model = None if a.model == "none" else a.model
    with tempfile.TemporaryDirectory() as d:
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
        "cpus": os.cpu_count(),
    }))
    return 0 if len(kills) == a.kills else 1


if __name__ == "__main__":
    sys.exit(main())
