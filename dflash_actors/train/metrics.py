"""Per-batch and per-step training metrics in shared float64 tables.

A drafter writes batch b's ``BlockStats`` into row b of ``batch_stats`` before it
commits; the optimizer folds a step's rows in exactly the reference's order (each
drafter's batches in increasing id, then drafters in order) into row s of
``step_stats``. Rows are batch ids and steps of the whole run (``schedule``); a resumed
run leaves the rows before its resume point empty, and ``read_steps`` returns the
steps this run took. Python floats are float64, so the tables hold them exactly and
the per-step loss can be compared bit for bit with the reference trainer.

    batch_stats [total_batches, 8 + 2*B]   blocks, accepted, sum(CE*w), sum(w), tokens,
                                           selector (1.0: a DFlash2's), base_accepted, hits,
                                           slot_correct[B], slot_total[B]
    step_stats  [total_steps, 8]           loss, tau, lr, grad_norm, tokens, time (unix),
                                           skipped (1.0: not applied, non-finite), done (1.0)
"""

from __future__ import annotations

import math
import time

import torch

from ..models.loss import BlockStats

STEP_COLS = ("loss", "tau", "lr", "grad_norm", "tokens", "time", "skipped", "done")


SLOTS_AT = 8
"""Column of ``slot_correct[0]`` in ``batch_stats``."""


def batch_table(n_batches: int, block_size: int) -> torch.Tensor:
    return torch.zeros(n_batches, SLOTS_AT + 2 * block_size, dtype=torch.float64).share_memory_()


def step_table(n_steps: int) -> torch.Tensor:
    return torch.zeros(n_steps, len(STEP_COLS), dtype=torch.float64).share_memory_()


def write_batch(table: torch.Tensor, row: int, stats: BlockStats, tokens: int) -> None:
    B = len(stats.slot_correct)
    r = table[row]
    r[:SLOTS_AT] = torch.tensor([stats.blocks, stats.accepted, stats.weighted_ce, stats.weight, tokens,
                                 float(stats.selector), stats.base_accepted, stats.hits], dtype=torch.float64)
    r[SLOTS_AT:SLOTS_AT + B] = stats.slot_correct.double()
    r[SLOTS_AT + B:SLOTS_AT + 2 * B] = stats.slot_total.double()


def read_batch(table: torch.Tensor, row: int) -> tuple[BlockStats, int]:
    r = table[row]
    B = (len(r) - SLOTS_AT) // 2
    stats = BlockStats(int(r[0]), int(r[1]), r[SLOTS_AT:SLOTS_AT + B].long(), r[SLOTS_AT + B:SLOTS_AT + 2 * B].long(),
                       float(r[2]), float(r[3]), bool(r[5]), int(r[6]), int(r[7]))
    return stats, int(r[4])


def fold_step(table: torch.Tensor, rows_by_drafter) -> tuple[BlockStats, int]:
    """Sum a step's batch stats in the reference's order; returns (stats, tokens)."""
    total, tokens = None, 0
    for rows in rows_by_drafter:
        shard = None
        for row in rows:
            s, t = read_batch(table, row)
            shard = s if shard is None else shard + s
            tokens += t
        total = shard if total is None else total + shard
    return total, tokens


def write_step(table: torch.Tensor, row: int, stats: BlockStats, lr: float, grad_norm: float,
               tokens: int, skipped: bool = False) -> dict:
    m = stats.metrics()
    table[row] = torch.tensor([m["loss"], m["tau"], lr, grad_norm, tokens, time.time(), float(skipped), 1.0],
                              dtype=torch.float64)
    return m


def bad_run(table: torch.Tensor, step: int) -> int:
    """How many steps in a row, ending just before ``step``, were skipped."""
    n = 0
    while step - n - 1 >= 0 and table[step - n - 1, -1] == 1.0 and table[step - n - 1, -2] == 1.0:
        n += 1
    return n


def read_steps(table: torch.Tensor) -> list[dict]:
    return [dict(zip(STEP_COLS, r.tolist())) for r in table if r[-1] == 1.0]


def finite(x):
    """``x``, or None when it is NaN or infinite: what strict JSON can hold."""
    return x if x is None or math.isfinite(x) else None
