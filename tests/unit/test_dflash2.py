"""DFlash2 (``drafter.arch: dflash2``): the in-block convolution stays inside its block,
a fresh DFlash2 computes what a DFlash computes, the selector's objective and walk are
what decoding and the peers do, and the export is the published checkpoint contract."""

import json

import pytest
import torch
from safetensors import safe_open

from dflash_actors.config import ConfigError
from dflash_actors.models import dflash2
from dflash_actors.models.blocks import all_anchors, block_hidden
from dflash_actors.models.drafter import DFlashDrafter
from dflash_actors.models.drafter_start import build_drafter
from dflash_actors.models.loss import Objective, batch_loss, dflash_loss
from dflash_actors.train.drafter_step import drafter_step
from tests.support.heads import first_batch, moved_off_start

B = 8


def arch(cfg, **extra):
    changes = {"drafter.arch": "dflash2", "drafter.selector_rank": 8, "drafter.selector_top_k": 6}
    return cfg.updated(changes | {f"train.{k}": v for k, v in extra.items()})


@pytest.fixture(scope="module")
def setup(tiny):
    cfg, target = tiny
    batch = first_batch(cfg)
    return cfg, target, batch, target.features(batch)


def trained_like(d: DFlashDrafter, seed: int = 0) -> DFlashDrafter:
    """``d`` with its DFlash2 parts moved off their identity start, as training moves them."""
    return moved_off_start(d, lambda name: "_conv." in name or name.startswith("candidate_selector."),
                           lambda name: 0.3 if "base_kernel" in name or "codebook" in name else 0.05, seed)


def test_a_fresh_dflash2_computes_what_the_dflash_of_its_seed_computes(setup):
    cfg, target, batch, feats = setup
    one, two = build_drafter(cfg, target), build_drafter(arch(cfg), target)
    theirs = two.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in one.state_dict().items())
    a, sa = dflash_loss(one, target, feats, batch, all_anchors(batch), 4.0)
    b, sb = dflash_loss(two, target, feats, batch, all_anchors(batch), 4.0)
    assert torch.equal(a, b) and sa.accepted == sb.accepted == sb.base_accepted
    assert torch.equal(sa.slot_correct, sb.slot_correct) and sb.selector and sb.hits > 0


_block_conv = dflash2.block_conv


def block_conv_leaking(x, delta, base, block_size):
    """The convolution without block boundaries: what a careless port computes."""
    return _block_conv(x, delta, base, x.shape[1])


def test_blocks_laid_end_to_end_compute_what_each_block_alone_computes(setup, monkeypatch):
    """Training lays a row's blocks end to end; decoding runs one. A convolution tap that
    read the previous block's last position would train one thing and serve another."""
    cfg, target, batch, feats = setup
    d = trained_like(build_drafter(arch(cfg), target))
    s, e = batch.sequences()[1]
    ids, ctx = batch.input_ids[s:e], d.context(feats[s:e])
    anchors = torch.tensor([3, 12, 21, 30])          # apart, so every block has a predecessor block

    def each_vs_together():
        together = block_hidden(d, target.embed_tokens, ctx, ids, anchors)
        alone = torch.cat([block_hidden(d, target.embed_tokens, ctx, ids, a[None]) for a in anchors])
        return (together - alone).abs().max()
    assert each_vs_together() < 1e-5
    monkeypatch.setattr(dflash2, "block_conv", block_conv_leaking)
    assert each_vs_together() > 1e-2


def test_the_convolution_starts_as_the_identity_and_reads_only_its_predecessor():
    conv = dflash2.BlockConv(32, 2, 16, 4)
    x = torch.randn(2, 8, 32)
    y, delta = conv.before(x)
    assert torch.equal(y, x) and torch.equal(conv.after(x, delta), x)
    with torch.no_grad():
        conv.base_kernel[0, 0], conv.base_kernel[0, 1] = 0.0, 1.0     # out_t = x_{t-1}
    y, _ = conv.before(x)
    assert torch.equal(y[:, 1:4], x[:, 0:3]) and torch.equal(y[:, 5:8], x[:, 4:7])
    assert not y[:, 0].any() and not y[:, 4].any()                   # the anchor reads zeros


