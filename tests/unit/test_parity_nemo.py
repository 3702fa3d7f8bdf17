"""The DFlash2 step equals NeMo Automodel's own (``benchmarks/parity_dflash2.py``): its
``DFlash2TrainerModule`` imported unmodified from the pinned ``nemo-automodel`` wheel that
``make peers`` fetches. Skipped only where that wheel could not be fetched, with the reason."""

import pytest

from benchmarks import nemo_dflash2 as nemo
from benchmarks import peers


@pytest.fixture(scope="module")
def parity():
    try:
        loaded = nemo.load_nemo()
    except peers.PeerUnavailable as e:
        pytest.skip(str(e))
    from benchmarks import parity_dflash2
    assert loaded.record["peer"] == "nemo-automodel " + peers.PINS["nemo-automodel"].version
    assert loaded.record["sha256"] == peers.PINS["nemo-automodel"].sha256 and not loaded.record["stubbed"]
    return parity_dflash2


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("holes", [True, False])
def test_loss_gradients_acceptance_and_walk_equal_nemos(parity, holes, window):
    out = parity.case(holes=holes, window=window)
    assert out["ok"], out
    assert out["grads"] == 36 and out["candidate_recall"] > 0
    if not holes:       # acceptances that differ between the selector and the argmax
        assert out["tau"] > 1 and out["tau_unary"] > 1 and out["tau"] != out["tau_unary"]


def test_the_check_sees_another_normalisation_and_a_leaking_convolution(parity, monkeypatch):
    from dflash_actors.models import dflash2

    other = parity.case(holes=True, objective=dflash2.SelectorObjective(1.0, "dflash", "skip", "full"))
    assert not other["ok"] and other["loss_rel_diff"] > 1e-3
    block_conv = dflash2.block_conv
    monkeypatch.setattr(dflash2, "block_conv", lambda x, d, base, _block: block_conv(x, d, base, x.shape[1]))
    leaking = parity.case(holes=True)
    assert not leaking["ok"] and leaking["grad_max_rel_diff"] > 1e-2


def test_the_window_cuts_and_the_check_sees_another_window(parity):
    # NeMo's own loss moves with its window: the blocks past position 8 lose context.
    assert abs(parity.case(holes=True)["nemo_loss"] - parity.case(holes=True, window=8)["nemo_loss"]) > 0.1
    for ours in (None, 9, 8):      # full attention, a window one wider, and (sanity) the same one
        out = parity.case(holes=True, window=8, our_window=ours)
        assert out["ok"] == (ours == 8), (ours, out)
