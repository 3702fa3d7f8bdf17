"""DSpark (``drafter.arch: dspark``): every slot proposes the token after it, the Markov
head is teacher-forced in training and walks from the drafted token in decoding, the
three-term objective splits into micro-batches as the whole batch, and the export is the
flat layout vLLM's ``Qwen3DSparkModel`` loads. (Equality with NeMo Automodel's own step:
``test_parity_dspark.py``.)"""

import json

import pytest
import torch
from safetensors import safe_open

from dflash_actors.config import ConfigError
from dflash_actors.models import dspark
from dflash_actors.models.blocks import all_anchors, block_labels
from dflash_actors.models.drafter import DFlashDrafter
from dflash_actors.models.drafter_start import build_drafter
from dflash_actors.models.loss import Objective, batch_loss, dflash_loss
from dflash_actors.train.drafter_step import drafter_step
from tests.support.heads import moved_off_start, with_teacher


def arch(cfg, **drafter):
    changes = {"drafter.arch": "dspark", "drafter.markov_rank": 8, "train.loss": "distill"}
    return cfg.updated(changes | {f"drafter.{k}": v for k, v in drafter.items()})


@pytest.fixture(scope="module")
def setup(tiny):
    return with_teacher(tiny)


def trained_like(d: DFlashDrafter, seed: int = 0) -> DFlashDrafter:
    """``d`` with its heads moved off their small start, as training moves them."""
    return moved_off_start(d, lambda name: name.startswith(("markov_head.", "confidence_head.")), 0.3, seed)


def test_config_rules(tiny):
    cfg, _ = tiny
    with pytest.raises(ConfigError, match="train.loss: dspark's distance and confidence terms"):
        cfg.updated({"drafter.arch": "dspark"})
    assert cfg.updated({"drafter.arch": "dspark", "drafter.dspark_distance_alpha": 0.0,
                        "drafter.dspark_confidence_alpha": 0.0}).drafter.arch == "dspark"
    with pytest.raises(ConfigError, match="train.head_vocab: dspark needs full"):
        arch(cfg).updated({"train.head_vocab": "data"})
    with pytest.raises(ConfigError, match="train.position_weight: dspark"):
        arch(cfg).updated({"train.position_weight": "dpace"})
    with pytest.raises(ConfigError, match="all 0"):
        arch(cfg, dspark_ce_alpha=0.0, dspark_distance_alpha=0.0, dspark_confidence_alpha=0.0)
    o = Objective.from_config(arch(cfg))
    assert o.dspark == dspark.DSparkObjective(0.1, 0.9, 1.0, "l1") and o.gamma == 4.0 and o.selector is None
    assert Objective.from_config(cfg).dspark is None


def test_a_fresh_dspark_backbone_is_the_dflash_of_its_seed(setup):
    cfg, target, _, _ = setup
    one, two = build_drafter(cfg, target), build_drafter(arch(cfg), target)
    theirs = two.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in one.state_dict().items())
    assert set(theirs) - set(one.state_dict()) == {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                                                   "confidence_head.proj.weight", "confidence_head.proj.bias"}
    assert two.label_shift == 1 and two.proposals == two.block_size and one.proposals == one.block_size - 1
    assert not theirs["confidence_head.proj.bias"].any()
    H, r = target.hidden_size, 8
    assert theirs["confidence_head.proj.weight"].shape == (1, H + r)
    assert build_drafter(arch(cfg, confidence_with_markov=False), target).confidence_head.proj.in_features == H
    assert build_drafter(arch(cfg, dspark_confidence_alpha=0.0), target).confidence_head is None


def test_every_slot_is_labelled_with_the_token_after_it_and_a_hole_ends_the_block():
    tokens = torch.arange(20, 40)
    mask = torch.ones(20, dtype=torch.int8)
    mask[[9, 15]] = 0
    labels, valid = block_labels(tokens, mask, torch.tensor([3, 7, 17]), block_size=4, shift=1)
    assert labels[0].tolist() == [24, 25, 26, 27] and valid[0].tolist() == [True] * 4
    assert valid[1].tolist() == [True, False, False, False]          # a+2 = 9 is a hole: the rest go too
    assert valid[2].tolist() == [True, True, False, False]           # the text ends at 19
    # DFlash's own layout is unchanged: slot k is a + k, slot 0 never, holes cut one slot.
    _, flat = block_labels(tokens, mask, torch.tensor([7]), block_size=4)
    assert flat[0].tolist() == [False, True, False, True]


