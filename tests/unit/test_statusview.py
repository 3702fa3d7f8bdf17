"""``launch.py status``: each exit code from a status.json written here, against real
processes (this one alive, a reaped child dead, a child that exits during --watch)."""

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from dflash_actors.observe import statusview

pytestmark = pytest.mark.timeout(30)

ACTORS = ("loader.0", "target.0", "target.1", "drafter.0", "drafter.1", "optimizer.0")


def _actor(pid, batch, **extra):
    return {"pid": pid, "state": "working", "restarts": 0, "heartbeat_age_s": 0.2, "batch": batch,
            "holds": [batch], "progress": {"done": 40, "wip": 1}, "busy_pct_30s": 71.5, "busy_s": 30.2,
            "rss_mb": 412.0, "cpu_pct": 35.0, "gpu_mem_mb": None, "phase": None, "stuck": None, **extra}


def _status(pid=None, started=None, **top):
    """A 2-2 run at step 42/160 whose supervisor is this process, written just now."""
    if pid is None:
        pid, started = os.getpid(), psutil.Process().create_time()
    status = {
        "time": time.time(), "state": "running", "supervisor_pid": pid, "supervisor_started": started,
        "stuck_after_s": 15.0, "hang_timeout_s": 60.0,
        "actors": {a: _actor(20000 + i, 50 + i) for i, a in enumerate(ACTORS)},
        "rings": {"batch": {"slots": 4, "used": 3}, "features": {"slots": 4, "used": 4}},
        "batches": {"PLANNED": 100, "LOADED": 2, "FEATURED": 3, "GRAD_DONE": 1, "COMMITTED": 214,
                    "committed_this_run": 214, "total": 320},
        "training": {"step": 42, "total_steps": 160, "epoch": 2, "total_epochs": 40, "loss": 5.123,
                     "simulated_tau": 1.52, "lr": 0.0003, "tokens": 212000, "tokens_per_s": 2800.5,
                     "tokens_per_s_30s": 3012.0, "eta_s": 38.0, "skipped_steps": 0},
    }
    status.update(top)
    return status


def _run(tmp_path, capsys, status, *args):
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "status.json").write_text(json.dumps(status))
    code = statusview.main([str(run), *args])
    out, err = capsys.readouterr()
    return code, out, err


def _dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_healthy_run_is_0_and_shows_every_actor(tmp_path, capsys):
    code, out, err = _run(tmp_path, capsys, _status())
    assert code == 0, out
    first = out.splitlines()[0]
    assert first == "running: step 42/160 (26%), epoch 2/40"
    for a in ACTORS:
        assert a in out
    assert "42/160 (26%)" in out and "3,012 (30 s)" in out and "2,800" in out and "0:00:38" in out
    assert "batch 3/4  features 4/4" in out and "214/320" in out
    assert "STUCK" not in out and "gpu MB" not in out and err == ""
    assert max(len(line) for line in out.splitlines()) <= statusview.WIDTH


@pytest.mark.parametrize("top, first", [
    ({"state": "stopping", "reason": "SIGINT"}, "stopping: SIGINT"),
    ({"state": "done"}, f"finishing: done at step 42/160, supervisor {os.getpid()} still exiting"),
], ids=["stopping", "finishing"])   # not the pid: every pytest-xdist worker must collect the same names
def test_stopping_or_finishing_with_a_live_supervisor_is_1(tmp_path, capsys, top, first):
    code, out, _ = _run(tmp_path, capsys, _status(**top))
    assert code == 1
    assert out.splitlines()[0] == first


def test_a_stuck_actor_is_1_and_named(tmp_path, capsys):
    status = _status()
    status["actors"]["target.1"]["stuck"] = "no heartbeat for 17.2 s"
    code, out, _ = _run(tmp_path, capsys, status)
    assert code == 1
    assert out.splitlines()[0] == "stuck: target.1 no heartbeat for 17.2 s"
    assert "STUCK: no heartbeat for 17.2 s" in out


def test_a_stale_status_is_1_with_its_age(tmp_path, capsys):
    code, out, _ = _run(tmp_path, capsys, _status(time=time.time() - 30))
    assert code == 1
    first = out.splitlines()[0]
    assert first.startswith("stuck: ") and "status.json for 30." in first


def test_a_final_state_ages_while_the_checkpoint_is_written(tmp_path, capsys):
    """The last status comes before the final checkpoint: an old one then means finishing, not stuck."""
    code, out, _ = _run(tmp_path, capsys, _status(state="stopped", time=time.time() - 30))
    assert code == 1
    first = out.splitlines()[0]
    assert first.startswith("finishing: stopped at step 42/160") and "30." in first


def test_a_dead_supervisor_is_3_with_the_last_state(tmp_path, capsys):
    status = _status(pid=_dead_pid(), started=time.time() - 5, state="done")
    status["training"].update(step=160)
    code, out, _ = _run(tmp_path, capsys, status)
    assert code == 3
    assert out.splitlines()[0] == f"not running: supervisor {status['supervisor_pid']} is gone; " \
                                  "last state: done at step 160/160"


def test_a_reused_pid_is_3(tmp_path, capsys):
    code, out, _ = _run(tmp_path, capsys, _status(pid=os.getpid(), started=psutil.Process().create_time() - 1000))
    assert code == 3
    assert out.startswith("not running: ") and "another process" in out.splitlines()[0]


