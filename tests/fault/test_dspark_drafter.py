"""A DSpark drafter (``drafter.arch: dspark``) through the pipeline: micro-batched
(``train.drafter_block_tokens``), its target distilling (``train.loss: distill``, the
teacher's last layer in every feature slot), a drafter killed with -9 in a 2-2 run: it
ends bit-identical to the reference, and its checkpoint is a DSpark directory that
loads back, with a Markov and a confidence head that trained."""

import json

import torch

from dflash_actors.job.reference import train_reference
from dflash_actors.models.drafter import DFlashDrafter
from dflash_actors.train.checkpoint import latest_checkpoint
from tests.support.pipeline import assert_same_weights, final_weights, losses, new_job, small_config

DSPARK = ("drafter.arch=dspark", "drafter.markov_rank=16", "train.loss=distill", "train.grad_accum=2",
          "train.drafter_block_tokens=512")


def test_a_dspark_drafter_survives_a_kill_bit_for_bit(cache_dir, tmp_path):
    kill = ("runtime.faults", [{"actor": "drafter.1", "at_batch": 5, "kind": "sigkill"}])
    job = new_job(small_config(cache_dir, tmp_path / "run", "2-2", *DSPARK, kill), progress=False)
    result = job.run()
    assert result.exit_code == 0, result.reason
    assert result.summary["restarts_by_actor"] == {"drafter.1": 1}
    ref = train_reference(small_config(cache_dir, tmp_path / "ref", "2-2", *DSPARK), progress=False)
    assert_same_weights(final_weights(tmp_path / "run"), ref.state_dict)
    assert losses(tmp_path / "run") == ref.losses
    ckpt = latest_checkpoint(tmp_path / "run")
    conf = json.loads((ckpt / "config.json").read_text())
    assert conf["architectures"] == ["Qwen3DSparkModel"] and conf["markov_rank"] == 16
    back = DFlashDrafter.from_pretrained(ckpt)
    fresh = DFlashDrafter(back.config).init_weights(0)
    for name in ("markov_head.markov_w2.weight", "confidence_head.proj.bias"):
        assert not torch.equal(back.state_dict()[name], fresh.state_dict()[name]), name
