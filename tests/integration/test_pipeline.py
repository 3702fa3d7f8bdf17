"""The actor pipeline against the single-process reference trainer (the oracle)."""

import json

import pytest
from support.pipeline import assert_same_weights, final_weights, losses, small_config

from dflash_actors.pipeline import Job
from dflash_actors.reference import train_reference

REFERENCE = {}


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("pipeline-cache")


def reference(cache_dir, tmp_path, topology):
    """Reference results depend on M only (targets do not change the math)."""
    m = topology.split("-")[1]
    if m not in REFERENCE:
        REFERENCE[m] = train_reference(small_config(cache_dir, tmp_path / "ref", topology), progress=False)
    return REFERENCE[m]


@pytest.mark.parametrize("topology", ["1-1", "2-2", "1-3"])
def test_pipeline_is_bit_identical_to_reference(cache_dir, tmp_path, topology):
    cfg = small_config(cache_dir, tmp_path / "run", topology)
    result = Job(cfg, progress=False).run()
    assert result.exit_code == 0, result.reason
    ref = reference(cache_dir, tmp_path, topology)
    assert result.summary["step"] == ref.steps == result.summary["total_steps"]
    assert sorted(result.committed) == list(range(ref.steps * cfg.train.grad_accum * cfg.topology.num_drafters))
    assert losses(tmp_path / "run") == ref.losses
    assert_same_weights(final_weights(tmp_path / "run"), ref.state_dict)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["tokens"] == ref.tokens and summary["restarts"] == 0
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["training"]["step"] == ref.steps and status["training"]["loss"] == ref.losses[-1]


def test_grad_accumulation_matches_reference(cache_dir, tmp_path):
    cfg = small_config(cache_dir, tmp_path / "run", "1-2", "train.grad_accum=2")
    result = Job(cfg, progress=False).run()
    assert result.exit_code == 0, result.reason
    ref = train_reference(cfg, progress=False)
    assert losses(tmp_path / "run") == ref.losses
    assert_same_weights(final_weights(tmp_path / "run"), ref.state_dict)
