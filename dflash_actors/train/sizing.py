"""A run sized to a number of optimizer steps, for the tools and benchmarks that train for
a budget (``launch.py taps``, ``benchmarks.bench_real``, ``benchmarks.recipes``). Not
the actors' business: they get a config already sized."""

from __future__ import annotations

import numpy as np

from .schedule import Schedule


def sized_to_steps(cfg, lengths: np.ndarray, steps: int, at_least_epochs: int = 0):
    """``cfg`` cut at ``steps`` optimizer steps (``train.max_steps``), its epochs sized to
    hold them (at least ``at_least_epochs``), so an LR schedule ends where the run does.
    ``steps`` 0: only the epochs change."""
    per_epoch = Schedule.from_config(cfg.updated({"train.epochs": 1, "train.max_steps": 0}), lengths).total_steps
    if steps and per_epoch == 0:
        raise ValueError(f"train: no full step fits an epoch (need {cfg.train.grad_accum} batches per drafter)")
    need = -(-steps // per_epoch) if steps else 0
    return cfg.updated({"train.epochs": max(at_least_epochs, need, 1), "train.max_steps": steps})