def test_a_live_pid_without_start_time_counts_as_the_supervisor(tmp_path, capsys):
    status = _status()
    del status["supervisor_started"]
    assert _run(tmp_path, capsys, status)[0] == 0
    del status["supervisor_pid"]
    code, out, _ = _run(tmp_path, capsys, status)
    assert code == 3 and out.startswith("not running: ")


def test_bad_input_is_2_with_one_error_line(tmp_path, capsys):
    assert statusview.main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert statusview.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not a run directory" in err and err.count("\n") == 1
    (tmp_path / "status.json").write_text('{"time": 17')
    t0 = time.monotonic()
    assert statusview.main([str(tmp_path)]) == 2
    assert time.monotonic() - t0 >= 0.2  # retried once
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and err.count("\n") == 1 and out == ""


def test_a_bare_status_renders(tmp_path, capsys):
    """No training block, no optional actor fields, nulls where a field may be null."""
    status = _status()
    del status["training"], status["supervisor_started"], status["stuck_after_s"], status["hang_timeout_s"]
    status["actors"] = {a: {"pid": None, "state": "dead", "restarts": 1, "heartbeat_age_s": None, "batch": None,
                            "holds": [], "progress": {"done": 0, "wip": 0}} for a in ("loader.0", "work.0")}
    status["rings"] = {"batch": None}
    code, out, _ = _run(tmp_path, capsys, status)
    assert code == 0
    assert out.splitlines()[0] == "running: 214/320 batches committed"
    assert "work.0" in out and "restarts   2" in out


def test_a_starting_actor_shows_its_phase_and_gpu_memory(tmp_path, capsys):
    status = _status()
    status["actors"]["target.0"].update(state="starting", gpu_mem_mb=1536.0,
                                        phase={"name": "load target weights", "done": 3, "total": 12,
                                               "elapsed_s": 4.2, "idle_s": 1.0})
    status["actors"]["target.1"].update(state="attaching", phase={"name": "map shared memory", "done": None,
                                                                  "total": None, "elapsed_s": 1.0, "idle_s": 0.1})
    _, out, _ = _run(tmp_path, capsys, status)
    assert "starting: load target weights 3/12" in out
    status["actors"]["target.0"]["phase"]["name"] = "compile the target's forward for every sequence length"
    _, out, _ = _run(tmp_path, capsys, status)
    cell = "starting: compile the target's… 3/12"
    assert len(cell) == statusview.STATE_WIDTH and cell in out
    assert "attaching: map shared memory " in out and "gpu MB" in out and "1536" in out


def test_watch_returns_3_when_the_supervisor_exits(tmp_path, capsys):
    child = subprocess.Popen(["sleep", "0.5"])
    try:
        status = _status(pid=child.pid, started=psutil.Process(child.pid).create_time())
        t0 = time.monotonic()
        code, out, _ = _run(tmp_path, capsys, status, "--watch", "0.1")
        assert code == 3 and time.monotonic() - t0 < 5
    finally:
        child.wait()
    verdicts = [line for line in out.splitlines() if line.startswith(("running: ", "not running: "))]
    assert len(verdicts) >= 2 and out.count("run dir ") == len(verdicts)
    assert verdicts[0].startswith("running: ") and verdicts[-1].startswith("not running: ")
    assert "\033[" not in out and out.endswith("\n\n")


def test_watch_on_a_terminal_redraws_in_place_and_ctrl_c_returns_the_last_code(tmp_path, capsys, monkeypatch):
    def interrupt(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(statusview.time, "sleep", interrupt)
    code, out, err = _run(tmp_path, capsys, _status(), "--watch")
    assert code == 0 and err == ""
    assert out.startswith("\033[H\033[Jrunning: ") and out.count("\033[H\033[J") == 1


@pytest.mark.parametrize("extra,says", [
    ({"waiting_for": {"nodes": [1], "s": 3.24}, "failure": None}, "; waiting for node 1 for 3.2 s"),
    ({"waiting_for": None, "failure": "lost node 1: no heartbeat from its supervisor for 120 s"},
     "; lost node 1: no heartbeat"),
])
def test_a_node_of_several_says_which_and_whom_it_waits_for(tmp_path, capsys, extra, says):
    cluster = {"nodes": 2, "rank": 0, "master": "10.0.0.1:29500", "steps_exchanged": 41, "exchange_ms_mean": 11.25,
               **extra}
    code, out, _ = _run(tmp_path, capsys, _status(cluster=cluster))
    assert code == 0
    line = [x for x in out.splitlines() if x.startswith("cluster")]
    assert len(line) == 1 and len(line[0]) <= statusview.WIDTH
    head = "cluster    node 0 of 2 (rendezvous 10.0.0.1:29500), 41 steps exchanged at 11.2 ms"
    assert line[0].startswith(head + says)


def test_a_gang_shows_every_rank(tmp_path, capsys):
    status = _status()
    status["actors"]["target.0"]["ranks"] = [20001, 30001]
    code, out, _ = _run(tmp_path, capsys, status)
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("target.0"))
    assert row.endswith("ranks 20001 30001")
    assert "ranks" not in next(line for line in out.splitlines() if line.startswith("target.1"))
