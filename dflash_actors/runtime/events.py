"""``<run_dir>/events.log``: every decision of a job, one JSON object a line.

Schema of a line: ``t`` (unix time), ``mono`` (``time.monotonic()``, the clock of the
heartbeat table, so intervals between lines are exact), ``event``, then the event's
own fields; a decision carries a ``reason``. The supervisor logs its decisions through
this class, and the training job its own (a rollback, between two supervisor runs),
so the file has one writer and one schema.

The file is opened for each line (a job logs a few lines a second at most), so that a
path that stops being writable while the job runs (a full disk, a directory put in its
place) fails the next line rather than going unnoticed behind an open descriptor. A
failed line is not raised: the log stops there, keeps the reason (``error``) and calls
``on_error`` with it; the supervisor passes ``request_failure``, and the job ends.
Later lines are dropped, so the logging of that very stop cannot fail again.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable, Optional

from .files import cannot_write


class EventLog:
    def __init__(self, path: str | Path, on_error: Optional[Callable[[str], None]] = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.on_error = on_error
        self.error: Optional[str] = None
        """Why the log stopped (``files.cannot_write``); None while it writes."""

    def log(self, event: str, **fields) -> None:
        if self.error is not None:
            return
        rec = {"t": round(time.time(), 3), "mono": round(time.monotonic(), 4), "event": event, **fields}
        line = (json.dumps(rec, default=str) + "\n").encode()
        try:
            # One write on an O_APPEND descriptor: a line is never torn or interleaved.
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as e:
            self._failed(e)

    def probe(self) -> None:
        """Open the file as a line would, writing nothing: a break shows now (``on_error``)."""
        if self.error is not None:
            return
        try:
            os.close(os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644))
        except OSError as e:
            self._failed(e)

    def _failed(self, e: OSError) -> None:
        self.error = cannot_write(self.path, e)
        if self.on_error is not None:
            self.on_error(self.error)

    def close(self) -> None:
        """Nothing to release: each line opens and closes the file."""

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
