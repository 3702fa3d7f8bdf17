"""Bootstrap intervals over prompts (``eval.intervals``): seeded, around the estimate, narrower
with more prompts, and paired for a ratio of two proposers on the same prompts."""

import numpy as np
import pytest

from dflash_actors.eval.intervals import mean_interval, ratio_interval


def test_a_mean_interval_holds_the_mean_and_narrows_with_more_prompts():
    rng = np.random.default_rng(0)
    few, many = rng.normal(1.4, 0.3, 16), rng.normal(1.4, 0.3, 256)
    for v in (few, many):
        lo, hi = mean_interval(v)
        assert lo < float(np.mean(v)) < hi
    assert np.diff(mean_interval(many))[0] < 0.5 * np.diff(mean_interval(few))[0]
    assert mean_interval(few) == mean_interval(few)                  # seeded
    assert mean_interval(few, seed=1) != mean_interval(few)
    assert mean_interval([1.3]) is None and mean_interval([1.2, 1.2, 1.2]) == [1.2, 1.2]


def test_about_95_of_100_intervals_cover_the_true_mean():
    rng = np.random.default_rng(1)
    covered = 0
    for i in range(100):
        lo, hi = mean_interval(rng.exponential(1.0, 64) + 1.0, draws=1000, seed=i)
        covered += lo <= 2.0 <= hi
    assert 85 <= covered <= 100


def test_the_ratio_is_paired_by_prompt():
    """A drafter 10% better than the baseline on every prompt, with prompts far apart: paired,
    the ratio's interval is 1.1 exactly; unpaired draws would spread it widely."""
    base = np.random.default_rng(2).uniform(1.0, 3.0, 40)
    assert ratio_interval(1.1 * base, base) == [1.1, 1.1]
    lo, hi = ratio_interval(base + np.random.default_rng(3).normal(0, 0.05, 40), base)
    assert lo < 1.0 < hi
    with pytest.raises(ValueError, match="paired by prompt"):
        ratio_interval(base, base[:-1])
    assert ratio_interval([1.5], [1.2]) is None


def test_pooled_intervals_and_a_paired_difference_between_two_drafters():
    from dflash_actors.eval.intervals import pooled_difference_interval, pooled_interval

    rng = np.random.default_rng(4)
    steps = rng.integers(20, 60, 64)
    tokens = (steps * rng.uniform(1.2, 1.6, 64)).round()
    lo, hi = pooled_interval(tokens, steps)
    assert lo < tokens.sum() / steps.sum() < hi
    # The same drafter twice: no difference, whatever the texts.
    assert pooled_difference_interval((tokens, steps), (tokens, steps)) == [0.0, 0.0]
    # One more token on every text's walk: paired, the difference stays clear of 0.
    lo, hi = pooled_difference_interval((tokens + 1, steps), (tokens, steps))
    assert 0 < lo <= hi
    with pytest.raises(ValueError, match="paired by text"):
        pooled_difference_interval((tokens, steps), (tokens[:-1], steps[:-1]))


def test_a_pooled_ratio_against_a_baseline_is_paired_by_text():
    from dflash_actors.eval.intervals import pooled_ratio_interval

    rng = np.random.default_rng(5)
    steps = rng.integers(20, 60, 64)
    tokens = (steps * rng.uniform(1.2, 1.6, 64)).round()
    assert pooled_ratio_interval((tokens, steps), (tokens, steps)) == [1.0, 1.0]
    # Every text walks 10% further than its baseline: the ratio's interval holds 1.1 alone.
    lo, hi = pooled_ratio_interval((tokens * 1.1, steps), (tokens, steps))
    assert lo == pytest.approx(1.1) and hi == pytest.approx(1.1)
    with pytest.raises(ValueError, match="pooled_ratio_interval: 63 texts against 64"):
        pooled_ratio_interval((tokens[:-1], steps[:-1]), (tokens, steps))
