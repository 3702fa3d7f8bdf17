"""The runtime with toy actors in real processes: tensors through the rings, chains,
status file, events log, graceful stop."""

import json
import os
import signal
import threading
import time

import psutil

from dflash_actors.observe import statusview
from dflash_actors.observe.status import read as read_status
from dflash_actors.runtime.messages import ProtocolError
from dflash_actors.runtime.outcome import JobState
from tests.support.runtime import assert_exactly_once, events, runtime
from tests.support.toy import toy_job


def test_producer_consumer_moves_real_tensors_in_order(tmp_path):
    sup, results = toy_job(runtime(tmp_path, batch_slots=3), n_batches=40, stages=2)
    result = sup.run()
    assert result.state is JobState.DONE and result.exit_code == 0
    assert result.committed == list(range(40))       # one ordered consumer: exact order
    assert_exactly_once(sup, results, result, 40)
    kinds = [e["event"] for e in events(tmp_path / "run")]
    assert kinds.count("spawn") == 2 and kinds.count("ready") == 2 and kinds[-1] == "end"
    assert "died" not in kinds


def test_three_stage_chain_with_parallel_targets_and_drafters(tmp_path):
    sup, results = toy_job(runtime(tmp_path, batch_slots=4, feature_slots=3), n_batches=60, stages=3,
                  n_targets=2, n_drafters=2)
    result = sup.run()
    assert result.state is JobState.DONE
    assert_exactly_once(sup, results, result, 60)
    for j in range(2):   # drafter j gets b % 2 == j, in increasing b
        assert [b for b in result.committed if b % 2 == j] == list(range(j, 60, 2))
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert set(status["actors"]) == {"loader.0", "target.0", "target.1", "drafter.0", "drafter.1"}
    assert status["batches"]["committed"] == 60 and status["state"] == "done"
    assert sum(a["progress"]["done"] for k, a in status["actors"].items() if k.startswith("target")) == 60


def test_a_protocol_error_in_an_actor_stops_the_job_instead_of_restarting_it(tmp_path):
    """A ProtocolError is a bug: restarting the actor would meet the same contradiction
    again, so the job stops at the first one and hands the error to its caller."""
    sup, _ = toy_job(runtime(tmp_path, max_restarts=5), n_batches=40, stages=2, contradict_at=7)
    result = sup.run()
    assert result.state is JobState.FAILED and isinstance(result.raised, ProtocolError)
    assert "batch 7 contradicts the ledger" in result.reason and result.restarts["drafter.0"] == 0
    died = [e for e in events(tmp_path / "run") if e["event"] == "died"]
    assert [(e["actor"], e["decision"]) for e in died] == [("drafter.0", "raise")]


