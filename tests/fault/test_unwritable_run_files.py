"""A run file that stops being writable while the job runs (here a directory put at its
path; a full disk fails the same writes) stops the job: exit 1 with one line naming the
file, the final checkpoint written, no actor left. Once the path is writable again,
``--resume`` continues, and the run ends bit-identical to the reference."""

import json
import os
import signal
import threading
import time

import psutil

from dflash_actors.job.reference import train_reference
from dflash_actors.train.checkpoint import latest_checkpoint
from tests.support import shared_server
from tests.support.pipeline import assert_same_weights, final_weights, new_job, small_config
from tests.support.runtime import all_gone

# 81 steps at about 10 a second on 1-1 (2 cores): each stop below costs a second or two of them.
EXTRA = ("train.epochs=9", "train.checkpoint_every=4", "train.num_threads=1")


def version(job) -> int:
    """The newest weight version: steps done since the run began, resumes included."""
    return job.shared.weights.version


def put_directory(path):
    """Move ``path`` aside (returned, to restore) and put an empty directory there; a
    file the job recreates meanwhile is removed again."""
    aside = path.with_name(path.name + ".aside")
    os.replace(path, aside)
    while True:
        try:
            path.mkdir()
            return aside
        except FileExistsError:
            path.unlink()


class Breaker(threading.Thread):
    """Once the job has made two steps, replaces ``path`` by a directory; for events.log,
    which is written only on decisions, then kills the loader, so that one is logged."""

    def __init__(self, job, path):
        super().__init__(daemon=True)
        self.job, self.path = job, path
        self.at_step, self.aside, self.error = None, None, None

    def run(self):
        try:
            mark = version(self.job) + 2
            end = time.monotonic() + 120
            while version(self.job) < mark:
                assert time.monotonic() < end, "no progress"
                time.sleep(0.02)
            status = json.loads((self.path.parent / "status.json").read_text())
            self.at_step = version(self.job)
            self.aside = put_directory(self.path)
            if self.path.name == "events.log":
                os.kill(status["actors"]["loader.0"]["pid"], signal.SIGKILL)
        except Exception as e:   # noqa: BLE001 - reported by the test
            self.error = e


def descendants() -> list[int]:
    """Pids of this process's descendants but the stdlib's resource tracker and the
    session's fork server (both live as long as we do); the server's actors count."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(p.cmdline()) and p.pid != shared_server.pid():
                out.append(p.pid)
        except psutil.Error:    # gone meanwhile
            pass
    return out


def test_each_run_file_unwritable_mid_run_stops_the_job_and_resume_ends_bit_identical(cache_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    cfg = small_config(cache_dir, run_dir, "1-1", *EXTRA)
    for i, name in enumerate(["events.log", "status.json", "metrics.jsonl"]):
        job = new_job(cfg, resume=i > 0, progress=False)
        first, total = job.start.version, job.schedule.total_steps
        capsys.readouterr()
        breaker = Breaker(job, run_dir / name)
        breaker.start()
        result = job.run()
        breaker.join(10)
        assert breaker.error is None, breaker.error
        assert result.exit_code == 1, (name, result.reason)
        path = run_dir / name
        said = capsys.readouterr().err.splitlines()
        assert not [line for line in said if "Traceback" in line or line.startswith("warning: ")], said
        err = [line for line in said if line.startswith("error: ")]
        assert err == [f"error: cannot write {path}: Is a directory; resume with --resume once it is writable"], err
        stopped = version(job)
        assert first < breaker.at_step <= stopped < total, (name, first, breaker.at_step, stopped)
        assert latest_checkpoint(run_dir).name == f"step-{stopped:07d}"
        assert all_gone(descendants(), within_s=10), "an actor outlived the stopped job"
        path.rmdir()
        os.replace(breaker.aside, path)
    job = new_job(cfg, resume=True, progress=False)
    result = job.run()
    assert result.exit_code == 0, result.reason
    assert result.summary["resumed_from"] == stopped
    ref = train_reference(small_config(cache_dir, tmp_path / "ref", "1-1", *EXTRA), progress=False)
    assert_same_weights(final_weights(run_dir), ref.state_dict)
