"""The step math against updates worked out by hand: shard reduction, clipping, AdamW
with decoupled weight decay, the warmup+cosine LR, and resuming from stored moments."""

import math
import weakref
from types import SimpleNamespace

import pytest
import torch

from dflash_actors.train.optim import build_optimizer, build_scheduler, lr_factor, reduce_and_step, restore

P0 = [1.0, -2.0, 0.5]
G1 = [0.3, -1.2, 2.0]
G2 = [0.5, 0.4, -0.6]       # (G1 + G2) / 4 = [0.2, -0.2, 0.35], norm 0.45


def _train(lr=0.1, weight_decay=0.01, warmup_ratio=0.0, lr_schedule="cosine", decay_ratio=0.2):
    return SimpleNamespace(lr=lr, weight_decay=weight_decay, warmup_ratio=warmup_ratio, lr_schedule=lr_schedule,
                           decay_ratio=decay_ratio)


def _param(values=P0):
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def _shards(scale, g1=G1, g2=G2):
    return [[torch.tensor(g1, dtype=torch.float32) * scale], [torch.tensor(g2, dtype=torch.float32) * scale]]


# -- lr schedule --------------------------------------------------------------


def test_wsd_by_hand():
    """10 steps, warmup 2 (0.2), decay the last 3 (ceil(0.25 * 10)): 0.5, 1 | 1 x 5 | 3/3 .. 1/3, then 0."""
    got = [lr_factor(s, 10, 0.2, "wsd", 0.25) for s in range(11)]
    assert got == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2 / 3, 1 / 3, 0.0])
    assert [lr_factor(s, 4, 0.0, "wsd", 1.0) for s in range(4)] == pytest.approx([1.0, 0.75, 0.5, 0.25])
    # A decay longer than what the warmup leaves starts right after the warmup.
    assert [lr_factor(s, 4, 0.5, "wsd", 0.9) for s in range(4)] == pytest.approx([0.5, 1.0, 1.0, 0.5])


def test_wsd_scheduler_follows_the_factor():
    train = _train(lr=0.1, warmup_ratio=0.2, lr_schedule="wsd", decay_ratio=0.25)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer([p], train)
    sched = build_scheduler(opt, train, total_steps=10)
    for step in range(10):
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * lr_factor(step, 10, 0.2, "wsd", 0.25), abs=1e-12)
        opt.step()
        sched.step()


def test_lr_factor_by_hand():
    # ratio 0.2 of 10 steps: warmup 2 steps (0.5, 1.0), then a cosine over 8 steps.
    assert lr_factor(0, 10, 0.2) == pytest.approx(0.5)
    assert lr_factor(1, 10, 0.2) == pytest.approx(1.0)
    assert lr_factor(2, 10, 0.2) == pytest.approx(1.0)
    assert lr_factor(6, 10, 0.2) == pytest.approx(0.5)
    assert lr_factor(9, 10, 0.2) == pytest.approx(0.5 * (1 - math.cos(math.pi / 8)))
    assert lr_factor(10, 10, 0.2) == pytest.approx(0.0, abs=1e-12)
    # No warmup: the cosine starts at 1.
    assert lr_factor(0, 10, 0.0) == pytest.approx(1.0)
    assert lr_factor(5, 10, 0.0) == pytest.approx(0.5)
    # A fractional warmup rounds up: ceil(0.25 * 10) = 3 steps.
    assert [lr_factor(s, 10, 0.25) for s in range(4)] == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])


def test_scheduler_moves_the_optimizer_lr():
    train = _train(lr=0.1, warmup_ratio=0.2)
    p = _param()
    opt = build_optimizer([p], train)
    sched = build_scheduler(opt, train, total_steps=10)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * lr_factor(0, 10, 0.2))
    for step in range(10):
        reduce_and_step([p], _shards(1.0), opt, sched, batches=4, grad_clip=10.0)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * lr_factor(step + 1, 10, 0.2), abs=1e-12)
        assert sched.get_last_lr()[0] == opt.param_groups[0]["lr"]


# -- one step by hand ---------------------------------------------------------


