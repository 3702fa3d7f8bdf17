"""Everything the supervisor checks before it spawns anything.

Bad input must fail here, in the parent, with one line and nothing written to the run
directory: config (already validated on load), devices, dataset structure, that the
dataset has an anchor to train on, token range, and the epoch plan. Each step that can
take over a second shows progress.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from ..data.batching import EpochPlan, plan_for
from ..config import Config, ConfigError
from ..data.dataset import TokenDataset, open_dataset
from ..data.synthetic import ensure_synthetic_dataset


@dataclass(frozen=True)
class Devices:
    targets: tuple[str, ...]
    drafters: tuple[str, ...]
    features: str = "cpu"
    """Where the feature ring lives (``feature_device``)."""


def feature_device(transport: str, targets: tuple[str, ...], drafters: tuple[str, ...],
                   peer: Callable[[int, int], bool] | None = None) -> str:
    """The feature ring's device for ``runtime.feature_transport``: the first drafter's
    GPU, or cpu. Each target writes and each drafter reads that device's memory, so
    every one of them must be on a GPU that reaches it: the same one, or a peer
    (``peer(a, b)``: can device a access device b, as ``torch.cuda.can_device_access_peer``)."""
    if transport == "host":
        return "cpu"
    on_cpu = [d for d in (*targets, *drafters) if not d.startswith("cuda:")]
    ring = drafters[0]
    if not on_cpu:
        peer = peer or torch.cuda.can_device_access_peer
        k = int(ring[5:])
        far = sorted({d for d in (*targets, *drafters) if int(d[5:]) != k and not peer(int(d[5:]), k)})
    else:
        far = []
    if transport == "auto":
        return "cpu" if on_cpu or far else ring
    if on_cpu:
        raise ConfigError(f"runtime.feature_transport: cuda needs every target and drafter on a GPU, but "
                          f"{', '.join(sorted(set(on_cpu)))} is in the topology (targets {list(targets)}, "
                          f"drafters {list(drafters)}); use host or auto")
    if far:
        raise ConfigError(f"runtime.feature_transport: cuda puts the feature ring on {ring}, which "
                          f"{', '.join(far)} cannot reach peer to peer; use host or auto")
    return ring


def resolve_devices(cfg: Config, cuda_count: int | None = None) -> Devices:
    """Default placement: cuda:0..N-1 for targets then cuda:N..N+M-1 for drafters when
    that many GPUs exist, else cpu everywhere. Explicit cuda:K beyond the count is an error."""
    top = cfg.topology
    n, m = top.num_targets, top.num_drafters
    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if top.target_devices is None and top.drafter_devices is None:
        if cuda_count >= n + m:
            return Devices(tuple(f"cuda:{i}" for i in range(n)), tuple(f"cuda:{n + j}" for j in range(m)))
        return Devices(("cpu",) * n, ("cpu",) * m)
    targets = top.target_devices or ("cpu",) * n
    drafters = top.drafter_devices or ("cpu",) * m
    for name, devs in (("topology.target_devices", targets), ("topology.drafter_devices", drafters)):
        for d in devs:
            if d.startswith("cuda:") and int(d[5:]) >= cuda_count:
                raise ConfigError(f"{name}: {d} requested but this machine has {cuda_count} CUDA device(s)")
    return Devices(tuple(targets), tuple(drafters))


def train_path(cfg: Config) -> Path:
    """``data.path``, or the synthetic default, generated once into the cache."""
    return Path(cfg.data.path) if cfg.data.path is not None else ensure_synthetic_dataset(cfg.data)[0]


@dataclass
class Preflight:
    devices: Devices
    train_path: Path
    dataset: TokenDataset
    plan0: EpochPlan


def preflight(cfg: Config, progress: bool = True) -> Preflight:
    """Devices, dataset structure (and that it has something to learn) and the first
    epoch's plan. Token ids are checked against the vocabulary by the caller once it
    knows the target (``TokenDataset.check_values``)."""
    devices = resolve_devices(cfg)
    devices = replace(devices, features=feature_device(cfg.runtime.feature_transport, devices.targets,
                                                       devices.drafters))
    train = train_path(cfg)
    if cfg.eval.every and cfg.eval.data is not None:
        open_dataset(cfg.data, progress=False, path=cfg.eval.data)     # bad held-out data: exit 2 now
    if cfg.eval.every and cfg.eval.device.startswith("cuda") and int(cfg.eval.device[5:]) >= torch.cuda.device_count():
        raise ConfigError(f"eval.device: {cfg.eval.device} but {torch.cuda.device_count()} CUDA devices exist")
    ds = open_dataset(cfg.data, progress=progress, path=train)
    ds.check_trainable()
    plan0 = plan_for(cfg, ds.lengths, 0)
    return Preflight(devices, train, ds, plan0)
