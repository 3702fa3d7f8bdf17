"""Our DFlash training step equals SpecForge's own (``OnlineDFlashModel`` over its
``DFlashDraftModel``), both imported unmodified from the pinned ``specforge`` wheel
(``make peers``). Skipped only where that wheel could not be fetched, with the reason.

Same drafter weights, frozen embedding and head, two rows of different lengths (padded
for SpecForge, packed for us) with holes in their loss masks, and the anchors our seeded
draw picks (forced on SpecForge's trainer instance; its class is untouched): loss, every
gradient and the accuracy agree, whether our step runs in one pass or in micro-batches.
SpecForge's own anchor sampler, left to take every anchor it can, takes exactly ours.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchmarks import nemo_dflash2, peers
from dflash_actors.data.batching import Batch
from dflash_actors.models import blocks as blocks_module
from dflash_actors.models.blocks import anchor_candidates, batch_anchors
from dflash_actors.models.drafter import DFlashDrafter
from dflash_actors.models.loss import Objective
from dflash_actors.train.drafter_step import drafter_step

MODEL = "specforge.algorithms.common.dflash_family_model"
DRAFT = "specforge.modeling.draft.dflash"
RTOL = 1e-5
"""Float32 sums taken in another order."""
LENGTHS = (40, 29)
OBJECTIVE = Objective(num_anchors=6, gamma=7.0, seed=3)


@pytest.fixture(scope="module")
def specforge():
    try:
        return peers.load("specforge", (MODEL, DRAFT))
    except peers.PeerUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def case():
    """Config, weights, frozen parts, padded rows and the packed batch of the same text."""
    torch.set_num_threads(1)
    cfg = nemo_dflash2.tiny_config()
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        del cfg.dflash_config[key]
    g = torch.Generator().manual_seed(0)
    state = {k: v for k, v in nemo_dflash2.random_state(cfg, g).items() if "_conv." not in k and "selector" not in k}
    H, V, L = cfg.hidden_size, cfg.vocab_size, max(LENGTHS)
    embed = torch.nn.Embedding.from_pretrained(torch.randn(V, H, generator=g), freeze=True)
    head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    head.weight.data.copy_(torch.randn(V, H, generator=g) / H ** 0.5)
    head.weight.data[:8] *= 4.0      # the text's tokens (0..7) lead the logits: some slots are right
    ids = torch.randint(0, 8, (2, L), generator=g)
    mask = torch.zeros(2, L)
    mask[0, 5:40], mask[1, 4:29] = 1, 1
    mask[0, [14, 20, 30]] = mask[1, 17] = 0
    feats = torch.randn(2, L, 2 * H, generator=g)
    for r, n in enumerate(LENGTHS):       # padding: no loss, no features
        ids[r, n:], feats[r, n:] = 0, 0
    batch = Batch(torch.cat([ids[r, :n] for r, n in enumerate(LENGTHS)]),
                  torch.cat([torch.arange(n) for n in LENGTHS]),
                  torch.cat([mask[r, :n] for r, n in enumerate(LENGTHS)]).to(torch.int8),
                  torch.tensor(np.cumsum((0,) + LENGTHS), dtype=torch.int32), L)
    packed = torch.cat([feats[r, :n] for r, n in enumerate(LENGTHS)])
    return SimpleNamespace(cfg=cfg, state=state, frozen=SimpleNamespace(embed_tokens=embed, lm_head=head),
                           ids=ids, mask=mask, feats=feats, batch=batch, packed=packed)


def trainer(specforge, c, num_anchors: int):
    draft = specforge.modules[DRAFT].DFlashDraftModel(c.cfg).to(torch.float32)
    draft.load_state_dict(c.state, strict=True)
    return specforge.modules[MODEL].OnlineDFlashModel(
        draft, c.frozen.lm_head, c.frozen.embed_tokens, mask_token_id=c.cfg.dflash_config["mask_token_id"],
        block_size=c.cfg.block_size, attention_backend="sdpa", num_anchors=num_anchors,
        loss_decay_gamma=OBJECTIVE.gamma, objective_chunk_blocks=0)


def specforge_step(specforge, c, anchors: list[np.ndarray]) -> dict:
    model = trainer(specforge, c, OBJECTIVE.num_anchors)
    n = max(len(a) for a in anchors)
    forced, keep = torch.zeros(len(anchors), n, dtype=torch.long), torch.zeros(len(anchors), n, dtype=torch.bool)
    for r, a in enumerate(anchors):
        forced[r, :len(a)], keep[r, :len(a)] = torch.as_tensor(a), True
    # An instance attribute shadows the bound sampler; SpecForge's class is untouched.
    model._sample_anchor_positions = lambda seq_len, loss_mask, device: (forced, keep)
    loss, accuracy, _ = model(c.ids, c.feats, c.mask)
    loss.backward()
    return {"loss": float(loss.detach()), "accuracy": float(accuracy),
            "grads": {n: p.grad for n, p in model.draft_model.named_parameters()}}


def our_step(c, block_tokens: int | None) -> dict:
    drafter = DFlashDrafter(c.cfg)
    drafter.load_state_dict(c.state, strict=True)
    stats = drafter_step(drafter, c.frozen, c.packed, c.batch, OBJECTIVE, epoch=0, batch_id=5,
                         block_tokens=block_tokens)
    return {"loss": stats.weighted_ce / stats.weight,
            "accuracy": float(stats.slot_correct.sum() / stats.slot_total.sum()),
            "grads": {n: p.grad for n, p in drafter.named_parameters()}}


def worst_grad(ours: dict, theirs: dict) -> float:
    assert set(ours["grads"]) == set(theirs["grads"])
    return max(float((ours["grads"][n] - t).abs().max() / t.abs().max()) for n, t in theirs["grads"].items())


@pytest.mark.parametrize("block_tokens", [None, 16])
def test_loss_gradients_and_accuracy_equal_specforges(specforge, case, block_tokens):
    assert specforge.record()["peer"] == "specforge " + peers.PINS["specforge"].version
    anchors = batch_anchors(case.batch, OBJECTIVE.num_anchors, OBJECTIVE.seed, 0, 5)
    theirs = specforge_step(specforge, case, anchors)
    ours = our_step(case, block_tokens)
    assert abs(ours["loss"] - theirs["loss"]) <= RTOL * theirs["loss"]
    assert worst_grad(ours, theirs) < RTOL
    assert ours["accuracy"] == pytest.approx(theirs["accuracy"], abs=1e-6) and ours["accuracy"] > 0


def test_specforges_sampler_draws_from_our_anchor_candidates(specforge, case):
    model = trainer(specforge, case, num_anchors=1000)
    anchors, keep = model._sample_anchor_positions(case.ids.shape[1], case.mask, "cpu")
    for r, n in enumerate(LENGTHS):
        assert anchors[r][keep[r]].tolist() == anchor_candidates(case.mask[r, :n].numpy()).tolist()


def test_the_check_sees_a_mask_that_shows_the_anchors_own_state(specforge, case, monkeypatch):
    anchors = batch_anchors(case.batch, OBJECTIVE.num_anchors, OBJECTIVE.seed, 0, 5)
    theirs = specforge_step(specforge, case, anchors)
    visible = blocks_module.visible

    def leaking(row, q, kv, anchors, lengths, ctx_len, block_size, window=None):
        anchor = anchors[row, q // block_size]
        seen = visible(row, q, kv, anchors, lengths, ctx_len, block_size, window)
        return seen | ((kv == anchor) & (kv < lengths[row]))

    monkeypatch.setattr(blocks_module, "visible", leaking)
    assert worst_grad(our_step(case, None), theirs) > 1e-3
