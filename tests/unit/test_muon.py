"""``train.optimizer: muon`` (``optim.MuonAdamW``): which parameters Muon takes (the same
as speculators' own split, imported unmodified from its wheel), one step against
``torch.optim.Muon`` and ``torch.optim.AdamW`` stepped by hand on the same groups, the
LR schedule on both groups, the state's round trips (through the moments the actor
publishes, a skipped step, ``state_dict``), and the memory plan's trace of the step."""

import io
from types import SimpleNamespace

import pytest
import torch

from benchmarks import peers
from dflash_actors.config import ConfigError, TrainConfig, load_config
from dflash_actors.models.marks import keep_off_muon
from dflash_actors.train import memtrace
from dflash_actors.train.optim import (
    MuonAdamW,
    build_optimizer,
    build_scheduler,
    lr_factor,
    reduce_and_step,
    restore,
    skip_step,
    takes_muon,
)
from tests.support.pipeline import ROOT


def _train(**kw):
    base = dict(lr=0.01, weight_decay=0.02, warmup_ratio=0.0, lr_schedule="cosine", decay_ratio=0.2,
                optimizer="muon", muon_lr=0.05, muon_weight_decay=0.1, muon_momentum=0.95, muon_ns_steps=5,
                muon_adjust_lr="match_rms_adamw")
    return SimpleNamespace(**{**base, **kw})


def _params(seed=0):
    """A matrix, a tall matrix, a vector, a degenerate [1, N] weight and a marked table."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(6, 4), (8, 3), (4,), (1, 5), (7, 2)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    keep_off_muon(ps[4])
    return ps


def _grads(params, step, scale=1.0):
    g = torch.Generator().manual_seed(100 + step)
    return [[torch.randn(p.shape, generator=g) * scale for p in params] for _ in range(2)]


# -- which parameters --------------------------------------------------------------


def test_the_split_by_shape_and_mark():
    ps = _params()
    assert [takes_muon(p) for p in ps] == [True, True, False, False, False]
    opt = build_optimizer(ps, _train())
    assert isinstance(opt, MuonAdamW)
    assert [len(g["params"]) for g in opt.param_groups] == [3, 2]          # AdamW's group first
    assert opt.param_groups[1]["params"] == ps[:2]
    assert isinstance(build_optimizer(ps, _train(optimizer="adamw")), torch.optim.AdamW)
    # A train section without the key (older callers): AdamW as before.
    assert isinstance(build_optimizer(ps, SimpleNamespace(lr=0.1, weight_decay=0.0)), torch.optim.AdamW)


@pytest.fixture(scope="module")
def speculators_optimizers():
    try:
        got = peers.load("speculators", ("speculators.train.optimizers",), stubs=("loguru", "hs_connectors"))
    except peers.PeerUnavailable as e:
        pytest.skip(str(e))
    return got.modules["speculators.train.optimizers"]


SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}
DSPARK = {"markov_rank": 8, "markov_head_type": "vanilla", "enable_confidence_head": True,
          "confidence_head_with_markov": True}


def _drafter(dflash2=None, dspark=None):
    """A two-layer drafter of a small target's shape, made as the optimizer actor makes
    its own (``drafter_shell``): on the meta device, then ``to_empty`` (new parameters)."""
    from transformers import Qwen3Config
    with torch.device("meta"):
        d = memtrace.DFlashDrafter(memtrace.drafter_config(Qwen3Config(**SMALL), 2, 4, [0, 1], 95, "t", 96,
                                                           dflash2, None, dspark))
    return d.to_empty(device="cpu")


@pytest.mark.parametrize("dflash2, dspark", [(None, None), (DFLASH2, None), (None, DSPARK)],
                         ids=["dflash", "dflash2", "dspark"])
def test_muon_takes_what_speculators_gives_it(dflash2, dspark, speculators_optimizers):
    """The drafter is split as speculators' ``split_named_params_for_muon`` splits it by
    name: every linear weight on Muon; norms, conv kernels, the DFlash2 codebooks and the
    DSpark Markov tables on AdamW."""
    model = _drafter(dflash2, dspark)
    theirs, rest = speculators_optimizers.split_named_params_for_muon(model)
    ours = [n for n, p in model.named_parameters() if takes_muon(p)]
    assert ours == [n for n, _ in theirs] and rest
    assert ("candidate_selector.successor_codebook" in {n for n, _ in rest}) == (dflash2 is not None)
    assert ("markov_head.markov_w2.weight" in {n for n, _ in rest}) == (dspark is not None)
    train = TrainConfig(optimizer="muon")
    opt = build_optimizer(list(model.parameters()), train)
    assert opt.param_groups[1]["params"] == [p for _, p in theirs]
    assert opt.param_groups[1]["lr"] == train.lr        # muon_lr None: lr, as speculators resolves it


# -- the step ----------------------------------------------------------------------


def test_steps_equal_torch_muon_and_adamw_by_hand():
    """Three steps of ``reduce_and_step`` (sum, average, clip, step, schedule with a
    warmup) equal torch's two optimizers stepped on the same groups with the same
    gradients and each group's lr set by hand, bit for bit."""
    train = _train(warmup_ratio=0.5)
    ps, qs = _params(), _params()
    opt = build_optimizer(ps, train)
    sched = build_scheduler(opt, train, total_steps=4)
    muon = torch.optim.Muon(qs[:2], lr=0.05, weight_decay=0.1, momentum=0.95, ns_steps=5,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(qs[2:], lr=0.01, weight_decay=0.02)
    for step in range(3):
        f = lr_factor(step, 4, 0.5)
        assert [g["lr"] for g in opt.param_groups] == [0.01 * f, 0.05 * f]
        shards = _grads(ps, step, scale=3.0)
        reduce_and_step(ps, iter(shards), opt, sched, batches=4, grad_clip=0.5)
        for q, a, b in zip(qs, *shards):
            q.grad = (a + b) / 4
        torch.nn.utils.clip_grad_norm_(qs, 0.5)
        muon.param_groups[0]["lr"], adamw.param_groups[0]["lr"] = 0.05 * f, 0.01 * f
        muon.step()
        adamw.step()
        assert all(torch.equal(p, q) for p, q in zip(ps, qs)), step
    for p, q in zip(ps[:2], qs[:2]):
        st = opt.state[p]
        assert torch.equal(st["momentum_buffer"], muon.state[q]["momentum_buffer"])
        assert st["exp_avg"] is st["momentum_buffer"]
        assert not st["exp_avg_sq"].any() and st["exp_avg_sq"].untyped_storage().nbytes() == 4
    assert all(opt.state[p].keys() == {"step", "exp_avg", "exp_avg_sq"} for p in ps[2:])


def test_original_lr_adjustment_differs():
    """``muon_adjust_lr`` reaches torch: Keller Jordan's scaling moves the weights otherwise."""
    a, b = _params(), _params()
    for ps, kind in ((a, "match_rms_adamw"), (b, "original")):
        train = _train(muon_adjust_lr=kind)
        opt = build_optimizer(ps, train)
        reduce_and_step(ps, iter(_grads(ps, 0)), opt, build_scheduler(opt, train, 2), batches=2, grad_clip=10.0)
    assert not torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])


