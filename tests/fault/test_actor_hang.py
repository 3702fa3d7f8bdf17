"""SIGSTOP: an actor alive but silent is detected within hang_timeout_s and replaced;
before Ready, an actor is hung only when its start-up has shown no progress for
start_timeout_s, however long the whole start takes."""

import signal

from dflash_actors.runtime.outcome import JobState
from tests.support.runtime import Striker, assert_exactly_once, events, runtime
from tests.support.toy import toy_job

HANG_S = 4.0


def test_sigstopped_target_is_killed_and_replaced(tmp_path):
    sup, results = toy_job(runtime(tmp_path, hang_timeout_s=HANG_S), n_batches=150, stages=3, work_s=0.02)
    striker = Striker(sup, ["target.0"], sig=signal.SIGSTOP)
    striker.start()
    result = sup.run()
    striker.join(5)
    assert striker.error is None, striker.error
    assert len(striker.strikes) == 1
    assert result.state is JobState.DONE
    assert_exactly_once(sup, results, result, 150)
    hangs = events(tmp_path / "run", "hang")
    assert [h["actor"] for h in hangs] == ["target.0"], "a healthy actor was called hung, or none was"
    waited = hangs[0]["mono"] - striker.strikes[0]["mono"]
    # Not before the timeout, and within it plus scheduling slack on a loaded machine.
    assert HANG_S - 0.5 <= waited <= HANG_S + 3.0, waited
    died = events(tmp_path / "run", "died")
    assert len(died) == 1 and died[0]["reason"].startswith("hung: no heartbeat")
    assert result.restarts["target.0"] == 1


def test_slow_step_that_beats_is_not_a_hang(tmp_path):
    # Each item takes longer than hang_timeout_s, but the toy actors beat while working.
    sup, results = toy_job(runtime(tmp_path, hang_timeout_s=1.0), n_batches=3, stages=2, work_s=1.5)
    result = sup.run()
    assert result.state is JobState.DONE
    assert not events(tmp_path / "run", "hang")


def test_a_start_that_counts_outlives_start_timeout_and_a_silent_one_does_not(tmp_path):
    """Gangs of 2 whose load takes 2.4 s against a 1.2 s start_timeout_s: counting every
    0.2 s, the gang starts once and the job ends; silent, it is killed as hung (and,
    silent at every start, given up on as a crash loop)."""
    sup, results = toy_job(runtime(tmp_path / "counts", start_timeout_s=1.2), n_batches=20, target_gang=2,
                           target_start_s=2.4)
    result = sup.run()
    assert result.state is JobState.DONE, result.reason
    assert_exactly_once(sup, results, result, 20)
    assert not events(tmp_path / "counts" / "run", "hang")

    sup, _ = toy_job(runtime(tmp_path / "silent", start_timeout_s=1.2, max_restarts=1), n_batches=20,
                     target_gang=2, target_start_s=2.4, target_start_counts=False)
    result = sup.run()
    assert result.state is JobState.FAILED
    hangs = events(tmp_path / "silent" / "run", "hang")
    assert hangs and all(h["actor"] == "target.0" and "no start-up progress" in h["reason"] for h in hangs)
