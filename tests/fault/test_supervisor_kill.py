"""kill -9 of the supervisor: the parent-death signal takes every actor with it."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.support.pipeline import SMALL
from tests.support.runtime import ROOT, all_gone


@pytest.mark.parametrize("gang", [1, 2])
def test_children_die_with_a_killed_supervisor(tmp_path, gang):
    """With ``gang`` 2 the target is two processes (``Stage.gang``): both go too."""
    run_dir = tmp_path / "run"
    sup = subprocess.Popen([sys.executable, "-m", "tests.support.toy", "--run-dir", str(run_dir),
                            "--batches", "100", "--work-s", "30", "--target-gang", str(gang)], cwd=ROOT)
    status, pids = run_dir / "status.json", []
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end and not pids:
            if status.exists():
                actors = json.loads(status.read_text())["actors"]
                if all(a["state"] in ("idle", "working") for a in actors.values()):
                    pids = [p for a in actors.values() for p in a.get("ranks", [a["pid"]])]
            time.sleep(0.1)
        assert len(pids) == 2 + gang, "the actors never came up"
        if gang > 1:
            os.kill(actors["target.0"]["ranks"][1], signal.SIGSTOP)     # a stopped follower too
        # The actors, the fork server they came from (runtime.start_method's default),
        # and the stdlib's resource tracker.
        children = {p.pid for p in psutil.Process(sup.pid).children(recursive=True)}
        assert set(pids) <= children and len(children - set(pids)) <= 2
        pids = sorted(children)
        # Neither a busy actor (the loader, 30 s into a batch) nor a stopped one reads its
        # pipe, so only the parent-death signal can end them promptly.
        os.kill(actors["drafter.0"]["pid"], signal.SIGSTOP)
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait(10)
        assert all_gone(pids, within_s=5), "an actor outlived its supervisor"
    finally:
        sup.kill()
        sup.wait()



@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_children_die_with_a_supervisor_killed_during_startup(tmp_path, method):
    """launch.py's actors (under spawn), or the fork server they will come from, are still
    importing torch and transformers (seconds); the parent-death signal must already be
    armed then, and every process below the supervisor gone within a second."""
    run_dir = tmp_path / "run"
    argv = [sys.executable, "launch.py", "--topology", "2-2", "--run-dir", str(run_dir)]
    for kv in SMALL + [f"data.cache_dir={tmp_path / 'cache'}", "target.tiny.pretrain_steps=0",
                       f"runtime.start_method={method}"]:
        argv += ["--set", kv]
    sup = subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.DEVNULL)

    def started() -> bool:
        if method == "spawn":       # the actors themselves import
            return len(kids) >= 5
        return any("forkserver" in " ".join(p.cmdline()) for p in kids)
    try:
        end, kids = time.monotonic() + 120, []
        while time.monotonic() < end and not started():
            try:
                kids = [p for p in psutil.Process(sup.pid).children(recursive=True)
                        if "resource_tracker" not in " ".join(p.cmdline())]
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.02)
        assert started(), "the actors were never spawned"
        time.sleep(0.3)     # past interpreter start-up, inside the heavy imports
        kids = psutil.Process(sup.pid).children(recursive=True)
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait(10)
        # The fork server starts once the config is read, before the run directory exists.
        log = run_dir / "events.log"
        ready = [e for e in log.read_text().splitlines() if '"ready"' in e] if log.exists() else []
        assert not ready, "an actor was already ready: this killed nothing at start-up"
        assert all_gone([p.pid for p in kids], within_s=1.0), "a process outlived its supervisor at start-up"
    finally:
        sup.kill()
        sup.wait()
