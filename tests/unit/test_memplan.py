"""The memory plan: its traced figures against a real step, and the order of its levers."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import Qwen3Config

from dflash_actors.config import load_config
from dflash_actors.models import loss as L
from dflash_actors.models.drafter import DFlashDrafter, drafter_config
from dflash_actors.train import memplan, memtrace, tracecache
from tests.support.pipeline import ROOT

SMALL = Qwen3Config(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    num_hidden_layers=6, vocab_size=1000, max_position_embeddings=4096)


def real_saved_bytes(autocast_bf16: bool, rows: int, ctx: int, anchors: int, layers: int = 2) -> int:
    """What a real CPU step of the project's drafter keeps for the backward: distinct
    storages seen by autograd's saved-tensor hooks, weights, gradients and inputs excluded."""
    torch.manual_seed(0)
    V, H = SMALL.vocab_size, SMALL.hidden_size
    d = DFlashDrafter(drafter_config(SMALL, layers, 4, [1, 3], V - 1, "test", V))
    for p in d.parameters():
        p.grad = torch.zeros_like(p)
    dtype = torch.bfloat16 if autocast_bf16 else torch.float32
    head = SimpleNamespace(embed_tokens=torch.nn.Embedding(V, H, dtype=dtype).requires_grad_(False),
                           lm_head=torch.nn.Linear(H, V, bias=False, dtype=dtype).requires_grad_(False))
    feats = torch.randn(rows * ctx, 2 * H, dtype=dtype)
    batch = memtrace.packed_batch(rows, ctx)
    batch.input_ids.random_(0, V - 1)
    blocks = L.lay_out(batch, memtrace.spread_anchors(rows, ctx, anchors), 4, "cpu")
    before = {t.untyped_storage().data_ptr() for t in
              [*d.parameters(), *(p.grad for p in d.parameters()), *d.buffers(), head.embed_tokens.weight,
               head.lm_head.weight, feats]}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in before:
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        value, _ = L.blocks_loss(d, head, feats, blocks, 3.0, compute_dtype="bfloat16" if autocast_bf16 else "float32")
    value.backward()
    return sum(seen.values())


@pytest.mark.parametrize("autocast_bf16", [False, True])
@pytest.mark.parametrize("rows,ctx,anchors", [(1, 96, 16), (3, 64, 24)])
def test_traced_activations_equal_a_real_steps(autocast_bf16, rows, ctx, anchors):
    want = real_saved_bytes(autocast_bf16, rows, ctx, anchors)
    got = memtrace.trace_drafter_step(SMALL, layers=2, block_size=4, feature_layers=2,
                                      head_dtype=torch.bfloat16 if autocast_bf16 else torch.float32,
                                      autocast_bf16=autocast_bf16, cuda=False, rows=rows, ctx_len=ctx,
                                      anchors=anchors)
    assert want > 0 and abs(got.saved - want) <= 0.10 * want, (got.saved, want)
    assert got.peak >= got.saved


def test_a_trace_grows_with_the_blocks_and_shrinks_with_checkpointing():
    def saved(anchors, ckpt=False):
        return memtrace.trace_drafter_step(SMALL, layers=3, block_size=4, feature_layers=2, head_dtype=torch.bfloat16,
                                           autocast_bf16=True, cuda=True, rows=2, ctx_len=512, anchors=anchors,
                                           checkpoint_layers=ckpt).saved
    a, b, c = saved(32), saved(64), saved(128)
    assert 0 < a < b < c and 1.9 < (c - b) / (b - a) < 2.1       # linear in the blocks
    assert saved(128, ckpt=True) < 0.5 * c


def test_the_target_trace_follows_the_batch():
    small = memtrace.trace_target_forward(SMALL, dtype=torch.bfloat16, rows=2, length=128, layer_ids=[1, 3])
    big = memtrace.trace_target_forward(SMALL, dtype=torch.bfloat16, rows=4, length=128, layer_ids=[1, 3])
    assert 0 < small.peak < big.peak <= 2.2 * small.peak


def test_a_micro_batch_stays_within_its_budget():
    shape = memplan.BatchShape(rows=20, length=3000, anchors=512, target_rows=21, target_length=3000, longest=3000)
    for tokens in (16, 1024, 8192, 16384, 65536):
        rows, ctx, anchors = memplan.micro_batch(shape, tokens, 16)
        assert rows * anchors * 16 <= tokens and anchors <= 512
        assert rows * ctx >= min(tokens, rows * 3000) and ctx >= 3000


def plan_with(gpu_bytes: dict, **changes):
    cfg = load_config(ROOT / "configs/default.yaml", [("drafter.block_size", 4), *changes.items()], topology="1-1")
    shape = memplan.BatchShape(rows=8, length=256, anchors=64, target_rows=8, target_length=256, longest=256)
    have = {"cpu": 64 * memplan.GIB, **gpu_bytes}
    inp = memplan.Inputs(cfg, ("cuda:0",), ("cuda:1",), ("cpu",), SMALL, [1, 3], shape, have)
    return memplan.make_plan(inp, tracecache.RunTraces(cfg, SMALL, [1, 3]))


