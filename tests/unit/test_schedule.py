"""The batch schedule against a brute-force enumeration of the run: every batch id with
its epoch, position, step and drafter, listed one by one."""

import numpy as np
import pytest

from dflash_actors.config import config_from_dict
from dflash_actors.data.batching import plan_for
from dflash_actors.train.schedule import Schedule

PER_STEP, M, STEPS = 6, 3, (2, 1, 3)


def _schedule():
    return Schedule(PER_STEP, M, STEPS)


def _enumerate():
    """One dict per batch id, built by counting, not by the formulas under test."""
    rows, step = [], 0
    for epoch, steps in enumerate(STEPS):
        pos = 0
        for _ in range(steps):
            for k in range(PER_STEP):
                rows.append({"epoch": epoch, "pos": pos, "step": step, "drafter": k % M, "k": k})
                pos += 1
            step += 1
    return rows


RUN = _enumerate()


def test_totals():
    s = _schedule()
    assert s.total_steps == 6
    assert s.total_batches == 36 == len(RUN)


def test_locate():
    s = _schedule()
    for b, r in enumerate(RUN):
        assert s.locate(b) == (r["epoch"], r["pos"])
    with pytest.raises(IndexError):
        s.locate(len(RUN))
    with pytest.raises(IndexError):
        s.locate(len(RUN) + 7)


def test_step_first_and_drafter_of_every_batch():
    s = _schedule()
    for b, r in enumerate(RUN):
        assert s.step_of(b) == r["step"]
        assert s.drafter_of(b) == r["drafter"]
        first = min(c for c, q in enumerate(RUN) if q["step"] == r["step"])
        assert s.first_of_own_step(b) == first
        assert s.first_of_step(r["step"]) == first


def test_first_of_step_past_the_end_is_the_batch_count():
    # A run resumed with every step done starts (and ends) there.
    s = _schedule()
    assert s.first_of_step(s.total_steps) == s.total_batches


def test_epoch_of_step():
    s = _schedule()
    for step in range(s.total_steps):
        assert s.epoch_of_step(step) == next(r["epoch"] for r in RUN if r["step"] == step)
    assert [s.epoch_of_step(t) for t in range(s.total_steps)] == [0, 0, 1, 2, 2, 2]
    assert s.epoch_of_step(s.total_steps) == len(STEPS)


def test_drafter_batches_partition_each_step():
    s = _schedule()
    for step in range(s.total_steps):
        of_step = [b for b, r in enumerate(RUN) if r["step"] == step]
        seen = []
        for j in range(M):
            batches = list(s.drafter_batches(step, j))
            assert batches == [b for b in of_step if RUN[b]["drafter"] == j]
            assert batches == sorted(batches) and len(batches) == PER_STEP // M
            assert all(s.drafter_of(b) == j for b in batches)
            seen += batches
        assert sorted(seen) == of_step          # each batch of the step exactly once


def test_previous_for_drafter():
    s = _schedule()
    for b, r in enumerate(RUN):
        earlier = [c for c in range(b) if RUN[c]["step"] == r["step"] and RUN[c]["drafter"] == r["drafter"]]
        want = earlier[-1] if earlier else None
        assert s.previous_for_drafter(b) == want
    # Exactly M first batches per step, the ones that start each drafter's sum from zero.
    firsts = [b for b in range(len(RUN)) if s.previous_for_drafter(b) is None]
    assert len(firsts) == M * s.total_steps
    for step in range(s.total_steps):
        assert [s.drafter_batches(step, j)[0] for j in range(M)] == [b for b in firsts if RUN[b]["step"] == step]


def test_is_last_of_step():
    s = _schedule()
    for b, r in enumerate(RUN):
        assert s.is_last_of_step(b) == (r["k"] == PER_STEP - 1)


def _cfg():
    return config_from_dict({"batching": {"token_budget": 64, "max_samples": 4},
                             "train": {"epochs": 3, "grad_accum": 2},
                             "topology": {"num_drafters": 2},
                             "data": {"max_seq_len": 64},
                             "drafter": {"block_size": 8}})


