"""``launch.py --topology auto``: measure what each stage costs, then split the devices.

The costs are measured before any actor starts, in a process of their own (spawned:
the launching process never touches CUDA for them, since it goes on to be the
supervisor, and whatever the probe reserved on ``cuda:0`` would stay reserved there for
the whole run, beside ``target.0``). The probe runs on the first device (``cuda:0``,
else the CPU), over the first ``PROBE_BATCHES`` batches of the first epoch's plan after
one warm-up batch: assembling a batch (loader), the target's forward (target), the
drafter's forward and backward in the drafter actors' micro-batches (``drafter_step``,
drafter) and one AdamW step (optimizer). Under ``runtime.simulate`` the target and
drafter costs are the configured waits instead. An error in the probe comes back as a
one-line ``ValueError``, as does a probe that dies or gives no result within
``runtime.start_timeout_s + PROBE_S``. ``costmodel.advise`` then picks the split of the
devices into targets and drafters whose slowest stage is fastest, the same rule ``make
bench`` reports.
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from ..config import Config, ConfigError
from ..data.batching import Batch, BatchBuffers, assemble
from ..data.dataset import TokenDataset, open_dataset
from ..job.preflight import DataCheck
from ..models.drafter_start import build_drafter
from ..models.loss import Objective
from ..models.target import load_target
from ..runtime.boot import Deferred, boot
from ..runtime.children import exit_cause
from ..train import costmodel
from ..train.drafter_step import drafter_step, step_options
from ..train.optim import build_optimizer
from ..train.simulate import SimulatedCompute

PROBE_BATCHES = 3
PROBE_S = 600.0
"""How long the probe may take past ``runtime.start_timeout_s`` (which covers loading
the models): its batches, the first of which compiles the drafter's kernels."""
EXIT_S = 30.0
"""How long a probe that has answered, or closed its pipe, may take to exit."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _probe_batch(cfg: Config, dataset: TokenDataset, k: int, ids: np.ndarray, buf: BatchBuffers, models,
                 device) -> tuple[float, ...]:
    """(loader, target, drafter, optimizer seconds, tokens) of the plan's batch k, samples ``ids``."""
    target, drafter, opt = models
    t0 = time.perf_counter()
    meta = assemble(dataset, ids, buf)
    t1 = time.perf_counter()
    batch = Batch.from_buffers(buf, meta).to(device)
    features = target.features(batch)
    _sync(device)
    t2 = time.perf_counter()
    drafter_step(drafter, target, features, batch, Objective.from_config(cfg), epoch=0, batch_id=k,
                 **step_options(cfg))
    _sync(device)
    t3 = time.perf_counter()
    opt.step()
    _sync(device)
    return t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3, meta.n_tokens


def measure(cfg: Config, train_path: Path, batches: list[np.ndarray]) -> costmodel.StageCosts:
    """Mean cost per batch of each stage (per step for the optimizer) over ``batches``
    (sample ids of the plan's first batches), measured in this process."""
    torch.set_num_threads(cfg.train.num_threads)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dataset = open_dataset(cfg.data, progress=False, path=train_path)
    buf = BatchBuffers.allocate(cfg.batching.token_budget, cfg.batching.max_samples)
    target = load_target(cfg, device)
    drafter = build_drafter(cfg, target).to(device)
    models = (target, drafter, build_optimizer(list(drafter.parameters()), cfg.train))
    rows = [_probe_batch(cfg, dataset, k, ids, buf, models, device) for k, ids in enumerate(batches)]
    rows = rows[1:] or rows             # the first batch warms up
    loader, tgt, dft, opt, tokens = (sum(col) / len(rows) for col in zip(*rows))
    sim = SimulatedCompute.from_config(cfg)
    if sim is not None:
        tgt, dft = sim.target_s(tokens), sim.drafter_s(tokens)
    return costmodel.StageCosts(loader, tgt, dft, opt, tokens)


def probe_main(cfg: Config, train_path: Path, batches: list[np.ndarray], send) -> None:
    """The probe process: ``measure``'s costs down ``send``, or the message of the
    ``ValueError`` to raise instead."""
    try:
        send.send(measure(cfg, train_path, batches))
    except ValueError as e:             # ConfigError and the models' load errors: the user's to fix
        send.send(str(e))
    except Exception as e:
        send.send(f"--topology auto: the cost probe failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")


def probe_costs(cfg: Config, data: DataCheck) -> costmodel.StageCosts:
    """``measure`` in a spawned process (see the module docstring)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    got, send = ctx.Pipe(duplex=False)
    batches = [data.plan0.batch(k) for k in range(min(len(data.plan0), PROBE_BATCHES + 1))]
    if cfg.train.drafter_block_tokens is None:
        # The memory plan comes once the topology is chosen; until then the probe trains
        # a batch one sequence's blocks at a time, which fits wherever a run would (a
        # batch's cost is its FLOPs however it is split).
        row = min(cfg.train.num_anchors, cfg.data.max_seq_len - 1) * cfg.drafter.block_size
        cfg = cfg.updated({"train.drafter_block_tokens": max(row, cfg.drafter.block_size)})
    # Not daemonic, so that compiling may start worker processes; boot ties its life to ours.
    proc = ctx.Process(target=boot, name="topology-probe",
                       args=(os.getpid(), Deferred((cfg, data.train_path, batches, send)),
                             "dflash_actors.tools.advice:probe_main"))
    proc.start()
    send.close()                        # the child's copy is then the only one: its death ends the pipe
    limit = cfg.runtime.start_timeout_s + PROBE_S
    answered, result = False, None
    try:
        answered = got.poll(limit)
        if answered:
            result = got.recv()
    except EOFError:                    # its end closed without a result: it died
        pass
    finally:
        proc.join(EXIT_S if answered else 0)
        if proc.is_alive():
            proc.kill()
            proc.join()
        got.close()
    if not answered:
        raise ValueError(f"--topology auto: the cost probe gave no result in {limit:.0f} s "
                         f"(runtime.start_timeout_s + {PROBE_S:.0f} s); give the topology as N-M")
    if result is None:
        raise ValueError(f"--topology auto: the cost probe process died without a result "
                         f"({exit_cause(proc.exitcode, None, None)})")
    if isinstance(result, str):
        raise ValueError(result)
    return result


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
