"""``<run_dir>/events.log``: every decision of a job, one JSON object a line.

Schema of a line: ``t`` (unix time), ``mono`` (``time.monotonic()``, the clock of the
heartbeat table, so intervals between lines are exact), ``event``, then the event's
own fields; a decision carries a ``reason``. The supervisor logs its decisions through
this class, and the training job its own (a rollback, between two supervisor runs),
so the file has one writer and one schema.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


class EventLog:
    def __init__(self, path: str | Path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", buffering=1)

    def log(self, event: str, **fields) -> None:
        rec = {"t": round(time.time(), 3), "mono": round(time.monotonic(), 4), "event": event, **fields}
        self._f.write(json.dumps(rec, default=str) + "\n")

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
