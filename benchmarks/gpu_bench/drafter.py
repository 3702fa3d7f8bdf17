"""Section 2b: the drafter step at the micro-batch the pipeline's memory plan chose.
"""

from __future__ import annotations

import statistics
from types import SimpleNamespace

from .common import (
    FALLBACK_BLOCK_TOKENS,
    GIB,
    SMOKE,
    SPECFORGE_MFU,
    Sizes,
    building_on,
    device_name,
    emit,
    error_line,
    memory_gib,
    reset_memory,
    say,
    sig,
    timed,
)
from .flops import drafter_flops, peak_tflops, rates
from .launches import plan_brief, planned, step_part


def build_drafter_step(sizes: Sizes, device):
    """``(drafter, head, features, batch, layer_ids)`` for one product train step: a
    freshly initialised drafter, the frozen embeddings and LM head, random target
    features ``[T, k*H]`` and a packed batch of random tokens, every position supervised."""
    import torch
    from torch import nn
    from transformers import Qwen3Config

    from dflash_actors.data.batching import Batch
    from dflash_actors.models.drafter import DFlashDrafter, drafter_config
    from dflash_actors.models.target import build_target_layer_ids, resolve_dtype

    m = sizes.model
    vocab, hidden = m["vocab_size"], m["hidden_size"]
    layer_ids = build_target_layer_ids(m["num_hidden_layers"], sizes.draft_layers)
    mask_id = vocab - 1
    cfg = drafter_config(Qwen3Config(**m), sizes.draft_layers, sizes.block_size, layer_ids, mask_id, "bench", vocab)
    # fp32 master weights, as build_drafter makes them; initialised in place on the
    # device (build_drafter's seeded CPU init of 1e9 weights would take longer than the step)
    with building_on(device, torch.float32):
        drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, cfg.initializer_range)
    tdtype = resolve_dtype("auto", device)
    with building_on(device, tdtype):
        head = SimpleNamespace(embed_tokens=nn.Embedding(vocab, hidden).requires_grad_(False),
                               lm_head=nn.Linear(hidden, vocab, bias=False).requires_grad_(False))
        for mod in (head.embed_tokens, head.lm_head):
            nn.init.normal_(mod.weight, 0.0, cfg.initializer_range)
    g = torch.Generator(device=device).manual_seed(1)
    T, n = sizes.rows * sizes.seq_len, sizes.seq_len
    features = torch.randn(T, len(layer_ids) * hidden, device=device, dtype=tdtype, generator=g)
    batch = Batch(input_ids=torch.randint(0, vocab - 1, (T,), device=device, generator=g),
                  position_ids=torch.arange(n, device=device).repeat(sizes.rows),
                  loss_mask=torch.ones(T, dtype=torch.int8, device=device),
                  cu_seqlens=torch.arange(0, T + 1, n, dtype=torch.int32, device=device), max_len=n)
    return drafter, head, features, batch, layer_ids


def train_step(drafter, head, features, batch, objective, block_tokens: int | None, checkpoint_layers: bool,
               stats: dict):
    """``step(i)``: the drafter actor's work on batch i of a one-batch step
    (``drafter_step`` into fresh gradients); the last loss and block count go into ``stats``."""
    from dflash_actors.train.drafter_step import drafter_step

    params = list(drafter.parameters())

    def step(i: int) -> None:
        for p in params:
            p.grad = None
        st = drafter_step(drafter, head, features, batch, objective, epoch=0, batch_id=i, block_tokens=block_tokens,
                          checkpoint_layers=checkpoint_layers)
        stats.update(loss=st.metrics()["loss"], blocks=st.blocks)
    return step


def micro_batches(batch, objective, block_size: int, block_tokens: int | None) -> int:
    """How many micro-batches ``drafter_step`` splits batch 0 into."""
    from dflash_actors.models.blocks import batch_anchors
    from dflash_actors.train.drafter_step import split_anchors

    anchors = batch_anchors(batch, objective.num_anchors, objective.seed, 0, 0)
    lengths = [e - s for s, e in batch.sequences()]
    return sum(1 for g in split_anchors(lengths, anchors, block_size, block_tokens) if any(len(a) for a in g))


