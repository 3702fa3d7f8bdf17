"""The run directory at launch: one job at a time, unusable directories refused before
anything is written, and resumes that build on the run's own config.yaml and pass over
damaged checkpoints."""

import contextlib
import dataclasses
import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

import launch
from dflash_actors.actors.optimizer import RollbackRequired
from dflash_actors.config import dump_config
from dflash_actors.job import job as pipeline
from dflash_actors.job.reference import train_reference
from dflash_actors.job.rundir import LOCK_FILE, RunDirLock
from dflash_actors.models.drafter import WEIGHTS
from dflash_actors.runtime.channels import Ring
from dflash_actors.runtime.outcome import JobResult, JobState
from dflash_actors.train.checkpoint import (
    MANIFEST,
    checkpoint_problem,
    latest_checkpoint,
    list_checkpoints,
    save_checkpoint,
)
from tests.support.pipeline import ROOT, SMALL, assert_same_weights, final_weights, new_job, small_config
from tests.support.runtime import all_gone

FAST = ("train.num_threads=1", "train.checkpoint_every=2")


def sets(cache_dir, *extra) -> list[str]:
    out = []
    for kv in [*SMALL, f"data.cache_dir={cache_dir}", *FAST, *extra]:
        out += ["--set", kv]
    return out


def launch_main(argv) -> tuple[int, list[str]]:
    """``launch.main`` in this process; its exit code and its stderr lines but progress bars."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = launch.main(argv)
    return code, [line for line in err.getvalue().strip().splitlines() if "%|" not in line]


def wait_for(cond, what: str, proc=None, timeout: float = 240):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        assert proc is None or proc.poll() is None, f"the job ended before {what}"
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def flip_data_byte(path):
    """Flip one byte in the tensor data of a safetensors file: it still loads, wrongly."""
    raw = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")
    raw[(start + len(raw)) // 2] ^= 0x40
    path.write_bytes(bytes(raw))


def dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout)


@pytest.fixture(scope="module")
def killed_run(cache_dir, tmp_path_factory):
    """``--resume`` of a directory holding only config.yaml (a job killed before its first
    checkpoint), watched while it holds the directory, killed with kill -9 once its
    second checkpoint exists. Returns the run directory and what was seen."""
    run_dir = tmp_path_factory.mktemp("killed") / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(dump_config(small_config(cache_dir, run_dir, "1-1", *FAST)))
    err_path = run_dir.parent / "stderr"
    lock = str(run_dir / LOCK_FILE)
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "launch.py", "--resume", str(run_dir)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=err)
    seen = {"pid": proc.pid}
    try:
        wait_for(lambda: (run_dir / LOCK_FILE).is_file() and (run_dir / LOCK_FILE).read_text() == f"{proc.pid}\n",
                 "the lock", proc)
        # A second job while the first one's actors are still starting.
        seen["second"] = launch_main(["--run-dir", str(run_dir), "--topology", "1-1", *sets(cache_dir)])
        status = run_dir / "status.json"
        wait_for(lambda: status.is_file() and all(a["state"] in ("idle", "working")
                                                  for a in json.loads(status.read_text())["actors"].values()),
                 "the actors", proc)
        children = psutil.Process(proc.pid).children(recursive=True)
        seen["children"] = len(children)
        seen["holders"] = [p.pid for p in [psutil.Process(proc.pid), *children]
                           if lock in [f.path for f in p.open_files()]]
        wait_for(lambda: (run_dir / "checkpoints" / "step-0000004").is_dir(), "the second checkpoint", proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        relock = RunDirLock(run_dir)
        relock.acquire()        # at once: nothing but the dead parent ever held it
        relock.release()
        seen["relocked"] = True
        assert all_gone([c.pid for c in children], within_s=10), "an actor outlived its supervisor"
    finally:
        proc.kill()
        proc.wait()
    seen["stderr"] = err_path.read_text().splitlines()
    return run_dir, seen


def test_a_second_job_on_a_held_run_dir_exits_2_naming_the_holder(killed_run):
    _, seen = killed_run
    code, err = seen["second"]
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: runtime.run_dir: ") and f"in use by another job (pid {seen['pid']})" in err[0]


def test_the_lock_is_the_parents_alone_and_dies_with_it(killed_run):
    _, seen = killed_run
    assert seen["children"] >= 4        # the four actors (and the resource tracker)
    assert seen["holders"] == [seen["pid"]], "an actor inherited the run directory's lock"
    assert seen["relocked"]


def test_resume_before_the_first_checkpoint_starts_over_and_says_so(killed_run):
    run_dir, seen = killed_run
    said = [line for line in seen["stderr"] if line.startswith("--resume:")]
    assert said == [f"--resume: {run_dir} has no checkpoint yet (its job stopped before the first); "
                    "starting it from the beginning"], seen["stderr"]
    assert list_checkpoints(run_dir)[0].name == "step-0000002"


def test_resume_reuses_config_yaml_and_falls_back_past_a_damaged_checkpoint(killed_run, cache_dir, tmp_path):
    """Only ``--resume RUN_DIR`` (plus a resume-free override): the saved config.yaml
    supplies the rest. The newest checkpoint has a flipped byte in its tensor data; the
    resume passes over it, saying so, and ends bit-identical to an uninterrupted run.
    A temporary directory a killed writer left behind is gone afterwards."""
    run_dir = tmp_path / "run"
    shutil.copytree(killed_run[0], run_dir)
    *_, previous, newest = list_checkpoints(run_dir)
    flip_data_byte(newest / WEIGHTS)
    leftover = run_dir / "checkpoints" / f".tmp-step-0000006-{dead_pid()}"
    leftover.mkdir()
    (leftover / "config.json").write_text("{")
    code, err = launch_main(["--resume", str(run_dir), "--set", "runtime.grace_s=4"])
    assert code == 0, err[-5:]
    skipped = [line for line in err if line.startswith("skipping")]
    assert skipped == [f"skipping checkpoint {newest.name}: {WEIGHTS} does not match its checksum; "
                       f"resuming from {previous.name}"], err
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["resumed_from"] == int(previous.name.split("-")[1]) and saved["step"] == saved["total_steps"]
    config = (run_dir / "config.yaml").read_text()
    assert "grace_s: 4.0" in config and "num_samples: 128" in config
    names = [p.name for p in (run_dir / "checkpoints").iterdir()]
    assert not [n for n in names if n.startswith(".tmp")], names
    assert all(checkpoint_problem(p) is None for p in list_checkpoints(run_dir))   # the damaged one rewritten
    ref = train_reference(small_config(cache_dir, tmp_path / "ref", "1-1", *FAST), progress=False)
    assert_same_weights(final_weights(run_dir), ref.state_dict)


@pytest.mark.parametrize("given,refused", [(["--set", "train.lr=0.01"], "train.lr"),
                                           (["--config", str(ROOT / "configs/default.yaml")],
                                            "data.synthetic.num_samples")])
def test_flags_given_at_resume_apply_over_config_yaml(killed_run, tmp_path, given, refused):
    """Given flags override the saved config, and the math check still applies to them."""
    run_dir = tmp_path / "run"
    shutil.copytree(killed_run[0], run_dir)
    code, err = launch_main(["--resume", str(run_dir), *given])
    assert code == 2 and len(err) == 1 and "resume refused" in err[0] and refused in err[0], err


def test_resume_with_no_checkpoint_that_verifies_exits_2(killed_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(killed_run[0], run_dir)
    for ckpt in list_checkpoints(run_dir):
        flip_data_byte(ckpt / WEIGHTS)
    code, err = launch_main(["--resume", str(run_dir)])
    assert code == 2 and len(err) == 1 and "no checkpoint under" in err[0] and "verifies" in err[0], err
    assert err[0].count("does not match its checksum") == len(list_checkpoints(run_dir))


def test_a_full_disk_at_the_final_checkpoint_exits_1_keeping_the_previous(killed_run, cache_dir, tmp_path,
                                                                         monkeypatch, capsys):
    """The attempt is stood in for by one optimizer step (no actors): what is tested is
    the job's decision when its final checkpoint cannot be written."""
    run_dir = tmp_path / "run"
    shutil.copytree(killed_run[0], run_dir)
    job = new_job(small_config(cache_dir, run_dir, "1-1", *FAST), resume=True, progress=False)
    start = job.start.version

    def one_step():
        job.shared.weights.publish(start + 1, list(job.start.model.parameters()), None, None)
        return JobResult(JobState.DONE, "finished")

    def disk_full(run_dir, step, write_drafter, trainer_state):
        def write_then_fail(d):
            write_drafter(d)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return save_checkpoint(run_dir, step, write_then_fail, trainer_state)

    monkeypatch.setattr(job, "_attempt", one_step)
    monkeypatch.setattr(pipeline, "save_checkpoint", disk_full)
    result = job.run()
    assert result.exit_code == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert err == [f"error: final checkpoint (step {start + 1}) not written: No space left on device; "
                   f"the newest checkpoint is step-{start:07d}"], err
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp")] == []
    assert latest_checkpoint(run_dir).name == f"step-{start:07d}"
    relock = RunDirLock(run_dir)
    relock.acquire()        # run released it
    relock.release()


