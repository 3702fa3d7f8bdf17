"""Our DFlash2 selector term under speculators 0.9.0's choices (``train.selector_misses:
insert``, ``train.selector_norm: count``, ``drafter.selector_init: normal``) equals
speculators' own selector loss, imported unmodified from the pinned wheel
(``speculators.models.dflash2.metrics``: ``selector_training_candidates`` and
``compute_selector_loss``; ``model_definitions.CandidateSelector`` scores the
candidates): loss and gradients on the same drafter states, head, tokens and mask. A
control with SpecForge's denominator, or with misses skipped, must fail. Its import needs
``loguru`` and ``hs_connectors``, which this environment lacks and this code path does
not use: both are stubbed while it imports (``benchmarks/peers.py``)."""

import pytest
import torch

from benchmarks import peers
from dflash_actors.models.dflash2 import CandidateSelector, SelectorObjective, selector_rows

STUBS = ("loguru", "hs_connectors")
METRICS = "speculators.models.dflash2.metrics"
DEFS = "speculators.models.dflash2.model_definitions"
N, B, H, V, R, K, GAMMA = 12, 6, 16, 48, 8, 4, 4.0
SPECULATORS = SelectorObjective(1.0, "count", "insert", "full")


@pytest.fixture(scope="module")
def speculators():
    try:
        got = peers.load("speculators", (METRICS, DEFS), stubs=STUBS)
    except peers.PeerUnavailable as e:
        pytest.skip(str(e))
    assert got.record()["peer"] == "speculators " + peers.PINS["speculators"].version
    assert set(got.stubbed) <= set(STUBS)
    return got


def inputs(seed=0):
    """N blocks of B slots: drafter states, a frozen head, block tokens (slot 0 the
    anchor; about half the gold tokens among the head's top-K, the rest not), each slot's
    predecessor (the token before it, the anchor for slots 0 and 1), the supervised
    mask (never slot 0) and DFlash's slot weights ``exp(-(k - 1) / gamma)``."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N * B, H, generator=g)
    head = torch.randn(V, H, generator=g)
    top = (hidden @ head.T).topk(K).indices
    tokens = torch.randint(0, V, (N * B,), generator=g)
    hit = torch.rand(N * B, generator=g) < 0.5
    tokens[hit] = top[hit, torch.randint(0, K, (N * B,), generator=g)[hit]]
    blocks = tokens.view(N, B)
    predecessors = torch.cat([blocks[:, :1], blocks[:, :-1]], dim=1).reshape(-1)
    valid = torch.rand(N, B, generator=g) < 0.8
    valid[:, 0] = False
    k = torch.arange(B, dtype=torch.float32)
    w = (torch.exp(-(k - 1).clamp(min=0) / GAMMA) * (k > 0)).repeat(N)
    return hidden, head, tokens, predecessors, valid.reshape(-1), w


def selector(seed=1):
    s = CandidateSelector(V, H, R, K)
    g = torch.Generator().manual_seed(seed)
    s.reset_parameters(g, successors="normal")
    with torch.no_grad():
        s.hidden_projection.weight.copy_(torch.randn(R, H, generator=g) * 0.02)
    return s


def ours(sel, objective, hidden, head, tokens, predecessors, valid, w):
    """The term as ``loss.blocks_loss`` forms it: ``selector_rows`` over the supervised
    slots, divided by ``SelectorObjective.denominator``."""
    rows = valid.nonzero()[:, 0]
    cand = (hidden.detach() @ head.T).topk(K).indices[rows]
    out = selector_rows(sel, hidden[rows], head, cand, tokens[rows], predecessors[rows], w[rows], objective)
    hit_weight = (w[rows] * out.hit).sum()
    return objective.weight * out.numerator / objective.denominator(w[rows].sum(), hit_weight, len(rows)), out


def theirs(speculators, sel, hidden, head, tokens, predecessors, valid):
    m, d = speculators.modules[METRICS], speculators.modules[DEFS]
    peer = d.CandidateSelector(vocab_size=V, hidden_size=H, rank=R, top_k=K)
    peer.load_state_dict(sel.state_dict())
    unary = (hidden @ head.T)[None]
    cand = unary.topk(K, dim=-1).indices
    training, positions, _ = m.selector_training_candidates(cand, tokens[None])
    logits = peer.score_candidates(unary, hidden[None], predecessors[None], training)
    loss = m.compute_selector_loss(logits, positions, valid[None].float(), B, gamma=GAMMA,
                                   per_position_loss_weight="fixed-exp-decay", dpace_alpha=0.5)
    return loss, peer


def grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


def compare(speculators, objective, seed=0):
    hidden, head, tokens, predecessors, valid, w = inputs(seed)
    sel = selector()
    h1 = hidden.clone().requires_grad_()
    mine, out = ours(sel, objective, h1, head, tokens, predecessors, valid, w)
    mine_g = grads(mine, [h1, *sel.parameters()])
    h2 = hidden.clone().requires_grad_()
    peer_loss, peer = theirs(speculators, sel, h2, head, tokens, predecessors, valid)
    peer_g = grads(peer_loss, [h2, *peer.parameters()])
    mine, peer_loss = mine.detach(), peer_loss.detach()
    rel = abs(float(mine) - float(peer_loss)) / abs(float(peer_loss))
    grad_rel = max(float((a - b).norm() / b.norm()) for a, b in zip(mine_g, peer_g))
    return {"loss": float(mine), "peer": float(peer_loss), "loss_rel_diff": rel, "grad_rel_diff": grad_rel,
            "grads": len(mine_g), "misses": int((~out.hit).sum()), "hits": int(out.hit.sum()),
            "ok": rel < 1e-6 and grad_rel < 1e-5}


@pytest.mark.parametrize("seed", [0, 1])
def test_the_selector_term_and_its_gradients_equal_speculators(speculators, seed):
    got = compare(speculators, SPECULATORS, seed)
    assert got["ok"], got
    assert got["grads"] == 4 and got["hits"] > 5 and got["misses"] > 5    # the injection is exercised


@pytest.mark.parametrize("control", [SelectorObjective(1.0, "dflash", "insert", "full"),
                                     SelectorObjective(1.0, "count", "skip", "full")],
                         ids=["specforge-denominator", "misses-skipped"])
def test_the_check_sees_another_denominator_or_skipped_misses(speculators, control):
    got = compare(speculators, control)
    assert not got["ok"] and got["loss_rel_diff"] > 1e-3, got


def test_the_normal_start_is_speculators():
    """``selector_init: normal``: both codebooks normal(0.02), as speculators draws them
    (``nn.init.normal_(..., std=initializer_range)``); ``zeros`` keeps the successors 0."""
    s = selector()
    for p in (s.predecessor_codebook, s.successor_codebook):
        assert abs(float(p.std()) - 0.02) < 0.003 and abs(float(p.mean())) < 0.003
    s.reset_parameters(torch.Generator().manual_seed(1))
    assert not s.successor_codebook.any() and s.predecessor_codebook.any()
    with pytest.raises(ValueError, match="selector_init"):
        s.reset_parameters(successors="uniform")
