import contextlib
import copy
import functools
import math
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dflash_actors.config import load_config
from dflash_actors.data.batching import Batch
from dflash_actors.models import blocks as BL
from dflash_actors.models import head_loss as H
from dflash_actors.models import loss as L
from dflash_actors.models.drafter import sdpa_dense
from dflash_actors.models.drafter_start import build_drafter
from tests.support.oracle_loss import dflash_loss_per_sequence

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


# Packed around the sequence under test (row 1): a longer one with more anchors and a
# shorter one with fewer, so its row has padding columns and padding blocks.
LONGER, LONGER_ANCHORS = seq(41, 100), np.array([3, 4, 11, 20, 30, 38, 39])
SHORTER, SHORTER_ANCHORS = seq(9, 101), np.array([2])


def hidden(drafter, target, feats, ids, anchors, embed=None):
    """Hidden states ``[N, B, H]`` of one sequence's blocks, from the batched path with
    the sequence at row 1 between ``LONGER`` and ``SHORTER``."""
    batch = packed([LONGER, torch.as_tensor(ids).tolist(), SHORTER])
    feats = torch.cat([target.features(packed([LONGER])), feats, target.features(packed([SHORTER]))])
    h, p = BL.batch_hidden(drafter, embed or target.embed_tokens, feats, batch,
                          [LONGER_ANCHORS, np.asarray(anchors), SHORTER_ANCHORS])
    assert p.seq == [0, 1, 2]
    return h[1, :len(anchors)]


def attention_case(device):
    """Random q, k, v ``[R=3, heads, N*B, ...]`` and the rule's inputs for a small padded
    batch: ragged anchor counts, overlapping anchors, rows shorter than the context."""
    g = torch.Generator().manual_seed(0)
    B, C, lengths = 8, 150, [150, 97, 40]
    rows = [np.sort(np.random.default_rng(1).choice(148, 20, replace=False)),
            np.array([0, 3, 5, 6, 40, 41, 95]), np.array([10, 38])]
    anchors = torch.zeros(3, 20, dtype=torch.long)
    for r, a in enumerate(rows):
        anchors[r, :len(a)] = torch.from_numpy(a)
    Q = 20 * B
    q = torch.randn(3, 4, Q, 16, generator=g)
    k, v = (torch.randn(3, 2, C + Q, 16, generator=g) for _ in range(2))      # grouped-query heads
    mv = lambda t: t.to(device)
    return mv(q), mv(k), mv(v), mv(anchors), mv(torch.tensor(lengths)), C, B


def attention_and_grads(attend, q, k, v):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    out.backward(torch.cos(torch.arange(out.numel(), device=out.device, dtype=out.dtype)).view_as(out))
    return out.detach(), q.grad, k.grad, v.grad


# -- masks, labels, anchors -----------------------------------------------------


def test_dense_mask_is_strict_and_block_local():
    m = BL.block_mask_dense(torch.tensor([[2, 3]]), torch.tensor([5]), ctx_len=5, block_size=2)[0, 0].int()
    assert m.tolist() == [
        # ctx 0..4    block0  block1
        [1, 1, 0, 0, 0, 1, 1, 0, 0],   # block 0 (a=2) sees ctx < 2 only
        [1, 1, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 1, 1],   # block 1 (a=3) sees ctx < 3, not block 0 though they overlap
        [1, 1, 1, 0, 0, 0, 0, 1, 1],
    ]


def test_batched_dense_mask_is_per_row():
    # Row 0: length 5, anchors 2 and 4; row 1: length 3, one anchor 1 and a padding block.
    m = BL.block_mask_dense(torch.tensor([[2, 4], [1, 0]]), torch.tensor([5, 3]), ctx_len=5, block_size=2)
    assert m.shape == (2, 1, 4, 9)
    assert m[:, 0].int().tolist() == [
        [   # ctx 0..4       block0  block1
            [1, 1, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 1, 1],   # a=4: ctx < 4, not its own anchor's state
            [1, 1, 1, 1, 0, 0, 0, 1, 1],
        ],
        [
            [1, 0, 0, 0, 0, 1, 1, 0, 0],   # a=1 in a row of length 3
            [1, 0, 0, 0, 0, 1, 1, 0, 0],
            [0, 0, 0, 0, 0, 0, 0, 1, 1],   # padding block: only itself
            [0, 0, 0, 0, 0, 0, 0, 1, 1],
        ],
    ]
    # A row's padding columns stay hidden even from an anchor past them.
    m = BL.block_mask_dense(torch.tensor([[4], [4]]), torch.tensor([5, 2]), ctx_len=5, block_size=1)
    assert m[:, 0, 0, :5].int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]


