"""An actor that raises on start: restarted max_restarts times, then the job stops with
one line naming the actor, the exception and where it was raised, and exits non-zero."""

import subprocess
import sys

from tests.support.runtime import ROOT, events


def test_raise_on_start_stops_the_job_after_max_restarts(tmp_path):
    run_dir = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "tests.support.toy", "--run-dir", str(run_dir),
                        "--batches", "20", "--fail-on-start", "target", "--set", "runtime.max_restarts=2",
                        "--set", "runtime.restart_window_s=120"],
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 1, p.stderr
    err = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1, p.stderr
    line = err[0]
    assert "target.0" in line and "max_restarts=2" in line
    assert "RuntimeError: toy target.0 told to fail on start (toy.py:" in line and "in attach)" in line
    assert len(events(run_dir, "spawn")) == 3 + 2       # three actors, two restarts of target.0
    give_up = events(run_dir, "give_up")
    assert len(give_up) == 1 and give_up[0]["actor"] == "target.0"
    tb = events(run_dir, "actor_error")[-1]["traceback"]
    assert "Traceback (most recent call last)" in tb and "told to fail on start" in tb
    assert events(run_dir, "end")[0]["state"] == "failed"
