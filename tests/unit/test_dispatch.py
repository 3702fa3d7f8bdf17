"""The dispatcher without processes: actors are simulated by committing ledger rows."""

import enum
import random

import pytest

from dflash_actors.runtime.actor import Actor
from dflash_actors.runtime.channels import FieldSpec, RingSpec
from dflash_actors.runtime.dispatch import Dispatcher, Stage, in_order
from dflash_actors.runtime.ledger import Col, Ledger
from dflash_actors.runtime.messages import ProtocolError


class State(enum.IntEnum):
    PLANNED = 0
    LOADED = 1
    FEATURED = 2
    COMMITTED = 3


def _ring(name, n_slots):
    return RingSpec(name, n_slots, (FieldSpec("x", (8,), "int64"),))


def _members(stages):
    members, n_actor = {}, 0
    for i, s in enumerate(stages):
        for k in range(s.count):
            members[n_actor] = (i, k)
            n_actor += 1
    return members


def _setup(n, batch_slots=2, feature_slots=2, targets=1, drafters=1, credit=2, route=None):
    stages = [Stage("loader", Actor, State.PLANNED, State.LOADED, out_ring="batch", credit=credit),
              Stage("target", Actor, State.LOADED, State.FEATURED, count=targets, in_ring="batch",
                    out_ring="features", credit=credit),
              Stage("drafter", Actor, State.FEATURED, State.COMMITTED, count=drafters, in_ring="features",
                    route=route or (lambda b: b % drafters), credit=credit)]
    rings = [_ring("batch", batch_slots), _ring("features", feature_slots)]
    members = _members(stages)
    ledger = Ledger.allocate(n)
    d = Dispatcher(stages, rings, ledger, members)
    for a in members:
        d.on_ready(a)
    return d, ledger, stages


def _complete(d, ledger, stages, a, b):
    ledger.commit(b, stages[d.members[a][0]].to_state)
    d.on_done(a, b)


def _drive(d, ledger, stages, rng, kill_every=0, check=None, done=None, died=None, blocked=None):
    """Random completion order; optionally a death (without commit) every few steps,
    ``check(actor, work)`` on every dispatch, ``done(actor, batch)`` before each
    commit and ``died(actor, redone)`` after each death. ``blocked(actor, batch)``: the
    actor cannot finish that batch yet (it waits, as an early stage's actor does); it
    can still die while it waits."""
    inbox = {a: [] for a in d.members}
    steps = 0
    while not d.finished():
        for a, w in d.dispatch():
            assert w.out_slot == ledger.get(w.batch_id, Col.NEXT_SLOT)
            if check is not None:
                check(a, w)
            inbox[a].append(w)
        busy = [a for a in inbox if inbox[a]]
        free = [a for a in busy if blocked is None or not blocked(a, inbox[a][0].batch_id)]
        assert free, "deadlock: nothing in flight that can finish, and not finished"
        steps += 1
        dies = kill_every and steps % kill_every == 0
        a = rng.choice(busy if dies else free)
        if dies:
            settled, put_back, redone = d.on_death(a)
            assert sorted(settled + put_back) == sorted(w.batch_id for w in inbox[a])
            if died is not None:
                died(a, redone)
            inbox[a] = []
            d.on_ready(a)
            continue
        w = inbox[a].pop(0)
        if done is not None:
            done(a, w.batch_id)
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
    assert [(a, w.batch_id, w.out_slot) for a, w in sent] == [(0, 0, 0), (0, 1, 1)]
    assert d.occupancy()["batch"]["used"] == 2
    assert d.on_death(0) == ([], [0, 1], [])
    assert d.occupancy()["batch"]["used"] == 0
    assert ledger.get(0, Col.OWNER) == -1 and ledger.state(0) == State.PLANNED
    assert d.dispatch() == []               # the dead actor is not ready yet
    d.on_ready(0)
    again = d.dispatch()
    assert [(w.batch_id, w.out_slot) for _, w in again] == [(0, 0), (1, 1)]


def test_death_after_commit_settles_instead_of_redoing():
    d, ledger, stages = _setup(4)
    d.dispatch()
    ledger.commit(0, State.LOADED)          # committed, then died before sending Done
    assert d.on_death(0) == ([0], [1], [])
    assert ledger.get(0, Col.SLOT) == 0 and ledger.get(0, Col.OWNER) == -1
    d.on_ready(0)
    sent = d.dispatch()
    # batch 0 goes on to the target with its slot; batch 1 is loaded again.
    assert sorted((a, w.batch_id, w.in_slot) for a, w in sent) == [(0, 1, -1), (1, 0, 0)]