def test_labels_are_same_position_and_masked():
    tokens = torch.arange(100, 112)
    lm = torch.ones(12, dtype=torch.int8)
    lm[7] = 0
    labels, valid = BL.block_labels(tokens, lm, torch.tensor([3, 9]), block_size=4)
    assert labels[0].tolist() == [103, 104, 105, 106]        # slot k -> tok[a+k], no shift
    assert valid[0].tolist() == [False, True, True, True]    # slot 0 (the anchor) never supervised
    assert valid[1].tolist() == [False, True, True, False]   # 9+3 runs past the end
    labels, valid = BL.block_labels(tokens, lm, torch.tensor([5]), block_size=4)
    assert valid[0].tolist() == [False, True, False, True]   # loss_mask[7] == 0
    # Right-padded rows: a row's padding (loss_mask 0) is as invalid as its end.
    tok2 = torch.stack([tokens, torch.cat([tokens[:6], torch.zeros(6, dtype=torch.long)])])
    lm2 = torch.stack([lm, torch.tensor([1] * 6 + [0] * 6, dtype=torch.int8)])
    labels, valid = BL.block_labels(tok2, lm2, torch.tensor([[9], [3]]), block_size=4)
    assert labels[1, 0, :3].tolist() == [103, 104, 105]
    assert valid[:, 0].tolist() == [[False, True, True, False], [False, True, True, False]]


def test_anchor_candidates_need_two_supervised_tokens():
    m = np.array([0, 0, 1, 1, 1, 0, 1, 0, 1, 1])
    assert BL.anchor_candidates(m).tolist() == [2, 3, 8]


def test_anchor_sampling_is_seeded_by_position_not_global_state():
    b = packed([seq(40, 1), seq(30, 2)])
    a1 = BL.batch_anchors(b, 8, seed=0, epoch=1, batch_id=5)
    torch.manual_seed(123)
    np.random.seed(123)
    a2 = BL.batch_anchors(b, 8, seed=0, epoch=1, batch_id=5)
    assert all(np.array_equal(x, y) for x, y in zip(a1, a2))
    assert all(len(x) == 8 and np.all(np.diff(x) > 0) and x.max() <= n - 2 for x, n in zip(a1, (40, 30)))
    other = BL.batch_anchors(b, 8, seed=0, epoch=1, batch_id=6)
    assert not np.array_equal(a1[0], other[0])
    few = BL.batch_anchors(packed([seq(6, 3)]), 8, seed=0, epoch=0, batch_id=0)
    assert few[0].tolist() == [0, 1, 2, 3, 4]      # fewer candidates than anchors: all of them


def test_gamma_defaults():
    c = lambda b, g=None: load_config(overrides=[f"drafter.block_size={b}"] + ([f"train.gamma={g}"] if g else []))
    assert [L.decay_gamma(c(16)), L.decay_gamma(c(10)), L.decay_gamma(c(8)), L.decay_gamma(c(8, 2.5))] == [7, 5, 4, 2.5]
    w = L.slot_decay(4, 2.0)
    assert w[0] == 0 and w[1] == 1 and torch.isclose(w[3], torch.tensor(np.exp(-1.0), dtype=torch.float32))


def test_autocast_is_bf16_on_cuda_by_default_and_on_cpu_when_asked():
    for device, dtype in [("cpu", "auto"), (torch.device("cpu"), "float32"), ("cuda", "float32")]:
        assert isinstance(BL.autocast_for(device, dtype), contextlib.nullcontext)
    ac = BL.autocast_for("cpu", "bfloat16")
    assert isinstance(ac, torch.autocast) and ac.device == "cpu" and ac.fast_dtype == torch.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # without CUDA torch disables it, saying so
        for dtype in ("auto", "bfloat16"):
            ac = BL.autocast_for(torch.device("cuda", 0), dtype)
            assert isinstance(ac, torch.autocast) and ac.device == "cuda" and ac.fast_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="compute_dtype"):
        BL.autocast_for("cpu", "float16")


