"""How the training job is wired: its ledger states, its shared state, its rings and its
four stages, each given a typed spec of exactly what it needs.

    stage        ledger transition        data                       dispatch
    loader.0     PLANNED   -> LOADED      -> batch ring              lowest id first
    target.i     LOADED    -> FEATURED    batch -> feature ring      any free target
    drafter.j    FEATURED  -> GRAD_DONE   feature ring -> grads[j]   Schedule.drafter_of(b) == j,
                                                                     once step(b)'s weights exist;
                                                                     with grad_durability step,
                                                                     durable on its last of the step
    optimizer.0  GRAD_DONE -> COMMITTED   grads -> weights v+1       in order
                                          (across machines: grads ->
                                          link -> all nodes' sum)

"Once step(b)'s weights exist": the optimizer commits the last batch of step s only
after it has published weight version s+1, so a drafter batch of step s+1 is sent only
once every batch below ``Schedule.first_of_step(s+1)`` is committed.

``runtime.schedule: lockstep`` rebuilds the old loop from the same stages, for the
benchmarks: the loader starts a step only once the previous one is committed, and the
targets and the drafters each start only once the whole step has reached them
(``Stage.gather``). The math is the same; only the overlap goes.

With ``target.feature_cache`` the job's cache (``train.feature_cache``: shared host
memory or files in the run directory) is handed to every target in its spec, like a
ring: it outlives their restarts.

With ``topology.target_tp`` K > 1 each target.i is a gang of K processes (``Stage.gang``),
tensor parallel over K devices; the rest of the job sees one actor.

Placement (``resolve_devices``, ``ring_choices``): the targets' ranks on
cuda:0..N*K-1 (a gang's adjacent) and drafters on cuda:N*K..N*K+M-1 when that many GPUs
exist, else the CPU; but gangs on a machine with too few GPUs are refused rather than
run on the CPU. The feature ring may go on a drafter's GPU that every actor touching it
(drafters, the targets' rank 0) can reach (``runtime.feature_transport``), or in host
memory; the memory plan picks one (``train.memplan``), and the optimizer's device.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from ..actors.drafter import Drafter, DrafterSpec
from ..actors.loader import Loader, LoaderSpec
from ..actors.optimizer import Optimizer, OptimizerSpec
from ..actors.target import Target, TargetSpec
from ..cluster.exchange import Exchange
from ..config import Config, ConfigError
from ..data.batching import ring_fields
from ..models.shared_weights import SharedWeights
from ..runtime.channels import RingSpec
from ..runtime.dispatch import Stage, in_order
from ..runtime.faults import SUPERVISOR_POINTS as RUNTIME_POINTS
from ..train.feature_cache import FeatureCache
from ..train.metrics import batch_table, step_table
from ..train.params import GradAccumulators, ParamLayout, WeightStore
from ..train.schedule import Schedule


class State(enum.IntEnum):
    PLANNED = 0
    LOADED = 1
    FEATURED = 2
    GRAD_DONE = 3
    COMMITTED = 4


@dataclass(frozen=True)
class JobShared:
    """The drafter side's shared state, allocated by the job before anything spawns and
    handed to the actors that use it (``params``, ``metrics``)."""

    weights: WeightStore
    grads: GradAccumulators
    batch_stats: torch.Tensor
    step_stats: torch.Tensor
    exchange: Optional[Exchange] = None
    """Across machines: the optimizer's side of the node's link (``cluster``)."""

    @classmethod
    def allocate(cls, layout: ParamLayout, cfg: Config, schedule: Schedule) -> "JobShared":
        stats = batch_table(schedule.total_batches, cfg.drafter.block_size)
        exchange = None
        if schedule.nodes > 1:
            exchange = Exchange.allocate(layout.numel, schedule.batches_per_step, stats.shape[1])
        return cls(WeightStore.allocate(layout), GradAccumulators.allocate(layout, cfg.topology.num_drafters),
                   stats, step_table(schedule.total_steps), exchange)


@dataclass(frozen=True)
class Devices:
    targets: tuple[str, ...]
    """One per target rank: target i's gang is ``targets[i*K:(i+1)*K]`` (``topology.target_tp`` K)."""
    drafters: tuple[str, ...]
    features: str = "cpu"
    """Where the feature ring lives: the memory plan's choice among ``ring_choices``."""
    optimizer: Optional[str] = None
    """Where the optimizer keeps its state: the memory plan's choice
    (``runtime.optimizer_device``); None: the first drafter's device."""