def bench_drafter(sizes: Sizes, device, plan: dict, out: str | None = None) -> dict:
    """2b at the micro-batch and checkpointing ``plan`` (2c's) chooses; its peak memory
    beside the plan's for ``drafter.0``, whose parts this process holds too (weights,
    gradients, head, the batch's features, the step) but for the CUDA context."""
    from dflash_actors.models.loss import Objective

    result = {"section": "drafter", "device": device_name(device),
              "shape": "smoke" if sizes is SMOKE else "qwen3-8b", "draft_layers": sizes.draft_layers,
              "block_size": sizes.block_size, "num_anchors": sizes.num_anchors,
              "batch": [sizes.rows, sizes.seq_len], "tokens": sizes.rows * sizes.seq_len,
              "specforge_mfu": SPECFORGE_MFU, "plan": plan_brief(plan)}
    if "drafter_block_tokens" in plan:
        block_tokens, ckpt = plan["drafter_block_tokens"], bool(plan.get("checkpoint_layers"))
    else:
        block_tokens, ckpt = FALLBACK_BLOCK_TOKENS, False
        result["error"] = f"no plan ({plan.get('error')}): measured at {FALLBACK_BLOCK_TOKENS} block tokens"
    objective = Objective(sizes.num_anchors, 7.0, 0, "auto")
    reset_memory(device)
    drafter, head, features, batch, layer_ids = build_drafter_step(sizes, device)
    params = sum(p.numel() for p in drafter.parameters())
    before = memory_gib(device)["allocated_gib"]
    result.update(layer_ids=layer_ids, params=params, block_tokens=block_tokens, checkpoint_layers=ckpt,
                  micro_batches=micro_batches(batch, objective, sizes.block_size, block_tokens))
    emit(result, out)
    stats: dict = {}
    step = train_step(drafter, head, features, batch, objective, block_tokens, ckpt, stats)
    try:
        times = timed(step, sizes.warmup, sizes.runs, device)
        anchors = max(1, round(stats["blocks"] / sizes.rows))
        flops = drafter_flops(sizes.model, len(layer_ids), sizes.draft_layers, sizes.rows, sizes.seq_len,
                              anchors, sizes.block_size)
        result.update(times_s=[sig(x) for x in times], anchors_per_row=anchors, flops_per_batch=sig(flops),
                      **rates(flops, statistics.median(times), result["tokens"], peak_tflops(device)),
                      loss=sig(stats["loss"]))
        result["mfu_over_specforge"] = sig(result["mfu"] / SPECFORGE_MFU, 3)
    except Exception as e:  # noqa: BLE001 - an OOM or a compile failure is a result to record
        result["error"] = error_line(e)
        say(f"drafter: {error_line(e)}")
    mem = memory_gib(device)
    total, context = planned(plan, "drafter.0", str(device))
    # The traced step peak leaves out weights, gradients and inputs (memtrace.StepTrace).
    step_peak = None if before is None or mem["max_allocated_gib"] is None else \
        round(mem["max_allocated_gib"] - before - params * 4 / GIB, 3)
    result["memory"] = {"before_step_gib": before, **{k: mem[k] for k in ("max_allocated_gib", "max_reserved_gib")},
                        "step_peak_gib": step_peak, "planned_step_peak_gib": step_part(plan).get("gib"),
                        "planned_gib": total, "planned_context_gib": context}
    result["plan_vs_measured"] = [{"process": "drafter.0", "device": str(device), "planned_gib": total,
                                   "context_gib": context, "measured_peak_gib": mem["max_allocated_gib"],
                                   "reserved_peak_gib": mem["max_reserved_gib"]}]
    emit(result, out)
    return result