# -- flex_attention -------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_matches_dense_mask_on_cpu(monkeypatch):
    """The CUDA path's ``BlockMask`` against the CPU path's dense mask, on CPU.

    Its block tables (which tiles a kernel visits, and which it visits without calling
    ``mask_mod``) must agree with the dense mask tile by tile, and flex_attention with
    it must equal sdpa with the dense mask, outputs and q/k/v gradients. Eager
    flex_attention: compiling it for CPU took 15-45 s on two cores, and compiled CPU flex
    has no backward. Eager flex evaluates ``mask_mod`` through its own vmap over the
    captured per-row tensors but ignores the block tables, hence their own check; torch
    refuses its CPU backward by an up-front device check only, lifted here.
    """
    from torch.nn.attention import flex_attention as fa

    q, k, v, anchors, lengths, C, B = attention_case("cpu")
    dense = BL.block_mask_dense(anchors, lengths, C, B)
    bm = BL.flex_block_mask(anchors, lengths, C, B)
    (R, _, Q, KV), (tq, tk) = dense.shape, bm.BLOCK_SIZE
    nq, nk = -(-Q // tq), -(-KV // tk)
    assert nq > 1 and nk > 2                      # several tiles, so the tables say something
    tiles = F.pad(dense, (0, nk * tk - KV, 0, nq * tq - Q)).view(R, 1, nq, tq, nk, tk)

    def table(num, idx):
        t = torch.zeros(R, 1, nq, nk, dtype=torch.bool)
        for r in range(R):
            for i in range(nq):
                t[r, 0, i, idx[r, 0, i, :num[r, 0, i]]] = True
        return t
    full = table(bm.full_kv_num_blocks, bm.full_kv_indices)
    partial = table(bm.kv_num_blocks, bm.kv_indices)
    assert torch.equal(full | partial, tiles.any(5).any(3))
    assert torch.equal(full, tiles.all(5).all(3)) and not (full & partial).any()

    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)
    attend = BL.flex_attend(bm, fa.flex_attention)         # what make_attend returns on CUDA, eager
    flex = attention_and_grads(attend, q, k, v)
    ref = attention_and_grads(sdpa_dense(dense), q, k, v)
    for a, b in zip(flex, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Under autocast the drafter hands over fp32 queries and keys (after the RMSNorms)
    # with bf16 values: autocast casts sdpa's inputs, the wrapper casts flex's (compiled
    # flex may not take mixed dtypes; eager flex here does, so a spy checks the wrapper).
    seen = []
    spy = BL.flex_attend(bm, lambda q, k, v, **kw: seen.append((q.dtype, k.dtype, v.dtype)) or fa.flex_attention(
        q, k, v, **kw))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = spy(q, k, v.bfloat16())
        want = sdpa_dense(dense)(q, k, v.bfloat16())
    spy(q, k, v.bfloat16())
    assert seen == [(torch.bfloat16,) * 3, (torch.float32,) * 3]      # autocast's dtype, else the queries'
    torch.testing.assert_close(mixed.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_attention_matches_dense_mask_on_cuda():
    q, k, v, anchors, lengths, C, B = attention_case("cuda")
    attend = BL.make_attend(anchors, lengths, C, B)            # compiled flex on CUDA
    flex = attention_and_grads(attend, q, k, v)
    ref = attention_and_grads(sdpa_dense(BL.block_mask_dense(anchors, lengths, C, B)), q, k, v)
    for a, b in zip(flex, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# -- the batched objective against the per-sequence oracle ---------------------------


def oracle_cases():
    """Packed batches with ragged lengths, a row without anchors, rows with different
    anchor counts, anchors closer than a block apart and at ``L-2``, loss-mask holes."""
    masks = [[1] * 30, [1] * 7, [0] * 3 + [1] * 20 + [0] * 4 + [1] * 18, [1] * 5 + [0] * 2 + [1] * 5]
    fixed = (packed([seq(30, 20), seq(7, 21), seq(45, 22), seq(12, 23)], masks),
             [np.array([4, 5, 6, 20, 28]), np.array([], np.int64), np.array([3, 4, 10, 11, 12, 27, 40, 43]),
              np.array([2, 8])])
    cases = [fixed]
    for seed in range(3):
        rng = np.random.default_rng(seed)
        lengths = rng.integers(5, 60, size=rng.integers(3, 7))
        masks = [(rng.random(n) > 0.15).astype(int).tolist() for n in lengths]
        anchors = []
        for m in masks:
            cand = BL.anchor_candidates(np.array(m))
            anchors.append(np.sort(rng.choice(cand, rng.integers(0, len(cand) + 1), replace=False)))
        anchors[int(rng.integers(len(anchors)))] = np.array([], np.int64)
        cases.append((packed([seq(int(n), 30 + 10 * seed + i) for i, n in enumerate(lengths)], masks), anchors))
    return cases


def loss_and_grads(fn, d, *args):
    d.zero_grad(set_to_none=True)
    loss, stats = fn(d, *args, 4.0)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in d.parameters()], stats


def test_batched_loss_equals_per_sequence_oracle(setup):
    _, target, d = setup
    for batch, anchors in oracle_cases():
        feats = target.features(batch)
        loss, grads, stats = loss_and_grads(L.dflash_loss, d, target, feats, batch, anchors)
        want, want_grads, want_stats = loss_and_grads(dflash_loss_per_sequence, d, target, feats, batch, anchors)
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
        for (name, _), g, w in zip(d.named_parameters(), grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * float(w.abs().max()), msg=name)
        assert stats.blocks == want_stats.blocks == sum(map(len, anchors))
        assert stats.accepted == want_stats.accepted
        assert torch.equal(stats.slot_correct, want_stats.slot_correct)
        assert torch.equal(stats.slot_total, want_stats.slot_total)
        assert stats.weight == pytest.approx(want_stats.weight, rel=1e-6)


def distilling(target):
    """The same target, its feature slots ending with its last layer (``train.loss: distill``)."""
    from dflash_actors.models.target import TargetModel

    return TargetModel(target.model, target.layer_ids, teacher=True)


def test_distillation_equals_the_oracle_on_the_targets_own_logits(setup):
    """``loss="distill"``: every slot learns the target's softmax one position back, its
    logits from the model's own forward here (not from the feature slot's last columns)."""
    _, target, d = setup
    teacher = distilling(target)

    def own_logits(ids):
        with torch.no_grad():
            return target.model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None],
                                use_cache=False).logits[0]
    for batch, anchors in oracle_cases()[:3]:
        feats = teacher.features(batch)
        assert feats.shape[1] == (len(target.layer_ids) + 1) * target.hidden_size
        assert torch.equal(feats[:, :-target.hidden_size], target.features(batch))
        loss, grads, stats = loss_and_grads(functools.partial(L.dflash_loss, loss="distill"), d, target, feats,
                                            batch, anchors)
        want, want_grads, want_stats = loss_and_grads(
            functools.partial(dflash_loss_per_sequence, teacher_logits=own_logits), d, target, feats, batch, anchors)
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
        for (name, _), g, w in zip(d.named_parameters(), grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * float(w.abs().max()), msg=name)
        assert stats.accepted == want_stats.accepted and torch.equal(stats.slot_correct, want_stats.slot_correct)
        plain, _, _ = loss_and_grads(L.dflash_loss, d, target, feats, batch, anchors)
        assert not torch.isclose(plain, loss)     # the extra columns change what is learnt, not the context


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_loss_on_cuda_matches_cpu(setup):
    """The whole objective on CUDA (flex) against CPU (dense): fp32 closely, bf16 loosely."""
    _, target, d = setup
    batch, anchors = oracle_cases()[0]
    feats = target.features(batch)
    cpu_loss, cpu_grads, cpu_stats = loss_and_grads(L.dflash_loss, d, target, feats, batch, anchors)
    dc = copy.deepcopy(d).cuda()
    head = SimpleNamespace(embed_tokens=copy.deepcopy(target.embed_tokens).cuda(),
                           lm_head=copy.deepcopy(target.lm_head).cuda())
    args = (dc, head, feats.cuda(), batch.to("cuda"), anchors)
    loss, grads, stats = loss_and_grads(lambda *a: L.dflash_loss(*a, compute_dtype="float32"), *args)
    torch.testing.assert_close(loss.cpu(), cpu_loss, rtol=1e-4, atol=1e-5)
    for a, b in zip(grads, cpu_grads):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-3, atol=1e-4 * float(b.abs().max()) + 1e-7)
    assert stats.blocks == cpu_stats.blocks and torch.equal(stats.slot_total, cpu_stats.slot_total)
    bf16, _, _ = loss_and_grads(L.dflash_loss, *args)                     # "auto": bf16 autocast
    torch.testing.assert_close(bf16.cpu(), cpu_loss, rtol=3e-2, atol=0)


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
        def embed(noise_ids):                        # [R, N, B]: row 1 is the sequence under test
            e = target.embed_tokens(noise_ids).clone()
            e[1, j] += 1.0
            return e
        return embed
    out = hidden(d, target, feats, ids, anchors, embed=embed_perturbing_block(1))
    assert torch.equal(out[0], base[0]) and torch.equal(out[2], base[2]) and not torch.equal(out[1], base[1])
    assert out.shape == (3, B, target.hidden_size)


