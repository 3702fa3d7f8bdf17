"""A batch trained in micro-batches (``train.drafter_step``) has the whole batch's
gradient at float rounding, whatever the objective's options; the split keeps every
anchor once and each micro-batch within its budget."""

import numpy as np
import pytest
import torch

from dflash_actors.models.drafter_start import build_drafter
from dflash_actors.models.loss import Objective, batch_loss
from dflash_actors.models.target import load_target
from dflash_actors.train.drafter_step import drafter_step, split_anchors
from tests.support.heads import first_batch


@pytest.fixture(scope="module")
def tiny_cfg(tiny):
    return tiny[0]


@pytest.fixture(scope="module")
def setup(tiny):
    tiny_cfg, target = tiny
    batch = first_batch(tiny_cfg)
    return target, batch, target.features(batch)


def whole_and_split(cfg, target, batch, feats, budget, checkpoint):
    o = Objective.from_config(cfg)
    d = build_drafter(cfg, target)
    loss, whole = batch_loss(d, target, feats, batch, o, epoch=0, batch_id=3)
    loss.backward()
    want = [p.grad.clone() for p in d.parameters()]
    d.zero_grad(set_to_none=True)
    split = drafter_step(d, target, feats, batch, o, epoch=0, batch_id=3, block_tokens=budget,
                         checkpoint_layers=checkpoint)
    return want, [p.grad for p in d.parameters()], whole, split


# Budgets of 3 blocks (rows cut into runs) and 25 (several rows at once), alternating.
@pytest.mark.parametrize("options,budget,checkpoint", [
    ({}, 24, False), ({}, 200, True), ({"train.position_weight": "dpace"}, 24, True),
    ({"train.position_weight": "dpace"}, 200, False), ({"train.loss": "distill"}, 24, False),
    ({"train.head_loss": "checkpointed"}, 200, True), ({"train.head_vocab": "sampled", "train.head_negatives": 16},
                                                      24, True),
])
def test_micro_batches_add_up_to_the_whole_batch(setup, tiny_cfg, options, budget, checkpoint):
    target, batch, feats = setup
    cfg = tiny_cfg.updated(options)
    if cfg.train.loss == "distill":
        target = load_target(cfg, "cpu")
        feats = target.features(batch)
    want, got, whole, split = whole_and_split(cfg, target, batch, feats, budget, checkpoint)
    scale = max(float(w.abs().max()) for w in want)
    assert scale > 0
    for w, g in zip(want, got):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-6 * scale)
    assert split.blocks == whole.blocks and split.accepted == whole.accepted
    assert torch.equal(split.slot_correct, whole.slot_correct) and torch.equal(split.slot_total, whole.slot_total)
    assert split.metrics()["loss"] == pytest.approx(whole.metrics()["loss"], rel=1e-6)


def test_one_micro_batch_is_the_whole_batch_bit_for_bit(setup, tiny_cfg):
    """No budget, or one the batch fits: the arithmetic of a single pass, unchanged."""
    target, batch, feats = setup
    for budget in (None, 10 ** 9):
        want, got, _, _ = whole_and_split(tiny_cfg, target, batch, feats, budget, False)
        assert all(torch.equal(w, g) for w, g in zip(want, got))


def test_checkpointed_layers_change_no_bit(setup, tiny_cfg):
    target, batch, feats = setup
    o = Objective.from_config(tiny_cfg)
    grads = []
    for checkpoint in (False, True):
        d = build_drafter(tiny_cfg, target)
        drafter_step(d, target, feats, batch, o, epoch=0, batch_id=1, block_tokens=64, checkpoint_layers=checkpoint)
        grads.append([p.grad for p in d.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_the_split_keeps_every_anchor_once_within_its_budget():
    rng = np.random.default_rng(0)
    B = 4
    for _ in range(200):
        rows = int(rng.integers(1, 9))
        lengths = [int(x) for x in rng.integers(2, 60, rows)]
        anchors = [np.sort(rng.choice(L - 1, int(rng.integers(0, L)), replace=False)) for L in lengths]
        budget = int(rng.integers(B, 400))
        groups = split_anchors(lengths, anchors, B, budget)
        for r in range(rows):       # every anchor once, in order
            assert np.array_equal(np.concatenate([g[r] for g in groups]), anchors[r])
        for g in groups:
            members = [r for r in range(rows) if len(g[r])]
            if len(members) > 1:    # several rows: both budgets hold
                assert len(members) * max(len(g[r]) for r in members) * B <= budget
                assert len(members) * max(lengths[r] for r in members) <= budget
            for r in members:       # a run of one row never has more blocks than the budget allows
                assert len(g[r]) <= max(1, budget // B)
        whole = [r for r in range(rows) if 0 < len(anchors[r]) * B <= budget and lengths[r] <= budget]
        for r in whole:             # rows that fit stay whole
            assert sum(1 for g in groups if len(g[r])) == 1
