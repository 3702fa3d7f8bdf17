"""A DFlash2 job (``drafter.arch: dflash2``) through real processes: with a kill -9 of a
drafter, a stop and a resume, micro-batches whose selector term needs the whole batch's
own denominator (``train.selector_norm: own``: a forward without autograd first) and the
target's features from the memory cache, it still ends bit for bit where the
single-process reference does, and what it saves is a DFlash2 whose selector trained."""

import json

import launch
from dflash_actors.job.job import Job
from dflash_actors.job.reference import train_reference
from dflash_actors.train.checkpoint import latest_checkpoint
from tests.support.pipeline import assert_same_weights, final_weights, losses, run_until_stopped, small_config

ARCH = ("drafter.arch=dflash2", "drafter.selector_rank=16", "train.selector_norm=own",
        "train.drafter_block_tokens=512", "target.feature_cache=memory")
LEN = ("train.epochs=3", "train.grad_accum=2", "train.checkpoint_every=2")


def test_dflash2_survives_a_kill_and_a_resume_bit_for_bit(cache_dir, tmp_path):
    run_dir = tmp_path / "run"
    kill = ("runtime.faults", [{"actor": "drafter.0", "at_batch": 5, "kind": "sigkill"}])
    job = Job(small_config(cache_dir, run_dir, "2-2", *LEN, *ARCH, kill), progress=False)
    first = run_until_stopped(job, 4)
    assert first.exit_code == 130, first.reason
    assert first.summary["restarts_by_actor"] == {"drafter.0": 1}
    assert launch.main(["--resume", str(run_dir)]) == 0

    ref = train_reference(small_config(cache_dir, tmp_path / "ref", "2-2", *LEN, *ARCH), progress=False)
    got = final_weights(run_dir)
    assert_same_weights(got, ref.state_dict)
    assert losses(run_dir) == ref.losses[first.summary["step"]:]
    conf = json.loads((latest_checkpoint(run_dir) / "config.json").read_text())
    assert conf["architectures"] == ["DFlash2DraftModel"] and conf["dflash_config"]["selector_rank"] == 16
    assert got["candidate_selector.successor_codebook"].abs().max() > 0
    assert got["layers.0.mlp_conv.kernel_projection.weight"].abs().max() > 0
