"""``launch.py`` is one straight path: whatever options a run combines, its config text
is parsed once, the dataset opened once and each epoch planned once, and what the
options derive (a topology, faults) reaches the preflight and the job as data."""

import json

import pytest

import launch
from dflash_actors import config
from dflash_actors.data import batching
from dflash_actors.job import preflight
from tests.support.pipeline import SMALL


@pytest.fixture
def counted(monkeypatch):
    counts = {"load_config": 0, "open_dataset": 0, "plan_epoch": 0}

    def count(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapped
    monkeypatch.setattr(launch, "load_config", count("load_config", config.load_config))
    monkeypatch.setattr(preflight, "open_dataset", count("open_dataset", preflight.open_dataset))
    monkeypatch.setattr(batching, "plan_epoch", count("plan_epoch", batching.plan_epoch))
    return counts


@pytest.mark.parametrize("options", [[], ["--topology", "auto", "--devices", "3", "--chaos", "4"]])
def test_each_input_is_read_once(options, counted, tmp_path, cache_dir, capsys):
    argv = ["--plan-only", "--run-dir", str(tmp_path / "run"), *options]
    for kv in SMALL + [f"data.cache_dir={cache_dir}"]:
        argv += ["--set", kv]
    assert launch.main(argv) == 0
    out, err = capsys.readouterr()
    plan = json.loads(out.splitlines()[-1])
    epochs = 2                                      # SMALL's train.epochs
    assert counted == {"load_config": 1, "open_dataset": 1, "plan_epoch": epochs}, counted
    if options:     # the advised split reached the placement, and chaos planned on it
        chosen = next(line for line in err.splitlines() if line.startswith("topology auto:")).split()[2]
        assert chosen == f"{len(plan['targets'])}-{len(plan['drafters'])}"
        assert "--chaos 4: 10 faults" in err