def ring_choices(transport: str, targets: tuple[str, ...], drafters: tuple[str, ...],
                 peer: Callable[[int, int], bool] | None = None) -> tuple[str, ...]:
    """Every device the feature ring may go on for ``runtime.feature_transport``, for the
    memory plan to choose from. Each target writes and each drafter reads the ring's
    memory, so a GPU qualifies when every one of them is on a GPU that reaches it: the
    same one, or a peer (``peer(a, b)``: can device a access device b, as
    ``torch.cuda.can_device_access_peer``). ``host``: host memory only; ``auto``: each
    drafter GPU that qualifies, then host memory; ``cuda``: the qualifying drafter GPUs,
    and a ConfigError when there is none."""
    if transport == "host":
        return ("cpu",)
    on_cpu = sorted({d for d in (*targets, *drafters) if not d.startswith("cuda:")})
    gpus: list[str] = []
    if not on_cpu:
        peer = peer or torch.cuda.can_device_access_peer
        users = {int(d[5:]) for d in (*targets, *drafters)}
        gpus = [d for d in dict.fromkeys(drafters) if all(u == int(d[5:]) or peer(u, int(d[5:])) for u in users)]
    if transport == "auto":
        return (*gpus, "cpu")
    if on_cpu:
        raise ConfigError(f"runtime.feature_transport: cuda needs every target and drafter on a GPU, but "
                          f"{', '.join(on_cpu)} is in the topology (targets {list(targets)}, "
                          f"drafters {list(drafters)}); use host or auto")
    if not gpus:
        raise ConfigError(f"runtime.feature_transport: cuda puts the feature ring on a drafter's GPU, and none of "
                          f"{', '.join(dict.fromkeys(drafters))} is reachable peer to peer from every target and "
                          "drafter; use host or auto")
    return tuple(gpus)


def resolve_devices(cfg: Config, cuda_count: int | None = None) -> Devices:
    """Default placement: cuda:0..N*K-1 for the targets' ranks (each gang of K on
    adjacent devices) then cuda:N*K..N*K+M-1 for drafters when that many GPUs exist,
    else cpu everywhere. Errors: gangs (K > 1) on a machine with some GPUs but too few
    (a gang on the CPU is a test setup, not a fallback for a target that needs GPUs),
    and explicit cuda:K beyond the count."""
    top = cfg.topology
    n, m = top.num_targets * top.target_tp, top.num_drafters
    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if top.target_devices is None and top.drafter_devices is None:
        if cuda_count >= n + m:
            return Devices(tuple(f"cuda:{i}" for i in range(n)), tuple(f"cuda:{n + j}" for j in range(m)))
        if top.target_tp > 1 and cuda_count > 0:
            raise ConfigError(f"topology.target_tp: {top.num_targets}x{top.target_tp}-{m} needs {n} target ranks + "
                              f"{m} drafters = {n + m} GPUs, but this machine has {cuda_count}; use a smaller K "
                              "or N (or fewer drafters), or place them with topology.target_devices and "
                              "topology.drafter_devices")
        return Devices(("cpu",) * n, ("cpu",) * m)
    targets = top.target_devices or ("cpu",) * n
    drafters = top.drafter_devices or ("cpu",) * m
    for name, devs in (("topology.target_devices", targets), ("topology.drafter_devices", drafters)):
        for d in devs:
            if d.startswith("cuda:") and int(d[5:]) >= cuda_count:
                raise ConfigError(f"{name}: {d} requested but this machine has {cuda_count} CUDA device(s)")
    return Devices(tuple(targets), tuple(drafters))