def test_other_packed_sequences_are_invisible(setup):
    """Changing sequence r' changes no output of any other row, whether the change keeps
    the padded shapes or makes r' the longest row with the most anchors."""
    _, target, d = setup
    seqs = [seq(25, 10), seq(30, 11), seq(18, 12)]
    anchors = [np.array([3, 9, 20]), np.array([4, 5, 14, 27]), np.array([0, 16])]

    def rows(seqs, anchors):
        batch = packed(seqs)
        h, p = BL.batch_hidden(d, target.embed_tokens, target.features(batch), batch, anchors)
        return [h[r, :len(a)] for r, a in enumerate(anchors)]
    base = rows(seqs, anchors)
    same_shape = rows([seqs[0], seq(30, 13), seqs[2]], anchors)
    assert torch.equal(same_shape[0], base[0]) and torch.equal(same_shape[2], base[2])
    assert not torch.equal(same_shape[1], base[1])
    longer = rows([seqs[0], seq(50, 14), seqs[2]], [anchors[0], np.array([1, 2, 3, 30, 31, 40, 48]), anchors[2]])
    for r in (0, 2):
        torch.testing.assert_close(longer[r], base[r], rtol=1e-5, atol=1e-5)   # other shapes: rounding only


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
        lab, valid = BL.block_labels(batch.input_ids[s:e], batch.loss_mask[s:e], torch.tensor(a), d.block_size)
        ce = torch.nn.functional.cross_entropy(target.lm_head(h).flatten(0, 1), lab.flatten(), reduction="none")
        w = (valid.float() * decay).flatten()
        num, den = num + (ce * w).sum(), den + w.sum()
    torch.testing.assert_close(loss, num / den, rtol=1e-5, atol=0)
    assert stats.blocks == 6 and stats.slot_total[0] == 0 and stats.slot_total[1] == 6


