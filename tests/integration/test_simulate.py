"""Simulated compute: the models are waits, every byte and message is real, and the
trace shows every actor."""

import json
import subprocess
import sys

import torch

from dflash_actors.runtime import trace
from dflash_actors.train.simulate import stamp, stamp_problem
from tests.support.pipeline import new_job, small_config

WIDTH = 96


def test_simulated_run_moves_real_bytes_and_traces_every_actor(cache_dir, tmp_path):
    cfg = small_config(cache_dir, tmp_path / "run", "2-2", "runtime.simulate.enabled=true",
                       "runtime.simulate.target_us_per_token=2", "runtime.simulate.drafter_ms_per_batch=1",
                       f"runtime.simulate.feature_width={WIDTH}", "runtime.trace=true", "runtime.trace_batches=1000")
    job = new_job(cfg, progress=False)
    result = job.run()
    assert result.exit_code == 0, result.reason     # each drafter checked each batch's stamps
    n = job.schedule.total_batches
    assert sorted(result.committed) == list(range(n))
    spans = trace.load(tmp_path / "run" / trace.TRACE_FILE)
    tracks = {s["track"] for s in spans if s["name"] == "work"}
    # Every actor that worked has its track. (Which targets work is a race: with targets
    # this cheap, one that starts late may find every batch already taken.)
    status = json.loads((tmp_path / "run" / "status.json").read_text())["actors"]
    worked = {a for a, st in status.items() if st["progress"]["done"]}
    assert tracks == worked and {"loader.0", "drafter.0", "drafter.1", "optimizer.0"} <= worked
    assert worked & {"target.0", "target.1"}
    assert any(s["track"] == "supervisor" and s["name"] == "dispatch" for s in spans)
    # Every batch's features went through a slot at the configured width, once.
    tokens = job.shared.batch_stats[:, 4]
    copies = [s for s in spans if s["name"] == "feature copy"]
    assert sorted(s["args"]["batch"] for s in copies) == list(range(n))
    assert sum(s["args"]["bytes"] for s in copies) == int(tokens.sum()) * WIDTH * 4
    assert sum(1 for s in spans if s["name"] == "publish") == job.schedule.total_steps
    # The gradients really moved: every step's published weights differ from the last.
    assert job.shared.weights.version == job.schedule.total_steps


def test_a_stamp_from_another_batch_is_caught():
    f = torch.zeros(10, 4)
    stamp(f, 7, 3)
    assert stamp_problem(f, 7, 3) is None
    assert "expected 4" in stamp_problem(f, 7, 4)
    stamp(f, 7, 3 + 251)          # same stamp modulo 251: indistinguishable, by design
    assert stamp_problem(f, 7, 3) is None


def test_a_simulated_target_starts_without_transformers():
    """Importing transformers costs seconds of every (re)start; a simulated target
    has no model, so its module must not pull it in."""
    code = "import sys, dflash_actors.actors.target; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
