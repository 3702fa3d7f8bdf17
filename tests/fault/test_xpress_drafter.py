"""An XPress drafter (``drafter.arch: xpress``) through the pipeline: micro-batched
(``train.drafter_block_tokens``), its target distilling (``train.loss: distill``, the
teacher's last layer in every feature slot, which the TV term and the target-argmax CE
read), a drafter killed with -9 in a 2-2 run: it ends bit-identical to the reference, and
its checkpoint is an XPress directory that loads back, with a refiner that trained."""

import json

import torch

from dflash_actors.job.reference import train_reference
from dflash_actors.models.drafter import DFlashDrafter
from dflash_actors.train.checkpoint import latest_checkpoint
from tests.support.pipeline import assert_same_weights, final_weights, losses, new_job, small_config

XPRESS = ("drafter.arch=xpress", "drafter.xpress_rank=16", "train.loss=distill", "train.grad_accum=2",
          "train.drafter_block_tokens=512")


def test_an_xpress_drafter_survives_a_kill_bit_for_bit(cache_dir, tmp_path):
    kill = ("runtime.faults", [{"actor": "drafter.1", "at_batch": 5, "kind": "sigkill"}])
    job = new_job(small_config(cache_dir, tmp_path / "run", "2-2", *XPRESS, kill), progress=False)
    result = job.run()
    assert result.exit_code == 0, result.reason
    assert result.summary["restarts_by_actor"] == {"drafter.1": 1}
    ref = train_reference(small_config(cache_dir, tmp_path / "ref", "2-2", *XPRESS), progress=False)
    assert_same_weights(final_weights(tmp_path / "run"), ref.state_dict)
    assert losses(tmp_path / "run") == ref.losses
    ckpt = latest_checkpoint(tmp_path / "run")
    conf = json.loads((ckpt / "config.json").read_text())
    assert conf["architectures"] == ["Qwen3XPressModel"] and conf["xpress_rank"] == 16
    back = DFlashDrafter.from_pretrained(ckpt)
    fresh = DFlashDrafter(back.config).init_weights(0)
    assert back.refiner_head.mix_l.abs().sum() > 0                      # the mixer left zero
    for name in ("refiner_head.readout.weight", "refiner_head.in_proj.weight"):
        assert not torch.equal(back.state_dict()[name], fresh.state_dict()[name]), name
