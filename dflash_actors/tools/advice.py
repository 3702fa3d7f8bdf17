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

from ..config import Config, ConfigError
from ..data.batching import Batch, BatchBuffers, assemble
from ..job.preflight import DataCheck
from ..models.drafter import build_drafter
from ..models.loss import Objective, batch_loss
from ..models.target import load_target
from ..train import costmodel
from ..train.optim import build_optimizer
from ..train.simulate import SimulatedCompute

PROBE_BATCHES = 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _probe_batch(cfg: Config, data: DataCheck, k: int, buf: BatchBuffers, models, device) -> tuple[float, ...]:
    """(loader, target, drafter, optimizer seconds, tokens) of the plan's batch k."""
    target, drafter, opt = models
    t0 = time.perf_counter()
    meta = assemble(data.dataset, data.plan0.batch(k), buf)
    t1 = time.perf_counter()
    batch = Batch.from_buffers(buf, meta).to(device)
    features = target.features(batch)
    _sync(device)
    t2 = time.perf_counter()
    loss, _ = batch_loss(drafter, target, features, batch, Objective.from_config(cfg), epoch=0, batch_id=k)
    loss.backward()
    _sync(device)
    t3 = time.perf_counter()
    opt.step()
    _sync(device)
    return t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3, meta.n_tokens


def probe_costs(cfg: Config, data: DataCheck) -> costmodel.StageCosts:
    """Mean cost per batch of each stage (per step for the optimizer), measured here."""
    torch.set_num_threads(cfg.train.num_threads)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    buf = BatchBuffers.allocate(cfg.batching.token_budget, cfg.batching.max_samples)
    target = load_target(cfg, device)
    drafter = build_drafter(cfg, target).to(device)
    models = (target, drafter, build_optimizer(list(drafter.parameters()), cfg.train))
    n = min(len(data.plan0), PROBE_BATCHES + 1)
    rows = [_probe_batch(cfg, data, k, buf, models, device) for k in range(n)]
    rows = rows[1:] or rows             # the first batch warms up
    loader, tgt, dft, opt, tokens = (sum(col) / len(rows) for col in zip(*rows))
    sim = SimulatedCompute.from_config(cfg)
    if sim is not None:
        tgt, dft = sim.target_s(tokens), sim.drafter_s(tokens)
    return costmodel.StageCosts(loader, tgt, dft, opt, tokens)


def device_count() -> int:
    """GPUs to split; on a machine without one, 2 (one target, one drafter on the CPU)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def choose(cfg: Config, data: DataCheck, devices: int) -> tuple[int, int, str]:
    """(targets, drafters, the one line saying why) for ``devices`` devices, each target
    a gang of ``topology.target_tp`` of them."""
    tp = cfg.topology.target_tp
    if tp > 1 and not cfg.runtime.simulate.enabled:
        # The probe runs the target whole on one device, which a target that needs a
        # gang does not fit: the split is then the user's (NxK-M).
        raise ConfigError(f"--topology auto: measures the target whole on one device, so not with "
                          f"topology.target_tp={tp}; give the topology as NxK-M (e.g. 1x{tp}-{max(1, devices - tp)})")
    if devices < tp + 1:
        raise ConfigError(f"--devices: {devices} cannot hold a target of {tp} devices and a drafter")
    costs = probe_costs(cfg, data)
    n, m, _ = costmodel.advise(costs, devices, cfg.train.grad_accum, tp=tp)[0]
    return n, m, costmodel.explain(costs, devices, cfg.train.grad_accum, tp=tp)