def _expected(scale, grad_clip, lr, wd):
    """(pre-clip norm, clipped grad, new param), in float64, AdamW's first step."""
    p = torch.tensor(P0, dtype=torch.float64)
    g = (torch.tensor(G1, dtype=torch.float64) * scale + torch.tensor(G2, dtype=torch.float64) * scale) / 4
    norm = float(g.norm())
    coef = grad_clip / (norm + 1e-6)
    if coef < 1.0:
        g = g * coef
    p = p * (1 - lr * wd)
    m = 0.1 * g
    v = 0.001 * g * g
    mhat = m / (1 - 0.9)
    vhat = v / (1 - 0.999)
    p = p - lr * mhat / (vhat.sqrt() + 1e-8)
    return norm, g, p


# scale 1e-7 makes the gradient comparable to AdamW's eps, so the update depends on the
# clipped magnitude and not only on the gradient's sign.
@pytest.mark.parametrize("scale, grad_clip, clips", [(1.0, 0.2, True), (1.0, 1.0, False),
                                                     (1e-7, 2e-8, True), (1e-7, 1e-3, False)])
def test_one_step_matches_adamw_by_hand(scale, grad_clip, clips):
    train = _train(lr=0.1, weight_decay=0.01, warmup_ratio=0.0)
    p = _param()
    opt = build_optimizer([p], train)
    sched = build_scheduler(opt, train, total_steps=10)
    norm = reduce_and_step([p], _shards(scale), opt, sched, batches=4, grad_clip=grad_clip)

    lr = 0.1 * lr_factor(0, 10, 0.0)
    want_norm, want_g, want_p = _expected(scale, grad_clip, lr, 0.01)
    assert (grad_clip / (want_norm + 1e-6) < 1.0) == clips       # the case is the one intended
    assert norm == pytest.approx(want_norm, rel=1e-6)            # pre-clip, even when clipped
    assert torch.allclose(p.grad.double(), want_g, rtol=1e-5, atol=0)
    assert torch.allclose(p.detach().double(), want_p, rtol=0, atol=1e-6)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * lr_factor(1, 10, 0.0))


def test_clipping_changes_the_update_when_gradients_are_small():
    # Guards the test above: at this scale clipped and unclipped steps land far apart.
    _, _, clipped = _expected(1e-7, 2e-8, 0.1, 0.01)
    _, _, free = _expected(1e-7, 1e-3, 0.1, 0.01)
    assert (clipped - free).abs().max() > 1e-3


def test_shards_are_read_one_at_a_time_and_summed_in_order():
    """The optimizer hands its drafters' sums as a generator that reads each only when
    asked: the step holds the sum and one shard, never all of them (shard j-2 is gone
    by the time shard j is read), and the result is the listed shards' bit for bit."""
    g3 = [1e-8, 3.0, -7e7]      # magnitudes where the order of additions shows
    values = [G1, G2, g3, [-v for v in G1]]
    held = []

    def stream():
        for j, v in enumerate(values):
            assert j < 2 or held[j - 2]() is None, f"shard {j - 2} is still held when shard {j} is read"
            t = torch.tensor(v, dtype=torch.float32)
            held.append(weakref.ref(t))
            yield [t]

    def step(shards):
        train = _train()
        p = _param()
        opt = build_optimizer([p], train)
        norm = reduce_and_step([p], shards, opt, build_scheduler(opt, train, total_steps=10), batches=4,
                               grad_clip=1e9)
        return norm, p.grad, p.detach()

    got = step(stream())
    want = step([[torch.tensor(v, dtype=torch.float32)] for v in values])
    assert len(held) == len(values)
    assert got[0] == want[0] and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    by_hand = torch.tensor(G1) + torch.tensor(G2) + torch.tensor(g3) + torch.tensor([-v for v in G1])
    assert torch.equal(want[1], by_hand / 4)


def test_shards_are_not_modified():
    train = _train()
    p = _param()
    opt = build_optimizer([p], train)
    sched = build_scheduler(opt, train, total_steps=10)
    shards = _shards(1.0)
    copies = [[t.clone() for t in s] for s in shards]
    reduce_and_step([p], shards, opt, sched, batches=4, grad_clip=0.2)
    for s, c in zip(shards, copies):
        assert torch.equal(s[0], c[0])


# -- restore ------------------------------------------------------------------


def _setup(train, values=P0):
    p = _param(values)
    opt = build_optimizer([p], train)
    return p, opt, build_scheduler(opt, train, total_steps=10)


STEP1 = ([0.3, -1.2, 2.0], [0.5, 0.4, -0.6])
STEP2 = ([-0.7, 0.1, 0.9], [0.2, -0.8, 0.05])