def test_chunked_ce_matches_unchunked(setup, monkeypatch):
    cfg, target, d = setup
    batch = packed([seq(40, 15), seq(33, 16)])
    feats = target.features(batch)
    anchors = BL.batch_anchors(batch, 8, 0, 0, 0)

    def loss_and_grads():
        d.zero_grad(set_to_none=True)
        loss, stats = L.dflash_loss(d, target, feats, batch, anchors, 4.0)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in d.parameters()], stats
    whole = loss_and_grads()
    monkeypatch.setattr(H, "CE_CHUNK_ROWS", 7)
    chunked = loss_and_grads()
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-6, atol=0)
    for a, b in zip(chunked[1], whole[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    assert chunked[2].accepted == whole[2].accepted and torch.equal(chunked[2].slot_correct, whole[2].slot_correct)


def test_no_anchor_batch_gives_zero_gradients(setup):
    _, target, d = setup
    batch = packed([seq(12, 17)], [[0] * 12])
    d.zero_grad(set_to_none=True)
    loss, stats = L.dflash_loss(d, target, target.features(batch), batch, BL.all_anchors(batch), 4.0)
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
        loss, _ = L.batch_loss(d, target, target.features(batch), batch, L.Objective(16, 4.0, 0),
                               epoch=0, batch_id=step)
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


# -- the frozen head: fused against checkpointed; D-PACE -------------------------


@pytest.mark.parametrize("chunk", [H.CE_CHUNK_ROWS, 7])
def test_fused_head_equals_checkpointed(setup, monkeypatch, chunk):
    """The fused CE (gradient made in the forward) gives the checkpointed path's loss,
    stats and gradients, in one chunk and in many, for CE and for distillation (whose
    slots' extra columns plain CE must ignore)."""
    _, target, d = setup
    monkeypatch.setattr(H, "CE_CHUNK_ROWS", chunk)
    for batch, anchors in oracle_cases()[:2]:
        feats = distilling(target).features(batch)
        for weighting, loss in (("decay", "ce"), ("dpace", "ce"), ("decay", "distill"), ("dpace", "distill")):
            runs = [loss_and_grads(functools.partial(L.dflash_loss, head_loss=how, position_weight=weighting,
                                                     loss=loss),
                                   d, target, feats, batch, anchors) for how in ("fused", "checkpointed")]
            (loss, grads, stats), (want, want_grads, want_stats) = runs
            torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
            for (name, _), g, w in zip(d.named_parameters(), grads, want_grads):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6 * float(w.abs().max()), msg=name)
            assert stats.accepted == want_stats.accepted and torch.equal(stats.slot_correct, want_stats.slot_correct)


def test_fused_ce_values_and_gradient_of_a_weighted_sum():
    """Against plain autograd over whole logits, with weights on the rows, in fp32."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(23, 16, generator=g, dtype=torch.float64).float().requires_grad_()
    W = torch.randn(50, 16, generator=g)
    lab, w = torch.randint(0, 50, (23,), generator=g), torch.rand(23, generator=g)
    ce, pred, hard, cand = H.fused_ce(h, W, lab, top_k=5)      # and a DFlash2's candidates
    (ce * w).sum().backward()
    h2 = h.detach().clone().requires_grad_()
    logits = h2 @ W.T
    want = F.cross_entropy(logits, lab, reduction="none")
    (want * w).sum().backward()
    torch.testing.assert_close(ce, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(hard, ce.detach())
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(pred, logits.argmax(-1)) and torch.equal(cand, logits.topk(5).indices)
    assert H.fused_ce(h, W, lab)[3].shape == (23, 0)
    with pytest.raises(ValueError, match="frozen"):
        H.fused_ce(h, W.clone().requires_grad_(), lab)


@pytest.mark.parametrize("how", ["fused", "checkpointed"])
def test_distillation_rows_against_whole_logits(how, monkeypatch):
    """With teacher rows the loss is CE against softmax(teacher @ W.T), its gradient that
    of plain autograd, and the third result the CE against the labels, in chunks too."""
    monkeypatch.setattr(H, "CE_CHUNK_ROWS", 10)
    g = torch.Generator().manual_seed(4)
    h = torch.randn(23, 16, generator=g).requires_grad_()
    W, t = torch.randn(50, 16, generator=g), torch.randn(23, 16, generator=g)
    lab, w = torch.randint(0, 50, (23,), generator=g), torch.rand(23, generator=g)
    loss, pred, hard = H.head_ce(h, W, lab, how, teacher=t)
    (loss * w).sum().backward()
    h2 = h.detach().clone().requires_grad_()
    logits = h2 @ W.T
    want = -((t @ W.T).softmax(-1) * logits.log_softmax(-1)).sum(-1)
    (want * w).sum().backward()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hard, F.cross_entropy(logits, lab, reduction="none").detach(), rtol=1e-6, atol=1e-6)
    # softmax - p cancels: the error is fp32 rounding of the gradient's scale, not of each element.
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-6 * float(h2.grad.abs().max()))
    assert torch.equal(pred, logits.argmax(-1))
    # The teacher's own rows as the drafter's: the loss is the teacher's entropy, the gradient zero.
    same, _, _ = H.head_ce(t.clone().requires_grad_(), W, lab, how, teacher=t)
    p = (t @ W.T).softmax(-1)
    torch.testing.assert_close(same, -(p * p.log()).sum(-1), rtol=1e-5, atol=1e-5)


def test_dpace_weights_match_the_formula():
    """w_j = sum_{m >= j} prod_{i <= m} ((1 - a) q_i + a), q = exp(-CE), per block; a slot
    outside the loss ends the chain and slot 0 weighs nothing."""
    valid = torch.tensor([[[False, True, True, True, True], [False, True, True, False, False]]])
    rows = valid.nonzero(as_tuple=True)
    ce = torch.linspace(0.1, 2.0, len(rows[0]))
    alpha = 0.3
    got = L.dpace_weights(ce, valid, rows, alpha)
    q = torch.zeros(valid.shape)
    q[rows] = torch.exp(-ce)
    want = []
    for blk in range(2):
        r = [(1 - alpha) * float(q[0, blk, i]) + alpha if valid[0, blk, i] else 0.0 for i in range(5)]
        for j in range(1, 5):
            if valid[0, blk, j]:
                want.append(sum(np.prod(r[1:m + 1]) for m in range(j, 5)))
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), rtol=1e-6, atol=1e-7)
    assert not got.requires_grad


@pytest.mark.parametrize("how", ["fused", "checkpointed"])
@pytest.mark.parametrize("distill", [False, True])
def test_restricted_head_is_the_softmax_over_its_rows(how, distill, monkeypatch):
    """train.head_vocab=data: loss, gradient and argmax are those of plain autograd over
    the logits of the chosen rows only, the argmax in the full numbering."""
    monkeypatch.setattr(H, "CE_CHUNK_ROWS", 10)
    g = torch.Generator().manual_seed(5)
    h = torch.randn(23, 16, generator=g).requires_grad_()
    W = torch.randn(50, 16, generator=g)
    ids = torch.tensor([1, 4, 7, 8, 20, 33, 49])
    lab = ids[torch.randint(0, len(ids), (23,), generator=g)]
    w, t = torch.rand(23, generator=g), (torch.randn(23, 16, generator=g) if distill else None)
    rows = H.VocabRows(ids, 50, "cpu")
    loss, pred, hard = H.restricted_ce(h, W, lab, rows, how, teacher=t)
    (loss * w).sum().backward()
    h2 = h.detach().clone().requires_grad_()
    logits = h2 @ W[ids].T
    local = torch.searchsorted(ids, lab)
    want = F.cross_entropy(logits, local, reduction="none") if t is None else \
        -((t @ W[ids].T).softmax(-1) * logits.log_softmax(-1)).sum(-1)
    (want * w).sum().backward()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hard, F.cross_entropy(logits, local, reduction="none").detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-6 * float(h2.grad.abs().max()))
    assert torch.equal(pred, ids[logits.argmax(-1)])
    # Smaller than the full softmax's CE (fewer rows in the normaliser) wherever it is CE.
    if t is None:
        full, _, _ = H.head_ce(h.detach(), W, lab, how)
        assert (hard < full).all()
    with pytest.raises(ValueError, match="not in the training vocabulary"):
        rows.labels(torch.tensor([2]))


@pytest.mark.parametrize("how", ["fused", "checkpointed"])
def test_sampled_rows_carry_the_rest_of_the_head(how):
    """head_vocab=sampled: the data's rows plus k drawn from the rest, none twice, each
    drawn logit raised by log(rest / k); loss and gradient are plain autograd's over
    those biased logits. With every other row drawn the bias is 0 and the loss the full
    head's."""
    g = torch.Generator().manual_seed(6)
    h = torch.randn(13, 16, generator=g).requires_grad_()
    W = torch.randn(50, 16, generator=g)
    vocab = torch.tensor([2, 3, 10, 40])
    lab = vocab[torch.randint(0, 4, (13,), generator=g)]
    rows = H.VocabRows.sampled(vocab, 50, 9, torch.Generator().manual_seed(0), "cpu")
    assert torch.equal(rows.ids[:4], vocab) and len(set(rows.ids.tolist())) == 13
    assert torch.equal(rows.bias, torch.cat([torch.zeros(4), torch.full((9,), math.log(46 / 9))]))
    again = H.VocabRows.sampled(vocab, 50, 9, torch.Generator().manual_seed(0), "cpu")
    assert torch.equal(again.ids, rows.ids)
    loss, pred, _ = H.restricted_ce(h, W, lab, rows, how)
    loss.sum().backward()
    h2 = h.detach().clone().requires_grad_()
    logits = h2 @ W[rows.ids].T + rows.bias
    want = F.cross_entropy(logits, rows.labels(lab), reduction="none")
    want.sum().backward()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-6 * float(h2.grad.abs().max()))
    assert torch.equal(pred, rows.ids[logits.argmax(-1)])
    every = H.VocabRows.sampled(vocab, 50, 1000, g, "cpu")
    assert not every.bias.any()
    torch.testing.assert_close(H.restricted_ce(h.detach(), W, lab, every, how)[0],
                               F.cross_entropy(h.detach() @ W.T, lab, reduction="none"), rtol=1e-5, atol=1e-5)


