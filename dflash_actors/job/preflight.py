"""Everything checked before anything spawns, computed once and handed on.

Bad input must fail here, in the parent, with one line and nothing written to the run
directory. Cheapest first: the run directory can be written; the config's references
(a simulated shape, held-out data, the evaluator's device); the dataset's structure,
and that it has an anchor to train on; then, once the topology is known, the injected
faults against the actors, the devices, the target's shape (the tiny default is built
here, once) and family (``check_family``), the token range against its vocabulary, and
every epoch's plan. Each step that can take over a second shows progress.

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
from ..models.target_dir import VERIFIED_FAMILIES
from ..runtime.faults import check_faults
from ..train import feature_cache, simulate
from ..train.memplan import BatchShape, MemoryPlan, plan_memory
from ..train.schedule import Schedule
from . import rundir
from .wiring import SUPERVISOR_POINTS, Devices, actor_classes, gang_heads, resolve_devices, ring_choices


@dataclass(frozen=True)
class DataCheck:
    """The training data, opened and checked, with its first epoch planned (both None
    when a memory plan is asked for before the data exists: ``check_data``)."""

    train_path: Path
    dataset: Optional[TokenDataset]
    plan0: Optional[EpochPlan]


@dataclass(frozen=True)
class Preflight(DataCheck):
    """What a run of one config builds on: its data, devices, target, schedule and memory plan."""

    devices: Devices
    """Where each actor runs; the feature ring and the optimizer where the plan put them."""
    target: TargetInfo
    """The target's shape, from its config alone (no weights)."""
    schedule: Optional[Schedule]
    """This node's batch schedule over every epoch (None without data: ``check_data``)."""
    plan: MemoryPlan
    """What every process holds on every device (``train.memplan``); its ``settings``
    record what it chose for the keys left to it (``resolved``)."""


def check_data(cfg: Config, progress: bool = True, elsewhere: bool = False, plan_only: bool = False) -> DataCheck:
    """The checks that do not depend on the topology, and the first epoch's plan.
    ``elsewhere``: planning for another machine (``--gpu-memory``), whose GPUs this one
    need not have. ``plan_only``: a memory plan may come before the data (which the
    target itself makes, ``prepare``): missing data is then no error, and the plan
    is sized from the batching keys instead."""
    rundir.check(cfg.runtime.run_dir)
    simulate.check(cfg)
    feature_cache.check(cfg)
    missing = lambda p: plan_only and p is not None and not Path(p).exists()    # noqa: E731
    if cfg.eval.every and cfg.eval.data is not None and not missing(cfg.eval.data):
        open_dataset(cfg.data, progress=False, path=cfg.eval.data)     # bad held-out data: exit 2 now
    if cfg.eval.every and cfg.eval.device.startswith("cuda") and not elsewhere \
            and int(cfg.eval.device[5:]) >= torch.cuda.device_count():
        raise ConfigError(f"eval.device: {cfg.eval.device} but {torch.cuda.device_count()} CUDA devices exist")
    path = train_path(cfg)
    if missing(cfg.data.path):
        return DataCheck(path, None, None)
    ds = open_dataset(cfg.data, progress=progress, path=path)
    ds.check_trainable()
    return DataCheck(path, ds, plan_for(cfg, ds.lengths, 0))


def preflight(cfg: Config, node: int = 0, progress: bool = True, data: Optional[DataCheck] = None,
              gpu_memory: Optional[float] = None, plan_only: bool = False) -> Preflight:
    """Every check of ``cfg`` for node ``node`` (module docstring); ``data``: its
    ``check_data``, when the caller has it already (of this config, or of one that
    differs only in topology). ``gpu_memory``: plan for GPUs of that many GiB, on a
    machine that need not have them (``--gpu-memory``). A memory plan that does not fit
    is a ConfigError naming the key to change, unless ``plan_only`` (the caller shows the
    plan, then the line)."""
    data = data or check_data(cfg, progress, elsewhere=gpu_memory is not None)
    check_faults(cfg.runtime.faults, actor_classes(cfg), SUPERVISOR_POINTS)
    top = cfg.topology
    gpus, peer = None, None
    if gpu_memory is not None:
        # Another machine: as many GPUs as the topology names (or needs), each reaching the others.
        named = [int(d[5:]) + 1 for d in (*(top.target_devices or ()), *(top.drafter_devices or ()),
                                           *([cfg.eval.device] if cfg.eval.every else ())) if d.startswith("cuda:")]
        placed = top.target_devices is not None or top.drafter_devices is not None
        gpus = max([*named, 0 if placed else top.num_targets * top.target_tp + top.num_drafters])
        peer = lambda a, b: True    # noqa: E731
    devices = resolve_devices(cfg, gpus)
    heads = gang_heads(devices, top.target_tp)
    with console.phase("read the target's config (the tiny default is built once)", progress):
        target = target_info(cfg, "cpu")
    check_family(cfg, target.config)
    tensor_parallel.check(cfg, target.config)
    shape = BatchShape.of_config(cfg) if data.dataset is None else \
        BatchShape.of_plan(cfg, data.dataset.lengths, data.plan0)
    with console.phase("plan every device's memory (traced at the run's shapes)", progress):
        plan = plan_memory(cfg, devices.targets, devices.drafters,
                        ring_choices(cfg.runtime.feature_transport, heads, devices.drafters, peer), target.config,
                        target.layer_ids, shape, gpu_memory)
    if plan.problem and not plan_only:
        raise ConfigError(plan.problem)
    devices = Devices(devices.targets, devices.drafters, plan.feature_device, plan.optimizer_device)
    fields_ = {f.name: getattr(data, f.name) for f in fields(DataCheck)}
    if data.dataset is None:
        return Preflight(**fields_, devices=devices, target=target, schedule=None, plan=plan)
    data.dataset.check_values(target.vocab_size, progress=progress)
    with console.phase("plan every epoch", progress):
        sizes = [len(data.plan0)] + [len(plan_for(cfg, data.dataset.lengths, e)) for e in range(1, cfg.train.epochs)]
        schedule = Schedule.from_epoch_sizes(cfg, sizes, node)
    if schedule.total_steps == 0:
        raise ConfigError(f"train.grad_accum: no optimizer step fits an epoch ({len(data.plan0)} "
                          f"batches; a step needs grad_accum * drafters = {schedule.per_step})")
    return Preflight(**fields_, devices=devices, target=target, schedule=schedule, plan=plan)


def check_family(cfg: Config, target_config) -> None:
    """Refuse ``target.self_check: false`` on a family the target zoo does not verify
    (``VERIFIED_FAMILIES``). The wrapper runs each sequence in its own right-padded row
    with no mask, which keeps sequences apart only in a model whose every layer is
    causal and whose rows never meet (no MoE capacity shared by a batch, no state carried
    between rows); the self-check holds the features to the model's own forward before
    training. Without it, nothing would: such a run could train on leaked features."""
    kind = getattr(target_config, "model_type", None)
    if not cfg.target.self_check and kind not in VERIFIED_FAMILIES:
        raise ConfigError(f"target.self_check: off for a {kind!r} target, a family no test here verifies "
                          f"(verified: {', '.join(VERIFIED_FAMILIES)}); leave it on, and each target checks its "
                          "features against the model's own forward before training")


def resolved(cfg: Config, pre: Preflight) -> Config:
    """``cfg`` with what its memory plan chose for the keys left to it written in (the
    run's ``config.yaml`` then records it, and a resume keeps it)."""
    return cfg.updated(pre.plan.settings) if pre.plan.settings else cfg