def drafter_room(plan) -> tuple[int, int]:
    """(everything on the drafter's GPU but its step, its step's peak)."""
    d = next(x for x in plan.devices if x.device == "cuda:1")
    step = next(p for p in d.parts if p.what.startswith("step at its peak"))
    return d.need - step.nbytes, step.nbytes


def test_the_levers_come_in_order_and_the_last_line_names_a_key():
    """The whole batch when it fits; else the largest micro-batch of at least a whole
    sequence; else checkpointed layers; else one line naming the key."""
    big = plan_with({"cuda:0": 8 * memplan.GIB, "cuda:1": 8 * memplan.GIB})
    assert big.drafter_block_tokens is None and not big.checkpoint_layers and big.problem is None
    assert big.settings == {}
    fixed, whole = drafter_room(big)

    def gpu(step_bytes):    # a drafter GPU whose usable memory leaves exactly this for the step
        return {"cuda:0": 8 * memplan.GIB, "cuda:1": int((fixed + step_bytes) / (1 - memplan.HEADROOM)) + 1}

    smaller = plan_with(gpu(whole - 1))
    assert smaller.drafter_block_tokens is not None and not smaller.checkpoint_layers
    assert 64 * 4 <= smaller.drafter_block_tokens < 8 * 64 * 4
    assert smaller.settings == {"train.drafter_block_tokens": smaller.drafter_block_tokens}
    _, row = drafter_room(plan_with(gpu(whole), **{"train.drafter_block_tokens": 64 * 4}))
    ckpt = plan_with(gpu(row - 1))
    assert ckpt.checkpoint_layers and ckpt.problem is None
    assert ckpt.settings["train.checkpoint_layers"] == "on"
    none = plan_with({"cuda:0": 8 * memplan.GIB, "cuda:1": fixed})
    assert none.problem and none.problem.startswith("memory plan: cuda:1 needs")
    assert "change " in none.problem and "\n" not in none.problem


def test_a_set_budget_is_kept_or_refused():
    kept = plan_with({"cuda:0": 8 * memplan.GIB, "cuda:1": 8 * memplan.GIB}, **{"train.drafter_block_tokens": 512})
    assert kept.drafter_block_tokens == 512 and kept.settings == {}
    fixed, step = drafter_room(kept)
    refused = plan_with({"cuda:0": 8 * memplan.GIB, "cuda:1": int(fixed / (1 - memplan.HEADROOM))},
                        **{"train.drafter_block_tokens": 512, "train.checkpoint_layers": "off"})
    assert refused.problem and "train.drafter_block_tokens" in refused.problem


def test_the_optimizer_goes_where_it_leaves_the_drafters_most_room():
    """A target GPU with room takes it before the drafter's; none with room: the host."""
    roomy = plan_with({"cuda:0": 8 * memplan.GIB, "cuda:1": 8 * memplan.GIB})
    assert roomy.optimizer_device == "cuda:0"
    target = next(x for x in roomy.devices if x.device == "cuda:0")
    opt = sum(p.nbytes for p in target.parts if p.process == "optimizer.0")
    tight = plan_with({"cuda:0": int((target.need - opt) / (1 - memplan.HEADROOM)) + 1, "cuda:1": 8 * memplan.GIB})
    assert tight.optimizer_device == "cuda:1" and tight.problem is None


def test_the_json_lists_every_device_and_process():
    plan = plan_with({"cuda:0": 8 * memplan.GIB, "cuda:1": 8 * memplan.GIB})
    j = plan.as_json()
    assert [d["device"] for d in j["memory_plan"]] == ["cpu", "cuda:0", "cuda:1"]
    for d in j["memory_plan"]:
        assert d["need_gib"] == pytest.approx(sum(p["gib"] for p in d["parts"]), abs=0.01)
    procs = {(p["process"], p["device"]) for p in j["processes"]}
    assert {("target.0", "cuda:0"), ("drafter.0", "cuda:1"), ("supervisor", "cpu")} <= procs
    assert np.isclose(sum(p["gib"] for p in j["processes"]), sum(d["need_gib"] for d in j["memory_plan"]), atol=0.05)


def test_traces_are_kept_in_the_cache_and_keyed_by_what_they_depend_on(tmp_path, monkeypatch):
    gpus = {"cuda:0": 8 * memplan.GIB, "cuda:1": 8 * memplan.GIB}
    first = plan_with(gpus, **{"data.cache_dir": str(tmp_path)})
    assert list((tmp_path / "memtrace").glob("*.json"))

    def untraced(*args, **kwargs):
        raise AssertionError("traced again")
    for name in ("trace_drafter_step", "trace_target_forward", "trace_optimizer_step", "target_numel",
                 "drafter_numel"):
        monkeypatch.setattr(memtrace, name, untraced)
    again = plan_with(gpus, **{"data.cache_dir": str(tmp_path)})
    assert again.devices == first.devices
    with pytest.raises(AssertionError, match="traced again"):       # another drafter: not in the cache
        plan_with(gpus, **{"data.cache_dir": str(tmp_path), "drafter.num_layers": 2})