# -- the state's round trips -------------------------------------------------------


def _published(opt, ps):
    """What the optimizer actor writes into the shared moment buffers after a step."""
    states = [opt.state[p] for p in ps]
    return [st["exp_avg"].clone() for st in states], [st["exp_avg_sq"].clone() for st in states]


def test_restore_from_published_moments_continues_bit_for_bit():
    """Steps 0-1, publish, a fresh optimizer restored at version 2 from the weights and
    the published moments, step 2-3: equal to an unbroken run, weights and state. A
    skipped step (non-finite) restores likewise."""
    train = _train(warmup_ratio=0.25)
    ps = _params()
    opt = build_optimizer(ps, train)
    sched = build_scheduler(opt, train, total_steps=6)
    for step in range(2):
        reduce_and_step(ps, iter(_grads(ps, step)), opt, sched, batches=2, grad_clip=1.0)
    moments = _published(opt, ps)
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    keep_off_muon(qs[4])
    opt2 = build_optimizer(qs, train)
    sched2 = build_scheduler(opt2, train, total_steps=6)
    restore(opt2, sched2, qs, 2, *moments)
    assert opt2.state[qs[0]]["exp_avg"] is opt2.state[qs[0]]["momentum_buffer"]
    bad = [[torch.full(p.shape, float("nan")) for p in ps]]
    for o, s, params in ((opt, sched, ps), (opt2, sched2, qs)):
        for step in range(2, 4):
            reduce_and_step(params, iter(_grads(params, step)), o, s, batches=2, grad_clip=1.0)
        reduce_and_step(params, iter(bad), o, s, batches=1, grad_clip=1.0)       # skipped
        reduce_and_step(params, iter(_grads(params, 5)), o, s, batches=2, grad_clip=1.0)
    assert all(torch.equal(p, q) for p, q in zip(ps, qs))
    for a, b in zip(_published(opt, ps), _published(opt2, qs)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in opt2.param_groups]


