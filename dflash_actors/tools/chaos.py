"""Chaos: faults injected from inside the job, and kills from outside it, as a user's
cluster would deal them.

Two tools:

* ``chaos_faults(cfg, seed, n, total_batches)`` schedules ``n`` random ``runtime.faults``
  (as data, the entries of that key) over every actor of the job (loader and optimizer
  included), every fault point and every kind that ends or stalls an actor;
  ``launch.py --chaos SEED`` uses it. Faults never change the math (``nan`` is left
  out), so a chaos run must end bit-identical to a clean one.
* ``launch.py chaos RUN_DIR --kills N --seed S -- LAUNCH_ARGS`` starts
  ``launch.py --run-dir RUN_DIR LAUNCH_ARGS`` and, at random moments, ``kill -9``s real
  pids read from ``status.json``: actors (a random rank of a gang; each must come back), the supervisor itself
  (``--supervisor-kills``: its actors must be gone within a second, then the driver
  resumes the run with ``--resume``), and ``--stop-cont`` times it ``SIGSTOP``s a
  healthy actor for half of ``runtime.hang_timeout_s`` and continues it (it must not be
  restarted). When the run ends it prints one JSON line: what it did, restart times,
  and what it found wrong (orphans, a restarted stopped actor, the exit status).

Whether the run trained what a clean run trains is for the caller to check against
the final checkpoint (``benchmarks/chaos_suite.py``, ``make chaos``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ..observe.status import read_or_none

LAUNCH = Path(__file__).resolve().parents[2] / "launch.py"
ENDING_KINDS = ("sigkill", "exit", "exception", "segfault", "slow", "hang")
HANG_AFFORDABLE_S = 20.0
"""A hang costs ``hang_timeout_s`` of a stalled stage: chaos only injects one when cheap."""


def chaos_faults(cfg, seed: int, n: int, total_batches: int) -> list[dict]:
    """``n`` random faults (``runtime.faults`` entries) over ``[0, total_batches)``."""
    from ..job.wiring import actor_classes
    rng = random.Random(seed)
    actors = sorted(actor_classes(cfg))
    kinds = [k for k in ENDING_KINDS if k != "hang" or cfg.runtime.hang_timeout_s <= HANG_AFFORDABLE_S]
    out = []
    for _ in range(n):
        actor = rng.choice(actors)
        kind = rng.choice(kinds)
        points = ["work"] if kind == "slow" else ["work", "commit"]
        if actor == "optimizer.0" and kind != "slow":
            points += ["publish"] + (["checkpoint"] if cfg.train.checkpoint_every else [])
        out.append({"actor": actor, "at_batch": rng.randrange(total_batches), "kind": kind, "at": rng.choice(points)})
    return sorted(out, key=lambda f: f["at_batch"])


# ---------------------------------------------------------------------------
# the external driver


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:        # a zombie runs nothing
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    try:
        import psutil
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except Exception:   # noqa: BLE001 - gone already
        return []


def restart_times(run_dir: Path) -> list[float]:
    """From ``events.log``: seconds from each actor death that was restarted to its
    replacement's Ready, within each supervisor's life."""
    out, died = [], {}
    path = run_dir / "events.log"
    for line in path.read_text().splitlines() if path.exists() else []:
        e = json.loads(line)
        if e["event"] == "start":
            died = {}
        elif e["event"] == "died" and e.get("decision") == "restart":
            died[e["actor"]] = e["mono"]
        elif e["event"] == "ready" and e["actor"] in died:
            out.append(e["mono"] - died.pop(e["actor"]))
    return out


class Driver:
    def __init__(self, run_dir: Path, launch_args: list[str], seed: int, quiet: bool):
        self.run_dir, self.launch_args, self.rng = run_dir, launch_args, random.Random(seed)
        self.proc: subprocess.Popen | None = None
        self.log = open(run_dir.parent / f"{run_dir.name}.chaos.log", "a") if quiet else None
        self.supervisor_restart_s: list[float] = []
        self.problems: list[str] = []
        self.done = {"kills": 0, "supervisor_kills": 0, "stop_cont": 0}
        self.launches = 0

    def launch(self, resume: bool) -> None:
        where = ["--resume", str(self.run_dir)] if resume else ["--run-dir", str(self.run_dir)]
        out = self.log or None
        self.proc = subprocess.Popen([sys.executable, str(LAUNCH), *where, *self.launch_args],
                                     stdout=out, stderr=out)
        self.launches += 1

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def up(self, every: bool, timeout: float = 300.0) -> dict | None:
        """The live supervisor's status once ``every`` actor (else at least one) is idle
        or working; None if the run ends or the wait times out."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.running():
            st = read_or_none(self.run_dir)
            if st and st.get("supervisor_pid") == self.proc.pid and st["state"] == "running":
                states = [a["state"] in ("idle", "working") for a in st["actors"].values()]
                if all(states) if every else any(states):
                    return st
            time.sleep(0.05)
        return None

    def kill_actor(self, st: dict) -> bool:
        """kill -9 of a random live actor; kills may overlap others' restarts, as in life
        (restart times come from events.log: death to the replacement's Ready)."""
        live = sorted(k for k, a in st["actors"].items() if a["state"] in ("idle", "working"))
        victim = self.rng.choice(live)
        try:
            os.kill(self._pid(st["actors"][victim]), signal.SIGKILL)
        except ProcessLookupError:
            return False    # died meanwhile
        self.done["kills"] += 1
        return True

    def _pid(self, actor: dict) -> int:
        """The actor's pid; for a gang (``ranks``), a random rank's: any rank takes the gang down."""
        ranks = actor.get("ranks") or [actor["pid"]]
        return self.rng.choice(ranks) if len(ranks) > 1 else ranks[0]

    def kill_supervisor(self) -> None:
        kids = _children(self.proc.pid)
        t0 = time.monotonic()
        self.proc.kill()
        self.proc.wait()
        self.done["supervisor_kills"] += 1
        end = time.monotonic() + 1.0
        while time.monotonic() < end and any(_alive(p) for p in kids):
            time.sleep(0.02)
        left = [p for p in kids if _alive(p)]
        if left:
            self.problems.append(f"processes {left} outlived the killed supervisor by more than 1 s")
        self.launch(resume=True)
        if self.up(every=True) is not None:
            self.supervisor_restart_s.append(time.monotonic() - t0)

    def stop_cont(self, st: dict, hang_timeout_s: float) -> None:
        victim = self.rng.choice(sorted(st["actors"]))
        pid = self._pid(st["actors"][victim])
        os.kill(pid, signal.SIGSTOP)
        time.sleep(hang_timeout_s / 2)
        os.kill(pid, signal.SIGCONT)
        self.done["stop_cont"] += 1
        time.sleep(1.0)     # a hang decision in flight would show by now
        s = read_or_none(self.run_dir)
        if s and s.get("supervisor_pid") == self.proc.pid and pid not in (s["actors"][victim].get("ranks")
                                                                          or [s["actors"][victim]["pid"]]):
            self.problems.append(f"{victim} was restarted after a SIGSTOP shorter than hang_timeout_s")

    def _event(self, what: str, mean_gap_s: float) -> bool:
        """Wait a random gap, then do ``what``; retried until it lands (a victim that
        died meanwhile of its own fault does not count); False if the run ended first."""
        while self.up(every=what != "kill") is not None:
            time.sleep(self.rng.uniform(0, 2 * mean_gap_s))
            st = self.up(every=what != "kill", timeout=60.0)
            if st is None:
                continue
            if what == "kill":
                if self.kill_actor(st):
                    return True
            elif what == "supervisor":
                self.kill_supervisor()
                return True
            else:
                import yaml
                config = yaml.safe_load((self.run_dir / "config.yaml").read_text())
                self.stop_cont(st, float(config["runtime"]["hang_timeout_s"]))
                return True
        return False

    def run(self, kills: int, supervisor_kills: int, stops: int, mean_gap_s: float) -> dict:
        t0 = time.monotonic()
        plan = ["kill"] * kills + ["supervisor"] * supervisor_kills + ["stop"] * stops
        self.rng.shuffle(plan)
        self.launch(resume=False)
        for i, what in enumerate(plan):
            if not self._event(what, mean_gap_s):
                self.problems.append(f"the run ended before event {i + 1} of {len(plan)} ({what})")
                break
        code = self.proc.wait() if self.proc else None
        if code != 0:
            self.problems.append(f"launch.py exited {code}")
        restarts = restart_times(self.run_dir)
        return {"kills": self.done["kills"], "supervisor_kills": self.done["supervisor_kills"],
                "stop_cont": self.done["stop_cont"], "launches": self.launches, "exit_code": code,
                "restarts": len(restarts),
                "restart_s_median": round(statistics.median(restarts), 2) if restarts else None,
                "restart_s_max": round(max(restarts), 2) if restarts else None,
                "supervisor_restart_s_median": (round(statistics.median(self.supervisor_restart_s), 2)
                                                if self.supervisor_restart_s else None),
                "wall_s": round(time.monotonic() - t0, 1), "problems": self.problems}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="launch.py chaos", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--kills", type=int, default=10, help="kill -9 of random actors")
    ap.add_argument("--supervisor-kills", type=int, default=0, help="kill -9 of the supervisor, then --resume")
    ap.add_argument("--stop-cont", type=int, default=0, help="SIGSTOP then SIGCONT within hang_timeout_s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mean-gap-s", type=float, default=1.0, help="mean wait before each event")
    ap.add_argument("--quiet", action="store_true", help="send launch.py's output to RUN_DIR.chaos.log")
    ap.epilog = "Everything after -- goes to launch.py (e.g. -- --topology 2-2 --set train.epochs=20)."
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, launch_args = ap.parse_args(argv[:cut]), argv[cut + 1:]
    if min(args.kills, args.supervisor_kills, args.stop_cont) < 0:
        print("error: counts must be >= 0", file=sys.stderr)
        return 2
    if args.run_dir.exists():
        print(f"error: {args.run_dir} exists; chaos starts a new run", file=sys.stderr)
        return 2
    args.run_dir.parent.mkdir(parents=True, exist_ok=True)
    out = Driver(args.run_dir, launch_args, args.seed, args.quiet).run(
        args.kills, args.supervisor_kills, args.stop_cont, args.mean_gap_s)
    print(json.dumps(out), flush=True)
    return 0 if not out["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
