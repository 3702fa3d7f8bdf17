"""``python launch.py status RUN_DIR [--watch [SECONDS]]``: how a training job is doing.

Reads ``<RUN_DIR>/status.json`` (``status``: who writes it, and its schema) and prints
one verdict line and then a table. The exit status is for scripts:

    0  running and healthy
    1  running but stuck or stopping: state "stopping" (followed by the file's
       ``reason`` where it has one); a final state while the supervisor is still alive
       (it is writing the final checkpoint); an actor the supervisor calls stuck;
       status.json older than ``STALE_S`` in any other state
    2  bad input: no such directory, no status.json, or one that is not a JSON object
       (one line on stderr, ``error: ...``)
    3  not running: the supervisor pid is gone, or now belongs to another process

Pid reuse is told apart by the process's start time: ``supervisor_started`` must be
the supervisor's own ``psutil.Process().create_time()``, which this compares to the
live pid's within ``SAME_PROCESS_S``. Without it a live pid counts as the supervisor.

Ages in status.json are as of its ``time``; shown ages add the file's own age. Any
field may be missing or null and shows as ``-``. ``--watch`` redraws until the run is
no longer running (it returns 3 after the final view) or until Ctrl-C (it returns the
last verdict's code).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Optional

import psutil

from ..console import hms
from .status import NoStatus, read

STALE_S = 10.0
SAME_PROCESS_S = 1.0
WIDTH = 120
STATE_WIDTH = 36
FINAL_STATES = ("done", "stopped", "failed")


def process_started(pid: int) -> Optional[float]:
    """The start time of process ``pid``, or None when there is none (a zombie counts as none)."""
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
    except psutil.NoSuchProcess:
        return None


def verdict(status: dict, now: float, pid_info: Callable[[int], Optional[float]] = process_started) -> tuple[int, str]:
    """(exit code, first line of output). ``pid_info`` is ``process_started`` or a stand-in."""
    state = status.get("state") or "-"
    pid = status.get("supervisor_pid")
    started = status.get("supervisor_started")
    created = pid_info(pid) if isinstance(pid, int) else None
    if created is None:
        gone = f"supervisor {pid} is gone" if pid is not None else "status.json names no supervisor pid"
        return 3, f"not running: {gone}; last state: {state} at {_position(status)}"
    if started is not None and abs(created - started) > SAME_PROCESS_S:
        return 3, (f"not running: supervisor {pid} is gone (its pid is another process now); "
                   f"last state: {state} at {_position(status)}")
    age = _age(status, now)
    stale = age is not None and age > STALE_S
    if state in FINAL_STATES:
        # The supervisor writes its last status before the job saves the final
        # checkpoint, so here an old file is expected rather than a sign of a hang.
        since = f" ({age:.1f} s after its last status)" if stale else ""
        return 1, f"finishing: {state} at {_position(status)}, supervisor {pid} still exiting{since}"
    if stale:
        return 1, f"stuck: supervisor {pid} is alive but has not rewritten status.json for {age:.1f} s (state {state})"
    stuck = "; ".join(f"{a} {info['stuck']}" for a, info in _actors(status) if info.get("stuck"))
    if state == "running":
        if stuck:
            return 1, f"stuck: {stuck}"
        return 0, f"running: {_position(status, detail=True)}"
    if state == "stopping":
        line = "stopping" + (f": {status['reason']}" if status.get("reason") else "")
    else:
        line = f"unknown state {state!r} at {_position(status)}"
    return 1, line + (f"; stuck: {stuck}" if stuck else "")


def render(status: dict, now: float, run_dir: str = "-") -> str:
    """The table below the verdict line: header block, one row per actor, rings."""
    train = status.get("training") or {}
    actors = _actors(status)
    batches = status.get("batches") or {}
    age = _age(status, now)
    updated = "" if age is None else f", updated {age:.1f} s ago" if age < 60 else f", updated {hms(age)} ago"
    pct = _percent(train.get("step"), train.get("total_steps"))
    step = _of(train.get("step"), train.get("total_steps")) + (f" ({pct}%)" if pct is not None else "")
    restarts = sum(info.get("restarts") or 0 for _, info in actors)
    grid = [
        [("step", step), ("epoch", _of(train.get("epoch"), train.get("total_epochs"))),
         ("ETA", hms(train.get("eta_s")))],
        [("tokens/s", _fmt(train.get("tokens_per_s_30s"), ",.0f") + " (30 s)"),
         ("overall", _fmt(train.get("tokens_per_s"), ",.0f")), ("tokens", _fmt(train.get("tokens"), ","))],
        [("loss", _fmt(train.get("loss"), ".4f")), ("sim tau", _fmt(train.get("simulated_tau"), ".3f")),
         ("lr", _fmt(train.get("lr"), ".2e"))],
        [("restarts", str(restarts)),
         ("batches", _of(_count(batches, "committed"), batches.get("total")) + " committed"),
         ("skipped", _fmt(train.get("skipped_steps"), "d"))],
    ]
    lines = [f"{'run dir':<10} {run_dir}",
             f"{'state':<10} {status.get('state') or '-'}, supervisor {_fmt(status.get('supervisor_pid'), 'd')}"
             f"{updated}"]
    lines += ["".join(f"{label:<10} {value:<22}" for label, value in row).rstrip() for row in grid]
    lines += ["", *_actor_table(actors, age or 0.0), ""]
    rings = status.get("rings") or {}
    ring_text = "  ".join(f"{name} {_of(r.get('used'), r.get('slots'))}" for name, r in rings.items() if r)
    lines.append(f"{'rings':<10} {ring_text or '-'}")
    if status.get("cluster"):
        lines.append(f"{'cluster':<10} {_cluster(status['cluster'])}")
    return "\n".join(_clip(line) for line in lines)


def _cluster(c: dict) -> str:
    """``node 1 of 2 (rendezvous ...), 12 steps exchanged at 11.2 ms; waiting for node 0 for 3.1 s``."""
    text = (f"node {c.get('rank')} of {c.get('nodes')} (rendezvous {c.get('master')}), "
            f"{c.get('steps_exchanged', 0)} steps exchanged at {_fmt(c.get('exchange_ms_mean'), '.1f', ' ms')}")
    waiting = c.get("waiting_for")
    if c.get("failure"):
        text += f"; {c['failure']}"
    elif waiting:
        text += f"; waiting for node {', '.join(map(str, waiting['nodes']))} for {waiting['s']:.1f} s"
    return text


def _actor_table(actors: list[tuple[str, dict]], lag: float) -> list[str]:
    gpu = any((info.get("gpu_mem_mb") is not None) for _, info in actors)
    head = ["actor", "pid", "state", "busy", "batch", "beat", "restarts", "rss MB"] + (["gpu MB"] if gpu else [])
    rows = []
    for actor_id, info in actors:
        beat = info.get("heartbeat_age_s")
        row = [actor_id, _fmt(info.get("pid"), "d"), _actor_state(info), _fmt(info.get("busy_pct_30s"), ".0f", "%"),
               _fmt(info.get("batch"), "d"), _fmt(beat + lag if beat is not None else None, ".1f", " s"),
               _fmt(info.get("restarts"), "d"), _fmt(info.get("rss_mb"), ".0f")]
        if gpu:
            row.append(_fmt(info.get("gpu_mem_mb"), ".0f"))
        ranks = info.get("ranks")
        note = f"ranks {' '.join(_fmt(p, 'd') for p in ranks)}" if ranks else ""   # a gang's processes
        stuck = f"STUCK: {info['stuck']}" if info.get("stuck") else ""
        rows.append((row, "  ".join(x for x in (note, stuck) if x)))
    widths = [max(len(r[i]) for r in [head] + [row for row, _ in rows]) for i in range(len(head))]
    # The first and third columns are words, the rest numbers.
    cell = lambda i, text: text.ljust(widths[i]) if i in (0, 2) else text.rjust(widths[i])
    line = lambda row, stuck: ("  ".join(cell(i, t) for i, t in enumerate(row)) + "  " + stuck).rstrip()
    return [line(head, "")] + [line(row, stuck) for row, stuck in rows]


def _actor_state(info: dict) -> str:
    state = info.get("state") or "-"
    phase = info.get("phase")
    if not phase:
        return state
    counts = f" {_of(phase.get('done'), phase.get('total'))}" if phase.get("total") is not None else ""
    # A long phase name gives way; the counts are what moves.
    room = STATE_WIDTH - len(state) - 2 - len(counts)
    name = phase.get("name") or "-"
    return f"{state}: {name if len(name) <= room else name[:room - 1] + '…'}{counts}"


def _actors(status: dict) -> list[tuple[str, dict]]:
    return [(a, info or {}) for a, info in (status.get("actors") or {}).items()]


def _age(status: dict, now: float) -> Optional[float]:
    t = status.get("time")
    return max(0.0, now - t) if t is not None else None


def _position(status: dict, detail: bool = False) -> str:
    """Where the run is: its step (with the percentage and epoch when ``detail``), or,
    for a runtime without training, its committed batches."""
    train = status.get("training")
    if not train:
        batches = status.get("batches") or {}
        return f"{_of(_count(batches, 'committed'), batches.get('total'))} batches committed"
    text = f"step {_of(train.get('step'), train.get('total_steps'))}"
    if detail:
        pct = _percent(train.get("step"), train.get("total_steps"))
        text += f" ({pct}%)" if pct is not None else ""
        if train.get("epoch") is not None or train.get("total_epochs") is not None:
            text += f", epoch {_of(train.get('epoch'), train.get('total_epochs'))}"
    return text


def _count(batches: dict, name: str):
    # The supervisor writes ledger state names as the dispatcher spells them: either case.
    return batches.get(name, batches.get(name.upper()))


def _percent(done, total) -> Optional[int]:
    # Floored, so that 100% means finished.
    return int(100 * done // total) if done is not None and total else None


def _of(done, total) -> str:
    return f"{_fmt(done, 'd')}/{_fmt(total, 'd')}"


def _fmt(value, spec: str, unit: str = "") -> str:
    if value is None:
        return "-"
    if spec == "d":
        value = int(value)
    return format(value, spec) + unit


def _clip(line: str) -> str:
    return line if len(line) <= WIDTH else line[:WIDTH - 1] + "…"


def _view(run_dir: str) -> tuple[int, str]:
    status = read(run_dir)
    now = time.time()
    code, line = verdict(status, now)
    return code, f"{line}\n\n{render(status, now, run_dir)}"


def _interval(text: str) -> float:
    seconds = float(text)
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return seconds


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="launch.py status", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", metavar="RUN_DIR")
    ap.add_argument("--watch", nargs="?", const=2.0, type=_interval, metavar="SECONDS",
                    help="redraw every SECONDS (default 2) until the run ends or Ctrl-C")
    args = ap.parse_args(argv)
    tty = sys.stdout.isatty()
    code = 2
    try:
        while True:
            code, view = _view(args.run_dir)
            if args.watch is None:
                print(view)
                return code
            # A terminal redraws in place; a file or pipe gets one view after another.
            print("\033[H\033[J" + view if tty else view + "\n", flush=True)
            if code == 3:
                return code
            time.sleep(args.watch)
    except NoStatus as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return code
    except BrokenPipeError:     # `status ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return code