def test_status_file_shows_live_actors_and_a_stopped_one_as_stuck(tmp_path):
    """status.json while every actor is up; then a SIGSTOPed target: stuck in status.json,
    in ``launch.py status`` (exit 1, named) and in events.log, yet not restarted (it is
    below hang_timeout_s); once continued, healthy again."""
    sup, results = toy_job(runtime(tmp_path, stuck_after_s=0.8), n_batches=100_000, stages=3, work_s=0.005)
    path = tmp_path / "run" / "status.json"
    seen = {}

    def poll(cond, what):
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if path.exists():
                st = read_status(path.parent)       # one read: the verdict is of this very status
                verdict = statusview.verdict(st, time.time())
                if cond(st, verdict):
                    return st, verdict
            time.sleep(0.05)
        raise TimeoutError(what)

    def watch():
        try:
            seen["up"], seen["up_verdict"] = poll(lambda st, v: all(a["state"] in ("idle", "working")
                                                                    for a in st["actors"].values())
                                                  and st["batches"]["committed"] > 20, "every actor up")
            seen["children"] = {p.pid for p in psutil.Process().children(recursive=True)}
            pid = seen["up"]["actors"]["target.0"]["pid"]
            os.kill(pid, signal.SIGSTOP)
            try:
                seen["stuck"], seen["stuck_verdict"] = poll(lambda st, v: v[0] == 1, "the stopped target stuck")
            finally:
                os.kill(pid, signal.SIGCONT)
            seen["again"], seen["again_verdict"] = poll(lambda st, v: v[0] == 0, "healthy again")
        finally:
            sup.request_stop("test done")

    t = threading.Thread(target=watch)
    t.start()
    result = sup.run()
    t.join()
    assert result.state is JobState.STOPPED and "again" in seen, seen.keys()
    up = seen["up"]
    assert seen["up_verdict"][0] == 0 and up["supervisor_started"] == psutil.Process().create_time()
    for a in up["actors"].values():
        assert a["pid"] in seen["children"]
        assert a["restarts"] == 0 and a["heartbeat_age_s"] is not None and a["heartbeat_age_s"] < 5
        assert a["rss_mb"] > 0 and a["phase"] is None and a["stuck"] is None and a["busy_s"] > 0
    assert set(up["rings"]) == {"batch", "features"} and up["rings"]["batch"]["slots"] == 4
    pids = {e["actor"]: e["pid"] for e in events(tmp_path / "run", "spawn")}
    assert {k: a["pid"] for k, a in up["actors"].items()} == pids

    code, line = seen["stuck_verdict"]
    assert line.startswith("stuck: target.0 no heartbeat for"), line
    assert seen["stuck"]["actors"]["target.0"]["stuck"].startswith("no heartbeat for")
    assert [e["actor"] for e in events(tmp_path / "run", "stuck")] == ["target.0"]
    assert [e["actor"] for e in events(tmp_path / "run", "unstuck")] == ["target.0"]
    assert not events(tmp_path / "run", "died") and seen["again"]["actors"]["target.0"]["stuck"] is None
    # Each stage timed its work on every batch it committed (toy work: work_s each).
    done = result.committed
    assert done and (sup.work_times[done] >= 0.005).all()


def test_sigterm_drains_in_flight_work_and_calls_the_stop_hook(tmp_path):
    sup, results = toy_job(runtime(tmp_path), n_batches=10_000, stages=3, work_s=0.01)

    def term_after_progress():
        end = time.monotonic() + 60
        while len(sup.dispatcher.committed) < 20 and time.monotonic() < end:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=term_after_progress, daemon=True).start()
    result = sup.run()
    assert result.state is JobState.STOPPED and result.reason == "SIGTERM" and result.exit_code != 0
    assert [e["reason"] for e in events(tmp_path / "run", "stopping")] == ["SIGTERM"]
    assert 20 <= len(result.committed) < 10_000
    # Every actor finished the Work it had been sent and exited 0 on Stop: nothing in flight.
    held = (sup.ledger.table[:, 3] != -1).nonzero().flatten().tolist()
    assert not held, (held, sup.ledger.table[held].tolist(), events(tmp_path / "run")[-8:])
    assert [e["reason"] for e in events(tmp_path / "run", "exit")] == ["exit code 0"] * 3
    assert not events(tmp_path / "run", "escalate")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))


def test_stop_escalates_to_sigkill_for_an_actor_that_cannot_stop(tmp_path):
    # A stopped actor reads no Stop and ignores SIGTERM. The grace period is long, but a
    # second SIGTERM, like a second Ctrl-C, cuts it short.
    sup, results = toy_job(runtime(tmp_path, grace_s=120.0), n_batches=10_000, stages=3, work_s=0.01)

    def freeze_then_signal_twice():
        end = time.monotonic() + 60
        while time.monotonic() < end:
            c = sup.children[1]
            if all(x.ready for x in sup.children) and c.proc is not None:
                os.kill(c.proc.pid, signal.SIGSTOP)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1.0)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.01)

    threading.Thread(target=freeze_then_signal_twice, daemon=True).start()
    t0 = time.monotonic()
    result = sup.run()
    assert result.state is JobState.STOPPED
    assert len(events(tmp_path / "run", "hurry")) == 1
    esc = events(tmp_path / "run", "escalate")
    assert [(e["actor"], e["reason"].split()[-1]) for e in esc] == [("target.0", "SIGTERM"), ("target.0", "SIGKILL")]
    exits = {e["actor"]: e["reason"] for e in events(tmp_path / "run", "exit")}
    assert exits == {"loader.0": "exit code 0", "target.0": "exit code -9", "drafter.0": "exit code 0"}
    assert time.monotonic() - t0 < 60