@pytest.mark.parametrize("distance", ["l1", "kl"])
def test_micro_batches_add_up_to_the_whole_batch(setup, distance):
    cfg, target, batch, feats = setup
    c = arch(cfg, dspark_distance=distance)
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
    assert split.accepted == whole.accepted and int(whole.slot_total[0]) > 0
    assert len(whole.metrics()["slot_acc"]) == d.block_size          # the anchor slot proposes too


def test_an_unweighted_confidence_head_still_takes_a_zero_gradient(setup):
    cfg, target, batch, feats = setup
    c = arch(cfg, dspark_distance_alpha=0.0, dspark_confidence_alpha=0.0)
    d = build_drafter(arch(cfg), target)          # a head built, its term weighted 0
    loss, _ = batch_loss(d, target, feats, batch, Objective.from_config(c), epoch=0, batch_id=0)
    loss.backward()
    assert torch.equal(d.confidence_head.proj.weight.grad, torch.zeros_like(d.confidence_head.proj.weight))
    assert d.markov_head.markov_w2.weight.grad.abs().sum() > 0


def test_the_markov_walk_biases_each_slot_by_the_token_drafted_before_it():
    g = torch.Generator().manual_seed(0)
    head = dspark.MarkovHead(50, 4)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    logits, anchors = torch.randn(3, 6, 50, generator=g), torch.tensor([1, 2, 3])
    path = dspark.markov_walk(head, logits, anchors)
    with torch.no_grad():
        for n in range(3):
            prev = anchors[n]
            for k in range(6):
                want = int((logits[n, k] + head.markov_w2(head.markov_w1(prev))).argmax())
                assert int(path[n, k]) == want
                prev = path[n, k]
        assert not torch.equal(path, logits.argmax(-1))
        head.markov_w2.weight.zero_()
    assert torch.equal(dspark.markov_walk(head, logits, anchors), logits.argmax(-1))


def test_export_is_the_flat_dspark_layout_and_loads_back(setup, tmp_path):
    cfg, target, _, _ = setup
    d = trained_like(build_drafter(arch(cfg), target))
    d.save_pretrained(tmp_path / "dr")
    conf = json.loads((tmp_path / "dr" / "config.json").read_text())
    assert conf["architectures"] == ["Qwen3DSparkModel"] and "auto_map" not in conf
    assert not (tmp_path / "dr" / "dflash.py").exists() and conf["is_causal"] is False
    assert (conf["markov_rank"], conf["markov_head_type"], conf["enable_confidence_head"],
            conf["confidence_head_with_markov"]) == (8, "vanilla", True, True)
    assert conf["mask_token_id"] == conf["dflash_config"]["mask_token_id"]
    assert conf["target_layer_ids"] == conf["dflash_config"]["target_layer_ids"] == list(target.layer_ids)
    assert conf["block_size"] == cfg.drafter.block_size
    assert "partial_rotary_factor" not in json.dumps(conf)
    V, H, r = conf["vocab_size"], conf["hidden_size"], 8
    with safe_open(str(tmp_path / "dr" / "model.safetensors"), "pt") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if "head" in k}
    assert got == {"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V, r),
                   "confidence_head.proj.weight": (1, H + r), "confidence_head.proj.bias": (1,)}
    back = DFlashDrafter.from_pretrained(tmp_path / "dr")
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in d.state_dict().items())
    again = build_drafter(arch(cfg).updated({"drafter.init_from": str(tmp_path / "dr")}), target)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in d.state_dict().items())
    with pytest.raises(ValueError, match="is a dspark .* drafter, this run trains dflash"):
        build_drafter(cfg.updated({"drafter.init_from": str(tmp_path / "dr")}), target)
    with pytest.raises(ValueError, match="this run trains dspark"):
        build_drafter(arch(cfg, markov_rank=4).updated({"drafter.init_from": str(tmp_path / "dr")}), target)
    # DeepSpec writes the flat keys alone.
    del conf["dflash_config"]
    (tmp_path / "dr" / "config.json").write_text(json.dumps(conf))
    flat = DFlashDrafter.from_pretrained(tmp_path / "dr")
    assert flat.mask_token_id == d.mask_token_id and flat.target_layer_ids == d.target_layer_ids


