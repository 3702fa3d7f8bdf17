"""How progress reaches the person who started the job: a live bar on a terminal, plain
lines in a file.

``launch.py`` picks the mode once (``setup``, from ``monitor.console``): ``bar`` when
both stdout and stderr are terminals (tqdm on stderr, redrawn in place); ``lines``
otherwise, so that ``launch.py ... > run.log`` reads well with ``tail``: a line on
stdout every ``monitor.log_every_s``, each one whole, with the time in front. ``off``
prints nothing but errors and the summary.

``progress(total, desc, unit)`` is what a long phase with counts uses in either mode
(the tqdm calls it needs: ``update``, ``close``, a context manager), ``phase(desc)``
one without; ``say(text)`` prints one line that does not tear a live bar.

``first_line(e)`` is how every error reaches a person in one line: the ``error: ...``
of exit status 2, a skipped checkpoint's reason, a lost node's cause.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Optional

from tqdm import tqdm

DELAY_S = 1.0       # a phase shorter than this prints nothing

_mode: Optional[str] = None     # chosen by the first ``setup``, or "auto" on first use
_every_s = 30.0


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message, or its type's name when it has none."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def shown_path(path) -> str:
    """A path as reports and result files give it: relative to the working directory (the
    project, for every command here) when it lies under it, so that no file names the
    machine that wrote it."""
    p = Path(path).resolve()
    return p.relative_to(Path.cwd()).as_posix() if p.is_relative_to(Path.cwd()) else str(path)


def setup(mode: str = "auto", every_s: float = 30.0) -> str:
    """Choose the mode for this process; returns it."""
    global _mode, _every_s
    if mode == "auto":
        mode = "bar" if sys.stdout.isatty() and sys.stderr.isatty() else "lines"
    _mode, _every_s = mode, every_s
    return mode


def mode() -> str:
    return _mode or setup()


def stamp() -> str:
    return time.strftime("%H:%M:%S")


def say(text: str) -> None:
    """One line, as it happened: above the bar on a terminal, stamped in a file."""
    if mode() == "bar":
        tqdm.write(text, file=sys.stderr)
    elif _mode == "lines":
        print(f"[{stamp()}] {text}", flush=True)


def progress(total: Optional[int], desc: str, unit: str = "it", enabled: bool = True, **tqdm_args):
    """A progress counter for a phase that may take a while: counts, rate and ETA."""
    if not enabled or mode() == "off":
        return tqdm(total=total, disable=True)
    if _mode == "bar":
        return tqdm(total=total, desc=desc, unit=unit, delay=DELAY_S, dynamic_ncols=True, **tqdm_args)
    return Lines(total, desc, unit, _every_s)


@contextlib.contextmanager
def phase(desc: str, enabled: bool = True):
    """A step without counts (building a model, verifying a checkpoint): a line once it
    has taken ``DELAY_S``, another every ``log_every_s`` while it lasts, and one when
    it ends after that."""
    if not enabled or mode() == "off":
        yield
        return
    # Imported here: the runtime's actor module brings torch, and this module must stay
    # light (``launch.py`` imports it, and every actor re-imports ``launch.py`` as its
    # ``__mp_main__`` before its parent-death signal is armed).
    from .runtime.actor import every

    t0 = time.monotonic()
    with every(_every_s, lambda: say(f"{desc}: {time.monotonic() - t0:.0f} s so far"), first_s=DELAY_S):
        yield
    if time.monotonic() - t0 >= DELAY_S:
        say(f"{desc}: done in {time.monotonic() - t0:.1f} s")


def rate_eta(done: float, total: Optional[float], elapsed: float) -> str:
    """``12.3 /s, eta 0:01:05`` (the rate over ``elapsed``; no ETA without a total)."""
    rate = done / elapsed if elapsed > 0 else 0.0
    out = f"{_si(rate)}/s"
    if total and rate > 0 and done < total:
        out += f", eta {hms((total - done) / rate)}"
    return out


def hms(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _si(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.1f}{suffix}"
    return f"{x:.0f}" if x >= 100 or x == int(x) else f"{x:.1f}"


class Lines:
    """tqdm's interface, printing whole lines: after ``DELAY_S``, then every ``every_s``,
    and once at the end if anything was printed or the phase took over ``DELAY_S``."""

    def __init__(self, total: Optional[int], desc: str, unit: str, every_s: float):
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.n = 0
        self.t0 = time.monotonic()
        self.next = self.t0 + DELAY_S
        self.printed = False
        self.closed = False

    def update(self, k: int = 1) -> None:
        self.n += k
        now = time.monotonic()
        if now >= self.next:
            self._line(now)
            self.next = now + self.every_s

    def _line(self, now: float, end: bool = False) -> None:
        of = f"/{_si(self.total)}" if self.total else ""
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        how = f"done in {now - self.t0:.1f} s" if end else rate_eta(self.n, self.total, now - self.t0)
        print(f"[{stamp()}] {self.desc}: {_si(self.n)}{of} {self.unit}{pct}, {how}", flush=True)
        self.printed = True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        now = time.monotonic()
        if self.printed or now - self.t0 >= DELAY_S:
            self._line(now, end=True)

    def __enter__(self) -> "Lines":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
