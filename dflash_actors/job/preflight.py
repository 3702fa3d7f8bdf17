"""Everything checked before anything spawns, computed once and handed on.

Bad input must fail here, in the parent, with one line and nothing written to the run
directory. Cheapest first: the run directory can be written; the config's references
(a simulated shape, held-out data, the evaluator's device); the dataset's structure,
and that it has an anchor to train on; then, once the topology is known, the injected
faults against the actors, the devices, the target's shape (the tiny default is built
here, once), the token range against its vocabulary, and every epoch's plan. Each step
that can take over a second shows progress.

The result, ``Preflight``, is what the job and every ``launch.py`` option build on, so
nothing opens the dataset or plans an epoch twice. It comes in two steps because
``--topology auto`` must see the data (``check_data``: the first epoch's plan) before
it can choose the topology that devices and the schedule depend on (``preflight``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import torch

from .. import console
from ..config import Config, ConfigError
from ..data.batching import EpochPlan, plan_for
from ..data.dataset import TokenDataset, open_dataset
from ..data.synthetic import train_path
from ..models import tensor_parallel
from ..models.head import TargetInfo, target_info
from ..runtime.supervisor import check_faults
from ..train import feature_cache, simulate
from ..train.schedule import Schedule
from . import rundir
from .wiring import SUPERVISOR_POINTS, Devices, actor_classes, feature_device, gang_heads, resolve_devices


@dataclass(frozen=True)
class DataCheck:
    """The training data, opened and checked, with its first epoch planned."""

    train_path: Path
    dataset: TokenDataset
    plan0: EpochPlan


@dataclass(frozen=True)
class Preflight(DataCheck):
    """What a run of one config builds on: its data, devices, target and schedule."""

    devices: Devices
    target: TargetInfo
    """The target's shape, from its config alone (no weights)."""
    schedule: Schedule
    """This node's batch schedule over every epoch."""


def check_data(cfg: Config, progress: bool = True) -> DataCheck:
    """The checks that do not depend on the topology, and the first epoch's plan."""
    rundir.check(cfg.runtime.run_dir)
    simulate.check(cfg)
    feature_cache.check(cfg)
    if cfg.eval.every and cfg.eval.data is not None:
        open_dataset(cfg.data, progress=False, path=cfg.eval.data)     # bad held-out data: exit 2 now
    if cfg.eval.every and cfg.eval.device.startswith("cuda") and int(cfg.eval.device[5:]) >= torch.cuda.device_count():
        raise ConfigError(f"eval.device: {cfg.eval.device} but {torch.cuda.device_count()} CUDA devices exist")
    path = train_path(cfg)
    ds = open_dataset(cfg.data, progress=progress, path=path)
    ds.check_trainable()
    return DataCheck(path, ds, plan_for(cfg, ds.lengths, 0))


def preflight(cfg: Config, node: int = 0, progress: bool = True, data: Optional[DataCheck] = None) -> Preflight:
    """Every check of ``cfg`` for node ``node`` (module docstring); ``data``: its
    ``check_data``, when the caller has it already (of this config, or of one that
    differs only in topology)."""
    data = data or check_data(cfg, progress)
    check_faults(cfg.runtime.faults, actor_classes(cfg), SUPERVISOR_POINTS)
    devices = resolve_devices(cfg)
    devices = Devices(devices.targets, devices.drafters,
                      feature_device(cfg.runtime.feature_transport, gang_heads(devices, cfg.topology.target_tp),
                                     devices.drafters))
    with console.phase("read the target's config (the tiny default is built once)", progress):
        target = target_info(cfg, "cpu")
    tensor_parallel.check(cfg, target.config)
    data.dataset.check_values(target.vocab_size, progress=progress)
    with console.phase("plan every epoch", progress):
        sizes = [len(data.plan0)] + [len(plan_for(cfg, data.dataset.lengths, e)) for e in range(1, cfg.train.epochs)]
        schedule = Schedule.from_epoch_sizes(cfg, sizes, node)
    if schedule.total_steps == 0:
        raise ConfigError(f"train.grad_accum: no optimizer step fits an epoch ({len(data.plan0)} "
                          f"batches; a step needs grad_accum * drafters = {schedule.per_step})")
    return Preflight(**{f.name: getattr(data, f.name) for f in fields(DataCheck)}, devices=devices, target=target,
                     schedule=schedule)