@pytest.mark.parametrize("how", ["fused", "checkpointed"])
def test_the_selector_term_reaches_every_parameter_through_either_head(setup, how):
    cfg, target, batch, feats = setup
    grads = {}
    for h in ("fused", how):
        c = arch(cfg, head_loss=h)
        d = trained_like(build_drafter(c, target))
        loss, stats = batch_loss(d, target, feats, batch, Objective.from_config(c), epoch=0, batch_id=0)
        loss.backward()
        grads[h] = {n: p.grad for n, p in d.named_parameters()}
    assert all(g.abs().max() > 0 for g in grads["fused"].values())
    for n, g in grads["fused"].items():
        torch.testing.assert_close(grads[how][n], g, rtol=1e-4, atol=1e-7)
    assert stats.selector and 0 < stats.hits <= int(stats.slot_total.sum())


def test_stop_gradient_keeps_the_selector_term_out_of_the_backbone(setup):
    cfg, target, batch, feats = setup
    grads = {}
    for key, extra in (("none", {"selector_weight": 0.0}), ("stop", {"selector_grad": "stop"}),
                       ("full", {})):
        c = arch(cfg, **extra)
        d = trained_like(build_drafter(c, target))
        loss, _ = batch_loss(d, target, feats, batch, Objective.from_config(c), epoch=0, batch_id=0)
        loss.backward()
        grads[key] = {n: p.grad for n, p in d.named_parameters()}
    backbone = [n for n in grads["full"] if not n.startswith("candidate_selector.")]
    assert all(torch.equal(grads["stop"][n], grads["none"][n]) for n in backbone)
    assert any(not torch.allclose(grads["full"][n], grads["none"][n]) for n in backbone)
    assert grads["stop"]["candidate_selector.successor_codebook"].abs().max() > 0
    assert not grads["none"]["candidate_selector.successor_codebook"].any()      # a zero, not None


@pytest.mark.parametrize("extra, budget", [({}, 24), ({"selector_norm": "own"}, 24),
                                           ({"selector_norm": "own", "position_weight": "dpace"}, 200),
                                           ({"selector_misses": "insert"}, 24),
                                           ({"selector_norm": "count", "selector_misses": "insert"}, 24)])
def test_micro_batches_add_up_to_the_whole_batch_with_the_selector(setup, extra, budget):
    cfg, target, batch, feats = setup
    c = arch(cfg, **extra)
    o = Objective.from_config(c)
    d = trained_like(build_drafter(c, target))
    loss, whole = batch_loss(d, target, feats, batch, o, epoch=0, batch_id=3)
    loss.backward()
    want = [p.grad.clone() for p in d.parameters()]
    d.zero_grad(set_to_none=True)
    split = drafter_step(d, target, feats, batch, o, epoch=0, batch_id=3, block_tokens=budget)
    for w, g in zip(want, (p.grad for p in d.parameters())):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6 * float(w.abs().max()))
    assert (split.accepted, split.base_accepted, split.hits) == (whole.accepted, whole.base_accepted, whole.hits)


def test_the_walk_takes_the_best_candidate_after_the_one_it_chose():
    g = torch.Generator().manual_seed(0)
    sel = dflash2.CandidateSelector(50, 12, 4, 5)
    with torch.no_grad():
        for p in sel.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    hidden, logits = torch.randn(3, 6, 12, generator=g), torch.randn(3, 6, 50, generator=g)
    anchors = torch.tensor([1, 2, 3])
    path = sel.walk(hidden, logits, anchors)
    torch.set_grad_enabled(False)
    for n in range(3):
        prev = anchors[n]
        for k in range(6):
            best = max(logits[n, k].topk(5).indices.tolist(),
                       key=lambda b: float(logits[n, k, b] + (sel.predecessor_codebook[prev]
                                                               * sel.hidden_projection(hidden[n, k])
                                                               * sel.successor_codebook[b]).sum()))
            assert int(path[n, k]) == best
            prev = path[n, k]
    with torch.no_grad():
        sel.successor_codebook.zero_()
    assert torch.equal(sel.walk(hidden, logits, anchors), logits.argmax(-1))      # DFlash's argmax
    torch.set_grad_enabled(True)


def test_dflash2_needs_the_full_head(tiny):
    cfg, _ = tiny
    with pytest.raises(ConfigError, match="train.head_vocab: dflash2 needs full"):
        cfg.updated({"drafter.arch": "dflash2", "train.head_vocab": "data"})


