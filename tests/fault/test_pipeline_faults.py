"""Real kills against the training pipeline: nothing lost, nothing done twice, same bits."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from dflash_actors.job.job import Job
from dflash_actors.job.reference import train_reference
from dflash_actors.models.drafter import DFlashDrafter
from dflash_actors.train.checkpoint import latest_checkpoint, load_trainer_state
from tests.support.pipeline import ROOT, SMALL, assert_same_weights, final_weights, losses, new_job, small_config
from tests.support.runtime import all_gone

LONG = ("train.epochs=20",)



def read_status(run_dir):
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def steps_done(job) -> int:
    return int(job.shared.step_stats[:, -1].sum())


# tests/support/inject/sitecustomize.py stalls every checkpoint write this long.
SLOW_CHECKPOINTS = {"PYTHONPATH": str(ROOT / "tests/support/inject"), "DFLASH_TEST_CHECKPOINT_PAUSE_S": "2"}


class Killer(threading.Thread):
    """Kills each actor in turn with SIGKILL, once the previous one is back and the job
    has made two more optimizer steps; records what it did."""

    def __init__(self, job, run_dir, victims):
        super().__init__(daemon=True)
        self.job, self.run_dir, self.victims = job, run_dir, victims
        self.killed: list[tuple[str, int, int]] = []
        self.error = None

    def _wait(self, cond, what, timeout=120):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if cond():
                return
            time.sleep(0.02)
        raise TimeoutError(what)

    def run(self):
        try:
            for victim in self.victims:
                mark = steps_done(self.job) + 2
                self._wait(lambda m=mark: steps_done(self.job) >= m, f"progress before killing {victim}")
                st = read_status(self.run_dir)
                pid = st["actors"][victim]["pid"]
                os.kill(pid, signal.SIGKILL)
                self.killed.append((victim, pid, steps_done(self.job)))

                def back(v=victim, old=pid):
                    s = read_status(self.run_dir)
                    a = s and s["actors"][v]
                    return a and a["pid"] not in (None, old) and a["state"] in ("idle", "working")
                self._wait(back, f"{victim} restart")
        except Exception as e:   # noqa: BLE001 - reported by the test
            self.error = e


@pytest.mark.chaos      # make chaos, for time: make test keeps a cheaper case of each path
def test_kill_every_role_mid_run(cache_dir, tmp_path):
    cfg = small_config(cache_dir, tmp_path / "run", "2-2", *LONG)
    job = new_job(cfg, progress=False)
    killer = Killer(job, tmp_path / "run", ["drafter.1", "loader.0", "optimizer.0", "target.0"])
    killer.start()
    result = job.run()
    killer.join(5)
    assert killer.error is None, killer.error
    assert [k[0] for k in killer.killed] == ["drafter.1", "loader.0", "optimizer.0", "target.0"]
    assert result.exit_code == 0, result.reason
    assert result.summary["restarts_by_actor"] == dict.fromkeys(killer.victims, 1)
    total = job.schedule.total_batches
    assert sorted(result.committed) == list(range(total)), "a batch was lost or committed twice"
    ref = train_reference(cfg, progress=False)
    assert losses(tmp_path / "run") == ref.losses
    assert_same_weights(final_weights(tmp_path / "run"), ref.state_dict)
    events = [json.loads(x) for x in (tmp_path / "run" / "events.log").read_text().splitlines()]
    died = [e for e in events if e["event"] == "died"]
    assert [e["actor"] for e in died] == [k[0] for k in killer.killed]
    assert all(e["reason"] == "killed by SIGKILL" for e in died)


RESUME_LEN = ("train.epochs=6",)


def _launch(cache_dir, run_dir, *extra, env=None, resume=False):
    args = [sys.executable, "launch.py", "--topology", "2-2"]
    args += ["--resume", str(run_dir)] if resume else ["--run-dir", str(run_dir)]
    for kv in SMALL + [f"data.cache_dir={cache_dir}", *RESUME_LEN, *extra]:
        args += ["--set", kv]
    return subprocess.Popen(args, cwd=ROOT, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.chaos      # make chaos, for time: make test keeps a cheaper case of each path
def test_kill_whole_job_during_checkpoint_then_resume(cache_dir, tmp_path):
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    sup = _launch(cache_dir, run_dir, "train.checkpoint_every=3", env=SLOW_CHECKPOINTS)
    try:
        end = time.monotonic() + 240
        while time.monotonic() < end and not list(ckpts.glob(".tmp-step-0000006-*")):
            assert sup.poll() is None, sup.communicate()
            time.sleep(0.02)
        assert list(ckpts.glob(".tmp-step-0000006-*")), "the second checkpoint never started"
        children = [p.pid for p in psutil.Process(sup.pid).children(recursive=True)]
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait(10)
        assert all_gone(children, within_s=10), "an actor outlived the killed supervisor"
    finally:
        sup.kill()
        sup.communicate()
    # The write in progress never became a checkpoint; the previous one is whole.
    last = latest_checkpoint(run_dir)
    assert last.name == "step-0000003"
    assert load_trainer_state(last)["next_batch"] == 3 * 2
    DFlashDrafter.from_pretrained(last)

    refused = _launch(cache_dir, run_dir, "train.lr=1e-2", resume=True)
    out, err = refused.communicate(timeout=120)
    assert refused.returncode == 2 and "train.lr" in err and "resume refused" in err

    resumed = _launch(cache_dir, run_dir, resume=True)
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-2000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["resumed_from"] == 3 and summary["step"] == summary["total_steps"]
    assert not list(ckpts.glob(".tmp-*"))
    # One id space: the resumed ledger spans the whole run, its first 3 steps committed.
    start = [json.loads(x) for x in (run_dir / "events.log").read_text().splitlines()
             if '"event": "start"' in x][-1]
    assert start["committed_before"] == 3 * 2 and start["batches"] == summary["total_steps"] * 2
    cfg = small_config(cache_dir, tmp_path / "ref", "2-2", *RESUME_LEN)
    ref = train_reference(cfg, progress=False)
    assert_same_weights(final_weights(run_dir), ref.state_dict)
    assert losses(run_dir) == ref.losses[3:]


@pytest.mark.chaos      # make chaos, for time: make test keeps a cheaper case of each path
def test_sigterm_checkpoints_promptly_and_resumes(cache_dir, tmp_path):
    run_dir = tmp_path / "run"
    sup = _launch(cache_dir, run_dir)
    try:
        end = time.monotonic() + 240
        while time.monotonic() < end:
            st = read_status(run_dir)
            if st and st["batches"]["committed"] >= 8:
                break
            assert sup.poll() is None, sup.communicate()
            time.sleep(0.05)
        os.kill(sup.pid, signal.SIGTERM)
        t0 = time.monotonic()
        out, err = sup.communicate(timeout=60)
        stop_s = time.monotonic() - t0
    finally:
        sup.kill()
    assert sup.returncode == 130, err[-2000:]
    events = [json.loads(x) for x in (run_dir / "events.log").read_text().splitlines()]
    assert not [e for e in events if e["event"] == "escalate"], "an actor had to be forced to stop"
    assert stop_s < 20
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["result"] == "SIGTERM" and latest_checkpoint(run_dir).name == f"step-{summary['step']:07d}"
    resumed = _launch(cache_dir, run_dir, resume=True)
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-2000:]
    ref = train_reference(small_config(cache_dir, tmp_path / "ref", "2-2", *RESUME_LEN), progress=False)
    assert_same_weights(final_weights(run_dir), ref.state_dict)


def test_untrustworthy_optimizer_state_rolls_back_to_the_last_checkpoint(cache_dir, tmp_path):
    # 1-1: the topology does not matter here, and two attempts of 4 actors start sooner than of 6
    cfg = small_config(cache_dir, tmp_path / "run", "1-1", "train.epochs=3", "train.checkpoint_every=3")
    job = new_job(cfg, progress=False)
    struck = {}

    def strike():
        end = time.monotonic() + 240
        while steps_done(job) < 5 and time.monotonic() < end:
            time.sleep(0.02)
        pid = read_status(tmp_path / "run")["actors"]["optimizer.0"]["pid"]
        os.kill(pid, signal.SIGSTOP)            # no step may land between corruption and kill
        weights = job.shared.weights
        weights.weights[:, :8] = float("nan")  # both buffers: whichever is committed is bad
        os.kill(pid, signal.SIGKILL)
        struck["at_step"] = weights.version

    t = threading.Thread(target=strike, daemon=True)
    t.start()
    result = job.run()
    t.join(5)
    assert struck, "the strike never happened"
    assert result.exit_code == 0, result.reason
    events = [json.loads(x) for x in (tmp_path / "run" / "events.log").read_text().splitlines()]
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert len(rollbacks) == 1 and "non-finite" in rollbacks[0]["reason"]
    assert rollbacks[0]["to"] == f"step-{result.summary['resumed_from']:07d}"
    assert result.summary["rollbacks"] == 1
    raised = [e for e in events if e["event"] == "raise"]
    assert [e["actor"] for e in raised] == ["optimizer.0"] and "RollbackRequired" in raised[0]["reason"]
    assert 3 <= result.summary["resumed_from"] <= struck["at_step"]
    ref = train_reference(cfg, progress=False)
    assert_same_weights(final_weights(tmp_path / "run"), ref.state_dict)
    assert losses(tmp_path / "run") == ref.losses[result.summary["resumed_from"]:]


def test_optimizer_killed_mid_checkpoint_writes_it_after_restart(cache_dir, tmp_path, monkeypatch):
    # The periodic checkpoint is written after the step's commit, while the drafters go
    # on; a kill there must not lose it: the replacement writes it before its next step.
    for k, v in SLOW_CHECKPOINTS.items():
        monkeypatch.setenv(k, v)       # the spawned actors start with this environment
    run_dir = tmp_path / "run"
    cfg = small_config(cache_dir, run_dir, "2-2", "train.checkpoint_every=3")
    job = Job(cfg, progress=False)   # its own fork server: started after the setenv above, so its actors see it
    killed = {}

    def kill_mid_write():
        end = time.monotonic() + 240
        while time.monotonic() < end and not list((run_dir / "checkpoints").glob(".tmp-step-0000003-*")):
            time.sleep(0.02)
        killed["pid"] = read_status(run_dir)["actors"]["optimizer.0"]["pid"]
        os.kill(killed["pid"], signal.SIGKILL)

    t = threading.Thread(target=kill_mid_write, daemon=True)
    t.start()
    result = job.run()
    t.join(5)
    assert killed, "the checkpoint write was never seen"
    assert result.exit_code == 0, result.reason
    assert result.summary["restarts_by_actor"] == {"optimizer.0": 1}
    names = [p.name for p in (run_dir / "checkpoints").iterdir()]
    assert "step-0000003" in names and not [n for n in names if n.startswith(".tmp")]
    assert load_trainer_state(run_dir / "checkpoints" / "step-0000003")["next_batch"] == 3 * 2
    ref = train_reference(cfg, progress=False)
    assert_same_weights(final_weights(run_dir), ref.state_dict)
    assert losses(run_dir) == ref.losses
