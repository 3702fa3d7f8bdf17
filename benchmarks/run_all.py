"""``make bench``: run every ``benchmarks/bench_*.py``, then print one table.

Each script prints one JSON line (its record); lines starting with ``#`` are progress
and are echoed as they come. The records go to ``benchmarks/results/<date>-<host>.json``
(top level: ``host``, ``at``, ``cpus``, ``pipeline``: one record per topology, and
``benches``: every script's record by name) and the table to the ``.md`` beside it, so
runs of different days compare side by side.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.report import render

HERE = Path(__file__).resolve().parent


def run_one(script: Path) -> dict:
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", f"benchmarks.{script.stem}"], cwd=HERE.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    record = None
    for line in proc.stdout:
        if line.startswith("#"):
            print(f"  {script.stem}{line.rstrip()[1:]}", file=sys.stderr, flush=True)
        elif line.startswith("{"):
            record = json.loads(line)
    err = proc.stderr.read()
    proc.wait()
    if proc.returncode or record is None:
        return {"bench": script.stem.removeprefix("bench_"), "error": err.strip()[-500:] or f"exit {proc.returncode}"}
    record["bench_s"] = round(time.perf_counter() - t, 1)
    return record


def main() -> int:
    now = datetime.datetime.now()
    benches = {}
    for script in sorted(HERE.glob("bench_*.py")):
        print(f"{script.stem} ...", file=sys.stderr, flush=True)
        rec = run_one(script)
        benches[rec["bench"]] = rec
        print(f"{script.stem}: {'FAILED' if 'error' in rec else 'done'} ({rec.get('bench_s', '?')} s)",
              file=sys.stderr, flush=True)
    results = {"host": platform.node(), "at": now.isoformat(timespec="seconds"), "cpus": os.cpu_count(),
               "pipeline": benches.get("pipeline", {}).get("pipeline", []), "benches": benches}
    table = render(results)
    print(table)
    stem = HERE / "results" / f"{now.date().isoformat()}-{platform.node()}"
    stem.parent.mkdir(exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    stem.with_suffix(".md").write_text(table + "\n")
    print(f"\nwritten: {stem}.json, {stem}.md", file=sys.stderr)
    return 1 if any("error" in r for r in benches.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
