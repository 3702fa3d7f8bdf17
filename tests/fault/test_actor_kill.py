"""kill -9 of every role mid-batch, many times in one run: nothing lost, nothing twice."""

import random

import pytest

from dflash_actors.runtime.outcome import JobState
from tests.support.runtime import Striker, assert_exactly_once, events, runtime
from tests.support.toy import toy_job


def _kill_run(tmp_path, plan, n, **job):
    sup, results = toy_job(runtime(tmp_path, max_restarts=len(plan)), n_batches=n, **job)
    striker = Striker(sup, plan)
    striker.start()
    result = sup.run()
    striker.join(5)
    assert striker.error is None, striker.error
    return sup, results, result, striker


def test_kill9_each_role_mid_batch_twice(tmp_path):
    plan = ["loader.0", "target.0", "drafter.0"] * 2
    sup, results, result, striker = _kill_run(tmp_path, plan, n=120, stages=3, work_s=0.03)
    assert [s["actor"] for s in striker.strikes] == plan, "the job ended before every kill landed"
    assert result.state is JobState.DONE
    assert result.committed == list(range(120))   # one ordered drafter: exact order, no gap, no repeat
    assert_exactly_once(sup, results, result, 120)
    assert result.restarts == {"loader.0": 2, "target.0": 2, "drafter.0": 2}
    died = events(tmp_path / "run", "died")
    assert [d["actor"] for d in died] == plan
    assert all(d["reason"] == "killed by SIGKILL" for d in died)
    for strike, d in zip(striker.strikes, died):
        # The batch in hand at death went back (or, if it committed in the last instant, was settled).
        assert strike["at_death"] is not None, "the successor wrote its row before the striker read it"
        assert strike["at_death"] == -1 or strike["at_death"] in d["put_back"] + d["settled"]
    assert any(d["put_back"] for d in died)


def test_kill9_producer_and_consumer_of_two_stage_ring(tmp_path):
    plan = ["drafter.0", "loader.0", "drafter.0", "loader.0"]
    sup, results, result, striker = _kill_run(tmp_path, plan, n=100, stages=2, work_s=0.03)
    assert len(striker.strikes) == len(plan)
    assert result.state is JobState.DONE and result.committed == list(range(100))
    assert_exactly_once(sup, results, result, 100)


@pytest.mark.chaos
def test_chaos_random_kills_with_parallel_actors(tmp_path):
    rng = random.Random(1234)
    roles = ["loader.0", "target.0", "target.1", "drafter.0", "drafter.1"]
    plan = [rng.choice(roles) for _ in range(25)]
    sup, results = toy_job(runtime(tmp_path, max_restarts=30, restart_window_s=600), n_batches=1500, stages=3,
                  work_s=0.02, n_targets=2, n_drafters=2)
    striker = Striker(sup, plan, wait_replacement=False, timeout=120)
    striker.start()
    result = sup.run()
    striker.join(5)
    assert striker.error is None, striker.error
    assert len(striker.strikes) == len(plan)
    assert result.state is JobState.DONE
    assert_exactly_once(sup, results, result, 1500)
    for j in range(2):
        assert [b for b in result.committed if b % 2 == j] == list(range(j, 1500, 2))
