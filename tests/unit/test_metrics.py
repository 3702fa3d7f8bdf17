"""Metric tables: batch rows round-trip exactly, a step folds its batches in drafter
order (float addition is not associative, so the order is observable), and only
finished step rows are read back."""

import time

import pytest
import torch

from dflash_actors.models.loss import BlockStats
from dflash_actors.train.metrics import (
    STEP_COLS,
    batch_table,
    fold_step,
    read_batch,
    read_steps,
    step_table,
    write_batch,
    write_step,
)

B = 4


def _stats(blocks, accepted, correct, total, wce, w):
    return BlockStats(blocks, accepted, torch.tensor(correct, dtype=torch.long), torch.tensor(total, dtype=torch.long),
                      wce, w)


def _assert_same(a, b):
    assert (a.blocks, a.accepted) == (b.blocks, b.accepted)
    assert torch.equal(a.slot_correct, b.slot_correct)
    assert torch.equal(a.slot_total, b.slot_total)
    assert a.weighted_ce == b.weighted_ce   # bit for bit, not approximately
    assert a.weight == b.weight


def test_tables_shape_and_dtype():
    t = batch_table(7, B)
    assert t.shape == (7, 8 + 2 * B) and t.dtype == torch.float64 and t.is_shared()
    s = step_table(3)
    assert s.shape == (3, len(STEP_COLS)) and s.dtype == torch.float64 and s.is_shared()


def test_write_read_batch_round_trip_is_exact():
    t = batch_table(3, B)
    # Values a float32 table would round: 1/3, and an int above 2**24.
    st = _stats(2**40 + 1, 2**30 + 3, [0, 2**25 + 1, 5, 1], [0, 2**25 + 7, 9, 4], 1.0 / 3.0, 0.1 + 0.2)
    write_batch(t, 1, st, tokens=2**24 + 1)
    got, tokens = read_batch(t, 1)
    _assert_same(got, st)
    assert tokens == 2**24 + 1
    assert got.slot_correct.dtype == torch.long and got.slot_total.dtype == torch.long
    # Neighbouring rows are untouched.
    assert torch.equal(t[0], torch.zeros(8 + 2 * B)) and torch.equal(t[2], torch.zeros(8 + 2 * B))
    # A DFlash2's selector fields too.
    st.selector, st.base_accepted, st.hits = True, 2**30 + 1, 2**26 + 5
    write_batch(t, 2, st, tokens=1)
    got, _ = read_batch(t, 2)
    _assert_same(got, st)
    assert (got.selector, got.base_accepted, got.hits) == (True, 2**30 + 1, 2**26 + 5)


def test_fold_step_sums_in_drafter_order():
    t = batch_table(4, B)
    ce = {0: 0.1, 1: 0.2, 2: 0.7, 3: 0.3}
    stats = {b: _stats(b + 1, b, [0, b, 1, 2 * b], [0, b + 2, 3, 4 * b], ce[b], 0.5 * b + 0.25) for b in range(4)}
    tokens = {0: 11, 1: 13, 2: 17, 3: 19}
    for b in range(4):
        write_batch(t, b, stats[b], tokens[b])
    by_drafter = [[0, 2], [1, 3]]          # drafter 0 summed batches 0, 2; drafter 1 batches 1, 3
    want = (stats[0] + stats[2]) + (stats[1] + stats[3])
    # The order is visible in the result: batch-id order gives another float.
    assert ((stats[0] + stats[1]) + stats[2] + stats[3]).weighted_ce != want.weighted_ce
    got, tok = fold_step(t, by_drafter)
    _assert_same(got, want)
    assert tok == sum(tokens.values())


def test_fold_step_single_drafter_single_batch():
    t = batch_table(2, B)
    st = _stats(3, 2, [0, 1, 1, 0], [0, 3, 2, 1], 1.5, 2.0)
    write_batch(t, 1, st, 9)
    got, tok = fold_step(t, [[1]])
    _assert_same(got, st)
    assert tok == 9


def test_write_step_read_steps_returns_done_rows_in_order():
    t = step_table(5)
    s2 = _stats(4, 6, [0, 3, 2, 1], [0, 4, 4, 4], 3.0, 1.5)
    s0 = _stats(10, 5, [0, 4, 1, 0], [0, 10, 9, 8], 7.25, 2.5)
    before = time.time()
    m2 = write_step(t, 2, s2, lr=1e-4, grad_norm=0.75, tokens=123)
    m0 = write_step(t, 0, s0, lr=3e-4, grad_norm=1.25, tokens=456)
    after = time.time()
    assert m2 == s2.metrics() and m0 == s0.metrics()
    rows = read_steps(t)
    assert len(rows) == 2                  # rows 1, 3, 4 were never written
    r0, r2 = rows                          # row order, not write order
    for r, m, lr, gn, tok in ((r0, m0, 3e-4, 1.25, 456), (r2, m2, 1e-4, 0.75, 123)):
        assert list(r) == list(STEP_COLS)
        assert r["loss"] == m["loss"] and r["tau"] == m["tau"]
        assert (r["lr"], r["grad_norm"], r["tokens"], r["done"]) == (lr, gn, tok, 1.0)
        assert before <= r["time"] <= after
    assert r0["loss"] == pytest.approx(7.25 / 2.5) and r0["tau"] == pytest.approx(1.5)
    assert r2["loss"] == pytest.approx(2.0) and r2["tau"] == pytest.approx(2.5)


def test_read_steps_ignores_rows_without_done():
    t = step_table(3)
    t[1, :-1] = 5.0                        # a half-written row: values but no done flag
    assert read_steps(t) == []
    write_step(t, 1, _stats(1, 1, [0, 1, 0, 0], [0, 1, 1, 1], 1.0, 1.0), 0.1, 0.2, 3)
    assert [r["tokens"] for r in read_steps(t)] == [3.0]
