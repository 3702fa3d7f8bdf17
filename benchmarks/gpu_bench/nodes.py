"""Section 3: two nodes on loopback, each 1-1 on one device: identical replicas.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .common import ROOT, emit
from .launches import last_error, with_sets
from .tiny import devices_sets, tiny_sets


def bench_nodes(work: Path, limit_s: float, smoke: bool, out: str | None = None) -> dict:
    """Two nodes on this machine (loopback), each 1-1 on one device, the gradient chain
    over gloo from host memory (NCCL refuses two ranks on one GPU): both must finish
    with identical replicas and the exchange time in their summaries."""
    import random

    device = "cpu" if smoke else "cuda:0"
    run = Path("/tmp/gpu-nodes")
    shutil.rmtree(run, ignore_errors=True)
    port = 29500 + random.randrange(1000)
    sets = tiny_sets(smoke) + devices_sets(device, 1) + ["runtime.collective_backend=gloo"]
    procs = []
    for r in (0, 1):
        cmd = with_sets([sys.executable, "launch.py", "--topology", "1-1", "--run-dir", str(run), "--nnodes", "2",
                         "--node-rank", str(r), "--master", f"127.0.0.1:{port}"], sets)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=open(work / f"nodes_{r}.log", "w"),
                                      stderr=subprocess.STDOUT))
    deadline = time.monotonic() + limit_s
    result = {"section": "nodes", "rc": []}
    for p in procs:
        try:
            result["rc"].append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            result["rc"].append(p.wait())
            result.setdefault("error", f"timed out after {limit_s:.0f} s")
    clusters = []
    for r in (0, 1):
        for line in (work / f"nodes_{r}.log").read_text(errors="replace").splitlines():
            if '"cluster"' in line:
                with contextlib.suppress(ValueError):
                    clusters.append(json.loads(line)["cluster"])
    result["cluster"] = clusters
    for r, rc in enumerate(result["rc"]):
        if rc != 0:
            result.setdefault("error", f"node {r} exit {rc}: {last_error(work / f'nodes_{r}.log')}")
    emit(result, out)
    return result
