"""XPress (``drafter.arch: xpress``): DFlash's backbone and labels plus a causal refiner
head; its teacher-forced and free-running passes, their objective split into
micro-batches as the whole batch, its export, and its Jacobi decoding. (Equality with
speculators 0.9.0's own XPress code: ``test_parity_xpress.py``.)"""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_actors.config import ConfigError
from dflash_actors.data.batching import Batch
from dflash_actors.models import xpress
from dflash_actors.models.drafter import DFlashDrafter
from dflash_actors.models.drafter_start import build_drafter
from dflash_actors.models.loss import Objective, batch_loss
from dflash_actors.train.drafter_step import drafter_step
from dflash_actors.train.optim import takes_muon
from tests.support.heads import moved_off_start, with_teacher

REFINER = {"token_embed.weight", "down_h.weight", "down_g.weight", "in_proj.weight", "mix_l", "mlp_gate.weight",
           "mlp_up.weight", "mlp_down.weight", "readout.weight"}


def arch(cfg, **drafter):
    changes = {"drafter.arch": "xpress", "drafter.xpress_rank": 8, "train.loss": "distill"}
    return cfg.updated(changes | {f"drafter.{k}": v for k, v in drafter.items()})


@pytest.fixture(scope="module")
def setup(tiny):
    return with_teacher(tiny)


def trained_like(d: DFlashDrafter, seed: int = 0) -> DFlashDrafter:
    """``d`` with its refiner (the mixer included) moved off its start."""
    return moved_off_start(d, lambda name: name.startswith("refiner_head."), 0.3, seed)


def test_config_rules(tiny):
    cfg, _ = tiny
    with pytest.raises(ConfigError, match="train.loss: xpress's TV term"):
        cfg.updated({"drafter.arch": "xpress"})
    ok = cfg.updated({"drafter.arch": "xpress", "drafter.xpress_tv_alpha": 0.0, "drafter.xpress_ce_labels": "data"})
    assert ok.drafter.arch == "xpress"
    with pytest.raises(ConfigError, match="train.head_vocab: xpress needs full"):
        arch(cfg).updated({"train.head_vocab": "data"})
    with pytest.raises(ConfigError, match="train.position_weight: xpress"):
        arch(cfg).updated({"train.position_weight": "dpace"})
    with pytest.raises(ConfigError, match="both 0"):
        arch(cfg, xpress_ce_alpha=0.0, xpress_tv_alpha=0.0)
    with pytest.raises(ConfigError):
        arch(cfg, xpress_rank=0)
    o = Objective.from_config(arch(cfg))
    assert o.xpress == xpress.XPressObjective(0.1, 0.9, 0.3, 3, 0.6, "target") and o.gamma == 4.0
    assert o.dspark is None and Objective.from_config(cfg).xpress is None


def test_a_fresh_xpress_backbone_is_the_dflash_of_its_seed_and_its_mixer_starts_at_zero(setup):
    cfg, target, _, _ = setup
    one, two = build_drafter(cfg, target), build_drafter(arch(cfg), target)
    theirs = two.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in one.state_dict().items())
    assert set(theirs) - set(one.state_dict()) == {"refiner_head." + k for k in REFINER}
    assert two.label_shift == 0 and two.proposals == two.block_size - 1
    H, V, B, r = target.hidden_size, target.vocab_size, cfg.drafter.block_size, 8
    assert not theirs["refiner_head.mix_l"].any() and theirs["refiner_head.mix_l"].shape == (r, B, B)
    assert theirs["refiner_head.in_proj.weight"].shape == (r, 3 * r)
    assert theirs["refiner_head.mlp_gate.weight"].shape == (2 * r, r)
    assert theirs["refiner_head.readout.weight"].shape == (V, r)
    assert theirs["refiner_head.down_g.weight"].shape == (r, H)
    # Token table and vocabulary readout stay on AdamW; the maps go to Muon; the 3-D mixer cannot.
    ref = two.refiner_head
    assert not takes_muon(ref.token_embed.weight) and not takes_muon(ref.readout.weight)
    assert takes_muon(ref.in_proj.weight) and not takes_muon(ref.mix_l)


def test_the_mixer_is_causal_within_the_block():
    torch.manual_seed(0)
    head = xpress.RefinerHead(50, 16, 6, 4, 2)
    with torch.no_grad():
        head.mix_l.normal_()
    cache = head.hidden_cache(torch.randn(3, 6, 16))
    prev = torch.randint(0, 50, (3, 6))
    x = head.state(prev, cache)
    later = prev.clone()
    later[:, 4:] = (later[:, 4:] + 1) % 50
    y = head.state(later, cache)
    assert torch.equal(x[:, :4], y[:, :4]) and not torch.equal(x[:, 4:], y[:, 4:])


