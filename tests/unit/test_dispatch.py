"""Ledger and dispatcher without processes: actors are simulated by committing rows."""

import random

import pytest

from dflash_actors.actors.base import Actor
from dflash_actors.channels import RingSpec
from dflash_actors.dispatch import Dispatcher, ProtocolError, Stage
from dflash_actors.ledger import Col, Ledger, State


def _setup(n, batch_slots=2, feature_slots=2, targets=1, drafters=1, credit=2):
    stages = [Stage("loader", Actor, State.PLANNED, State.LOADED, out_ring="batch", credit=credit),
              Stage("target", Actor, State.LOADED, State.FEATURED, count=targets, in_ring="batch",
                    out_ring="features", credit=credit),
              Stage("drafter", Actor, State.FEATURED, State.COMMITTED, count=drafters, in_ring="features",
                    ordered=True, credit=credit)]
    rings = [RingSpec.batch("batch", batch_slots, 8, 2),
             RingSpec.features("features", feature_slots, 8, 2, 4, "float32")]
    members, n_actor = {}, 0
    for i, s in enumerate(stages):
        for k in range(s.count):
            members[n_actor] = (i, k)
            n_actor += 1
    ledger = Ledger.allocate(n)
    d = Dispatcher(stages, rings, ledger, members)
    for a in members:
        d.on_ready(a)
    return d, ledger, stages


def _complete(d, ledger, stages, a, b):
    ledger.commit(b, stages[d.members[a][0]].to_state)
    d.on_done(a, b)


def _drive(d, ledger, stages, rng, kill_every=0):
    """Random completion order; optionally a death (without commit) every few steps."""
    inbox = {a: [] for a in d.members}
    steps = 0
    while not d.finished():
        for a, w in d.dispatch():
            assert w.out_slot == ledger.get(w.batch_id, Col.NEXT_SLOT)
            inbox[a].append(w)
        busy = [a for a in inbox if inbox[a]]
        assert busy, "deadlock: nothing in flight and not finished"
        a = rng.choice(busy)
        steps += 1
        if kill_every and steps % kill_every == 0:
            settled, put_back = d.on_death(a)
            assert sorted(settled + put_back) == sorted(w.batch_id for w in inbox[a])
            inbox[a] = []
            d.on_ready(a)
            continue
        w = inbox[a].pop(0)
        _complete(d, ledger, stages, a, w.batch_id)
    return steps


@pytest.mark.parametrize("kill_every", [0, 3, 7])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_batch_once_in_order_per_drafter_even_with_deaths(kill_every, seed):
    n = 50
    d, ledger, stages = _setup(n, batch_slots=3, feature_slots=2, targets=2, drafters=2)
    _drive(d, ledger, stages, random.Random(seed), kill_every)
    assert sorted(d.committed) == list(range(n))
    for j in range(2):
        assert [b for b in d.committed if b % 2 == j] == list(range(j, n, 2))
    assert all(p["used"] == 0 for p in d.occupancy().values())
    assert (ledger.table[:, Col.STATE] == State.COMMITTED).all()


def test_death_before_commit_puts_back_and_frees_the_reserved_slot():
    d, ledger, stages = _setup(4)
    sent = d.dispatch()
    assert [(a, w.batch_id, w.attempt, w.out_slot) for a, w in sent] == [(0, 0, 1, 0), (0, 1, 1, 1)]
    assert d.occupancy()["batch"]["used"] == 2
    settled, put_back = d.on_death(0)
    assert (settled, put_back) == ([], [0, 1])
    assert d.occupancy()["batch"]["used"] == 0
    assert ledger.get(0, Col.OWNER) == -1 and ledger.state(0) is State.PLANNED
    assert d.dispatch() == []               # the dead actor is not ready yet
    d.on_ready(0)
    again = d.dispatch()
    assert [(w.batch_id, w.attempt) for _, w in again] == [(0, 2), (1, 2)]


def test_death_after_commit_settles_instead_of_redoing():
    d, ledger, stages = _setup(4)
    d.dispatch()
    ledger.commit(0, State.LOADED)          # committed, then died before sending Done
    settled, put_back = d.on_death(0)
    assert (settled, put_back) == ([0], [1])
    assert ledger.get(0, Col.SLOT) == 0 and ledger.get(0, Col.OWNER) == -1
    d.on_ready(0)
    sent = d.dispatch()
    # batch 0 goes on to the target with its slot; batch 1 is loaded again.
    assert sorted((a, w.batch_id, w.in_slot) for a, w in sent) == [(0, 1, -1), (1, 0, 0)]


def test_ordered_stage_resumes_at_the_lowest_batch_put_back():
    d, ledger, stages = _setup(6, batch_slots=6, feature_slots=6, credit=6)
    sent = []
    for _ in range(4):       # load and feature everything; the drafter gets all, in order
        for a, w in d.dispatch():
            if a in (0, 1):
                _complete(d, ledger, stages, a, w.batch_id)
            else:
                sent.append(w.batch_id)
    assert sent == [0, 1, 2, 3, 4, 5]
    _complete(d, ledger, stages, 2, 0)
    _complete(d, ledger, stages, 2, 1)
    assert d.on_death(2) == ([], [2, 3, 4, 5])
    d.on_ready(2)
    assert [w.batch_id for a, w in d.dispatch()] == [2, 3, 4, 5]