def test_a_rollback_passes_over_a_damaged_checkpoint(killed_run, cache_dir, tmp_path, monkeypatch, capsys):
    """The attempts are stood in for (no actors): the first ends needing a rollback,
    by which time the newest checkpoint has been damaged; the job rolls back past it."""
    run_dir = tmp_path / "run"
    shutil.copytree(killed_run[0], run_dir)
    *_, previous, newest = list_checkpoints(run_dir)
    job = new_job(small_config(cache_dir, run_dir, "1-1", *FAST), resume=True, progress=False)
    assert job.start.checkpoint == newest
    results = [JobResult(JobState.FAILED, "stopped", raised=RollbackRequired("optimizer state inconsistent")),
               JobResult(JobState.DONE, "finished")]

    def attempt():
        if len(results) == 2:
            flip_data_byte(newest / WEIGHTS)
        return results.pop(0)
    monkeypatch.setattr(job, "_attempt", attempt)
    assert job.run().exit_code == 0
    assert job.start.checkpoint == previous and job.shared.weights.version == int(previous.name.split("-")[1])
    events = [json.loads(x) for x in (run_dir / "events.log").read_text().splitlines()]
    assert [e["to"] for e in events if e["event"] == "rollback"] == [previous.name]
    err = capsys.readouterr().err.splitlines()
    assert f"skipping checkpoint {newest.name}: {WEIGHTS} does not match its checksum; " \
           f"resuming from {previous.name}" in err, err


