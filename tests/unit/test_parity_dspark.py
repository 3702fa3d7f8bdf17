"""The DSpark step equals NeMo Automodel's own (``benchmarks/parity_dspark.py``): its
``DSparkTrainerModule`` and ``Qwen3DSparkModel`` imported unmodified from the pinned
``nemo-automodel`` wheel. Skipped only where that wheel could not be fetched, with the reason."""

import pytest
import torch

from benchmarks import nemo_dspark as nemo
from benchmarks import peers


@pytest.fixture(scope="module")
def parity():
    try:
        loaded = nemo.load_nemo()
    except peers.PeerUnavailable as e:
        pytest.skip(str(e))
    from benchmarks import parity_dspark
    assert loaded.record["peer"] == "nemo-automodel " + peers.PINS["nemo-automodel"].version
    assert loaded.record["sha256"] == peers.PINS["nemo-automodel"].sha256 and not loaded.record["stubbed"]
    return parity_dspark


@pytest.mark.parametrize("holes", [True, False])
def test_loss_gradients_and_walk_equal_nemos(parity, holes):
    out = parity.case(holes=holes)
    assert out["ok"], out
    # Every trainable tensor (2 layers x 11, fc, two norms, both heads' 4) and a walk the bias steers.
    assert out["grads"] == 29 and out["walk_differs_from_argmax"]
    assert all(v > 0 for v in out["nemo_terms"].values())


def test_the_check_sees_another_distance_decay_or_normalisation(parity):
    from dflash_actors.models.dspark import DSparkObjective

    kl = parity.case(holes=True, objective=DSparkObjective(0.1, 0.9, 1.0, "kl"))
    assert not kl["ok"] and kl["loss_rel_diff"] > 1e-3
    flat = parity.case(holes=True, nemo_gamma=None)                 # NeMo undecayed, ours exp(-k/4)
    assert not flat["ok"] and flat["loss_rel_diff"] > 1e-3
    no_confidence = parity.case(holes=True, objective=DSparkObjective(0.1, 0.9, 0.0, "l1"))
    assert not no_confidence["ok"]


def test_the_check_sees_a_dflash_alignment_a_leaking_markov_head_and_holes_that_do_not_cut(parity, monkeypatch):
    from dflash_actors.models import blocks, loss

    teacher_rows = loss.teacher_rows
    monkeypatch.setattr(loss, "teacher_rows", lambda f, p, rows, h, shift=0: teacher_rows(f, p, rows, h, 0))
    unshifted_teacher = parity.case(holes=False)
    assert not unshifted_teacher["ok"] and unshifted_teacher["loss_rel_diff"] > 1e-3
    monkeypatch.undo()
    # The Markov head fed each slot's own label instead of the token before it.
    monkeypatch.setattr(loss.Blocks, "predecessors", lambda self: self.labels[self.rows])
    leaking = parity.case(holes=False)
    assert not leaking["ok"] and leaking["loss_rel_diff"] > 1e-3
    monkeypatch.undo()
    # Holes that zero one slot only, as DFlash's labels do, instead of ending the block.
    block_labels = blocks.block_labels

    def no_cut(tokens, mask, anchors, block_size, shift=0):
        L = tokens.shape[-1]
        pos = anchors[..., None] + torch.arange(block_size) + shift
        flat = pos.clamp(max=L - 1).flatten(-2)
        return (tokens.gather(-1, flat).view(pos.shape),
                (pos < L) & mask.gather(-1, flat).view(pos.shape).bool())
    monkeypatch.setattr(loss, "block_labels", no_cut)
    assert not parity.case(holes=True)["ok"] and parity.case(holes=False)["ok"]
    monkeypatch.setattr(loss, "block_labels", block_labels)
