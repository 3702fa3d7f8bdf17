"""Chaos: faults injected from inside the job, and kills from outside it, as a user's
cluster would deal them.

Two tools:

* ``chaos_faults(cfg, seed, n, total_batches)`` schedules ``n`` random ``runtime.faults``
  (as data, the entries of that key) over every actor of the job (loader and optimizer
  included), every fault point and every kind that ends or stalls an actor;
  ``launch.py --chaos SEED`` uses it. Faults never change the math (``nan`` is left
  out), so a chaos run must end bit-identical to a clean one.
* ``launch.py chaos RUN_DIR --kills N --seed S -- LAUNCH_ARGS`` starts
  ``launch.py --run-dir RUN_DIR LAUNCH_ARGS`` and, at random moments, strikes real pids
  read from ``status.json``: ``kill -9`` of actors (of a gang, its leader and a follower
  in turn; each must come back), of the supervisor itself (``--supervisor-kills``: its
  actors must be gone within a second, then the driver resumes the run with
  ``--resume``), of the fork server (``--forkserver-kills``) or its SIGSTOP followed by
  an actor's kill, which needs a fork (``--forkserver-stops``): a new server must take
  over; and ``--stop-cont`` times it ``SIGSTOP``s a healthy actor for half of
  ``runtime.hang_timeout_s`` and continues it (it must not be restarted). A supervisor
  that ``runtime.faults`` kills from inside (``actor: supervisor``) is resumed too.
  Every process of the job it has seen must be gone within a second of its
  supervisor's death and at the end. When the run ends it prints one JSON line: what
  it did, by kind, restart times, and what it found wrong (orphans, a restarted
  stopped actor, the exit status).

Whether the run trained what a clean run trains is for the caller to check against
the final checkpoint (``benchmarks/chaos_suite.py``, ``make chaos``).
"""

from __future__ import annotations

import argparse
import contextlib
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
KINDS = ("kills", "leader_kills", "follower_kills", "supervisor_kills", "supervisor_faults", "forkserver_kills",
         "forkserver_stops", "stop_cont")
"""What the driver counts, by kind (a stop-cont is not a fault: nothing may restart)."""
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


def restart_gap(run_dir: Path) -> float:
    """From ``events.log``: the longest silence (seconds between two lines) while some
    actor was on its way up (spawned, or died to be restarted, and not yet Ready),
    within each supervisor's life. Training between restarts logs nothing and counts
    for nothing here; a restart that stalls shows as a silence that no start or hang
    timeout ended."""
    longest, pending, last = 0.0, set(), None
    path = run_dir / "events.log"
    for line in path.read_text().splitlines() if path.exists() else []:
        e = json.loads(line)
        if e["event"] == "start":
            pending, last = set(), None
        if pending and last is not None:
            longest = max(longest, e["mono"] - last)
        last = e["mono"]
        actor = e.get("actor")
        if e["event"] == "spawn" or (e["event"] == "died" and e.get("decision") == "restart"):
            pending.add(actor)
        elif e["event"] in ("ready", "exit", "give_up") or (e["event"] == "died" and actor in pending):
            pending.discard(actor)
    return longest


