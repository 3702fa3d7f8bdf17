"""Simulated compute (``runtime.simulate``): the pipeline with its models replaced by waits.

CPU cores cannot show how the pipeline behaves around GPUs: here the models compete for
two cores with everything else. Under simulation the target's forward and the
drafter's forward and backward become a ``time.sleep`` of a configured cost (per token
plus per batch), which, like a GPU kernel, leaves the CPU to the rest. The rest stays
real, so what is measured is the pipeline's own cost:
  * the loader assembles real batches into the batch ring;
  * the target copies the batch fields and writes a feature tensor of the configured
    width (``simulate.feature_width``, else the target's) into its slot, from device
    memory, as the real one does;
  * the drafter loads weights when their version changes, reads the whole feature
    tensor out of the slot, loads and commits its running gradient sum, and writes
    its stats row;
  * the optimizer is unchanged: real reduction, AdamW step, publish and checkpoints.
The target stamps each feature tensor with its batch id and the drafter checks the
stamp, so a test can tell that the bytes really went through the slot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from ..runtime.config import ConfigError
from .costmodel import SHAPES, Workload, simulated_costs

STAMP_MOD = 251
"""Stamps are ``b % 251``: exact in bf16 (integers up to 256 are)."""


@dataclass(frozen=True)
class SimulatedCompute:
    target_us_per_token: float
    target_us_per_batch: float
    drafter_us_per_token: float
    drafter_us_per_batch: float

    @classmethod
    def from_config(cls, cfg) -> Optional["SimulatedCompute"]:
        """The costs ``runtime.simulate`` sets, or None when it is off."""
        sim = cfg.runtime.simulate
        if not sim.enabled:
            return None
        t_tok, d_tok = sim.target_us_per_token, sim.drafter_us_per_token
        if sim.model is not None:
            check(cfg)
            w = Workload()
            t_s, d_s = simulated_costs(SHAPES[sim.model], w, sim.tflops)
            t_tok, d_tok = t_tok + t_s / w.token_budget * 1e6, d_tok + d_s / w.token_budget * 1e6
        return cls(t_tok, sim.target_ms_per_batch * 1e3, d_tok, sim.drafter_ms_per_batch * 1e3)

    def target_s(self, n_tokens: int) -> float:
        return (self.target_us_per_token * n_tokens + self.target_us_per_batch) * 1e-6

    def drafter_s(self, n_tokens: int) -> float:
        return (self.drafter_us_per_token * n_tokens + self.drafter_us_per_batch) * 1e-6


def check(cfg) -> None:
    """ConfigError unless ``runtime.simulate.model`` is None or a known shape."""
    model = cfg.runtime.simulate.model
    if model is not None and model not in SHAPES:
        raise ConfigError(f"runtime.simulate.model: unknown shape {model!r} (known: {', '.join(sorted(SHAPES))})")


def feature_width(cfg, target) -> int:
    """Floats per token in the feature slots: the selected layers' outputs side by side
    (and the distillation teacher's last layer, ``train.loss: distill``), or the
    simulated width."""
    sim = cfg.runtime.simulate
    if sim.enabled and sim.feature_width is not None:
        return sim.feature_width
    return (len(target.layer_ids) + (cfg.train.loss == "distill")) * target.hidden_size


def stamp(features: torch.Tensor, n_tokens: int, b: int) -> None:
    """Mark the first and the last token's features with batch b."""
    features[0].fill_(b % STAMP_MOD)
    features[n_tokens - 1].fill_(b % STAMP_MOD)


def stamp_problem(features: torch.Tensor, n_tokens: int, b: int) -> Optional[str]:
    """None if the features carry batch b's stamps, else what they carry."""
    found = int(features[0, 0]), int(features[n_tokens - 1, -1])
    if found != (b % STAMP_MOD,) * 2:
        return f"stamps {found}, expected {b % STAMP_MOD}"
    return None


def no_stats(block_size: int):
    """A simulated batch measures nothing: zero blocks, zero loss weight (a
    ``BlockStats``; imported here because the loss module brings in transformers,
    which a simulated target must not pay for)."""
    from ..models.loss import BlockStats
    zeros = torch.zeros(block_size, dtype=torch.int64)
    return BlockStats(0, 0, zeros, zeros.clone(), 0.0, 0.0)


def fake_backward(params: list[torch.Tensor]) -> None:
    """Stand-in for backward: every gradient written once, deterministically."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.add_(1e-6)


def wait(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)
