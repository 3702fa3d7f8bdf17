"""``launch.py`` is one straight path: whatever options a run combines, its config text
is parsed once, the dataset opened once and each epoch planned once, and what the
options derive (a topology, faults) reaches the preflight and the job as data."""

import json

import psutil
import pytest

import launch
from dflash_actors import config
from dflash_actors.data import batching
from dflash_actors.job import forkserver, preflight
from tests.support import shared_server
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
    argv = ["--plan-only", "--json", "--run-dir", str(tmp_path / "run"), *options]
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


def test_plan_only_shows_a_gangs_ranks(tmp_path, cache_dir, capsys):
    argv = ["--plan-only", "--json", "--topology", "2x2-1", "--run-dir", str(tmp_path / "run")]
    for kv in SMALL + [f"data.cache_dir={cache_dir}"]:
        argv += ["--set", kv]
    assert launch.main(argv) == 0
    plan = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert plan["target_tp"] == 2 and plan["targets"] == ["cpu"] * 4 and plan["drafters"] == ["cpu"]


def _fork_servers() -> list[psutil.Process]:
    """Fork servers this process started, but the session's shared one."""
    return [p for p in psutil.Process().children(recursive=True)
            if "forkserver" in " ".join(p.cmdline()) and p.pid != shared_server.pid()]


def test_the_fork_server_starts_with_the_config_and_serves_the_job(tmp_path, cache_dir):
    """launch.py starts the server before the checks; the job forks every actor from it,
    and no module an actor imports is missing from its preload."""
    run_dir = tmp_path / "run"
    argv = ["--topology", "1-1", "--run-dir", str(run_dir)]
    for kv in SMALL + [f"data.cache_dir={cache_dir}", "train.epochs=1", "runtime.start_method=forkserver"]:
        argv += ["--set", kv]
    assert launch.main(argv) == 0
    events = [json.loads(x) for x in (run_dir / "events.log").read_text().splitlines()]
    server = next(e for e in events if e["event"] == "forkserver")
    assert "started at launch" in server["reason"] and server["not_preloaded"] == [], server
    assert not _fork_servers()


def test_bad_input_after_the_fork_server_started_stops_it(tmp_path, cache_dir, capsys, monkeypatch):
    """Data that fails its check is found after the config, when the server is already
    importing: exit 2 all the same, the server gone and nothing written."""
    started = []
    start = forkserver.EarlyForkServer.start

    def spy(self, cfg):
        start(self, cfg)
        started.append(self.server.pid)
    monkeypatch.setattr(forkserver.EarlyForkServer, "start", spy)
    run_dir = tmp_path / "run"
    argv = ["--run-dir", str(run_dir), "--set", f"data.path={tmp_path / 'no-such-data'}",
            "--set", "runtime.start_method=forkserver", "--set", f"data.cache_dir={cache_dir}"]
    assert launch.main(argv) == 2
    assert "dataset not found" in capsys.readouterr().err
    assert len(started) == 1 and not psutil.pid_exists(started[0]), started
    assert not _fork_servers() and not run_dir.exists()