def test_a_rollback_runs_on_the_first_attempts_rings(cache_dir, tmp_path, monkeypatch):
    """A dropped CUDA ring is not freed (its consumers never release their IPC counts):
    the attempt after a rollback must get the same rings, the GPU one included, not new
    ones. Stood in for: the feature ring's CUDA memory (host memory under a cuda spec)
    and the supervisor (no actors)."""
    job = new_job(small_config(cache_dir, tmp_path / "run", "1-1", *FAST), progress=False)
    job.pre = dataclasses.replace(job.pre, devices=dataclasses.replace(job.pre.devices, features="cuda:0"))
    allocated, given = [], []
    on_host = Ring.allocate

    def allocate(spec):
        ring = Ring(spec, on_host(dataclasses.replace(spec, device="cpu")).tensors)
        allocated.append(ring)
        return ring
    monkeypatch.setattr(Ring, "allocate", allocate)
    results = [JobResult(JobState.FAILED, "stopped", raised=RollbackRequired("optimizer state inconsistent")),
               JobResult(JobState.DONE, "finished")]

    class Supervisor:
        def __init__(self, runtime, stages, rings, n_batches, **kw):
            given.append(list(rings))
            self.work_times = torch.zeros(n_batches, len(stages), dtype=torch.float64)

        def request_failure(self, reason):
            pass

        def run(self):
            return results.pop(0)
    monkeypatch.setattr(pipeline, "Supervisor", Supervisor)
    assert job.run().exit_code == 0
    assert [r.spec.device for r in allocated] == ["cpu", "cuda:0"]
    assert len(given) == 2 and all(a is b for a, b in zip(given[1], given[0], strict=True))
    assert all(a is b for a, b in zip(given[0], allocated, strict=True))


def test_a_checkpoint_from_before_manifests_is_resumed_with_a_warning(killed_run, cache_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(killed_run[0], run_dir)
    for ckpt in list_checkpoints(run_dir):
        (ckpt / MANIFEST).unlink()
    newest = list_checkpoints(run_dir)[-1]
    job = new_job(small_config(cache_dir, run_dir, "1-1", *FAST), resume=True, progress=False)
    job.lock.release()
    assert job.start.checkpoint == newest
    err = capsys.readouterr().err.splitlines()
    assert err == [f"warning: checkpoint {newest.name} has no {MANIFEST} (written before checksums); "
                   "resuming from it unverified"], err


def test_unusable_run_dirs_exit_2_writing_nothing(cache_dir, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("keep")
    for run_dir, expected in [(a_file, f"{a_file} is a file, not a directory"),
                              (a_file / "run", f"{a_file} is a file, not a directory")]:
        code, err = launch_main(["--run-dir", str(run_dir), *sets(cache_dir)])
        assert code == 2 and err == [f"error: runtime.run_dir: {expected}"], err
    assert a_file.read_text() == "keep"
    for resume, expected in [(a_file, "is a file, not a run directory"), (tmp_path / "none", "does not exist")]:
        code, err = launch_main(["--resume", str(resume)])
        assert code == 2 and len(err) == 1 and expected in err[0], err


@contextlib.contextmanager
def read_only(path):
    """``path`` unwritable for this user: no write permission, or for root (whom
    permissions do not stop) the immutable attribute."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)
        return
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
        pytest.skip("running as root without chattr +i: no way to make a directory unwritable")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.mark.parametrize("resume", [False, True])
def test_a_read_only_run_dir_exits_2_writing_nothing(cache_dir, tmp_path, resume):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(dump_config(small_config(cache_dir, run_dir, "1-1", *FAST)))
    argv = ["--resume", str(run_dir)] if resume else ["--run-dir", str(run_dir), *sets(cache_dir)]
    with read_only(run_dir):
        code, err = launch_main(argv)
    assert code == 2 and err == [f"error: runtime.run_dir: {run_dir} is not writable"], err
    assert [p.name for p in run_dir.iterdir()] == ["config.yaml"]


def test_a_corrupt_init_from_config_is_named(cache_dir, tmp_path):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text('{"hidden_size": 64,')
    (drafter / WEIGHTS).write_bytes(b"")
    code, err = launch_main(["--run-dir", str(tmp_path / "run"), *sets(cache_dir, f"drafter.init_from={drafter}")])
    assert code == 2 and len(err) == 1 and f"{drafter / 'config.json'}: not readable as JSON" in err[0], err
    assert not (tmp_path / "run").exists()
