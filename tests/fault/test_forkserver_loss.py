"""The fork server every actor comes from, struck: kill -9, SIGSTOP, and a supervisor
killed after it has replaced one. The job goes on, every batch exactly once, the
server's loss counted as one restart event (no actor's restart intensity charged),
and the replacement carries the first server's settings: it dies with its supervisor."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil

from dflash_actors.runtime.outcome import JobState
from tests.support.runtime import ROOT, all_gone, assert_exactly_once, events, runtime, wait_for
from tests.support.toy import toy_job


def _working(sup):
    """Every actor ready and the target gang mid-batch; then the pids of every rank."""
    if not all(c.ready and c.proc is not None for c in sup.children):
        return None
    if sup.heartbeats.row(sup.children[1].number)["batch"] < 0:
        return None
    return [p.pid for c in sup.children for p in [c.proc] + [f.proc for f in c.followers]]


def _strike_server(sup, sig, then=None):
    """A thread that sends ``sig`` to the fork server once the job is at work (and then
    calls ``then(pids)``); returns it and the record of what it did."""
    done = {}

    def run():
        try:
            pids = wait_for(lambda: _working(sup), "the job at work")
            done["server"], done["actors"] = sup.group.server_pid, pids
            os.kill(done["server"], sig)
            if then is not None:
                then(pids)
        except Exception as e:  # noqa: BLE001 - reported by the test
            done["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done


def test_a_killed_fork_server_is_replaced_and_its_actors_restart_as_one_event(tmp_path):
    sup, results = toy_job(runtime(tmp_path), n_batches=300, work_s=0.02, target_gang=2, own_server=True)
    t, done = _strike_server(sup, signal.SIGKILL)
    result = sup.run()
    t.join(5)
    assert "error" not in done, done
    assert result.state is JobState.DONE, result.reason
    assert_exactly_once(sup, results, result, 300)
    assert result.restarts == {"loader.0": 0, "target.0": 0, "drafter.0": 0, "forkserver": 1}
    assert all(c.policy.recent == 0 for c in sup.children), "an actor's restart intensity was charged"
    run = tmp_path / "run"
    lost = events(run, "forkserver_lost")
    assert len(lost) == 1 and lost[0]["pid"] == done["server"] and "killed by SIGKILL" in lost[0]["reason"]
    servers = [e["pid"] for e in events(run, "forkserver")]
    assert len(servers) == 2 and servers[0] == done["server"] and servers[1] != servers[0]
    died = events(run, "died")
    assert sorted(d["actor"] for d in died) == ["drafter.0", "loader.0", "target.0"]
    assert all("its fork server was lost" in d["reason"] and d["decision"] == "restart" for d in died)
    assert all_gone(done["actors"] + servers, 5.0)


def test_a_stopped_fork_server_is_found_out_at_the_next_fork_and_replaced(tmp_path):
    """SIGSTOP of the server, then a kill -9 of an actor: its death is seen although the
    stopped server cannot report it, its restart's fork times out (fork_timeout_s), and
    the server is killed and replaced; the job ends as if nothing had happened."""
    sup, results = toy_job(runtime(tmp_path, fork_timeout_s=1.0), n_batches=300, work_s=0.02, own_server=True)

    def kill_drafter(pids):
        time.sleep(0.2)
        os.kill(pids[-1], signal.SIGKILL)
    t, done = _strike_server(sup, signal.SIGSTOP, then=kill_drafter)
    result = sup.run()
    t.join(5)
    assert "error" not in done, done
    assert result.state is JobState.DONE, result.reason
    assert_exactly_once(sup, results, result, 300)
    assert result.restarts["forkserver"] == 1
    lost = events(tmp_path / "run", "forkserver_lost")
    assert len(lost) == 1 and "did not fork within 1s" in lost[0]["reason"]
    assert not psutil.pid_exists(done["server"]) or psutil.Process(done["server"]).status() == "zombie"


def test_a_fork_server_lost_past_the_restart_intensity_gives_way_to_spawn(tmp_path):
    sup, results = toy_job(runtime(tmp_path, max_restarts=1, restart_window_s=300), n_batches=200, work_s=0.03,
                           own_server=True)
    strikes = []

    def new_server():
        pid = sup.group.server_pid
        return pid if pid not in (None, *strikes) and _working(sup) else None

    def striker():
        for _ in range(2):
            strikes.append(wait_for(new_server, "a new fork server at work"))
            os.kill(strikes[-1], signal.SIGKILL)
    t = threading.Thread(target=striker, daemon=True)
    t.start()
    result = sup.run()
    t.join(5)
    assert len(strikes) == 2
    assert result.state is JobState.DONE, result.reason
    assert_exactly_once(sup, results, result, 200)
    assert result.restarts["forkserver"] == 2
    assert sup.group.start_method == "spawn" and sup.status()["forkserver_pid"] is None
    given_up = events(tmp_path / "run", "forkserver_given_up")
    assert len(given_up) == 1 and "lost 2 times within 300s" in given_up[0]["reason"]


def test_a_replaced_fork_server_still_dies_with_its_supervisor(tmp_path):
    """The replacement is started as the first was (parent-death signal armed first):
    a kill -9 of the supervisor then takes it and every actor with it."""
    run_dir = tmp_path / "run"
    sup = subprocess.Popen([sys.executable, "-m", "tests.support.toy", "--run-dir", str(run_dir),
                            "--batches", "100000", "--work-s", "0.05", "--target-gang", "2"], cwd=ROOT)
    status = run_dir / "status.json"

    def up(not_server=None):
        try:
            st = json.loads(status.read_text())
        except (OSError, ValueError):
            return None
        ok = st["forkserver_pid"] not in (None, not_server) and all(
            a["state"] in ("idle", "working") for a in st["actors"].values())
        return st if ok else None
    try:
        first = wait_for(up, "the job at work", 120)["forkserver_pid"]
        os.kill(first, signal.SIGKILL)
        st = wait_for(lambda: up(first), "a new fork server and its actors", 120)
        assert st["forkserver_restarts"] == 1
        below = [p.pid for p in psutil.Process(sup.pid).children(recursive=True)]
        assert st["forkserver_pid"] in below
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait(10)
        assert all_gone(below, within_s=5), "the new fork server or an actor outlived the supervisor"
    finally:
        sup.kill()
        sup.wait()
