"""The pipeline trace: where every actor spent its time, as a Chrome trace (Perfetto).

Off unless ``runtime.trace`` is set. Each process appends its own spans, one JSON
object per line, to ``<run_dir>/trace/<actor>.<pid>.jsonl``: no lock and no shared
buffer, so a kill -9 loses at most the spans of the Work item in hand (the file is
flushed after every item). When the supervisor's run ends it merges the parts into
``<run_dir>/trace.json`` (trace-event format, ``ph: "X"`` complete events) with one
track per actor, named by its id, and one for the supervisor, then removes the parts.

Times are ``time.monotonic()``, which on Linux is one clock for every process of the
machine, so spans of different actors line up. Gaps between spans are waits.

Size is bounded by batch id: only spans of the first and last ``runtime.trace_batches``
batches of the run are kept (``Window``), plus spans that belong to no batch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .files import write_atomically

PARTS_DIR = "trace"
TRACE_FILE = "trace.json"
SUPERVISOR_TRACK = 0
"""Track (tid) of the supervisor; actor number n is track n + 1."""


@dataclass(frozen=True)
class Window:
    """Which batch ids are traced: ``[first, first + n)`` and ``[end - n, end)``."""

    first: int
    end: int
    n: int

    def keeps(self, batch: int) -> bool:
        return batch < 0 or batch < self.first + self.n or batch >= self.end - self.n


class Tracer:
    """Span recorder of one process. A disabled tracer (``path=None``) costs one
    branch per span."""

    def __init__(self, path: Optional[Path], track: int, window: Optional[Window] = None):
        self.track, self.window = track, window
        self._f = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(path, "a", buffering=1 << 16)

    @property
    def enabled(self) -> bool:
        return self._f is not None

    @contextlib.contextmanager
    def span(self, name: str, batch: int = -1, **args):
        if self._f is None or (self.window is not None and not self.window.keeps(batch)):
            yield
            return
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.record(name, t0, time.monotonic(), batch, **args)

    def record(self, name: str, t0: float, t1: float, batch: int = -1, **args) -> None:
        """A span measured by the caller (``time.monotonic()`` seconds)."""
        if self._f is None or (self.window is not None and not self.window.keeps(batch)):
            return
        if batch >= 0:
            args["batch"] = batch
        ev = {"name": name, "ph": "X", "ts": round(t0 * 1e6, 1), "dur": round((t1 - t0) * 1e6, 1),
              "tid": self.track, "args": args}
        self._f.write(json.dumps(ev) + "\n")

    def instant(self, name: str, **args) -> None:
        if self._f is not None:
            ev = {"name": name, "ph": "i", "s": "t", "ts": round(time.monotonic() * 1e6, 1), "tid": self.track,
                  "args": args}
            self._f.write(json.dumps(ev) + "\n")

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def clear(run_dir: Path) -> None:
    """Drop parts left by an earlier run of this directory (a supervisor killed before it
    could merge them)."""
    shutil.rmtree(Path(run_dir) / PARTS_DIR, ignore_errors=True)


def part_path(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / PARTS_DIR / f"{name}.{os.getpid()}.jsonl"


def merge(run_dir: Path, tracks: dict[int, str]) -> Path:
    """Merge every part under ``run_dir/trace`` into ``run_dir/trace.json``, name the
    tracks (``tracks``: tid -> name), and remove the parts. Timestamps start at 0. A
    part cut short by a kill may end in half a line; that line is dropped."""
    run_dir = Path(run_dir)
    events = []
    for part in sorted((run_dir / PARTS_DIR).glob("*.jsonl")):
        for line in part.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    t0 = min((e["ts"] for e in events), default=0.0)
    for e in events:
        e["ts"] = round(e["ts"] - t0, 1)
        e["pid"] = 1
    events.sort(key=lambda e: (e["tid"], e["ts"]))
    meta = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "job"}}]
    for tid, name in sorted(tracks.items()):
        meta.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid, "args": {"sort_index": tid}})
    out = run_dir / TRACE_FILE
    doc = {"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": {"origin_monotonic_s": t0 / 1e6}}
    write_atomically(out, lambda tmp: tmp.write_text(json.dumps(doc)))
    shutil.rmtree(run_dir / PARTS_DIR, ignore_errors=True)
    return out


def origin(path: Path) -> float:
    """The ``time.monotonic()`` at which a merged trace's timestamps start."""
    return json.loads(Path(path).read_text())["otherData"]["origin_monotonic_s"]


def load(path: Path) -> list[dict]:
    """The span events (``ph: X``) of a merged trace, with a ``track`` name each."""
    doc = json.loads(Path(path).read_text())
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    return [{**e, "track": names.get(e["tid"], str(e["tid"]))} for e in doc["traceEvents"] if e["ph"] == "X"]