def _step(p, opt, sched, grads):
    return reduce_and_step([p], _shards(1.0, *grads), opt, sched, batches=4, grad_clip=1.0)


def test_restore_continues_bit_identically():
    train = _train(lr=0.1, weight_decay=0.01, warmup_ratio=0.2)   # lr differs between steps

    p, opt, sched = _setup(train)
    _step(p, opt, sched, STEP1)
    _step(p, opt, sched, STEP2)

    pa, opta, scheda = _setup(train)
    _step(pa, opta, scheda, STEP1)
    st = opta.state[pa]
    p2, opt2, sched2 = _setup(train, pa.detach().clone().tolist())
    assert torch.equal(p2.detach(), pa.detach())
    restore(opt2, sched2, [p2], 1, [st["exp_avg"].clone()], [st["exp_avg_sq"].clone()])
    assert opt2.param_groups[0]["lr"] == opta.param_groups[0]["lr"]
    _step(p2, opt2, sched2, STEP2)

    assert torch.equal(p2.detach(), p.detach())
    assert torch.equal(opt2.state[p2]["exp_avg"], opt.state[p]["exp_avg"])
    assert torch.equal(opt2.state[p2]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
    assert float(opt2.state[p2]["step"]) == float(opt.state[p]["step"]) == 2.0
    assert sched2.get_last_lr() == sched.get_last_lr()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]

    # Without restore the second step is a different one (so the check above can fail).
    p3, opt3, sched3 = _setup(train, pa.detach().clone().tolist())
    _step(p3, opt3, sched3, STEP2)
    assert not torch.equal(p3.detach(), p.detach())


def test_restore_copies_the_moments():
    # The optimizer must own its moments: later writes to the source (a shared buffer
    # the next publish overwrites) must not reach it.
    train = _train()
    p, opt, sched = _setup(train)
    m, v = torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.01, 0.02, 0.03])
    restore(opt, sched, [p], 3, [m], [v])
    m.fill_(9.0)
    v.fill_(9.0)
    assert torch.equal(opt.state[p]["exp_avg"], torch.tensor([0.1, 0.2, 0.3]))
    assert torch.equal(opt.state[p]["exp_avg_sq"], torch.tensor([0.01, 0.02, 0.03]))
    assert float(opt.state[p]["step"]) == 3.0
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * lr_factor(3, 10, 0.0))


def test_restore_version_zero_is_a_fresh_start():
    train = _train(warmup_ratio=0.2)
    p, opt, sched = _setup(train)
    restore(opt, sched, [p], 0, [torch.ones(3)], [torch.ones(3)])
    assert len(opt.state) == 0
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * lr_factor(0, 10, 0.2))


# -- non-finite steps ---------------------------------------------------------

NAN = ([math.nan, 0.0, 0.0], [0.1, 0.1, 0.1])


@pytest.mark.parametrize("first", [True, False])
def test_a_non_finite_step_is_skipped_and_restore_agrees(first):
    """No update and the schedule moves on; a restart at the next version rebuilds the
    same state, so the run stays bit-identical across it (first: the very first step)."""
    train = _train(lr=0.1, weight_decay=0.01, warmup_ratio=0.2)
    p, opt, sched = _setup(train)
    if not first:
        _step(p, opt, sched, STEP1)
    before = p.detach().clone()
    moments = {k: v.clone() for k, v in opt.state[p].items()} if not first else None
    assert not math.isfinite(_step(p, opt, sched, NAN))
    assert torch.equal(p.detach(), before) and p.grad is None
    if moments:
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k], moments[k])
    version = 1 if first else 2
    assert sched.last_epoch == version and float(opt.state[p]["step"]) == version
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * lr_factor(version, 10, 0.2))
    # A restart at this version, from the stored weights and moments.
    q, opt2, sched2 = _setup(train, p.detach().tolist())
    restore(opt2, sched2, [q], version, [opt.state[p]["exp_avg"]], [opt.state[p]["exp_avg_sq"]])
    _step(p, opt, sched, STEP2)
    _step(q, opt2, sched2, STEP2)
    assert torch.equal(p.detach(), q.detach())


def test_a_non_finite_loss_alone_skips_the_step():
    p, opt, sched = _setup(_train())
    before = p.detach().clone()
    norm = reduce_and_step([p], _shards(1.0), opt, sched, batches=4, grad_clip=1.0, loss=math.inf)
    assert math.isnan(norm) and torch.equal(p.detach(), before) and sched.last_epoch == 1
