"""Bad input: one line on stderr, exit status 2, before any actor starts, and nothing
written to the run directory."""

import json

import numpy as np
import pytest

import launch
from dflash_actors.config import load_config
from dflash_actors.data.synthetic import flatten, write_token_dataset
from dflash_actors.models.drafter_start import build_drafter
from dflash_actors.models.head import load_head
from tests.support.pipeline import ROOT, SMALL


@pytest.fixture(scope="module")
def other_drafter(cache_dir, tmp_path_factory):
    """A drafter saved for a target with a different hidden size."""
    cfg = load_config(ROOT / "configs/default.yaml", SMALL + [
        f"data.cache_dir={cache_dir}", "target.tiny.hidden_size=32", "target.tiny.pretrain_steps=0"])
    out = tmp_path_factory.mktemp("other") / "drafter"
    build_drafter(cfg, load_head(cfg)).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    from transformers import T5Config
    out = tmp_path_factory.mktemp("t5")
    T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=64).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def bad_tokens(tmp_path_factory):
    ids = [np.arange(2, 40), np.arange(2, 30), np.array([5, 6, 999, 7])]
    offsets, flat = flatten(ids)
    return write_token_dataset(tmp_path_factory.mktemp("bad") / "ds", offsets, flat, None)


CASES = {
    "topology": (["--topology", "2-0"], "topology"),
    "missing dataset": (["--set", "data.path=/no/such/dataset"], "dataset not found"),
    "target dir without a model": (["--set", "target.path={tmp}"], "holds no model (no config.json, no .gguf"),
    "target not a causal LM": (["--set", "target.path={bert}"], "'t5' model, not a causal LM"),
    "block larger than budget": (["--set", "drafter.block_size=4096"], "drafter.block_size"),
    "drafter hidden size": (["--set", "drafter.init_from={other}"], "drafter.init_from: "),
    "too many GPUs": (["--set", "topology.target_devices=[cuda:0]"], "CUDA device"),
    "layer out of range": (["--set", "drafter.target_layer_ids=[99]"], "target_layer_ids"),
    "last layer as a tap": (["--set", "drafter.target_layer_ids=[1, 3]"], "layer 3 is the target's last layer"),
    "mask id outside vocab": (["--set", "drafter.mask_token_id=100000"], "mask_token_id"),
    "token out of vocab": (["--set", "data.path={bad}"], "row 2: input_ids value 999"),
    "unknown key": (["--set", "train.learning_rate=1"], "train.learning_rate: unknown key"),
    "one device for auto": (["--topology", "auto", "--devices", "1"], "--devices: a topology needs at least 2"),
    "devices without auto": (["--devices", "4"], "--devices: only with --topology auto"),
    "lockstep without room": (["--topology", "2-2", "--set", "runtime.batch_slots=1", "--set",
                               "runtime.schedule=lockstep"], "runtime.batch_slots: lockstep holds a whole step"),
    "unknown simulated shape": (["--set", "runtime.simulate.model=gpt-9"], "runtime.simulate.model: unknown shape"),
    "missing held-out data": (["--set", "eval.every=5", "--set", "eval.data=/no/such/heldout"], "/no/such/heldout"),
    "eval device": (["--set", "eval.device=gpu"], "eval.device: 'cpu' or 'cuda:N'"),
    "node rank": (["--nnodes", "2", "--node-rank", "2", "--master", "127.0.0.1:29500"],
                  "--node-rank: must be in [0, 1] for 2 nodes (got 2)"),
    "master": (["--nnodes", "2", "--node-rank", "0", "--master", "node0"], "--master: expected ADDR:PORT"),
    "nodes by --set": (["--set", "topology.nodes=2"], "topology.nodes: set by --nnodes"),
    "cuda features on cpu": (["--set", "runtime.feature_transport=cuda"],
                             "runtime.feature_transport: cuda needs every target and drafter on a GPU"),
    "gang not dividing the heads": (["--topology", "1x3-1"],
                                    "topology.target_tp: 3 does not divide the target's num_attention_heads (4)"),
    "gang not dividing the kv heads": (["--topology", "1x4-1"],
                                       "topology.target_tp: 4 does not divide the target's num_key_value_heads (2)"),
    "gang devices": (["--topology", "1x2-1", "--set", "topology.target_devices=[cpu]"],
                     "target_devices: needs 2 entries"),
    "gang mixing cpu and cuda": (["--topology", "1x2-1", "--set", "topology.target_devices=[cuda:0,cpu]"],
                                 "topology.target_devices: target 0's gang ['cuda:0', 'cpu'] mixes cpu and cuda"),
    "gang repeating a GPU": (["--topology", "1x2-1", "--set", "topology.target_devices=[cuda:0,cuda:0]"],
                             "topology.target_devices: target 0's gang ['cuda:0', 'cuda:0'] repeats a GPU"),
    "auto with a gang": (["--topology", "auto", "--set", "topology.target_tp=2"],
                         "--topology auto: measures the target whole on one device"),
    "gang of no devices": (["--topology", "1x0-1"], "topology: a target spans at least one device"),
    "nccl on cpu": (["--nnodes", "2", "--node-rank", "0", "--master", "127.0.0.1:1", "--set",
                     "runtime.collective_backend=nccl"], "nccl needs the drafters on CUDA devices"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_exits_2_and_writes_nothing(case, tmp_path, cache_dir, other_drafter, bad_tokens, bert, capsys):
    argv, expected = CASES[case]
    argv = [a.format(tmp=tmp_path, other=other_drafter, bad=bad_tokens, bert=bert) for a in argv]
    run_dir = tmp_path / "run"
    common = ["--run-dir", str(run_dir)]
    for kv in SMALL + [f"data.cache_dir={cache_dir}"]:
        common += ["--set", kv]
    assert launch.main(common + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
    assert not run_dir.exists()


def test_gang_on_too_few_gpus_exits_2(tmp_path, cache_dir, capsys, monkeypatch):
    """A machine with 3 GPUs (as torch reports it here) refuses 1x2-2, which needs 4,
    rather than running the gang on the CPU."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    run_dir = tmp_path / "run"
    argv = ["--run-dir", str(run_dir), "--topology", "1x2-2", "--set", f"data.cache_dir={cache_dir}"]
    for kv in SMALL:
        argv += ["--set", kv]
    assert launch.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: topology.target_tp: 1x2-2 needs 2 target ranks + "
                                               "2 drafters = 4 GPUs, but this machine has 3;"), err
    assert not run_dir.exists()


def test_resume_without_checkpoint(tmp_path, cache_dir, capsys):
    (tmp_path / "empty").mkdir()
    argv = ["--resume", str(tmp_path / "empty"), "--set", f"data.cache_dir={cache_dir}"]
    for kv in SMALL:
        argv += ["--set", kv]
    assert launch.main(argv) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    assert list((tmp_path / "empty").iterdir()) == []


def test_topology_auto_picks_the_advised_split_and_says_why(tmp_path, cache_dir, capsys):
    args = ["--topology", "auto", "--devices", "3", "--plan-only", "--json", "--run-dir", str(tmp_path / "run")]
    for o in SMALL + [f"data.cache_dir={cache_dir}"]:
        args += ["--set", o]
    assert launch.main(args) == 0
    out, err = capsys.readouterr()
    why = [line for line in err.splitlines() if line.startswith("topology auto:")]
    assert len(why) == 1, err
    chosen = why[0].split()[2]
    n, m = map(int, chosen.split("-"))
    assert n + m == 3 and "bound" in why[0]
    plan = json.loads(out.splitlines()[-1])
    assert (len(plan["targets"]), len(plan["drafters"])) == (n, m)


def test_wrong_layer_mapping_stops_the_job_before_training(tmp_path, cache_dir, capsys, monkeypatch):
    """A target wrapper that captures the wrong layers (injected into the spawned target
    actor) is caught by its start-up self-check: the job stops with one line naming the
    layer, and no optimizer step is taken."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests/support/inject"))
    monkeypatch.setenv("DFLASH_TEST_SHIFT_LAYERS", "1")
    run_dir = tmp_path / "run"
    argv = ["--topology", "1-1", "--run-dir", str(run_dir), "--set", "runtime.max_restarts=0"]
    for kv in SMALL + [f"data.cache_dir={cache_dir}"]:
        argv += ["--set", kv]
    assert launch.main(argv) not in (0, 2)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(err) == 1 and "target.self_check: layer 2 features differ" in err[0], err
    assert not (run_dir / "checkpoints").exists() or all(
        p.name == "step-0000000" for p in (run_dir / "checkpoints").iterdir())


def test_status_subcommand_reads_the_run_dir(tmp_path, capsys):
    assert launch.main(["status", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    gone = 2**22 + 1            # above Linux's largest pid
    (tmp_path / "status.json").write_text(json.dumps({"state": "done", "supervisor_pid": gone,
                                                      "actors": {}, "training": {"step": 4, "total_steps": 4}}))
    assert launch.main(["status", str(tmp_path)]) == 3
    assert capsys.readouterr().out.startswith(f"not running: supervisor {gone} is gone; last state: done at step 4/4")