def test_restricted_head_in_the_block_loss(setup):
    """dflash_loss with every token id as its vocabulary is the exact head's loss and
    stats; with only the batch's labels (and a few more) the loss is smaller and the
    argmaxes behind its stats never leave that set."""
    _, target, d = setup
    batch = packed([seq(40, 15), seq(33, 16)])
    feats = target.features(batch)
    anchors = BL.batch_anchors(batch, 8, 0, 0, 0)
    V = target.lm_head.weight.shape[0]
    full, fs = L.dflash_loss(d, target, feats, batch, anchors, 4.0)
    every, es = L.dflash_loss(d, target, feats, batch, anchors, 4.0, vocab=torch.arange(V))
    torch.testing.assert_close(every, full, rtol=1e-6, atol=0)
    assert es.accepted == fs.accepted and torch.equal(es.slot_correct, fs.slot_correct)
    some = torch.unique(torch.cat([batch.input_ids[batch.loss_mask.bool()], torch.tensor([0, 1, 2])]))
    assert len(some) < V
    part, ps = L.dflash_loss(d, target, feats, batch, anchors, 4.0, vocab=some)
    assert float(part.detach()) < float(full.detach())
    assert ps.accepted >= fs.accepted       # an argmax outside the set can only have been wrong


def test_supervised_tokens_are_those_under_the_loss_mask(tmp_path):
    # Two shards of rows_per_batch 2: chunks whose offsets do not start at 0.
    from dflash_actors.data.dataset import TokenDataset
    from dflash_actors.data.synthetic import write_token_dataset
    ids = [[5, 6, 7, 8], [9, 10, 5], [11, 12], [13, 14, 15], [16, 3]]
    masks = [[0, 0, 1, 1], [1, 0, 1], [0, 0], [0, 1, 0], [1, 1]]
    offsets = np.cumsum([0] + [len(r) for r in ids])
    flat = np.concatenate([np.array(r) for r in ids])
    path = write_token_dataset(tmp_path / "d", offsets, flat, np.concatenate([np.array(m, np.int8) for m in masks]),
                               num_shards=2, rows_per_batch=2)
    assert TokenDataset(path, progress=False).supervised_tokens().tolist() == [3, 5, 7, 8, 9, 14, 16]
    no_mask = write_token_dataset(tmp_path / "n", offsets, flat, None)
    assert TokenDataset(no_mask, progress=False).supervised_tokens().tolist() == sorted(set(flat.tolist()))


