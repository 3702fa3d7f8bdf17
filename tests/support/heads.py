"""What the tests of a drafter's heads share (DFlash2, DSpark, XPress, the micro-batch
step): the first batch of the tiny config's synthetic data, as the loader assembles it,
and a drafter whose head parameters are moved off their start, as training moves them (a
fresh head often starts at the identity or at zero, where a wrong gradient can hide)."""

from __future__ import annotations

import torch

from dflash_actors.data.batching import Batch, BatchBuffers, assemble, plan_for
from dflash_actors.data.dataset import open_dataset
from dflash_actors.data.synthetic import train_path


def first_batch(cfg) -> Batch:
    """Batch 0 of epoch 0, in tensors of its own (not views of the loader's buffers)."""
    ds = open_dataset(cfg.data, progress=False, path=train_path(cfg))
    buf = BatchBuffers.allocate(cfg.batching.token_budget, cfg.batching.max_samples)
    batch = Batch.from_buffers(buf, assemble(ds, plan_for(cfg, ds.lengths, 0).batch(0), buf))
    return Batch(*(t.clone() for t in (batch.input_ids, batch.position_ids, batch.loss_mask, batch.cu_seqlens)),
                 batch.max_len)


def with_teacher(tiny):
    """``(cfg, target, first batch, its features with the target's last state)``: what the
    DSpark and XPress tests train on (their objectives read the target's distribution)."""
    from dflash_actors.models.target import TargetModel

    cfg, target = tiny
    batch = first_batch(cfg)
    return cfg, target, batch, TargetModel(target.model, target.layer_ids, teacher=True).features(batch)


def moved_off_start(d, picks, scale, seed: int = 0):
    """``d`` with every parameter ``picks(name)`` accepts moved by N(0, 1) times
    ``scale(name)`` (a number, or a function of the name), in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if picks(name):
                p.add_(torch.randn(p.shape, generator=g) * (scale(name) if callable(scale) else scale))
    return d