def rings(cfg: Config, feature_width: int, feature_dtype: str, feature_device: str = "cpu") -> list[RingSpec]:
    """The batch ring, in (pinned) host memory, and the feature ring, there too or on
    ``feature_device`` (``runtime.feature_transport``); the drafter reads the batch
    fields from its feature slot as tensors, wherever the slot lives."""
    b, r = cfg.batching, cfg.runtime
    return [RingSpec("batch", r.batch_slots, ring_fields(b.token_budget, b.max_samples)),
            RingSpec("features", r.feature_slots,
                     ring_fields(b.token_budget, b.max_samples, feature_width, feature_dtype), feature_device)]


def gang_heads(devices: Devices, tp: int) -> tuple[str, ...]:
    """Each target's rank-0 device: the one that writes its features."""
    return devices.targets[::tp]


def carried(cfg: Config, spec: type, stage: str) -> Config:
    """``cfg`` as stage ``stage``'s spec carries it: only the sections its spec lists."""
    return cfg.carrying(spec.SECTIONS, f"{stage}'s spec")


def stages(cfg: Config, schedule: Schedule, devices: Devices, shared: JobShared, train_path: Path,
           first_step: int, cache: Optional[FeatureCache] = None,
           weights: Optional[SharedWeights] = None) -> list[Stage]:
    """The four stages; ``cache``: the job's feature cache, which every target shares;
    ``weights``: the target's weights in shared memory, which every target maps."""
    s = shared
    lockstep = cfg.runtime.schedule == "lockstep"
    gather = schedule.step_batches if lockstep else None
    return [
        Stage("loader", Loader, State.PLANNED, State.LOADED, out_ring="batch", credit=cfg.runtime.batch_slots,
              barrier=schedule.first_of_own_step if lockstep else None,
              spec=LoaderSpec(carried(cfg, LoaderSpec, "loader"), schedule, str(train_path))),
        Stage("target", Target, State.LOADED, State.FEATURED, count=cfg.topology.num_targets,
              in_ring="batch", out_ring="features", credit=1, gather=gather, gang=cfg.topology.target_tp,
              spec=TargetSpec(carried(cfg, TargetSpec, "target"), devices.targets, schedule, cache, weights,
                              torch.zeros(1, dtype=torch.int8).share_memory_() if cfg.topology.target_tp > 1
                              else None)),
        Stage("drafter", Drafter, State.FEATURED, State.GRAD_DONE, count=cfg.topology.num_drafters,
              in_ring="features", route=schedule.drafter_of, barrier=schedule.first_of_own_step, gather=gather,
              early=not lockstep,
              durable=schedule.is_last_for_drafter if cfg.runtime.grad_durability == "step" else None,
              spec=DrafterSpec(carried(cfg, DrafterSpec, "drafter"), schedule, devices.drafters, s.weights, s.grads,
                               s.batch_stats)),
        Stage("optimizer", Optimizer, State.GRAD_DONE, State.COMMITTED, route=in_order, credit=schedule.per_step,
              spec=OptimizerSpec(carried(cfg, OptimizerSpec, "optimizer"), schedule,
                                 devices.optimizer or devices.drafters[0], first_step, s.weights,
                                 s.grads, s.batch_stats, s.step_stats, s.exchange)),
    ]


SUPERVISOR_POINTS = (*RUNTIME_POINTS, "share_weights")
"""Where ``runtime.faults`` can strike the supervisor's process: the runtime's points, and
``share_weights``, halfway through reading the target's weights into shared memory."""


def actor_classes(cfg: Config) -> dict[str, type]:
    """Every actor id the job will run, with its class (what ``runtime.faults`` may name)."""
    top = cfg.topology
    return {"loader.0": Loader, **{f"target.{i}": Target for i in range(top.num_targets)},
            **{f"drafter.{j}": Drafter for j in range(top.num_drafters)}, "optimizer.0": Optimizer}