def test_previous_tokens_teacher_forced_and_free_running():
    tokens = torch.tensor([[10, 11, 12, 13]])
    before, anchor = torch.tensor([9]), torch.tensor([10])
    assert xpress.tf_prev(before, tokens).tolist() == [[9, 10, 11, 12]]
    pred = torch.tensor([[77, 21, 22, 23]])              # slot 0's guess is never read
    assert xpress.round_prev(before, anchor, pred).tolist() == [[9, 10, 21, 22]]


@pytest.mark.parametrize("labels", ["target", "data"])
def test_micro_batches_add_up_to_the_whole_batch(setup, labels):
    cfg, target, batch, feats = setup
    c = arch(cfg, xpress_ce_labels=labels)
    o = Objective.from_config(c)
    d = trained_like(build_drafter(c, target))
    loss, whole = batch_loss(d, target, feats, batch, o, epoch=0, batch_id=3)
    loss.backward()
    want = {n: p.grad.clone() for n, p in d.named_parameters()}
    assert all(g.abs().sum() > 0 for g in want.values()), [n for n, g in want.items() if not g.abs().sum()]
    d.zero_grad(set_to_none=True)
    split = drafter_step(d, target, feats, batch, o, epoch=0, batch_id=3, block_tokens=24)
    for n, p in d.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6 * float(want[n].abs().max()))
    assert split.accepted == whole.accepted and int(whole.slot_total[0]) == 0


def test_rounds_and_anchor_terms_weigh_in(setup):
    cfg, target, batch, feats = setup
    d = trained_like(build_drafter(arch(cfg), target))
    base = Objective.from_config(arch(cfg))
    values = {}
    for name, changes in {"all": {}, "no_rounds": {"xpress_consistency_weight": 0.0},
                          "no_anchor": {"xpress_base_anchor_weight": 0.0},
                          "one_round": {"xpress_consistency_passes": 1}}.items():
        o = Objective.from_config(arch(cfg, **changes))
        with torch.no_grad():
            values[name] = float(batch_loss(d, target, feats, batch, o, epoch=0, batch_id=1)[0])
    assert len(set(values.values())) == 4, values
    assert values["no_rounds"] < values["all"] and values["no_anchor"] < values["all"]
    assert base.xpress.rounds == 3


def test_export_and_reload(setup, tmp_path):
    cfg, target, _, _ = setup
    d = trained_like(build_drafter(arch(cfg), target))
    d.save_pretrained(tmp_path / "dr")
    conf = json.loads((tmp_path / "dr" / "config.json").read_text())
    assert conf["architectures"] == ["Qwen3XPressModel"] and "auto_map" not in conf
    assert (conf["xpress_rank"], conf["xpress_mlp_ratio"], conf["num_jacobi_passes"]) == (8, 2, 6)
    # vLLM 0.33's keys beside speculators': the MLP width, passes, block, exact scoring.
    assert (conf["xpress_mlp_hidden"], conf["xpress_num_passes"], conf["xpress_block_size"],
            conf["xpress_topc"]) == (16, 6, d.block_size, 0)
    assert conf["sample_from_anchor"] is False and conf["is_causal"] is False
    assert conf["dflash_config"]["target_layer_ids"] == list(target.layer_ids)
    with safe_open(str(tmp_path / "dr" / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    # The refiner under vLLM 0.33's names (its load_weights' map), nothing under ours.
    assert {k.removeprefix("xpress_head.") for k in saved if k.startswith("xpress_head.")} == \
        set(xpress.ENGINE_NAMES.values()) and not any(k.startswith("refiner_head.") for k in saved)
    assert torch.equal(saved["xpress_head.w2.weight"], d.refiner_head.readout.weight)
    assert torch.equal(saved["xpress_head.mix.L"], d.refiner_head.mix_l)
    assert {xpress.ENGINE_NAMES[k] for k in REFINER} == set(xpress.ENGINE_NAMES.values())
    back = DFlashDrafter.from_pretrained(tmp_path / "dr")
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in d.state_dict().items())
    # speculators' names (the exports before vLLM's were read) load the same.
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "config.json").write_text(json.dumps(conf))
    save_file({k: v.contiguous() for k, v in d.state_dict().items()}, str(tmp_path / "ours" / "model.safetensors"))
    ours = DFlashDrafter.from_pretrained(tmp_path / "ours")
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in d.state_dict().items())
    # The two namings of a size must agree.
    for key, bad in (("xpress_mlp_hidden", 24), ("xpress_num_passes", 3), ("xpress_block_size", d.block_size + 1)):
        (tmp_path / key).mkdir()
        (tmp_path / key / "config.json").write_text(json.dumps({**conf, key: bad}))
        (tmp_path / key / "model.safetensors").write_bytes((tmp_path / "dr" / "model.safetensors").read_bytes())
        with pytest.raises(ValueError, match=f"{key}.* disagree"):
            DFlashDrafter.from_pretrained(tmp_path / key)
    again = build_drafter(arch(cfg).updated({"drafter.init_from": str(tmp_path / "dr")}), target)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in d.state_dict().items())
    # A config that states only the rank (speculators' defaults for the rest) reads the same.
    for k in ("xpress_mlp_ratio", "num_jacobi_passes", "xpress_mlp_hidden", "xpress_num_passes"):
        del conf[k]
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text(json.dumps(conf))
    (tmp_path / "bare" / "model.safetensors").write_bytes((tmp_path / "dr" / "model.safetensors").read_bytes())
    bare = DFlashDrafter.from_pretrained(tmp_path / "bare")
    assert xpress.xpress_sizes(bare.config) == {"xpress_rank": 8, "xpress_mlp_ratio": 2, "num_jacobi_passes": 6}
    with pytest.raises(ValueError, match="is a xpress .* drafter, this run trains dflash"):
        build_drafter(cfg.updated({"drafter.init_from": str(tmp_path / "dr")}), target)
    with pytest.raises(ValueError, match="this run trains xpress"):
        build_drafter(arch(cfg, xpress_rank=4).updated({"drafter.init_from": str(tmp_path / "dr")}), target)


