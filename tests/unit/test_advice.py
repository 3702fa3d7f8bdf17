"""``--topology auto``'s cost probe runs in a spawned process; whatever ends it comes back
to the launching process as a one-line ValueError, and no process of it survives."""

import multiprocessing
import os
import signal
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from dflash_actors.data.batching import EpochPlan
from dflash_actors.job.preflight import check_data
from dflash_actors.tools import advice
from dflash_actors.train.costmodel import StageCosts
from tests.support.leakcheck import no_leaks  # noqa: F401  (autouse: the probe leaves no process behind)
from tests.support.pipeline import small_config


@pytest.fixture(scope="module")
def probe(cache_dir, tmp_path_factory):
    """(cfg, its DataCheck) of the small default."""
    cfg = small_config(cache_dir, tmp_path_factory.mktemp("advice") / "run", "1-1")
    return cfg, check_data(cfg, progress=False)


@pytest.fixture
def not_here(monkeypatch):
    """Measuring in the test's own process fails the test (not with a ValueError)."""
    def here(*args, **kwargs):
        raise AssertionError("the probe measured in the launching process")
    for name in ("measure", "load_target", "build_drafter", "drafter_step"):
        monkeypatch.setattr(advice, name, here)


def test_the_probe_measures_the_plans_first_batches_in_another_process(probe, not_here):
    cfg, data = probe
    costs = advice.probe_costs(cfg, data)
    assert isinstance(costs, StageCosts)
    assert min(costs.loader_s, costs.target_s, costs.drafter_s, costs.optimizer_s) > 0
    n = min(len(data.plan0), advice.PROBE_BATCHES + 1)
    assert n > 1
    lengths = data.dataset.lengths
    assert costs.tokens_per_batch == pytest.approx(np.mean([lengths[data.plan0.batch(k)].sum() for k in range(1, n)]))


def test_a_value_error_in_the_probe_is_raised_here_as_it_was_there(probe, not_here, tmp_path):
    cfg, data = probe
    with pytest.raises(ValueError) as e:
        advice.probe_costs(cfg.updated({"target.path": str(tmp_path / "missing")}), data)
    assert str(e.value) == f"target.path: not found: {tmp_path / 'missing'}"


def test_another_error_in_the_probe_is_one_line_then_its_traceback(probe, not_here):
    cfg, data = probe
    beyond = EpochPlan(0, np.array([len(data.dataset) + 5]), np.array([0, 1]), np.array([8], np.int32))
    with pytest.raises(ValueError) as e:
        advice.probe_costs(cfg, replace(data, plan0=beyond))
    first, *rest = str(e.value).splitlines()
    assert first.startswith("--topology auto: the cost probe failed: IndexError: ")
    assert rest[0] == "Traceback (most recent call last):" and "in assemble" in str(e.value)


def test_a_probe_that_dies_is_a_one_line_error_with_its_exit_code(probe, not_here):
    cfg, data = probe
    killed = []

    def kill_the_probe():
        deadline = time.monotonic() + 60
        while not killed and time.monotonic() < deadline:
            for p in multiprocessing.active_children():
                if p.name == "topology-probe":
                    os.kill(p.pid, signal.SIGKILL)
                    killed.append(p.pid)
            time.sleep(0.02)

    killer = threading.Thread(target=kill_the_probe)
    killer.start()
    with pytest.raises(ValueError) as e:
        advice.probe_costs(cfg, data)
    killer.join()
    assert killed and str(e.value) == ("--topology auto: the cost probe process died without a result "
                                       "(killed by SIGKILL)")


def test_a_probe_without_a_result_in_time_is_killed(probe, not_here, monkeypatch):
    cfg, data = probe
    monkeypatch.setattr(advice, "PROBE_S", 0.0)
    t = time.monotonic()
    with pytest.raises(ValueError, match=r"^--topology auto: the cost probe gave no result in 0 s "):
        advice.probe_costs(cfg.updated({"runtime.start_timeout_s": 0.1}), data)
    assert time.monotonic() - t < 10
