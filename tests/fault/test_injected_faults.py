"""``runtime.faults``: every kind of failure injected at a chosen batch, inside the job."""

import json
import math

import pytest

from dflash_actors.job.reference import train_reference
from dflash_actors.runtime.outcome import JobState
from tests.support.pipeline import assert_same_weights, final_weights, losses, new_job, small_config
from tests.support.runtime import assert_exactly_once, runtime
from tests.support.toy import toy_job


def events(run_dir):
    return [json.loads(x) for x in (run_dir / "events.log").read_text().splitlines()]


def faults(*entries):
    return "runtime.faults=[" + ", ".join("{" + ", ".join(f"{k}: {v}" for k, v in e.items()) + "}"
                                          for e in entries) + "]"


# Every kind that ends an actor, at each role and at each fault point, in one 2-2 run
# of 16 batches (checkpoints every 2 steps: the optimizer writes versions 2, 4 and 6).
# A free batch goes to the lowest-numbered free target, so target.1 works only when
# target.0 is busy, which a drafter-bound run may never make it: the kill goes to
# target.0, and the slow fault to target.1, which has the batches while target.0 restarts.
FATAL = [dict(actor="loader.0", at_batch=3, kind="exit"),
         dict(actor="target.0", at_batch=5, kind="sigkill"),
         dict(actor="drafter.0", at_batch=6, kind="exception", at="commit"),
         dict(actor="drafter.1", at_batch=9, kind="hang"),
         dict(actor="optimizer.0", at_batch=11, kind="sigkill", at="publish"),
         dict(actor="optimizer.0", at_batch=9, kind="segfault", at="checkpoint"),
         dict(actor="target.1", at_batch=6, kind="slow")]


def test_every_ending_kind_in_the_generic_runtime_loses_nothing(tmp_path):
    """The cheap form of the test below (toy actors, no model): each kind that ends an
    actor, at both fault points, and every batch still committed exactly once."""
    plan = [dict(actor="loader.0", at_batch=5, kind="exit"),
            dict(actor="target.0", at_batch=10, kind="exception", at="commit"),
            dict(actor="drafter.0", at_batch=15, kind="segfault"),
            dict(actor="target.0", at_batch=20, kind="sigkill", at="commit"),
            dict(actor="drafter.0", at_batch=25, kind="hang"),
            dict(actor="loader.0", at_batch=30, kind="slow")]
    sup, results = toy_job(runtime(tmp_path, hang_timeout_s=2.0, faults=plan), n_batches=40, stages=3,
                           work_s=0.002)
    result = sup.run()
    assert result.state is JobState.DONE, result.reason
    assert_exactly_once(sup, results, result, 40)
    ev = events(tmp_path / "run")
    assert sorted((e["actor"], e["kind"]) for e in ev if e["event"] == "fault") == sorted(
        (f["actor"], f["kind"]) for f in plan)
    died = [(e["actor"], e["reason"]) for e in ev if e["event"] == "died"]
    for actor, cause in [("loader.0", "exit code 3"), ("target.0", "InjectedFault"), ("drafter.0", "SIGSEGV"),
                         ("target.0", "killed by SIGKILL"), ("drafter.0", "hung: no heartbeat")]:
        assert any(a == actor and cause in r for a, r in died), (actor, cause, died)
    assert len(died) == 5


@pytest.mark.chaos     # 7 faults in one 2-2 job, ~110 s here: make chaos (make test has each kind's cheaper kin)
def test_injected_faults_of_every_kind_change_nothing(cache_dir, tmp_path):
    run_dir = tmp_path / "run"
    cfg = small_config(cache_dir, run_dir, "2-2", faults(*FATAL), "train.checkpoint_every=2",
                       "runtime.hang_timeout_s=4")
    result = new_job(cfg, progress=False).run()
    assert result.exit_code == 0, result.reason
    assert sorted(result.committed) == list(range(len(result.committed))) and result.committed
    ev = events(run_dir)
    fired = [(e["actor"], e["kind"], e["at"]) for e in ev if e["event"] == "fault"]
    assert sorted(fired) == sorted((f["actor"], f["kind"], f.get("at", "work")) for f in FATAL), fired
    died = {(e["actor"], e["reason"]) for e in ev if e["event"] == "died"}
    for actor, cause in [("loader.0", "exit code 3"), ("target.0", "killed by SIGKILL"),
                         ("drafter.0", "InjectedFault"), ("drafter.1", "hung: no heartbeat"),
                         ("optimizer.0", "killed by SIGKILL"), ("optimizer.0", "killed by SIGSEGV")]:
        assert any(a == actor and cause in r for a, r in died), (actor, cause, died)
    # The slow actor beat while it dawdled: never taken for hung.
    assert "target.1" not in {a for a, _ in died}
    ref = train_reference(cfg, progress=False)
    assert losses(run_dir) == ref.losses
    assert_same_weights(final_weights(run_dir), ref.state_dict)


