"""A drafter holds the next step's batch before the optimizer has published its weights,
and waits for them on shared memory (``Stage.early``, ``Drafter.ready``). Faults while
it waits: the optimizer hung (killed by the hang check, its step redone), the optimizer
killed halfway through publishing, and the waiting drafter itself killed. The run
ends bit for bit on the reference, and the drafter, beating while it waits, is never
taken for hung."""

import json

from dflash_actors.job.reference import train_reference
from tests.support.pipeline import assert_same_weights, final_weights, losses, new_job, small_config

# grad_accum 1 and one drafter: every batch is a step, so the drafter waits at every one.
EXTRA = ("train.grad_accum=1", "runtime.hang_timeout_s=5")
FAULTS = [
    # The optimizer hangs before step 10: the drafter, holding batch 11, waits for v11.
    {"actor": "optimizer.0", "at_batch": 10, "kind": "hang", "at": "work"},
    # ... and is killed there; its replacement gets batch 11 back and waits again.
    {"actor": "drafter.0", "at_batch": 11, "kind": "sigkill", "at": "wait"},
    # Later the optimizer dies with step 14's weights half written, the drafter waiting.
    {"actor": "optimizer.0", "at_batch": 14, "kind": "sigkill", "at": "publish"},
]


def test_faults_while_the_drafter_waits_for_weights_end_bit_identical(cache_dir, tmp_path):
    ref = train_reference(small_config(cache_dir, tmp_path / "ref", "1-1", *EXTRA), progress=False)
    assert ref.steps > 15
    run = tmp_path / "run"
    job = new_job(small_config(cache_dir, run, "1-1", *EXTRA, "runtime.max_restarts=10",
                               ("runtime.faults", FAULTS)), progress=False)
    result = job.run()
    assert result.exit_code == 0, result.reason
    assert sorted(result.committed) == list(range(ref.steps))
    assert losses(run) == ref.losses
    assert_same_weights(final_weights(run), ref.state_dict)
    events = [json.loads(x) for x in (run / "events.log").read_text().splitlines()]
    assert [e["actor"] for e in events if e["event"] == "hang"] == ["optimizer.0"]
    died = [e for e in events if e["event"] == "died"]
    assert [e["actor"] for e in died] == ["drafter.0", "optimizer.0", "optimizer.0"]
    # The drafter died holding batch 11, not yet trained: put back, then trained once.
    assert died[0]["put_back"] == [11] and died[0]["settled"] == []
    assert died[1]["put_back"] == [10] and died[2]["put_back"] == [14]