def test_bf16_features_reach_fc_without_an_fp32_copy(tiny):
    """Under bf16 autocast the feature rows go into ``fc`` as they are (autocast casts
    there): no fp32 copy of ``[T, k*H]`` is ever made. Without autocast they are cast
    to the weights' dtype, once."""
    from torch.utils._python_dispatch import TorchDispatchMode

    cfg, target = tiny
    d = build_drafter(cfg, target)
    batch = packed([seq(40, 1), seq(30, 2)])
    feats = target.features(batch).bfloat16()
    anchors = BL.batch_anchors(batch, 8, 0, 0, 0)

    class Copies(TorchDispatchMode):
        """Counts fp32 copies made of the rows gathered from ``feats``."""

        def __init__(self):
            super().__init__()
            self.rows, self.fp32 = set(), 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.index.Tensor and args[0] is feats:
                self.rows.add(out.untyped_storage().data_ptr())
            elif func is torch.ops.aten._to_copy.default and out.dtype == torch.float32 \
                    and args[0].untyped_storage().data_ptr() in self.rows:
                self.fp32 += 1
            return out
    for compute, want in (("bfloat16", 0), ("float32", 1)):
        copies = Copies()
        with copies:
            L.dflash_loss(d, target, feats, batch, anchors, 4.0, compute_dtype=compute)
        assert copies.fp32 == want, compute