def test_jacobi_rounds_converge_to_the_left_to_right_walk():
    """With at least B-1 rounds, Jacobi's drafts are the sequential walk's (each slot's
    argmax after the token drafted before it); with none, the backbone's argmax."""
    torch.manual_seed(1)
    N, B, H, V = 5, 6, 16, 40
    head = xpress.RefinerHead(V, H, B, 8, 2)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 1.0)
    hidden, base = torch.randn(N, B, H), torch.randn(N, B - 1, V)
    before, anchor = torch.randint(0, V, (N,)), torch.randint(0, V, (N,))
    assert torch.equal(xpress.jacobi(head, hidden, base, before, anchor, 0), base.argmax(-1))
    cache = head.hidden_cache(hidden)
    walk = torch.zeros(N, B, dtype=torch.long)
    walk[:, 0] = anchor
    for k in range(1, B):
        x = head.state(xpress.round_prev(before, anchor, walk), cache)
        walk[:, k] = (base[:, k - 1] + head.bias(x[:, k])).argmax(-1)
    got = xpress.jacobi(head, hidden, base, before, anchor, B - 1)
    assert torch.equal(got, walk[:, 1:])
    assert not torch.equal(xpress.jacobi(head, hidden, base, before, anchor, 1), walk[:, 1:])


def test_fitted_xpress_decodes_losslessly_by_jacobi_and_the_evaluator_scores_it(tiny):
    """An XPress fitted for a moment drafts each block by its Jacobi rounds: decoding keeps
    the target's greedy text, the evaluator's replay of decoding gives decoding's tau, and
    the rounds change the drafts (``num_jacobi_passes`` 0 is the backbone's argmax)."""
    from dflash_actors.eval.decode import drafter_proposer, verify_block
    from dflash_actors.eval.evaluator import HeldOut, evaluate_version
    from dflash_actors.eval.tau import drafter_correct, real_tau, text_metrics
    from tests.support.fitting import fit_briefly, heldout_prompts

    cfg, target = tiny
    c = arch(cfg)
    prompts = heldout_prompts(cfg, 6)
    d = build_drafter(c, target)
    objective = xpress.XPressObjective(1.0, 0.0, ce_labels="data")     # the features carry no teacher
    stats, batch, feats = fit_briefly(d, target, prompts, xpress=objective)
    assert stats.metrics()["tau"] > 1.5 and verify_block(d) == d.block_size
    assert d.refiner_head.mix_l.abs().sum() > 0                          # the mixer trained off zero
    r = real_tau(d, target, list(prompts[:3]), 24)
    assert r["lossless"] and r["mismatches"] == [] and r["tau"] > 1.5
    assert len(r["per_position"]) == d.block_size - 1
    heldout = HeldOut(c, target, 8, 4, 16)
    got = evaluate_version(d, target, heldout)["real"]
    want = real_tau(d, target, [ids[:first] for ids, first, _ in heldout.items[:4]], 16, check_lossless="none")
    assert got == {k: want[k] for k in got}
    ids = batch.input_ids[:batch.cu_seqlens[1]]
    mask = batch.loss_mask[:batch.cu_seqlens[1]].numpy()
    assert text_metrics(*drafter_correct(d, target, ids, mask))["tau"] > 1.5
    # The rounds are what proposes: a refiner moved far enough changes some block's drafts.
    trained_like(d, seed=3)
    prefix = ids[:12]
    ctx = target.features(Batch(prefix, torch.arange(12), torch.ones(12, dtype=torch.int8),
                                torch.tensor([0, 12], dtype=torch.int32), 12))[:11]
    drafts = {}
    for passes in (0, 6):
        d.config.num_jacobi_passes = passes
        drafts[passes] = drafter_proposer(d, target)(prefix, ctx)
    assert len(drafts[6]) == d.block_size - 1 and not torch.equal(drafts[0], drafts[6])


