"""Micro-batched drafters (``train.drafter_block_tokens``, with checkpointed layers) under a
kill -9 and a stop-and-resume: the pipeline still equals the reference bit for bit, and
the micro-batches did run (the whole-batch arithmetic differs at float rounding). The
same where the memory plan, not the config, picks the micro-batches (a host too small
for whole batches): the reference resolves its config through the job's own plan.

The drafter is a DFlash2 (``drafter.arch: dflash2``) whose selector term takes its own
denominator (``train.selector_norm: own``: a split batch first runs a forward without
autograd per micro-batch), with the target's features from the memory cache: the widest
path through a drafter step. What it saves is a DFlash2 whose selector trained."""

import json

import pytest

import launch
from dflash_actors.job.reference import train_reference
from dflash_actors.train import drafter_step
from dflash_actors.train.checkpoint import latest_checkpoint
from tests.support.host_memory import squeeze_host
from tests.support.pipeline import assert_same_weights, final_weights, losses, new_job, run_until_stopped, small_config

# Default config: block 8, 32 anchors a row (256 block tokens), rows of up to ~190 tokens:
# two rows a micro-batch, about eight of them a batch (tests/unit/test_drafter_step.py
# cuts rows apart too).
MICRO = ("train.drafter_block_tokens=512", "train.checkpoint_layers=on", "drafter.arch=dflash2",
         "drafter.selector_rank=16", "train.selector_norm=own", "target.feature_cache=memory")
LEN = ("train.epochs=3", "train.grad_accum=2", "train.checkpoint_every=2")


def test_micro_batches_survive_a_kill_and_a_resume_bit_for_bit(cache_dir, tmp_path):
    run_dir = tmp_path / "run"
    kill = ("runtime.faults", [{"actor": "drafter.1", "at_batch": 5, "kind": "sigkill"}])
    cfg = small_config(cache_dir, run_dir, "1-2", *LEN, *MICRO, kill)
    job = new_job(cfg, progress=False)
    first = run_until_stopped(job, 4)
    assert first.exit_code == 130, first.reason
    assert first.summary["restarts_by_actor"] == {"drafter.1": 1}
    assert 4 <= first.summary["step"] < job.schedule.total_steps
    assert launch.main(["--resume", str(run_dir)]) == 0

    ref = train_reference(small_config(cache_dir, tmp_path / "ref", "1-2", *LEN, *MICRO), progress=False)
    got = final_weights(run_dir)
    assert_same_weights(got, ref.state_dict)
    assert losses(run_dir) == ref.losses[first.summary["step"]:]
    conf = json.loads((latest_checkpoint(run_dir) / "config.json").read_text())
    assert conf["architectures"] == ["DFlash2DraftModel"] and conf["dflash_config"]["selector_rank"] == 16
    assert got["candidate_selector.successor_codebook"].abs().max() > 0
    assert got["layers.0.mlp_conv.kernel_projection.weight"].abs().max() > 0
    whole = train_reference(small_config(cache_dir, tmp_path / "whole", "1-2", *LEN, *MICRO[2:]), progress=False)
    assert whole.losses != ref.losses
    # Float rounding, grown over a few steps (the selector's top-K can flip at a near tie).
    assert whole.losses == pytest.approx(ref.losses, rel=1e-3)


def test_the_plans_micro_batches_survive_a_kill_bit_for_bit(cache_dir, tmp_path, monkeypatch, capsys):
    """The config leaves the micro-batch to the plan, and the host is too small for whole
    batches: the job's plan picks micro-batches, the reference's plan picks the same, and
    a 2-2 job with a drafter killed ends bit-identical to the reference. ``launch.py
    reference --job`` of that run says so too."""
    run_dir = tmp_path / "run"
    kill = ("runtime.faults", [{"actor": "drafter.1", "at_batch": 5, "kind": "sigkill"}])
    cfg = small_config(cache_dir, run_dir, "2-2", "train.grad_accum=2", kill)
    assert cfg.train.drafter_block_tokens is None and cfg.train.checkpoint_layers == "auto"
    squeeze_host(monkeypatch, cfg)
    job = new_job(cfg, progress=False)
    tokens = job.cfg.train.drafter_block_tokens
    assert tokens is not None, "the plan kept whole batches: the host was not squeezed enough"
    result = job.run()
    assert result.exit_code == 0, result.reason
    assert result.summary["restarts_by_actor"] == {"drafter.1": 1}

    split = []
    real_split = drafter_step.split_anchors

    def counted(*args):
        groups = real_split(*args)
        split.append(len(groups))
        return groups

    monkeypatch.setattr(drafter_step, "split_anchors", counted)
    ref = train_reference(cfg, progress=False)
    assert ref.resolved["train.drafter_block_tokens"] == tokens
    assert max(split) > 1, "no batch was larger than the plan's micro-batch"
    assert ref.steps == result.summary["step"] >= 4
    assert_same_weights(final_weights(run_dir), ref.state_dict)
    assert losses(run_dir) == ref.losses

    capsys.readouterr()
    assert launch.main(["reference", "--job", str(run_dir), "--run-dir", str(tmp_path / "ref")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["resolved"]["train.drafter_block_tokens"] == tokens and out["final_loss"] == ref.losses[-1]
    assert out["job"] == {"run_dir": str(run_dir), "step": ref.steps, "checkpoint": f"step-{ref.steps:07d}",
                          "identical": True, "max_abs_diff": 0.0}
