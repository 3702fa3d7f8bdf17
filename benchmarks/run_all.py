"""``make bench``: run every ``benchmarks/bench_*.py`` in turn, one JSON line each.

Lines are echoed and appended to ``benchmarks/results/<date>.jsonl`` with the host and
time, so reports from different days sit side by side.
"""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    out = HERE / "results" / f"{datetime.date.today().isoformat()}.jsonl"
    out.parent.mkdir(exist_ok=True)
    failed = 0
    for script in sorted(HERE.glob("bench_*.py")):
        module = f"benchmarks.{script.stem}"
        proc = subprocess.run([sys.executable, "-m", module], cwd=HERE.parent, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            failed += 1
            print(json.dumps({"bench": script.stem, "error": (proc.stderr or proc.stdout).strip()[-500:]}))
            continue
        record = json.loads(lines[-1])
        record.update(host=platform.node(), at=datetime.datetime.now().isoformat(timespec="seconds"))
        print(lines[-1], flush=True)
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