@pytest.mark.parametrize("n_samples, steps", [(30, 3), (32, 4), (24, 3), (8, 1), (6, 0)])
def test_from_config_drops_the_incomplete_last_step(n_samples, steps):
    # Two 32-token samples fill a 64-token batch: n/2 batches an epoch, 4 per step.
    cfg = _cfg()
    lengths = np.full(n_samples, 32, np.int32)
    assert [len(plan_for(cfg, lengths, e)) for e in range(3)] == [n_samples // 2] * 3
    s = Schedule.from_config(cfg, lengths)
    assert s.per_step == 4
    assert s.num_drafters == 2
    assert s.steps_per_epoch == (steps,) * 3
    assert s.total_batches == 3 * steps * 4


@pytest.mark.parametrize("nodes,m,accum", [(2, 1, 1), (2, 2, 3), (3, 2, 1)])
def test_nodes_shard_the_run_of_one_machine_with_all_their_drafters(nodes, m, accum):
    """Across K nodes, node k's local batches are, in order, exactly the global batches
    of drafters k*M..k*M+M-1 of one machine with K*M drafters: disjoint, covering the
    run once, at the same plan positions, each node's drafter j summing them in the
    single machine's order."""
    steps = (2, 1, 3)
    whole = Schedule(accum * m * nodes, m * nodes, steps)
    seen = []
    for k in range(nodes):
        s = Schedule(accum * m, m, steps, nodes, k)
        assert s.total_steps == whole.total_steps and s.batches_per_step == whole.per_step
        for b in range(s.total_batches):
            g = s.global_id(b)
            seen.append(g)
            assert s.locate(b) == whole.locate(g) and s.step_of(b) == whole.step_of(g)
            assert whole.drafter_of(g) == k * m + s.drafter_of(b)
        for step in range(s.total_steps):
            for j in range(m):
                assert [s.global_id(b) for b in s.drafter_batches(step, j)] == \
                    list(whole.drafter_batches(step, k * m + j))
    assert sorted(seen) == list(range(whole.total_batches))


def test_from_config_per_node_and_whole():
    cfg = config_from_dict({"topology": {"num_drafters": 2, "nodes": 2}, "train": {"grad_accum": 1}})
    lengths = np.full(64, 40, dtype=np.int64)
    whole, node1 = Schedule.from_config(cfg, lengths), Schedule.from_config(cfg, lengths, node=1)
    assert (whole.per_step, whole.num_drafters, whole.nodes) == (4, 4, 1)
    assert (node1.per_step, node1.num_drafters, node1.nodes, node1.node) == (2, 2, 2, 1)
    assert node1.steps_per_epoch == whole.steps_per_epoch
    with pytest.raises(ValueError):
        Schedule.from_config(cfg, lengths, node=2)


def test_a_drafters_last_batch_of_a_step_is_where_its_sum_is_complete():
    s = Schedule(per_step=6, num_drafters=2, steps_per_epoch=(2,))      # A=3, M=2
    assert [b for b in range(12) if s.is_last_for_drafter(b)] == [4, 5, 10, 11]
    assert all(s.is_last_for_drafter(s.drafter_batches(st, j)[-1]) for st in range(2) for j in range(2))


@pytest.mark.parametrize("cap, steps", [(0, (4, 4, 4)), (9, (4, 4, 1)), (4, (4,)), (3, (3,)), (12, (4, 4, 4)),
                                        (50, (4, 4, 4))])
def test_max_steps_cuts_the_run_at_the_cap(cap, steps):
    """train.max_steps: the first ``cap`` steps of the run, epoch by epoch; epochs left
    with no step are not in it."""
    cfg = _cfg().updated({"train.max_steps": cap})
    sched = Schedule.from_config(cfg, np.full(32, 32, np.int32))
    assert sched.steps_per_epoch == steps
    assert sched.total_steps == min(cap or 12, 12)
    assert sched.epoch_of_step(sched.total_steps - 1) == len(steps) - 1