class Driver:
    """Runs one job under external strikes (module docstring), resuming it after every
    death of its supervisor, and keeps every process of the job it has seen
    (``status.json``: actors, gang ranks, the fork server) to check none outlives it."""

    def __init__(self, run_dir: Path, launch_args: list[str], seed: int, quiet: bool):
        self.run_dir, self.launch_args, self.rng = run_dir, launch_args, random.Random(seed)
        self.proc: subprocess.Popen | None = None
        self.log = open(run_dir.parent / f"{run_dir.name}.chaos.log", "a") if quiet else None
        self.supervisor_restart_s: list[float] = []
        self.problems: list[str] = []
        self.done = {kind: 0 for kind in KINDS}
        self.launches = 0
        self.seen: dict[int, float] = {}
        """pid -> create time of every process of the job seen so far (pid reuse safe)."""
        self.follower_next = False
        self.struck_at = 0.0
        """Unix time of the last strike: a status.json older than that predates its effect
        (the supervisor writes none while it replaces a fork server), and its pids may be
        dead, or another process's by now."""

    def launch(self, resume: bool) -> None:
        where = ["--resume", str(self.run_dir)] if resume else ["--run-dir", str(self.run_dir)]
        out = self.log or None
        self.proc = subprocess.Popen([sys.executable, str(LAUNCH), *where, *self.launch_args],
                                     stdout=out, stderr=out)
        self.launches += 1

    def running(self) -> bool:
        """Whether the job runs; a supervisor that struck itself (``runtime.faults``
        aimed at it) is counted, checked for orphans and resumed here."""
        if self.proc is None:
            return False
        if self.proc.poll() is None:
            return True
        struck = self._self_struck()
        if self.proc.returncode == -signal.SIGKILL and struck > self.done["supervisor_faults"]:
            self.done["supervisor_faults"] = struck
            self._check_gone("the supervisor struck by runtime.faults")
            self.launch(resume=True)
            return True
        return False

    def _self_struck(self) -> int:
        path = self.run_dir / "events.log"
        lines = path.read_text().splitlines() if path.is_file() else []
        return sum(1 for x in lines if '"event": "fault"' in x and '"actor": "supervisor"' in x)

    def _track(self, st: dict) -> None:
        import psutil
        pids = [st.get("forkserver_pid")] + [p for a in st["actors"].values() for p in a.get("ranks") or [a["pid"]]]
        for pid in pids:
            if pid and pid not in self.seen:
                try:
                    self.seen[pid] = psutil.Process(pid).create_time()
                except psutil.Error:
                    pass

    def outlived(self) -> list[int]:
        """Processes of the job seen alive once that still run."""
        import psutil
        left = []
        for pid, born in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == born and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.Error:
                pass
        return left

    def _check_gone(self, what: str) -> None:
        end = time.monotonic() + 1.0
        while time.monotonic() < end and self.outlived():
            time.sleep(0.02)
        left = self.outlived()
        if left:
            self.problems.append(f"processes {left} outlived {what} by more than 1 s")

    def up(self, every: bool, timeout: float = 300.0) -> dict | None:
        """The live supervisor's status once ``every`` actor (else at least one) is idle
        or working; None if the run ends or the wait times out."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.running():
            st = read_or_none(self.run_dir)
            if (st and st.get("supervisor_pid") == self.proc.pid and st["state"] == "running"
                    and st.get("time", 0.0) > self.struck_at):
                self._track(st)
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
        pid, kind = self._pid(st["actors"][victim])
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False    # died meanwhile
        self.struck_at = time.time()
        self.done[kind] += 1
        return True

    def _pid(self, actor: dict) -> tuple[int, str]:
        """The actor's pid and the kind of kill; for a gang (``ranks``) its leader and a
        follower in turn: any rank takes the gang down, and both paths must hold."""
        ranks = actor.get("ranks") or [actor["pid"]]
        if len(ranks) == 1:
            return ranks[0], "kills"
        self.follower_next = not self.follower_next
        return (self.rng.choice(ranks[1:]), "follower_kills") if self.follower_next else (ranks[0], "leader_kills")

    def kill_supervisor(self) -> None:
        t0 = time.monotonic()
        self.proc.kill()
        self.proc.wait()
        self.done["supervisor_kills"] += 1
        self._check_gone("the killed supervisor")
        self.launch(resume=True)
        if self.up(every=True) is not None:
            self.supervisor_restart_s.append(time.monotonic() - t0)

    def strike_forkserver(self, st: dict, stop: bool) -> bool:
        """kill -9 of the fork server, or SIGSTOP of it and a kill -9 of an actor (so
        that the stopped server is asked to fork): either way a new server must serve
        every actor again. False if there is no server (spawn) or it vanished."""
        old = st.get("forkserver_pid")
        if not old:
            return False
        try:
            os.kill(old, signal.SIGSTOP if stop else signal.SIGKILL)
        except ProcessLookupError:
            return False
        self.struck_at = time.time()
        if stop:
            time.sleep(0.2)
            self.kill_actor(st)
        self.done["forkserver_stops" if stop else "forkserver_kills"] += 1
        end = time.monotonic() + 120
        while time.monotonic() < end:
            now = self.up(every=True, timeout=5.0)
            if now is not None and now.get("forkserver_pid") not in (old,):
                break
            if not self.running():
                break
        else:
            self.problems.append(f"no new fork server took over from pid {old} within 120 s")
        if stop:
            with contextlib.suppress(ProcessLookupError):
                os.kill(old, signal.SIGCONT)
        return True

    def stop_cont(self, st: dict, hang_timeout_s: float) -> None:
        victim = self.rng.choice(sorted(st["actors"]))
        pid, _ = self._pid(st["actors"][victim])
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
            elif what in ("forkserver", "forkserver_stop"):
                if self.strike_forkserver(st, stop=what == "forkserver_stop"):
                    return True
            else:
                import yaml
                config = yaml.safe_load((self.run_dir / "config.yaml").read_text())
                self.stop_cont(st, float(config["runtime"]["hang_timeout_s"]))
                return True
        return False

    def run(self, plan_counts: dict[str, int], mean_gap_s: float) -> dict:
        t0 = time.monotonic()
        plan = [what for what, n in plan_counts.items() for _ in range(n)]
        self.rng.shuffle(plan)
        self.launch(resume=False)
        for i, what in enumerate(plan):
            if not self._event(what, mean_gap_s):
                self.problems.append(f"the run ended before event {i + 1} of {len(plan)} ({what})")
                break
        while self.running():
            time.sleep(0.1)
        code = self.proc.returncode if self.proc else None
        if code != 0:
            self.problems.append(f"launch.py exited {code}")
        self._check_gone("the end of the run")
        restarts = restart_times(self.run_dir)
        return {**self.done, "faults": sum(self.done[k] for k in KINDS if k != "stop_cont"),
                "launches": self.launches, "exit_code": code, "restarts": len(restarts),
                "restart_s_median": round(statistics.median(restarts), 2) if restarts else None,
                "restart_s_max": round(max(restarts), 2) if restarts else None,
                "supervisor_restart_s_median": (round(statistics.median(self.supervisor_restart_s), 2)
                                                if self.supervisor_restart_s else None),
                "processes_seen": len(self.seen), "wall_s": round(time.monotonic() - t0, 1),
                "problems": self.problems}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="launch.py chaos", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--kills", type=int, default=10,
                    help="kill -9 of random actors (of a gang: its leader and a follower in turn)")
    ap.add_argument("--supervisor-kills", type=int, default=0, help="kill -9 of the supervisor, then --resume")
    ap.add_argument("--forkserver-kills", type=int, default=0, help="kill -9 of the fork server")
    ap.add_argument("--forkserver-stops", type=int, default=0,
                    help="SIGSTOP of the fork server, then kill -9 of an actor (which needs a fork)")
    ap.add_argument("--stop-cont", type=int, default=0, help="SIGSTOP then SIGCONT within hang_timeout_s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mean-gap-s", type=float, default=1.0, help="mean wait before each event")
    ap.add_argument("--quiet", action="store_true", help="send launch.py's output to RUN_DIR.chaos.log")
    ap.epilog = ("Everything after -- goes to launch.py (e.g. -- --topology 2-2 --set train.epochs=20). "
                 "runtime.faults aimed at the supervisor kill it from inside; the driver resumes it.")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, launch_args = ap.parse_args(argv[:cut]), argv[cut + 1:]
    counts = {"kill": args.kills, "supervisor": args.supervisor_kills, "forkserver": args.forkserver_kills,
              "forkserver_stop": args.forkserver_stops, "stop": args.stop_cont}
    if min(counts.values()) < 0:
        print("error: counts must be >= 0", file=sys.stderr)
        return 2
    if args.run_dir.exists():
        print(f"error: {args.run_dir} exists; chaos starts a new run", file=sys.stderr)
        return 2
    args.run_dir.parent.mkdir(parents=True, exist_ok=True)
    out = Driver(args.run_dir, launch_args, args.seed, args.quiet).run(counts, args.mean_gap_s)
    print(json.dumps(out), flush=True)
    return 0 if not out["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