def test_the_memory_plan_traces_the_refiner_and_its_passes(tiny):
    """The plan's trace of an XPress step keeps what a real CPU step keeps for the backward
    (every pass's refined states, the checkpointed vocabulary chunks), counts the refiner's
    weights, and a run's traces carry its fields."""
    from types import SimpleNamespace

    from dflash_actors.models.drafter import drafter_config
    from dflash_actors.models.loss import blocks_loss, lay_out
    from dflash_actors.train import memtrace
    from dflash_actors.train.tracecache import RunTraces
    from tests.unit.test_memplan import SMALL

    fields = {"xpress_rank": 16, "xpress_mlp_ratio": 2, "num_jacobi_passes": 6}
    V, H, rows, ctx, anchors, B, r = SMALL.vocab_size, SMALL.hidden_size, 2, 64, 16, 4, 16
    torch.manual_seed(0)
    d = DFlashDrafter(drafter_config(SMALL, 2, B, [1, 3], V - 1, "test", V, xpress=fields))
    for p in d.parameters():
        p.grad = torch.zeros_like(p)
    head = SimpleNamespace(embed_tokens=torch.nn.Embedding(V, H).requires_grad_(False),
                           lm_head=torch.nn.Linear(H, V, bias=False).requires_grad_(False))
    feats = torch.randn(rows * ctx, 3 * H)
    batch = memtrace.packed_batch(rows, ctx)
    batch.input_ids.random_(0, V - 1)
    blocks = lay_out(batch, memtrace.spread_anchors(rows, ctx, anchors), B, "cpu", 0)
    before = {t.untyped_storage().data_ptr() for t in [*d.parameters(), *(p.grad for p in d.parameters()),
                                                        *d.buffers(), head.embed_tokens.weight,
                                                        head.lm_head.weight, feats]}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in before:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        value, _ = blocks_loss(d, head, feats, blocks, 4.0, loss="distill", xpress=xpress.XPressObjective())
    value.backward()
    want = sum(seen.values())
    common = dict(layers=2, block_size=B, feature_layers=2, head_dtype=torch.float32, autocast_bf16=False,
                  cuda=False, rows=rows, ctx_len=ctx, anchors=anchors)
    got = memtrace.trace_drafter_step(SMALL, loss="distill", xpress=fields, **common)
    assert want > 0 and abs(got.saved - want) <= 0.10 * want, (got.saved, want)
    assert got.saved > memtrace.trace_drafter_step(SMALL, **common).saved
    plain = memtrace.drafter_numel(SMALL, 2, B, 2)
    refiner = 2 * V * r + 2 * H * r + 3 * r * r + r * B * B + 3 * 2 * r * r
    assert memtrace.drafter_numel(SMALL, 2, B, 2, xpress=fields) - plain == refiner
    cfg, target = tiny
    assert RunTraces(arch(cfg), target.config, target.layer_ids).arch["xpress"] == xpress.xpress_fields(
        arch(cfg).drafter)
    assert "xpress" not in RunTraces(cfg, target.config, target.layer_ids).arch


def test_a_shell_built_on_meta_computes_what_a_built_drafter_does(setup):
    """The pipeline's drafters are shells whose weights are loaded (``drafter_shell``):
    the refiner must hold nothing that loading leaves uninitialised."""
    from dflash_actors.models.drafter_start import drafter_shell

    cfg, target, batch, feats = setup
    c = arch(cfg)
    d = trained_like(build_drafter(c, target))
    shell = drafter_shell(c, target)
    shell.load_state_dict(d.state_dict())
    o = Objective.from_config(c)
    with torch.no_grad():
        a = batch_loss(d, target, feats, batch, o, epoch=0, batch_id=2)[0]
        b = batch_loss(shell, target, feats, batch, o, epoch=0, batch_id=2)[0]
    assert torch.equal(a, b) and torch.isfinite(a)