def test_slots_go_to_the_lowest_batch_first():
    d, ledger, stages = _setup(6, batch_slots=1, feature_slots=1, credit=1)
    order = []
    while not d.finished():
        for a, w in d.dispatch():
            order.append((stages[d.members[a][0]].role, w.batch_id))
            _complete(d, ledger, stages, a, w.batch_id)
    assert [b for r, b in order if r == "drafter"] == list(range(6))


def test_done_that_the_ledger_contradicts_is_a_protocol_error():
    d, ledger, stages = _setup(2)
    d.dispatch()
    with pytest.raises(ProtocolError, match="ledger says PLANNED"):
        d.on_done(0, 0)
    with pytest.raises(ProtocolError, match="does not hold"):
        d.on_done(1, 0)


def test_stages_must_chain():
    rings = [RingSpec.batch("batch", 1, 8, 2)]
    bad = [Stage("loader", Actor, State.PLANNED, State.LOADED, out_ring="batch"),
           Stage("drafter", Actor, State.FEATURED, State.COMMITTED, in_ring="batch")]
    with pytest.raises(ValueError, match="does not consume"):
        Dispatcher(bad, rings, Ledger.allocate(1), {0: (0, 0), 1: (1, 0)})


def test_ledger_resumes_from_recorded_states():
    ledger = Ledger.allocate(4)
    ledger.commit(0, State.COMMITTED)
    ledger.commit(1, State.COMMITTED)
    d = Dispatcher([Stage("loader", Actor, State.PLANNED, State.COMMITTED, ordered=True)], [], ledger, {0: (0, 0)})
    d.on_ready(0)
    assert [w.batch_id for _, w in d.dispatch()] == [2, 3]
    assert ledger.counts() == {"planned": 2, "loaded": 0, "featured": 0, "grad_done": 0, "committed": 2}


def test_batch_ring_slots_are_exactly_batch_buffers():
    from dflash_actors.batching import BatchBuffers
    from dflash_actors.channels import Ring
    ring = Ring.allocate(RingSpec.batch("batch", 2, 16, 3))
    ref = BatchBuffers.allocate(16, 3)
    view = ring.batch_buffers(1)
    for name in ("input_ids", "position_ids", "loss_mask", "cu_seqlens", "sample_ids"):
        assert getattr(view, name).shape == getattr(ref, name).shape
        assert getattr(view, name).dtype == getattr(ref, name).dtype
    view.input_ids[:] = 7
    assert int(ring.tensors["input_ids"][1].sum()) == 7 * 16 and int(ring.tensors["input_ids"][0].sum()) == 0
    assert ring.tensors["input_ids"].is_shared()
    assert ring.nbytes == 2 * RingSpec.batch("b", 1, 16, 3).slot_bytes


def test_ring_placement_needs_one_shared_gpu():
    from dflash_actors.channels import placement
    assert placement("cpu", "cpu") == "cpu"
    assert placement("cuda:0", "cuda:1") == "cpu"
    import torch
    assert placement("cuda:0", "cuda:0") == ("cuda:0" if torch.cuda.is_available() else "cpu")


def test_rings_are_shaped_by_the_config():
    from dflash_actors.channels import rings_from_config
    from dflash_actors.config import config_from_dict
    cfg = config_from_dict({"batching": {"token_budget": 4096, "max_samples": 16},
                            "runtime": {"batch_slots": 3, "feature_slots": 5}})
    batch, feats = rings_from_config(cfg, feature_width=3 * 576, feature_dtype="bfloat16")
    assert (batch.n_slots, feats.n_slots) == (3, 5)
    hidden = {f.name: f for f in feats.fields}["hidden"]
    assert hidden.shape == (4096, 1728) and hidden.dtype == "bfloat16"
    assert feats.slot_bytes == batch.slot_bytes + 4096 * 1728 * 2


def test_restart_policy_is_a_sliding_window():
    from dflash_actors.supervisor import RestartPolicy
    p = RestartPolicy(max_restarts=2, window_s=10.0)
    assert p.allow(0.0) and p.allow(1.0)
    assert not p.allow(2.0)                  # third death within 10 s
    p = RestartPolicy(max_restarts=2, window_s=10.0)
    assert p.allow(0.0) and p.allow(6.0) and p.allow(12.0)   # the first fell out of the window
    assert not p.allow(13.0)
    assert not RestartPolicy(max_restarts=0, window_s=1.0).allow(0.0)


def test_actor_error_one_line_names_the_innermost_frame():
    from dflash_actors.messages import ActorError
    tb = ('Traceback (most recent call last):\n'
          '  File "/x/dflash_actors/actors/base.py", line 120, in actor_main\n    actor.attach()\n'
          '  File "/x/dflash_actors/actors/toy.py", line 57, in attach\n    raise RuntimeError("boom")\n'
          'RuntimeError: boom\n')
    e = ActorError("target.0", "RuntimeError", "boom\nmore", tb)
    assert e.one_line() == "RuntimeError: boom (toy.py:57 in attach)"
