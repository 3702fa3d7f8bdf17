"""``make bench``: run every ``benchmarks/bench_*.py``, then print one table.

Each script speaks ``benchmarks.harness``'s protocol: its record is a JSON line on
stdout, its progress lines (``# ...``) on stderr, echoed here as they come. The records
go to ``benchmarks/results/<date>-<host>.json`` (top level: ``host``, ``at``, ``cpus``,
``pipeline``: one record per topology, and ``benches``: every script's record by name)
and the table to the ``.md`` beside it, so runs of different days compare side by side.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.report import render

HERE = Path(__file__).resolve().parent


def run_one(script: Path) -> dict:
    t = time.perf_counter()
    code, records, err = harness.run_script(f"benchmarks.{script.stem}",
                                            echo=lambda text: print(f"  {script.stem}: {text}", file=sys.stderr,
                                                                    flush=True))
    if code or not records:
        return {"bench": script.stem.removeprefix("bench_"), "error": err[-500:] or f"exit {code}"}
    record = records[-1]
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
    stem = harness.result_path(platform.node(), "")
    harness.write_result(stem, results, table, indent=1)
    print(f"\nwritten: {harness.shown(str(stem))}.json, .md", file=sys.stderr)
    return 1 if any("error" in r for r in benches.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