def test_export_is_the_published_dflash2_contract(setup, tmp_path):
    """Key set, shapes as functions of (H, V, r, group, taps) and config keys, as z-lab's
    DFlash2 fixtures (``tests/fixtures/dflash2-{config,safetensors-header}.json``) have them."""
    cfg, target, _, _ = setup
    d = trained_like(build_drafter(arch(cfg), target))
    d.save_pretrained(tmp_path / "dr")
    conf = json.loads((tmp_path / "dr" / "config.json").read_text())
    assert conf["architectures"] == ["DFlash2DraftModel"] and conf["is_causal"] is False
    assert "auto_map" not in conf and not (tmp_path / "dr" / "dflash.py").exists()
    dc = conf["dflash_config"]
    assert {"block_size", "mask_token_id", "target_layer_ids", "conv_kernel_size", "conv_group_size",
            "selector_rank", "selector_top_k"} <= set(dc)
    H, V, r, taps, group = conf["hidden_size"], conf["vocab_size"], dc["selector_rank"], dc["conv_kernel_size"], \
        dc["conv_group_size"]
    heads, kv, hd = conf["num_attention_heads"], conf["num_key_value_heads"], conf["head_dim"]
    want = {"fc.weight": (H, len(dc["target_layer_ids"]) * H), "hidden_norm.weight": (H,), "norm.weight": (H,),
            "candidate_selector.hidden_projection.weight": (r, H),
            "candidate_selector.predecessor_codebook": (V, r), "candidate_selector.successor_codebook": (V, r)}
    for i in range(conf["num_hidden_layers"]):
        L = f"layers.{i}."
        want |= {L + "self_attn.q_proj.weight": (heads * hd, H), L + "self_attn.k_proj.weight": (kv * hd, H),
                 L + "self_attn.v_proj.weight": (kv * hd, H), L + "self_attn.o_proj.weight": (H, heads * hd),
                 L + "self_attn.q_norm.weight": (hd,), L + "self_attn.k_norm.weight": (hd,),
                 L + "mlp.gate_proj.weight": (conf["intermediate_size"], H),
                 L + "mlp.up_proj.weight": (conf["intermediate_size"], H),
                 L + "mlp.down_proj.weight": (H, conf["intermediate_size"]),
                 L + "input_layernorm.weight": (H,), L + "post_attention_layernorm.weight": (H,)}
        for conv in ("attention_conv", "mlp_conv"):
            want |= {L + f"{conv}.base_kernel": (2, taps, H),
                     L + f"{conv}.kernel_projection.weight": (2 * taps * H // group, H)}
    with safe_open(str(tmp_path / "dr" / "model.safetensors"), "pt") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert got == want


def test_a_dflash2_directory_loads_back_and_starts_a_run(setup, tmp_path):
    from safetensors.torch import load_file, save_file

    cfg, target, batch, feats = setup
    d = trained_like(build_drafter(arch(cfg), target))
    d.save_pretrained(tmp_path / "dr")
    back = DFlashDrafter.from_pretrained(tmp_path / "dr")
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in d.state_dict().items())
    # The codebooks under nn.Embedding's names (z-lab maps its loader onto those) load too.
    state = load_file(str(tmp_path / "dr" / "model.safetensors"))
    state = {(k + ".weight" if k.endswith("_codebook") else k): v for k, v in state.items()}
    save_file(state, str(tmp_path / "dr" / "model.safetensors"))
    again = build_drafter(arch(cfg).updated({"drafter.init_from": str(tmp_path / "dr")}), target)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in d.state_dict().items())
    # Published configs keep block_size only in dflash_config.
    conf = json.loads((tmp_path / "dr" / "config.json").read_text())
    del conf["block_size"]
    (tmp_path / "dr" / "config.json").write_text(json.dumps(conf))
    assert DFlashDrafter.from_pretrained(tmp_path / "dr").block_size == d.block_size
    with pytest.raises(ValueError, match="is a dflash2 .* drafter, this run trains dflash"):
        build_drafter(cfg.updated({"drafter.init_from": str(tmp_path / "dr")}), target)
    with pytest.raises(ValueError, match="this run trains dflash2"):
        build_drafter(arch(cfg).updated({"drafter.selector_rank": 4, "drafter.init_from": str(tmp_path / "dr")}),
                      target)


