"""The overfit gate: training and serving agree end to end.

A drafter trained on a handful of the target's own greedy texts until it has memorised
them must, when it drafts for real (``decode.speculative_generate``: draft a block,
verify it with the target's KV-cached forward, keep the matching prefix), get nearly
whole blocks accepted on the very prompts it learned: tau >= 0.9 x block size. A wrong
label shift, a context leak that training exploits and serving lacks, a position or
mask mismatch between the objective and the decoding loop, or a drafter that learns the
wrong head all keep tau far below that, however low the training loss goes.
"""

from __future__ import annotations

import pytest
import torch

from dflash_actors.config import load_config
from dflash_actors.data.dataset import open_dataset
from dflash_actors.eval.tau import real_tau
from dflash_actors.job.reference import train_reference
from dflash_actors.models.drafter_start import build_drafter
from dflash_actors.models.target import load_target
from dflash_actors.prepare.regenerate import ensure_target_text, prompts_of
from tests.support.pipeline import ROOT

PROMPTS = 4
NEW_TOKENS = 48


@pytest.mark.timeout(600)
# Measured 2026-12-01 (2 contended cores): both inits reach training tau 7.55 (the most
# the texts' ends allow) and real tau 8.0 in 250 steps, about 50 s each; random init is
# the slow suite's.
@pytest.mark.parametrize("init", ["target", pytest.param("random", marks=pytest.mark.slow)])
def test_a_memorised_drafter_gets_nearly_whole_blocks_accepted(tmp_path, init):
    torch.set_num_threads(1)
    cfg = load_config(ROOT / "configs/default.yaml", [
        f"data.cache_dir={tmp_path}", f"data.synthetic.num_samples={PROMPTS}", "data.synthetic.heldout_samples=1",
        f"data.synthetic.completion_len=[{NEW_TOKENS}, {NEW_TOKENS}]", "target.tiny.pretrain_steps=100",
        f"drafter.init={init}", "train.epochs=250", "train.lr=3e-3", "train.warmup_ratio=0.02",
        "train.num_anchors=512", "topology.num_drafters=1", "runtime.run_dir=" + str(tmp_path / "run")])
    cfg = cfg.updated({"data.path": str(ensure_target_text(cfg))})      # the target's own greedy text
    result = train_reference(cfg)
    target = load_target(cfg)
    drafter = build_drafter(cfg, target)
    drafter.load_state_dict(result.state_dict)
    drafter.eval()
    texts = open_dataset(cfg.data, progress=False, path=cfg.data.path)
    prompts = [p for p, _ in prompts_of(texts)]
    real = real_tau(drafter, target, prompts, NEW_TOKENS, check_lossless="cached")
    B = cfg.drafter.block_size
    assert real["lossless"], real
    assert result.metrics[-1]["tau"] >= 0.9 * B, f"not memorised: training tau {result.metrics[-1]['tau']:.2f}"
    assert real["tau"] >= 0.9 * B, (f"memorised in training (tau {result.metrics[-1]['tau']:.2f}) but real "
                                    f"decoding accepts {real['tau']:.2f} of {B} per step")
