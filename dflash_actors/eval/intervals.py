"""Bootstrap intervals over prompts: how far a tau, or a ratio of two, could move with another
draw of prompts of the same kind.

A decision between two drafters (or a drafter and a baseline) on some tens of prompts is only
as good as its interval: prompts differ far more from each other than decoding's steps within
a prompt do, so the prompt is the unit resampled. A ratio is resampled paired, the same
prompts in numerator and denominator, since both proposers decoded the same texts. The
draws are seeded: a report's interval is reproducible from its per-prompt figures.
"""

from __future__ import annotations

import numpy as np

DRAWS = 4000
LEVEL = 0.95


def _draws(n: int, draws: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(draws, n))


def _bounds(stats: np.ndarray, level: float) -> list[float]:
    tail = (1 - level) / 2
    lo, hi = np.quantile(stats, [tail, 1 - tail])
    return [round(float(lo), 4), round(float(hi), 4)]


def mean_interval(values, level: float = LEVEL, draws: int = DRAWS, seed: int = 0) -> list[float] | None:
    """The percentile bootstrap interval of the mean of ``values`` (one per prompt); None
    for fewer than two."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) < 2:
        return None
    return _bounds(v[_draws(len(v), draws, seed)].mean(axis=1), level)


def ratio_interval(numerator, denominator, level: float = LEVEL, draws: int = DRAWS,
                   seed: int = 0) -> list[float] | None:
    """The paired bootstrap interval of ``mean(numerator) / mean(denominator)``, both one
    value per prompt of the same prompts; None for fewer than two."""
    a, b = np.asarray(numerator, dtype=np.float64), np.asarray(denominator, dtype=np.float64)
    if len(a) != len(b):
        raise ValueError(f"ratio_interval: {len(a)} numerators against {len(b)} denominators (paired by prompt)")
    if len(a) < 2:
        return None
    idx = _draws(len(a), draws, seed)
    return _bounds(a[idx].mean(axis=1) / b[idx].mean(axis=1), level)


def pooled_interval(tokens, steps, level: float = LEVEL, draws: int = DRAWS, seed: int = 0) -> list[float] | None:
    """The bootstrap interval over texts of ``sum(tokens) / sum(steps)`` (a pooled tau: each
    text's tokens and verify steps)."""
    t, s = np.asarray(tokens, dtype=np.float64), np.asarray(steps, dtype=np.float64)
    if len(t) < 2:
        return None
    idx = _draws(len(t), draws, seed)
    return _bounds(t[idx].sum(axis=1) / np.maximum(s[idx].sum(axis=1), 1), level)


def pooled_difference_interval(a: tuple, b: tuple, level: float = LEVEL, draws: int = DRAWS,
                               seed: int = 0) -> list[float] | None:
    """The paired bootstrap interval over texts of ``pooled(a) - pooled(b)``, each a
    ``(tokens, steps)`` per text of the same texts: two drafters on one held-out set."""
    return _paired_pooled(a, b, np.subtract, "pooled_difference_interval", level, draws, seed)


def pooled_ratio_interval(a: tuple, b: tuple, level: float = LEVEL, draws: int = DRAWS,
                          seed: int = 0) -> list[float] | None:
    """The paired bootstrap interval over texts of ``pooled(a) / pooled(b)``: a drafter
    against a baseline (the n-gram table) on one held-out set."""
    return _paired_pooled(a, b, np.divide, "pooled_ratio_interval", level, draws, seed)


def _paired_pooled(a: tuple, b: tuple, op, name: str, level: float, draws: int, seed: int) -> list[float] | None:
    (ta, sa), (tb, sb) = [tuple(np.asarray(x, dtype=np.float64) for x in pair) for pair in (a, b)]
    if len(ta) != len(tb):
        raise ValueError(f"{name}: {len(ta)} texts against {len(tb)} (paired by text)")
    if len(ta) < 2:
        return None
    idx = _draws(len(ta), draws, seed)

    def pooled(t, s):
        return t[idx].sum(axis=1) / np.maximum(s[idx].sum(axis=1), 1)
    return _bounds(op(pooled(ta, sa), pooled(tb, sb)), level)
