from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_actors.batching import Batch
from dflash_actors.config import load_config
from dflash_actors.models import loss as L
from dflash_actors.models.drafter import build_drafter, sdpa_dense

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def setup(tiny):
    cfg, target = tiny
    drafter = build_drafter(cfg, target)
    with torch.no_grad():      # break the init's symmetry so that leaks would show
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    return cfg, target, drafter


def packed(seqs, masks=None) -> Batch:
    ids = torch.tensor(sum(seqs, []))
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    lm = torch.tensor(sum(masks, []), dtype=torch.int8) if masks else torch.ones(len(ids), dtype=torch.int8)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    return Batch(ids, pos, lm, cu, max(len(s) for s in seqs))


def seq(n, seed):
    return torch.randint(2, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hidden(drafter, target, feats, ids, anchors, embed=None):
    ctx = drafter.context(feats)
    return L.block_hidden(drafter, embed or target.embed_tokens, ctx, torch.as_tensor(ids), torch.tensor(anchors))


# -- masks, labels, anchors -----------------------------------------------------


def test_dense_mask_is_strict_and_block_local():
    m = L.block_mask_dense(torch.tensor([2, 3]), ctx_len=5, block_size=2)[0, 0].int()
    assert m.tolist() == [
        # ctx 0..4    block0  block1
        [1, 1, 0, 0, 0, 1, 1, 0, 0],   # block 0 (a=2) sees ctx < 2 only
        [1, 1, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 1, 1],   # block 1 (a=3) sees ctx < 3, not block 0 though they overlap
        [1, 1, 1, 0, 0, 0, 0, 1, 1],
    ]


def test_labels_are_same_position_and_masked():
    tokens = torch.arange(100, 112)
    lm = torch.ones(12, dtype=torch.int8)
    lm[7] = 0
    labels, valid = L.block_labels(tokens, lm, torch.tensor([3, 9]), block_size=4)
    assert labels[0].tolist() == [103, 104, 105, 106]        # slot k -> tok[a+k], no shift
    assert valid[0].tolist() == [False, True, True, True]    # slot 0 (the anchor) never supervised
    assert valid[1].tolist() == [False, True, True, False]   # 9+3 runs past the end
    labels, valid = L.block_labels(tokens, lm, torch.tensor([5]), block_size=4)
    assert valid[0].tolist() == [False, True, False, True]   # loss_mask[7] == 0


def test_anchor_candidates_need_two_supervised_tokens():
    m = np.array([0, 0, 1, 1, 1, 0, 1, 0, 1, 1])
    assert L.anchor_candidates(m).tolist() == [2, 3, 8]


def test_anchor_sampling_is_seeded_by_position_not_global_state():
    b = packed([seq(40, 1), seq(30, 2)])
    a1 = L.batch_anchors(b, 8, seed=0, epoch=1, batch_id=5)
    torch.manual_seed(123)
    np.random.seed(123)
    a2 = L.batch_anchors(b, 8, seed=0, epoch=1, batch_id=5)
    assert all(np.array_equal(x, y) for x, y in zip(a1, a2))
    assert all(len(x) == 8 and np.all(np.diff(x) > 0) and x.max() <= n - 2 for x, n in zip(a1, (40, 30)))
    other = L.batch_anchors(b, 8, seed=0, epoch=1, batch_id=6)
    assert not np.array_equal(a1[0], other[0])
    few = L.batch_anchors(packed([seq(6, 3)]), 8, seed=0, epoch=0, batch_id=0)
    assert few[0].tolist() == [0, 1, 2, 3, 4]      # fewer candidates than anchors: all of them


def test_gamma_defaults():
    c = lambda b, g=None: load_config(overrides=[f"drafter.block_size={b}"] + ([f"train.gamma={g}"] if g else []))
    assert [L.decay_gamma(c(16)), L.decay_gamma(c(10)), L.decay_gamma(c(8)), L.decay_gamma(c(8, 2.5))] == [7, 5, 4, 2.5]
    w = L.slot_decay(4, 2.0)
    assert w[0] == 0 and w[1] == 1 and torch.isclose(w[3], torch.tensor(np.exp(-1.0), dtype=torch.float32))


# -- leaks ----------------------------------------------------------------------


def test_block_equals_block_computed_alone(setup):
    """The masked, batched blocks equal each block run alone on its own visible context."""
    _, target, d = setup
    ids = seq(30, 4)
    feats = target.features(packed([ids]))
    anchors = [4, 5, 6, 17, 27]                      # overlapping blocks, one running past the end
    together = hidden(d, target, feats, ids, anchors)
    ctx, B = d.context(feats), d.block_size
    for j, a in enumerate(anchors):
        noise_ids = torch.full((1, B), d.mask_token_id)
        noise_ids[0, 0] = ids[a]
        pos = torch.cat([torch.arange(a), a + torch.arange(B)])[None]
        alone = d(target.embed_tokens(noise_ids), ctx[None, :a], pos, sdpa_dense(None))[0]
        torch.testing.assert_close(together[j], alone, rtol=0, atol=1e-5)


def test_context_at_or_after_anchor_is_invisible(setup):
    _, target, d = setup
    ids = seq(30, 5)
    feats = target.features(packed([ids]))
    anchors = [8, 12, 20]
    base = hidden(d, target, feats, ids, anchors)
    f2 = feats.clone()
    f2[12:] += 1.0                                   # the anchor's own state and everything after
    ids2 = ids[:13] + seq(17, 6)                     # tokens after the anchor
    out = hidden(d, target, f2, ids2, anchors)
    assert torch.equal(out[1], base[1]) and torch.equal(out[0], base[0])
    f3 = feats.clone()
    f3[11] += 1.0                                    # the last visible context position
    out = hidden(d, target, f3, ids, anchors)
    assert torch.equal(out[0], base[0]) and not torch.equal(out[1], base[1])


def test_token_perturbations_through_the_target(setup):
    _, target, d = setup
    ids = seq(30, 7)
    anchors = [10, 11, 20]
    base = hidden(d, target, target.features(packed([ids])), ids, anchors)
    later = ids[:11] + seq(19, 8)                    # every token after a_0 changed
    out = hidden(d, target, target.features(packed([later])), later, anchors)
    assert torch.equal(out[0], base[0]) and not torch.equal(out[2], base[2])
    earlier = ids.copy()
    earlier[9] = 3 if ids[9] != 3 else 4             # a context token of block 0
    out = hidden(d, target, target.features(packed([earlier])), earlier, anchors)
    assert not torch.equal(out[0], base[0])


def test_other_blocks_are_invisible(setup):
    _, target, d = setup
    ids = seq(30, 9)
    feats = target.features(packed([ids]))
    anchors = [10, 11, 12]                           # overlapping positions
    base = hidden(d, target, feats, ids, anchors)
    B = d.block_size

    def embed_perturbing_block(j):
        def embed(noise_ids):
            e = target.embed_tokens(noise_ids).clone()
            e[j] += 1.0
            return e
        return embed
    out = hidden(d, target, feats, ids, anchors, embed=embed_perturbing_block(1))
    assert torch.equal(out[0], base[0]) and torch.equal(out[2], base[2]) and not torch.equal(out[1], base[1])
    assert out.shape == (3, B, target.hidden_size)


def test_other_packed_sequences_are_invisible(setup):
    cfg, target, d = setup
    s0, s1 = seq(25, 10), seq(30, 11)
    batch = packed([s0, s1])
    anchors = [np.array([3, 9, 20]), np.array([4, 14])]
    _, _ = L.dflash_loss(d, target, target.features(batch), batch, anchors, 4.0)

    def first_seq_hidden(b):
        f = target.features(b)
        return hidden(d, target, f[:25], b.input_ids[:25], anchors[0])
    base = first_seq_hidden(batch)
    assert torch.equal(first_seq_hidden(packed([s0, seq(30, 12)])), base)


# -- loss ---------------------------------------------------------------------


def test_loss_is_weighted_mean_of_block_ce(setup):
    _, target, d = setup
    s0, s1 = seq(25, 13), seq(18, 14)
    m0 = [0] * 5 + [1] * 20
    m1 = [1] * 10 + [0] * 2 + [1] * 6
    batch = packed([s0, s1], [m0, m1])
    anchors = [np.array([5, 12, 22]), np.array([0, 7, 13])]
    feats = target.features(batch)
    loss, stats = L.dflash_loss(d, target, feats, batch, anchors, gamma=4.0)
    decay = L.slot_decay(d.block_size, 4.0)
    num = den = 0.0
    for (s, e), a in zip(batch.sequences(), anchors):
        h = hidden(d, target, feats[s:e], batch.input_ids[s:e], a)
        lab, valid = L.block_labels(batch.input_ids[s:e], batch.loss_mask[s:e], torch.tensor(a), d.block_size)
        ce = torch.nn.functional.cross_entropy(target.lm_head(h).flatten(0, 1), lab.flatten(), reduction="none")
        w = (valid.float() * decay).flatten()
        num, den = num + (ce * w).sum(), den + w.sum()
    torch.testing.assert_close(loss, num / den, rtol=1e-5, atol=0)
    assert stats.blocks == 6 and stats.slot_total[0] == 0 and stats.slot_total[1] == 6


def test_chunked_ce_matches_unchunked(setup, monkeypatch):
    cfg, target, d = setup
    batch = packed([seq(40, 15), seq(33, 16)])
    feats = target.features(batch)
    anchors = L.batch_anchors(batch, 8, 0, 0, 0)

    def loss_and_grads():
        d.zero_grad(set_to_none=True)
        loss, stats = L.dflash_loss(d, target, feats, batch, anchors, 4.0)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in d.parameters()], stats
    whole = loss_and_grads()
    monkeypatch.setattr(L, "CE_CHUNK_ROWS", 7)
    chunked = loss_and_grads()
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-6, atol=0)
    for a, b in zip(chunked[1], whole[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    assert chunked[2].accepted == whole[2].accepted and torch.equal(chunked[2].slot_correct, whole[2].slot_correct)


def test_no_anchor_batch_gives_zero_gradients(setup):
    _, target, d = setup
    batch = packed([seq(12, 17)], [[0] * 12])
    d.zero_grad(set_to_none=True)
    loss, stats = L.dflash_loss(d, target, target.features(batch), batch, L.all_anchors(batch), 4.0)
    loss.backward()
    assert stats.blocks == 0 and float(loss.detach()) == 0.0
    assert all(p.grad is not None and not p.grad.any() for p in d.parameters())


def test_tau_counts_leading_correct_slots():
    s = L.BlockStats(blocks=4, accepted=6, slot_correct=torch.tensor([0, 3, 2, 1]),
                     slot_total=torch.tensor([0, 4, 4, 4]), weighted_ce=2.0, weight=4.0)
    m = s.metrics()
    assert m["tau"] == 2.5 and m["slot_acc"] == [0.75, 0.5, 0.25] and m["loss"] == 0.5


def test_label_alignment_perfect_context(setup):
    """Trained on a deterministic successor map f, slot k predicts f^k(tok[a]) = tok[a+k]."""
    cfg, target, d0 = setup
    d = build_drafter(cfg, target)
    rng = np.random.default_rng(0)
    order = rng.permutation(np.arange(2, 42))
    succ = np.zeros(256, np.int64)
    succ[order] = np.roll(order, -1)

    def chain(start, n):
        out = [int(start)]
        for _ in range(n - 1):
            out.append(int(succ[out[-1]]))
        return out
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    for step in range(150):
        batch = packed([chain(x, 48) for x in rng.choice(order, 8)])
        loss, _ = L.batch_loss(d, target, target.features(batch), batch, num_anchors=16, gamma=4.0,
                               seed=0, epoch=0, batch_id=step)
        opt.zero_grad()
        loss.backward()
        opt.step()
    ids = chain(order[5], 40)
    anchors = [7, 19, 30]
    with torch.no_grad():
        pred = target.lm_head(hidden(d, target, target.features(packed([ids])), ids, anchors)).argmax(-1)
    want = torch.tensor([[ids[a + k] for k in range(1, d.block_size)] for a in anchors])
    shifted = torch.tensor([[ids[a + k + 1] for k in range(1, d.block_size)] for a in anchors])
    assert (pred[:, 1:] == want).float().mean() > 0.9
    assert (pred[:, 1:] == shifted).float().mean() < 0.1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_attention_matches_dense_mask(setup):
    _, target, d = setup
    ids = torch.tensor(seq(64, 18), device="cuda")
    anchors = torch.tensor([3, 4, 20, 40, 62], device="cuda")
    d = d.to("cuda")
    embed = target.embed_tokens.to("cuda")
    ctx = d.context(torch.randn(64, d.fc.in_features, device="cuda"))
    flex = L.block_hidden(d, embed, ctx, ids, anchors)
    n, B = len(anchors), d.block_size
    noise = embed(torch.cat([ids[anchors][:, None], torch.full((n, B - 1), d.mask_token_id, device="cuda")], 1))
    pos = torch.cat([torch.arange(64, device="cuda"), (anchors[:, None] + torch.arange(B, device="cuda")).flatten()])
    dense = d(noise.reshape(1, n * B, -1), ctx[None], pos[None], sdpa_dense(L.block_mask_dense(anchors, 64, B)))
    torch.testing.assert_close(flex, dense.reshape(n, B, -1), rtol=1e-4, atol=1e-4)
