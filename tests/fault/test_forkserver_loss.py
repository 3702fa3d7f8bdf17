"""The fork server every actor comes from, struck: kill -9, SIGSTOP (before a fork,
while a new one imports and the supervisor waits for its first fork, and right after it
has forked the restarted actors), and a supervisor killed after it has replaced one.
The job goes on, every batch exactly once, the server's loss counted as one restart
event (no actor's restart intensity charged), no silence in events.log longer than the
timeouts that bound a restart, and the replacement carries the first server's
settings: it dies with its supervisor."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

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


def _longest_silence(run_dir) -> float:
    """The longest gap between two events.log lines, in seconds."""
    t = [e["mono"] for e in events(run_dir)]
    return max(b - a for a, b in zip(t, t[1:]))


def _strike_replacement(sup, when):
    """A thread: once the job is at work, kill -9 the server; then SIGSTOP its
    replacement once ``when(new_pid)`` holds; the record of what it did."""
    done = {}

    def run():
        try:
            wait_for(lambda: _working(sup), "the job at work")
            done["first"] = sup.group.server_pid
            os.kill(done["first"], signal.SIGKILL)
            new = wait_for(lambda: sup.group.server_pid not in (None, done["first"]) and sup.group.server_pid,
                           "a new fork server", 60)
            wait_for(lambda: when(new), "the moment to stop the new server", 120, poll_s=0.0005)
            os.kill(new, signal.SIGSTOP)
            done["stopped"], done["at"] = new, time.monotonic()
        except Exception as e:  # noqa: BLE001 - reported by the test
            done["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done


# Restarts are bounded by these: a fork within FORK_S, a stopped server found out
# within FORK_S, a new server's imports within START_S (on a loaded machine: seconds).
FORK_S, START_S = 1.0, 60.0


@pytest.mark.timeout(240)
def test_a_replacement_stopped_while_the_supervisor_waits_for_its_first_fork_is_replaced(tmp_path):
    """The new server is stopped at once, while it imports and the supervisor waits for
    its first fork (which may take ``START_S`` for a running one): stopped, it is found
    out within ``fork_timeout_s``, killed and replaced, and the job ends as a clean one."""
    cfg = runtime(tmp_path, fork_timeout_s=FORK_S, start_timeout_s=START_S, hang_timeout_s=10.0)
    sup, results = toy_job(cfg, n_batches=300, work_s=0.02, own_server=True)
    t, done = _strike_replacement(sup, lambda new: True)
    result = sup.run()
    t.join(5)
    assert "error" not in done, done
    assert result.state is JobState.DONE, result.reason
    assert_exactly_once(sup, results, result, 300)
    assert result.restarts == {"loader.0": 0, "target.0": 0, "drafter.0": 0, "forkserver": 2}
    run = tmp_path / "run"
    lost = events(run, "forkserver_lost")
    assert [e["pid"] for e in lost] == [done["first"], done["stopped"]]
    assert "is stopped and did not fork within 1s" in lost[1]["reason"]
    assert lost[1]["mono"] - done["at"] < FORK_S + 5.0, "a stopped server was waited for as an importing one"
    assert _longest_silence(run) < START_S


@pytest.mark.timeout(240)
def test_a_replacement_stopped_right_after_it_forked_the_restarted_actors_is_replaced(tmp_path):
    """The new server is stopped the moment it has forked a restarted actor, before that
    actor has said a word: the actors it forked start and work without it, the forks
    it still owes fail within ``fork_timeout_s``, and so does the next fork a death
    needs (kill -9 of the drafter); a new server takes over and the job ends as a clean
    one."""
    cfg = runtime(tmp_path, fork_timeout_s=FORK_S, start_timeout_s=START_S, hang_timeout_s=10.0)
    sup, results = toy_job(cfg, n_batches=400, work_s=0.02, own_server=True)

    def forked_one(new):
        return sup.group.server_pid == new and sup.children[0].proc is not None and not sup.children[0].ready
    t, done = _strike_replacement(sup, forked_one)

    def then_a_death():
        t.join(120)
        if "stopped" not in done:
            return
        # Every actor ready again (from the stopped server, or from one after it).
        wait_for(lambda: all(c.ready for c in sup.children), "every actor ready", 120)
        if sup.group.server_pid == done["stopped"]:
            done["killed"] = sup.children[-1].proc.pid
            os.kill(done["killed"], signal.SIGKILL)
    killer = threading.Thread(target=then_a_death, daemon=True)
    killer.start()
    result = sup.run()
    killer.join(5)
    assert "error" not in done, done
    assert result.state is JobState.DONE, result.reason
    assert_exactly_once(sup, results, result, 400)
    assert result.restarts["forkserver"] == 2
    run = tmp_path / "run"
    lost = events(run, "forkserver_lost")
    assert [e["pid"] for e in lost] == [done["first"], done["stopped"]]
    assert "is stopped and did not fork within 1s" in lost[1]["reason"]
    assert _longest_silence(run) < START_S
    assert all_gone([done["stopped"]], 5.0)
