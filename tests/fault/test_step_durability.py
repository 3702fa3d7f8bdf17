"""Drafters killed mid-step, under both ``runtime.grad_durability`` modes. With ``step``
they lose their running sums: the supervisor makes those batches again from the loader
on (through rings that later batches keep full, so they take slots back). With ``batch``
the replacement continues from the sum in shared memory. Either way the run ends bit for
bit on the reference."""

import json

import pytest

from dflash_actors.job.reference import train_reference
from tests.support.pipeline import assert_same_weights, final_weights, losses, new_job, small_config

# 1-2 with grad_accum 3: a step is 6 batches, drafter j sums 6s+j, 6s+j+2, 6s+j+4.
EXTRA = ("data.synthetic.num_samples=384", "train.grad_accum=3", "runtime.batch_slots=2", "runtime.feature_slots=2")
KILLS = [("drafter.0", 10), ("drafter.1", 15), ("drafter.0", 26), ("drafter.1", 35)]


@pytest.mark.chaos
@pytest.mark.parametrize("durability", ["step", "batch"])
def test_drafters_killed_mid_step_end_bit_identical(cache_dir, tmp_path, durability):
    ref = train_reference(small_config(cache_dir, tmp_path / "ref", "1-2", *EXTRA), progress=False)
    assert ref.steps >= 7
    run = tmp_path / "run"
    faults = [{"actor": a, "at_batch": b, "kind": "sigkill"} for a, b in KILLS]
    job = new_job(small_config(cache_dir, run, "1-2", *EXTRA, "runtime.max_restarts=10",
                           f"runtime.grad_durability={durability}", ("runtime.faults", faults)), progress=False)
    result = job.run()
    assert result.exit_code == 0, result.reason
    assert sorted(result.committed) == list(range(ref.steps * 6))
    assert losses(run) == ref.losses
    assert_same_weights(final_weights(run), ref.state_dict)
    events = [json.loads(x) for x in (run / "events.log").read_text().splitlines()]
    died = [e for e in events if e["event"] == "died"]
    assert [(e["actor"]) for e in died] == [a for a, _ in KILLS]
    if durability == "batch":
        assert not any("redone" in e for e in died) and not any(e["event"] == "evicted" for e in events)
        return
    # Each died before its batch b: the batches of its step before b were redone.
    for e, (_, b) in zip(died, KILLS):
        step_first = b - b % 6 + b % 2
        assert e["redone"] == list(range(step_first, b, 2)), e
    # With two slots per ring, the batches made after the dead drafter's sat in them.
    assert any(e["event"] == "evicted" for e in events)