def test_routed_stage_resumes_at_the_lowest_batch_put_back():
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
    assert d.on_death(2) == ([], [2, 3, 4, 5], [])
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


def test_a_route_other_than_modulo_is_followed_and_survives_deaths():
    # Blocks of three: batches 0-2 to drafter 0, 3-5 to drafter 1, 6-8 to drafter 0, ...
    route = lambda b: (b // 3) % 2   # noqa: E731
    d, ledger, stages = _setup(30, batch_slots=3, feature_slots=3, targets=2, drafters=2, route=route)
    _drive(d, ledger, stages, random.Random(5), kill_every=4)
    for j in range(2):
        assert [b for b in d.committed if route(b) == j] == [b for b in range(30) if route(b) == j]


def _stepped(early: bool = False):
    """Loader -> worker (barrier: 4-batch steps) -> sink, every batch of 12 loaded."""
    stages = [Stage("loader", Actor, State.PLANNED, State.LOADED, out_ring="batch", credit=8),
              Stage("worker", Actor, State.LOADED, State.FEATURED, in_ring="batch", route=in_order, credit=8,
                    barrier=lambda b: b - b % 4, early=early),
              Stage("sink", Actor, State.FEATURED, State.COMMITTED, route=in_order, credit=8)]
    ledger = Ledger.allocate(12)
    d = Dispatcher(stages, [_ring("batch", 12)], ledger, _members(stages))
    for a in (0, 1, 2):
        d.on_ready(a)
    for _, w in d.dispatch():                 # load everything
        ledger.commit(w.batch_id, State.LOADED)
        d.on_done(0, w.batch_id)
    return ledger, d


def test_a_barrier_holds_a_stage_until_earlier_batches_are_final():
    """A stage gated on the final state: batches of "step" k (4 ids each) go out only
    once every batch of the steps before is committed."""
    ledger, d = _stepped()
    sent = [w.batch_id for a, w in d.dispatch() if a == 1]
    assert sent == [0, 1, 2, 3]               # step 0 only
    for b in sent:
        ledger.commit(b, State.FEATURED)
        d.on_done(1, b)
    sink = [w.batch_id for a, w in d.dispatch() if a == 2]
    assert sink == [0, 1, 2, 3]
    for b in sink[:3]:
        ledger.commit(b, State.COMMITTED)
        d.on_done(2, b)
    assert d.dispatch() == []                 # batch 3 not final yet: step 1 waits
    ledger.commit(3, State.COMMITTED)
    d.on_done(2, 3)
    assert [w.batch_id for a, w in d.dispatch() if a == 1] == [4, 5, 6, 7]


@pytest.mark.parametrize("kill_every", [0, 4])
def test_gathered_groups_move_through_the_stages_together(kill_every):
    """Lock-step: groups of 4 ids; the loader starts a group once the previous one is
    final, and the targets and drafters each start it only once all 4 have arrived."""
    group = lambda b: range(b - b % 4, b - b % 4 + 4)
    stages = [Stage("loader", Actor, State.PLANNED, State.LOADED, out_ring="batch", credit=4,
                    barrier=lambda b: group(b).start),
              Stage("target", Actor, State.LOADED, State.FEATURED, count=2, in_ring="batch", out_ring="features",
                    credit=1, gather=group),
              Stage("drafter", Actor, State.FEATURED, State.COMMITTED, count=2, in_ring="features",
                    route=lambda b: b % 2, credit=2, gather=group)]
    ledger = Ledger.allocate(16)
    d = Dispatcher(stages, [_ring("batch", 4), _ring("features", 4)], ledger, _members(stages))
    for a in d.members:
        d.on_ready(a)

    def check(a, w):
        i, ids = d.members[a][0], group(w.batch_id)
        if i == 0:
            assert all(ledger.state(b) == State.COMMITTED for b in range(ids.start))
        else:
            assert all(ledger.state(b) >= stages[i].from_state for b in ids), (i, w.batch_id)
            assert all(ledger.state(b) <= stages[i].to_state for b in ids)

    _drive(d, ledger, stages, random.Random(kill_every), kill_every, check)
    assert sorted(d.committed) == list(range(16))


class GradDone(enum.IntEnum):
    PLANNED, LOADED, FEATURED, GRAD_DONE, COMMITTED = range(5)


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("kill_every", [0, 3, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_results_kept_in_memory_are_redone_after_a_death_with_full_rings(kill_every, seed, early):
    """The training job's ``grad_durability: step``: each drafter keeps its running sum
    of a step (2 drafters x 2 batches) in memory and makes it durable on its last
    batch. Deaths lose the memory; the batches it held are made again from the loader,
    through rings of 2 slots that later batches keep full, and every step's sums hold
    exactly its batches, once. ``early``: drafters get a step's batches once the step
    before is durably summed, and wait (and die while waiting) for its commit."""
    per_step, m = 4, 2
    step = lambda b: b // per_step                                           # noqa: E731
    last_of_drafter = lambda b: b + m >= (step(b) + 1) * per_step            # noqa: E731
    stages = [Stage("loader", Actor, GradDone.PLANNED, GradDone.LOADED, out_ring="batch", credit=2),
              Stage("target", Actor, GradDone.LOADED, GradDone.FEATURED, count=2, in_ring="batch",
                    out_ring="features", credit=1),
              Stage("drafter", Actor, GradDone.FEATURED, GradDone.GRAD_DONE, count=m, in_ring="features",
                    route=lambda b: b % m, barrier=lambda b: step(b) * per_step, durable=last_of_drafter,
                    early=early),
              Stage("optimizer", Actor, GradDone.GRAD_DONE, GradDone.COMMITTED, route=in_order, credit=per_step)]
    n = 40
    ledger = Ledger.allocate(n)
    d = Dispatcher(stages, [_ring("batch", 2), _ring("features", 2)], ledger, _members(stages))
    for a in d.members:
        d.on_ready(a)
    drafters = {a: k for a, (i, k) in d.members.items() if i == 2}
    memory = {j: [] for j in range(m)}       # the running sum: batch ids added, lost on death
    durable = {j: [] for j in range(m)}      # the committed sums
    steps_taken = []

    def done(a, b):
        if a in drafters:
            j = drafters[a]
            first = b - m < step(b) * per_step
            assert first or memory[j][-1:] == [b - m], f"drafter {j} got {b} after {memory[j]}"
            memory[j] = [b] if first else memory[j] + [b]
            if last_of_drafter(b):
                durable[j] = list(memory[j])
        elif d.members[a][0] == 3 and (b + 1) % per_step == 0:
            s = step(b)
            for j in range(m):
                assert durable[j] == list(range(s * per_step + j, (s + 1) * per_step, m))
            steps_taken.append(s)

    def died(a, redone):
        if a in drafters:
            memory[drafters[a]] = []
        else:
            assert redone == []

    waited = []

    def check(a, w):
        if a in drafters:
            b = w.batch_id
            # Every batch of the steps before is durably summed, if not yet committed.
            assert all(ledger.state(c) >= GradDone.GRAD_DONE and c not in d._pending
                       for c in range(step(b) * per_step))
            if not all(ledger.state(c) == GradDone.COMMITTED for c in range(step(b) * per_step)):
                assert early
                waited.append(b)

    def blocked(a, b):   # a drafter's batch needs the weights of its step: every batch before committed
        return a in drafters and not all(ledger.state(c) == GradDone.COMMITTED for c in range(step(b) * per_step))

    _drive(d, ledger, stages, random.Random(seed), kill_every, check=check, done=done, died=died, blocked=blocked)
    assert bool(waited) == early
    assert sorted(d.committed) == list(range(n)) and steps_taken == list(range(n // per_step))
    assert all(p["used"] == 0 for p in d.occupancy().values())
    if kill_every:
        assert d.redone and d.evicted        # the case this is about did happen
    else:
        assert not d.redone and not d.evicted


def test_an_early_barrier_opens_once_earlier_batches_are_through_the_stage():
    """As the barrier test above, with ``early``: step 1 goes out once step 0 is done at
    the worker, before the sink has committed any of it; a death of the sink puts
    its batches back and keeps that open."""
    ledger, d = _stepped(early=True)
    assert [w.batch_id for a, w in d.dispatch() if a == 1] == [0, 1, 2, 3]
    for b in range(3):
        ledger.commit(b, State.FEATURED)
        d.on_done(1, b)
    sent = d.dispatch()
    assert [(a, w.batch_id) for a, w in sent] == [(2, 0), (2, 1), (2, 2)]   # batch 3 still at the worker
    ledger.commit(3, State.FEATURED)
    d.on_done(1, 3)
    sent = d.dispatch()
    # Later stages first; step 1 goes to the worker with nothing committed yet.
    assert [(a, w.batch_id) for a, w in sent] == [(2, 3), (1, 4), (1, 5), (1, 6), (1, 7)]
    assert ledger.counts(4)[State.COMMITTED] == 0
    assert d.on_death(2) == ([], [0, 1, 2, 3], [])
    d.on_ready(2)
    assert [(a, w.batch_id) for a, w in d.dispatch()] == [(2, 0), (2, 1), (2, 2), (2, 3)]


def test_an_early_stage_needs_a_barrier_and_no_ring_after_it():
    rings = [_ring("batch", 1)]
    no_barrier = [Stage("loader", Actor, State.PLANNED, State.LOADED, out_ring="batch", early=True),
                  Stage("drafter", Actor, State.LOADED, State.COMMITTED, in_ring="batch")]
    ring_after = [Stage("loader", Actor, State.PLANNED, State.LOADED, out_ring="batch", barrier=lambda b: b,
                        early=True),
                  Stage("drafter", Actor, State.LOADED, State.COMMITTED, in_ring="batch")]
    for stages in (no_barrier, ring_after):
        with pytest.raises(ValueError, match="early needs a barrier"):
            Dispatcher(stages, rings, Ledger.allocate(1), {0: (0, 0), 1: (1, 0)})


def test_done_that_the_ledger_contradicts_is_a_protocol_error():
    d, ledger, stages = _setup(2)
    d.dispatch()
    with pytest.raises(ProtocolError, match="Done for loaded but the ledger says planned"):
        d.on_done(0, 0)
    with pytest.raises(ProtocolError, match="does not hold"):
        d.on_done(1, 0)


def test_stages_must_chain():
    rings = [_ring("batch", 1)]
    bad = [Stage("loader", Actor, State.PLANNED, State.LOADED, out_ring="batch"),
           Stage("drafter", Actor, State.FEATURED, State.COMMITTED, in_ring="batch")]
    with pytest.raises(ValueError, match="does not consume"):
        Dispatcher(bad, rings, Ledger.allocate(1), {0: (0, 0), 1: (1, 0)})


def test_a_resumed_ledger_dispatches_only_what_is_left():
    ledger = Ledger.allocate(6, initial=State.PLANNED, done=State.COMMITTED, done_below=2)
    d = Dispatcher([Stage("loader", Actor, State.PLANNED, State.COMMITTED, route=in_order, credit=10)], [], ledger,
                   {0: (0, 0)})
    assert d.remaining() == 4 and not d.finished()
    d.on_ready(0)
    assert [w.batch_id for _, w in d.dispatch()] == [2, 3, 4, 5]
    assert ledger.counts(4) == [4, 0, 0, 2]


def test_restart_policy_is_a_sliding_window_and_raises_escalations():
    from dflash_actors.runtime.actor import Escalate
    from dflash_actors.runtime.messages import ActorError
    from dflash_actors.runtime.policy import Decision, RestartPolicy
    p = RestartPolicy(max_restarts=2, window_s=10.0)
    assert [p.decide(t, None) for t in (0.0, 1.0, 2.0)] == [Decision.RESTART] * 2 + [Decision.GIVE_UP]
    p = RestartPolicy(max_restarts=2, window_s=10.0)
    # the first death falls out of the window
    assert [p.decide(t, None) for t in (0.0, 6.0, 12.0, 13.0)] == [Decision.RESTART] * 3 + [Decision.GIVE_UP]
    assert RestartPolicy(max_restarts=0, window_s=1.0).decide(0.0, None) is Decision.GIVE_UP
    crash = ActorError("a.0", "RuntimeError", "boom", "")
    assert RestartPolicy(max_restarts=5, window_s=1.0).decide(0.0, crash) is Decision.RESTART
    fatal = ActorError("a.0", "Escalate", "no", "", raised=Escalate("no"))
    assert RestartPolicy(max_restarts=5, window_s=1.0).decide(0.0, fatal) is Decision.RAISE


def test_actor_error_one_line_names_the_innermost_frame():
    from dflash_actors.runtime.messages import ActorError
    tb = ('Traceback (most recent call last):\n'
          '  File "/x/dflash_actors/runtime/actor.py", line 120, in actor_main\n    actor.attach()\n'
          '  File "/x/tests/support/toy.py", line 57, in attach\n    raise RuntimeError("boom")\n'
          'RuntimeError: boom\n')
    e = ActorError("target.0", "RuntimeError", "boom\nmore", tb)
    assert e.one_line() == "RuntimeError: boom (toy.py:57 in attach)"
