"""The drafters with heads over the vocabulary (``drafter.arch: dspark`` and ``xpress``)
through the pipeline: micro-batched (``train.drafter_block_tokens``), their target
distilling (``train.loss: distill``: the teacher's last layer in every feature slot, which
DSpark's distance and confidence and XPress's TV term read), a drafter killed with -9 in a
2-2 run: each ends bit-identical to the reference, and its checkpoint is a directory of its
architecture that loads back, with heads that trained (XPress's mixer off its zero start)."""

import json

import pytest
import torch

from dflash_actors.job.reference import train_reference
from dflash_actors.models.drafter import DFlashDrafter
from dflash_actors.train.checkpoint import latest_checkpoint
from tests.support.pipeline import assert_same_weights, final_weights, losses, new_job, small_config

COMMON = ("train.loss=distill", "train.grad_accum=2", "train.drafter_block_tokens=512")
ARCHS = {
    # arch: (its keys, exported architecture, its size key, tensors that must have trained)
    "dspark": (("drafter.markov_rank=16",), "Qwen3DSparkModel", "markov_rank",
               ("markov_head.markov_w2.weight", "confidence_head.proj.bias")),
    "xpress": (("drafter.xpress_rank=16",), "Qwen3XPressModel", "xpress_rank",
               ("refiner_head.readout.weight", "refiner_head.in_proj.weight", "refiner_head.mix_l")),
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_head_arch_drafter_survives_a_kill_bit_for_bit(cache_dir, tmp_path, arch):
    keys, architecture, size_key, trained = ARCHS[arch]
    sets = (f"drafter.arch={arch}", *keys, *COMMON)
    kill = ("runtime.faults", [{"actor": "drafter.1", "at_batch": 5, "kind": "sigkill"}])
    result = new_job(small_config(cache_dir, tmp_path / "run", "2-2", *sets, kill), progress=False).run()
    assert result.exit_code == 0, result.reason
    assert result.summary["restarts_by_actor"] == {"drafter.1": 1}
    ref = train_reference(small_config(cache_dir, tmp_path / "ref", "2-2", *sets), progress=False)
    assert_same_weights(final_weights(tmp_path / "run"), ref.state_dict)
    assert losses(tmp_path / "run") == ref.losses
    ckpt = latest_checkpoint(tmp_path / "run")
    conf = json.loads((ckpt / "config.json").read_text())
    assert conf["architectures"] == [architecture] and conf[size_key] == 16
    back = DFlashDrafter.from_pretrained(ckpt).state_dict()
    fresh = DFlashDrafter(DFlashDrafter.from_pretrained(ckpt).config).init_weights(0).state_dict()
    for name in trained:
        assert not torch.equal(back[name], fresh[name]), name