def test_fitted_dspark_decodes_losslessly_and_the_evaluator_scores_its_walk(tiny):
    """A DSpark fitted for a moment drafts B tokens per block through its Markov walk:
    decoding keeps the target's greedy text, and the evaluator's replay of decoding gives
    decoding's tau."""
    from dflash_actors.eval.decode import verify_block
    from dflash_actors.eval.evaluator import HeldOut, evaluate_version
    from dflash_actors.eval.tau import real_tau
    from tests.support.fitting import fit_briefly, heldout_prompts

    cfg, target = tiny
    c = arch(cfg)
    prompts = heldout_prompts(cfg, 6)
    d = trained_like(build_drafter(c, target))
    stats, batch, feats = fit_briefly(d, target, prompts)      # CE only: the features carry no teacher
    assert stats.metrics()["tau"] > 1.5 and verify_block(d) == d.block_size + 1
    r = real_tau(d, target, list(prompts[:3]), 24)
    assert r["lossless"] and r["mismatches"] == [] and r["tau"] > 1.5
    assert len(r["per_position"]) == d.block_size
    heldout = HeldOut(c, target, 8, 4, 16)
    got = evaluate_version(d, target, heldout)["real"]
    want = real_tau(d, target, [ids[:first] for ids, first, _ in heldout.items[:4]], 16, check_lossless="none")
    assert got == {k: want[k] for k in got}
    with torch.no_grad():
        _, now = dflash_loss(d, target, feats, batch, all_anchors(batch), 4.0)
    assert now.accepted > 0


def test_the_memory_plan_traces_the_heads_and_their_terms():
    """The plan's trace of a DSpark step keeps what a real CPU step keeps for the backward
    (the checkpointed vocabulary chunks, the heads' inputs), and counts the heads' weights."""
    from types import SimpleNamespace

    from dflash_actors.models.drafter import drafter_config
    from dflash_actors.models.loss import blocks_loss, lay_out
    from dflash_actors.train import memtrace
    from tests.unit.test_memplan import SMALL

    fields = {"markov_rank": 16, "markov_head_type": "vanilla", "enable_confidence_head": True,
              "confidence_head_with_markov": True}
    V, H, rows, ctx, anchors = SMALL.vocab_size, SMALL.hidden_size, 2, 64, 16
    torch.manual_seed(0)
    d = DFlashDrafter(drafter_config(SMALL, 2, 4, [1, 3], V - 1, "test", V, dspark=fields))
    for p in d.parameters():
        p.grad = torch.zeros_like(p)
    head = SimpleNamespace(embed_tokens=torch.nn.Embedding(V, H).requires_grad_(False),
                           lm_head=torch.nn.Linear(H, V, bias=False).requires_grad_(False))
    feats = torch.randn(rows * ctx, 3 * H)
    batch = memtrace.packed_batch(rows, ctx)
    batch.input_ids.random_(0, V - 1)
    blocks = lay_out(batch, memtrace.spread_anchors(rows, ctx, anchors), 4, "cpu", 1)
    before = {t.untyped_storage().data_ptr() for t in [*d.parameters(), *(p.grad for p in d.parameters()),
                                                        *d.buffers(), head.embed_tokens.weight,
                                                        head.lm_head.weight, feats]}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in before:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        value, _ = blocks_loss(d, head, feats, blocks, 4.0, loss="distill", dspark=dspark.DSparkObjective())
    value.backward()
    want = sum(seen.values())
    common = dict(layers=2, block_size=4, feature_layers=2, head_dtype=torch.float32, autocast_bf16=False,
                  cuda=False, rows=rows, ctx_len=ctx, anchors=anchors)
    got = memtrace.trace_drafter_step(SMALL, loss="distill", dspark=fields, **common)
    assert want > 0 and abs(got.saved - want) <= 0.10 * want, (got.saved, want)
    assert got.saved > memtrace.trace_drafter_step(SMALL, **common).saved
    plain = memtrace.drafter_numel(SMALL, 2, 4, 2)
    assert memtrace.drafter_numel(SMALL, 2, 4, 2, dspark=fields) - plain == 2 * V * 16 + H + 16 + 1


def test_the_run_traces_carry_the_dspark_fields(tiny):
    from dflash_actors.train.tracecache import RunTraces

    cfg, target = tiny
    traces = RunTraces(arch(cfg), target.config, target.layer_ids)
    assert traces.arch["dspark"] == dspark.dspark_fields(arch(cfg).drafter)
    assert "dspark" not in RunTraces(cfg, target.config, target.layer_ids).arch
