"""Micro-batched drafters (``train.drafter_block_tokens``, with checkpointed layers) under a
kill -9 and a stop-and-resume: the pipeline still equals the reference bit for bit, and
the micro-batches did run (the whole-batch arithmetic differs at float rounding)."""


import pytest

import launch
from dflash_actors.job.job import Job
from dflash_actors.job.reference import train_reference
from tests.support.pipeline import assert_same_weights, final_weights, losses, run_until_stopped, small_config

# Default config: block 8, 32 anchors a row (256 block tokens), rows of up to ~190 tokens:
# two rows a micro-batch, about eight of them a batch (tests/unit/test_drafter_step.py
# cuts rows apart too).
MICRO = ("train.drafter_block_tokens=512", "train.checkpoint_layers=on")
LEN = ("train.epochs=3", "train.grad_accum=2", "train.checkpoint_every=2")


def test_micro_batches_survive_a_kill_and_a_resume_bit_for_bit(cache_dir, tmp_path):
    run_dir = tmp_path / "run"
    kill = ("runtime.faults", [{"actor": "drafter.1", "at_batch": 5, "kind": "sigkill"}])
    cfg = small_config(cache_dir, run_dir, "1-2", *LEN, *MICRO, kill)
    job = Job(cfg, progress=False)
    first = run_until_stopped(job, 4)
    assert first.exit_code == 130, first.reason
    assert first.summary["restarts_by_actor"] == {"drafter.1": 1}
    assert 4 <= first.summary["step"] < job.schedule.total_steps
    assert launch.main(["--resume", str(run_dir)]) == 0

    ref = train_reference(small_config(cache_dir, tmp_path / "ref", "1-2", *LEN, *MICRO), progress=False)
    assert_same_weights(final_weights(run_dir), ref.state_dict)
    assert losses(run_dir) == ref.losses[first.summary["step"]:]
    whole = train_reference(small_config(cache_dir, tmp_path / "whole", "1-2", *LEN), progress=False)
    assert whole.losses != ref.losses
    assert whole.losses == pytest.approx(ref.losses, rel=1e-4)
