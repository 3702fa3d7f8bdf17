"""The batch ledger: allocation, the supervisor's slot bookkeeping, meta columns, and
that a pickled ledger is the same shared table in a spawned child."""

import pytest
import torch
import torch.multiprocessing as mp

from dflash_actors.runtime.ledger import Col, Ledger


def test_allocate_initial_state_and_empty_columns():
    led = Ledger.allocate(5, meta_cols=2, initial=3)
    assert len(led) == 5
    assert led.table.shape == (5, Col.META + 2)
    assert led.table.is_shared()
    for b in range(5):
        assert led.state(b) == 3
        # No slot, no reservation, no owner, no meta until someone writes them.
        assert led.get(b, Col.SLOT) == -1
        assert led.get(b, Col.NEXT_SLOT) == -1
        assert led.get(b, Col.OWNER) == -1
        assert led.meta(b) == (-1, -1)


def test_allocate_done_below_marks_the_resumed_prefix():
    led = Ledger.allocate(6, initial=0, done=4, done_below=3)
    assert [led.state(b) for b in range(6)] == [4, 4, 4, 0, 0, 0]
    assert led.counts(5) == [3, 0, 0, 0, 3]


def test_allocate_done_below_without_done_state_raises():
    with pytest.raises(ValueError):
        Ledger.allocate(4, done_below=2)


def test_constructor_rejects_a_bad_table():
    with pytest.raises(ValueError):
        Ledger(torch.zeros(3, Col.META, dtype=torch.int32))
    with pytest.raises(ValueError):
        Ledger(torch.zeros(3, Col.META - 1, dtype=torch.int64))
    with pytest.raises(ValueError):
        Ledger(torch.zeros(3 * Col.META, dtype=torch.int64))


def test_assign_settle_moves_the_reserved_slot_in():
    led = Ledger.allocate(3)
    led.assign(1, owner=7, next_slot=2)
    assert led.get(1, Col.OWNER) == 7
    assert led.get(1, Col.NEXT_SLOT) == 2
    assert led.get(1, Col.SLOT) == -1
    led.commit(1, 1)
    assert led.settle(1) == -1          # it had no slot before
    assert (led.get(1, Col.SLOT), led.get(1, Col.NEXT_SLOT), led.get(1, Col.OWNER)) == (2, -1, -1)
    assert led.state(1) == 1            # settle never touches STATE

    # Second transition: the old slot 2 comes back to the caller to free.
    led.assign(1, owner=4, next_slot=5)
    led.commit(1, 2)
    assert led.settle(1) == 2
    assert (led.get(1, Col.SLOT), led.get(1, Col.NEXT_SLOT), led.get(1, Col.OWNER)) == (5, -1, -1)
    # Other rows are untouched.
    for b in (0, 2):
        assert led.table[b].tolist() == [0, -1, -1, -1]


def test_put_back_returns_the_reservation_and_keeps_state_and_slot():
    led = Ledger.allocate(2)
    led.assign(0, owner=1, next_slot=3)
    led.commit(0, 1)
    led.settle(0)                       # SLOT = 3, state 1
    led.assign(0, owner=2, next_slot=6)
    assert led.put_back(0) == 6
    assert led.state(0) == 1
    assert led.get(0, Col.SLOT) == 3    # the input slot still holds the data
    assert led.get(0, Col.NEXT_SLOT) == -1
    assert led.get(0, Col.OWNER) == -1


def test_owned_by_lists_rows_lowest_first():
    led = Ledger.allocate(8)
    for b, owner in ((6, 1), (2, 1), (4, 0), (0, 1), (7, 2)):
        led.assign(b, owner=owner, next_slot=b)
    assert led.owned_by(1) == [0, 2, 6]
    assert led.owned_by(0) == [4]
    assert led.owned_by(3) == []
    led.settle(2)
    assert led.owned_by(1) == [0, 6]


def test_meta_round_trip_and_wrong_length():
    led = Ledger.allocate(3, meta_cols=3)
    led.set_meta(1, [10, 20, 30])
    assert led.meta(1) == (10, 20, 30)
    assert led.meta(0) == (-1, -1, -1)
    with pytest.raises(ValueError):
        led.set_meta(1, [1, 2])
    with pytest.raises(ValueError):
        led.set_meta(1, [1, 2, 3, 4])
    assert led.meta(1) == (10, 20, 30)   # a rejected write leaves the row alone
    with pytest.raises(ValueError):
        Ledger.allocate(2).set_meta(0, [1])


def test_counts():
    led = Ledger.allocate(7)
    for b, s in ((0, 2), (1, 2), (2, 1), (5, 3)):
        led.commit(b, s)
    assert led.counts(4) == [3, 1, 2, 1]
    assert led.counts(6) == [3, 1, 2, 1, 0, 0]   # minlength pads unused states


def _child_writes(led):
    # Runs in a spawned child: every write must land in the parent's table.
    led.set_meta(2, [111, 222])
    led.commit(2, 5)
    led.assign(3, owner=9, next_slot=4)


def test_pickled_ledger_shares_rows_with_a_spawned_child():
    led = Ledger.allocate(4, meta_cols=2)
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_child_writes, args=(led,))
    p.start()
    p.join(timeout=120)
    if p.is_alive():
        p.kill()
        p.join()
        pytest.fail("child did not finish")
    assert p.exitcode == 0
    assert led.state(2) == 5
    assert led.meta(2) == (111, 222)
    assert led.owned_by(9) == [3]
    assert led.get(3, Col.NEXT_SLOT) == 4
    assert led.table[0].tolist() == [0, -1, -1, -1, -1, -1]
