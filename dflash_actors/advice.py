"""``launch.py --topology auto``: measure what each stage costs, then split the devices.

The costs are measured in the launching process, before anything is spawned, on the
first device (``cuda:0``, else the CPU), over the first ``PROBE_BATCHES`` batches of
the first epoch's plan after one warm-up batch: assembling a batch (loader), the
target's forward (target), the drafter's forward and backward (drafter) and one AdamW
step (optimizer). Under ``runtime.simulate`` the target and drafter costs are the
configured waits instead. ``costmodel.advise`` then picks the split of the devices
into targets and drafters whose slowest stage is fastest, the same rule ``make bench``
reports.
"""

from __future__ import annotations

import time

import torch

from . import costmodel
from .batching import Batch, BatchBuffers, assemble
from .config import Config
from .models.drafter import build_drafter
from .models.loss import batch_loss, decay_gamma
from .models.target import load_target
from .optim import build_optimizer
from .preflight import Preflight
from .simulate import SimulatedCompute

PROBE_BATCHES = 3


def _timed(fn, device: torch.device) -> float:
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


def probe_costs(cfg: Config, pre: Preflight) -> costmodel.StageCosts:
    """Mean cost per batch of each stage (per step for the optimizer), measured here."""
    torch.set_num_threads(cfg.train.num_threads)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    ids = [pre.plan0.batch(i) for i in range(min(len(pre.plan0), PROBE_BATCHES + 1))]
    buf = BatchBuffers.allocate(cfg.batching.token_budget, cfg.batching.max_samples)
    sim = SimulatedCompute.from_config(cfg)
    target = load_target(cfg, device)
    drafter = build_drafter(cfg, target).to(device)
    opt = build_optimizer(list(drafter.parameters()), cfg.train)
    costs = {"loader": [], "target": [], "drafter": [], "optimizer": [], "tokens": []}
    for k, sample_ids in enumerate(ids):
        costs["loader"].append(_timed(lambda: assemble(pre.dataset, sample_ids, buf), device))
        meta = assemble(pre.dataset, sample_ids, buf)
        batch = Batch.from_buffers(buf, meta).to(device)
        t0 = time.perf_counter()
        features = target.features(batch)
        costs["target"].append(time.perf_counter() - t0 if sim is None else sim.target_s(meta.n_tokens))

        def train():
            loss, _ = batch_loss(drafter, target, features, batch, num_anchors=cfg.train.num_anchors,
                                 gamma=decay_gamma(cfg), seed=cfg.train.seed, epoch=0, batch_id=k)
            loss.backward()
        d = _timed(train, device)
        costs["drafter"].append(d if sim is None else sim.drafter_s(meta.n_tokens))
        costs["optimizer"].append(_timed(opt.step, device))
        costs["tokens"].append(meta.n_tokens)
    mean = lambda xs: sum(xs[1:]) / len(xs[1:]) if len(xs) > 1 else xs[0]    # the first is the warm-up
    return costmodel.StageCosts(mean(costs["loader"]), mean(costs["target"]), mean(costs["drafter"]),
                                mean(costs["optimizer"]), mean(costs["tokens"]))


def device_count() -> int:
    """GPUs to split; on a machine without one, 2 (one target, one drafter on the CPU)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def choose(cfg: Config, pre: Preflight, devices: int) -> tuple[str, str]:
    """(``"N-M"``, the one line saying why)."""
    costs = probe_costs(cfg, pre)
    n, m, _ = costmodel.advise(costs, devices, cfg.train.grad_accum)[0]
    return f"{n}-{m}", costmodel.explain(costs, devices, cfg.train.grad_accum)
