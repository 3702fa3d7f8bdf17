"""The XPress objective equals speculators 0.9.0's own (``benchmarks/parity_xpress.py``):
its ``XPressDraftModel.forward``, ``XPressRefinerHead`` and ``compute_metrics`` imported
unmodified from the pinned wheel, driven from this project's backbone output. Loss and
every gradient agree; controls with another round count, anchor weight, CE label or
previous-token rule must not. Skipped only where the wheel is not available, with the reason."""

import pytest

from benchmarks import peers
from dflash_actors.models import xpress
from dflash_actors.models.xpress import XPressObjective


@pytest.fixture(scope="module")
def parity():
    try:
        from benchmarks import parity_xpress
        got = parity_xpress.load()
    except peers.PeerUnavailable as e:
        pytest.skip(str(e))
    assert got.record()["peer"] == "speculators " + peers.PINS["speculators"].version
    assert set(got.stubbed) <= set(parity_xpress.STUBS)
    return parity_xpress, got


@pytest.mark.parametrize("holes", [True, False])
def test_loss_and_every_gradient_equal_speculators(parity, holes):
    P, got = parity
    out = P.case(got, holes=holes)
    assert out["ok"], out
    # 2 layers x 11, fc, two norms, the refiner's nine.
    assert out["grads"] == 34 and out["supervised"] > 60
    terms = out["speculators_terms"]
    assert len({terms[f"consistency_round{j}_loss"] for j in range(3)} | {terms["tf_loss"]}) == 4


def test_data_labels_are_speculators_ce_from_data(parity):
    P, got = parity
    assert P.case(got, holes=True, objective=XPressObjective(ce_labels="data"), ce_from_data=True)["ok"]


def test_the_check_sees_other_rounds_weights_and_labels(parity):
    P, got = parity
    for objective, ce_from_data in ((XPressObjective(consistency_passes=2), False),
                                    (XPressObjective(base_anchor_weight=0.5), False),
                                    (XPressObjective(), True)):
        out = P.case(got, holes=True, objective=objective, ce_from_data=ce_from_data)
        assert not out["ok"] and (out["loss_rel_diff"] > 1e-4 or out["grad_max_rel_diff"] > 1e-3), objective


def test_the_check_sees_a_leaking_or_misplaced_previous_token(parity, monkeypatch):
    P, got = parity
    # Each slot fed its own token instead of the one before it.
    monkeypatch.setattr(xpress, "tf_prev", lambda before, tokens: tokens)
    leak = P.case(got, holes=False)
    assert not leak["ok"] and leak["loss_rel_diff"] > 1e-3
    monkeypatch.undo()
    # Slot 0 fed the anchor rather than the token before it (the mixer carries it to every slot).
    tf_prev, round_prev = xpress.tf_prev, xpress.round_prev
    monkeypatch.setattr(xpress, "tf_prev", lambda before, tokens: tf_prev(tokens[..., 0], tokens))
    monkeypatch.setattr(xpress, "round_prev", lambda before, anchor, pred: round_prev(anchor, anchor, pred))
    anchored = P.case(got, holes=False)
    assert not anchored["ok"] and anchored["loss_rel_diff"] > 1e-5