def test_non_finite_steps_are_skipped_then_stop_the_job(cache_dir, tmp_path):
    """1-1, one batch per step: a NaN gradient at step 4 is skipped and training goes on;
    a second one at step 5 makes two in a row, over max_bad_steps=1: the job stops with
    the weights of before step 4 (skips change nothing) in its final checkpoint."""
    run_dir = tmp_path / "run"
    cfg = small_config(cache_dir, run_dir, "1-1", "train.max_bad_steps=1",
                       faults(dict(actor="drafter.0", at_batch=4, kind="nan"),
                              dict(actor="drafter.0", at_batch=5, kind="nan")))
    result = new_job(cfg, progress=False).run()
    assert result.exit_code == 1
    assert "NonFiniteStop: 2 steps in a row" in result.reason and "before step 4" in result.reason
    bad = [e for e in events(run_dir) if e["event"] == "bad_step"]
    assert [(e["step"], e["in_a_row"]) for e in bad] == [(4, 1), (5, 2)]
    summary = json.loads((run_dir / "summary.json").read_text(), parse_constant=pytest.fail)
    assert summary["skipped_steps"] == [4, 5] and summary["step"] == 5
    got = losses(run_dir)
    assert len(got) == 6 and all(math.isfinite(x) for x in got)
    ref = train_reference(small_config(cache_dir, tmp_path / "ref", "1-1"), progress=False)
    assert got[:5] == ref.losses[:5]
    # Step 4 changed nothing and step 5 was never published: the final checkpoint, of
    # version 5, holds the weights after the 4 good steps, finite.
    assert summary["checkpoint"].endswith("step-0000005")
    assert all(t.isfinite().all() for t in final_weights(run_dir).values())


@pytest.mark.parametrize("share", ["on", "off"])
def test_a_restarted_target_checks_again_only_what_it_reads_anew(cache_dir, tmp_path, share):
    """On CPU with shared weights the replacement computes on the bytes the first start
    checked, and skips the check (it still lands on the reference's bits); a target that
    reads the checkpoint again checks it again."""
    run_dir = tmp_path / "run"
    cfg = small_config(cache_dir, run_dir, "1-1", f"target.share_weights={share}", "train.epochs=1",
                       faults(dict(actor="target.0", at_batch=3, kind="sigkill")))
    result = new_job(cfg, progress=False).run()
    assert result.exit_code == 0, result.reason
    ev = events(run_dir)
    starts = [e for e in ev if e["event"] == "ready" and e["actor"] == "target.0"]
    checks = [e for e in ev if e["event"] == "starting" and e["phase"] == "self-check features"]
    assert len(starts) == 2 and len(checks) == (1 if share == "on" else 2), (starts, checks)
    if share == "on":
        ref = train_reference(cfg, progress=False)
        assert losses(run_dir) == ref.losses
        assert_same_weights(final_weights(run_dir), ref.state_dict)


def test_a_checkpoint_write_that_hangs_is_ended_as_a_hang(cache_dir, tmp_path):
    """The write beats from a thread (it has no loop to beat from), but only for as long
    as its bytes may take: a write stuck past that is killed and the step's checkpoint
    written again by the replacement."""
    run_dir = tmp_path / "run"
    cfg = small_config(cache_dir, run_dir, "1-1", "train.epochs=1", "train.checkpoint_every=2",
                       "runtime.hang_timeout_s=2", faults(dict(actor="optimizer.0", at_batch=5, kind="hang",
                                                               at="checkpoint")))
    result = new_job(cfg, progress=False).run()
    assert result.exit_code == 0, result.reason
    died = [(e["actor"], e["reason"]) for e in events(run_dir) if e["event"] == "died"]
    assert len(died) == 1 and died[0][0] == "optimizer.0" and "hung: no heartbeat" in died[0][1], died
    assert sorted(result.committed) == list(range(len(result.committed))) and result.committed