def test_fitted_dflash2_decodes_losslessly_and_the_evaluator_scores_its_walk(tiny):
    """A DFlash2 fitted for a moment proposes through its selector: decoding keeps the
    target's greedy text, and the evaluator's replay of decoding gives decoding's tau."""
    from dflash_actors.eval.evaluator import HeldOut, evaluate_version
    from dflash_actors.eval.tau import real_tau
    from tests.support.fitting import fit_briefly, heldout_prompts

    cfg, target = tiny
    c = arch(cfg, selector_norm="own")
    prompts = heldout_prompts(cfg, 6)
    d = trained_like(build_drafter(c, target))     # a selector that disagrees with the argmax somewhere
    stats, batch, feats = fit_briefly(d, target, prompts, selector=Objective.from_config(c).selector)
    anchors = all_anchors(batch)
    assert stats.metrics()["tau"] > 1.5
    # Its proposals, not the head's argmax, are what is scored.
    with torch.no_grad():
        _, now = dflash_loss(d, target, feats, batch, anchors, 4.0)
    assert now.selector and now.accepted != now.base_accepted
    r = real_tau(d, target, [p for p in prompts[:3]], 24)
    assert r["lossless"] and r["mismatches"] == []
    heldout = HeldOut(cfg, target, 8, 4, 16)
    got = evaluate_version(d, target, heldout)["real"]
    want = real_tau(d, target, [ids[:first] for ids, first, _ in heldout.items[:4]], 16, check_lossless="none")
    assert got == {k: want[k] for k in got}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dflash2_step_and_walk_on_cuda_match_cpu(setup):
    """The CUDA paths: the convolution under bf16 autocast and fp32, flex's block mask, the
    candidates taken in the fused head's chunks, the selector term and the walk."""
    import copy
    from types import SimpleNamespace

    cfg, target, batch, feats = setup
    c = arch(cfg, selector_norm="own")
    o = Objective.from_config(c)
    d = trained_like(build_drafter(c, target))

    def step(model, head, f, b, dtype):
        model.zero_grad(set_to_none=True)
        loss, stats = dflash_loss(model, head, f, b, all_anchors(b)[:4], 4.0, compute_dtype=dtype,
                                  selector=o.selector)
        loss.backward()
        return loss.detach().cpu(), [p.grad.cpu() for p in model.parameters()], stats
    cpu = step(d, target, feats, batch, "float32")
    dc = copy.deepcopy(d).cuda()
    head = SimpleNamespace(embed_tokens=copy.deepcopy(target.embed_tokens).cuda(),
                           lm_head=copy.deepcopy(target.lm_head).cuda())
    gpu = step(dc, head, feats.cuda(), batch.to("cuda"), "float32")
    torch.testing.assert_close(gpu[0], cpu[0], rtol=1e-4, atol=1e-5)
    for a, b in zip(gpu[1], cpu[1]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4 * float(b.abs().max()) + 1e-7)
    assert gpu[2].hits == cpu[2].hits
    bf16 = step(dc, head, feats.cuda(), batch.to("cuda"), "auto")
    assert torch.isfinite(bf16[0]) and abs(float(bf16[0] - cpu[0])) < 0.05 * abs(float(cpu[0]))
    g = torch.Generator().manual_seed(1)
    hidden, logits = torch.randn(16, 7, d.config.hidden_size, generator=g), torch.randn(16, 7, 256, generator=g)
    anchors = torch.randint(0, 256, (16,), generator=g)
    want = d.candidate_selector.walk(hidden, logits, anchors)
    assert torch.equal(dc.candidate_selector.walk(hidden.cuda(), logits.cuda(), anchors.cuda()).cpu(), want)


def test_speculators_start_and_denominator_reach_training(setup):
    """``drafter.selector_init: normal`` draws the successor codebook N(0, 0.02) in
    ``build_drafter``, and ``selector_norm: count`` divides the selector term by the number
    of supervised slots in ``blocks_loss`` (speculators' way; ``own`` divides by the
    weight of the slots whose gold is a candidate)."""
    cfg, target, batch, feats = setup
    zeros = build_drafter(arch(cfg), target).candidate_selector.successor_codebook
    normal = build_drafter(arch(cfg).updated({"drafter.selector_init": "normal"}), target)
    drawn = normal.candidate_selector.successor_codebook
    assert not zeros.any() and float(drawn.std()) == pytest.approx(0.02, rel=0.1)
    d = trained_like(normal)
    losses = {}
    for norm in ("own", "count"):
        o = Objective.from_config(arch(cfg, selector_norm=norm))
        losses[norm], stats = batch_loss(d, target, feats, batch, o, epoch=0, batch_id=3)
    assert float(losses["own"]) != pytest.approx(float(losses["count"]), rel=1e-3)