def test_a_skip_before_any_step_is_what_restore_rebuilds():
    train = _train()
    ps = _params()
    opt = build_optimizer(ps, train)
    sched = build_scheduler(opt, train, total_steps=3)
    skip_step(opt, sched, ps)
    st = opt.state[ps[0]]
    assert st.keys() == {"momentum_buffer", "exp_avg", "exp_avg_sq"} and not st["exp_avg"].any()
    assert opt.state[ps[2]]["step"] == 1.0 and sched.last_epoch == 1


def test_state_dict_round_trip_keeps_the_two_optimizers_linked():
    """Through ``torch.save`` and ``load_state_dict``, which replaces the groups and the
    state: the inner optimizers follow, and the loaded momentum buffer is again the
    published ``exp_avg``; the next step equals the unbroken optimizer's."""
    train = _train()
    ps = _params()
    opt = build_optimizer(ps, train)
    sched = build_scheduler(opt, train, total_steps=4)
    reduce_and_step(ps, iter(_grads(ps, 0)), opt, sched, batches=2, grad_clip=1.0)
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    keep_off_muon(qs[4])
    opt2 = build_optimizer(qs, train)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)          # a copy: a state_dict shares the live tensors
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    assert all(o.state is opt2.state for o in opt2.inner)
    assert [g for o in opt2.inner for g in o.param_groups] == opt2.param_groups
    assert all(a is b for a, b in zip([g for o in opt2.inner for g in o.param_groups], opt2.param_groups))
    assert opt2.state[qs[1]]["exp_avg"] is opt2.state[qs[1]]["momentum_buffer"]
    sched2 = build_scheduler(opt2, train, total_steps=4)
    sched2.last_epoch = sched.last_epoch
    for o, params in ((opt, ps), (opt2, qs)):
        for g in o.param_groups:
            g["lr"] = g["initial_lr"] * lr_factor(1, 4, 0.0)
        for p, a, b in zip(params, *_grads(params, 1)):
            p.grad = a + b
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, qs))


# -- config and the memory plan ----------------------------------------------------


def test_config_refuses_bad_muon_values():
    assert TrainConfig().optimizer == "adamw" and TrainConfig().muon_lr is None
    for bad in ("train.muon_lr=-0.001", "train.muon_momentum=1", "train.optimizer=sgd", "train.muon_ns_steps=0",
                "train.muon_weight_decay=-1", "train.muon_adjust_lr=none"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(ROOT / "configs/default.yaml", [bad])


def test_the_memory_plan_traces_the_muon_step():
    """Muon's step runs under ``FakeTensorMode`` (Newton-Schulz included); on the CPU the
    trace is exactly what the same step allocates on real tensors, and it holds one
    buffer per Muon matrix where AdamW holds two."""
    from transformers import Qwen3Config
    c = Qwen3Config(**SMALL)
    kw = dict(layers=2, block_size=4, feature_layers=2, drafters=2, dflash2=DFLASH2)
    muon = TrainConfig(optimizer="muon")
    traced = memtrace.trace_optimizer_step(c, train=muon, device="cpu", **kw)
    adamw = memtrace.trace_optimizer_step(c, train=TrainConfig(), device="cpu", **kw)
    cuda = memtrace.trace_optimizer_step(c, train=muon, device="cuda", **kw)
    assert 0 < traced.peak < adamw.peak and cuda.peak > 0

    # The same step on real CPU tensors, measured by the same ``Live``.
    params = list(_drafter(DFLASH2).parameters())
    shards = [[torch.randn(p.shape) for p in params] for _ in range(2)]
    opt = build_optimizer(params, muon)
    sched = build_scheduler(opt, muon, 1)
    live = memtrace.Live()
    live.known([*params, *(g for s in shards for g in s)])
    with live:
        reduce_and_step(params, iter(shards), opt, sched, 2, muon.grad_clip)
    assert traced.peak == live.peak
