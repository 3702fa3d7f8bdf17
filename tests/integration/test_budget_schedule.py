"""``train.max_steps`` and ``train.lr_schedule: wsd`` in a real pipeline: a run cut at a
step cap partway through an epoch, with the warmup-stable-decay LR and a drafter and the
optimizer killed, ends bit for bit where the reference with the same settings does, at
the cap, with the LR at 0 on its last step's far side."""

import json

import numpy as np
import pytest

from dflash_actors.data.dataset import open_dataset
from dflash_actors.data.synthetic import train_path
from dflash_actors.job.reference import train_reference
from dflash_actors.train.optim import lr_factor
from dflash_actors.train.schedule import Schedule
from tests.support.pipeline import assert_same_weights, final_weights, losses, new_job, small_config


def test_capped_wsd_pipeline_with_kills_is_bit_identical_to_its_reference(cache_dir, tmp_path):
    run = tmp_path / "run"
    cfg = small_config(cache_dir, run, "1-2", "train.epochs=3", "train.lr_schedule=wsd", "train.decay_ratio=0.3",
                       "train.warmup_ratio=0.1", "train.max_steps=11",
                       "runtime.faults=[{actor: drafter.1, at_batch: 5, kind: sigkill}, "
                       "{actor: optimizer.0, at_batch: 13, kind: sigkill}]")
    job = new_job(cfg, progress=False)
    lengths = open_dataset(cfg.data, progress=False, path=train_path(cfg)).lengths
    uncapped = Schedule.from_config(cfg.updated({"train.max_steps": 0}), lengths)
    assert uncapped.total_steps > 11 and uncapped.steps_per_epoch[0] < 11     # the cap falls inside epoch 2 or 3
    result = job.run()
    assert result.exit_code == 0, result.reason
    assert result.summary["step"] == result.summary["total_steps"] == 11
    ref = train_reference(cfg, progress=False)
    assert ref.steps == 11
    assert losses(run) == ref.losses
    assert_same_weights(final_weights(run), ref.state_dict)
    # The reference's LRs are the schedule's, by hand: flat, then down to 1/4 of the peak.
    lrs = [m["lr"] / cfg.train.lr for m in ref.metrics]
    assert lrs == pytest.approx([lr_factor(s, 11, 0.1, "wsd", 0.3) for s in range(11)], abs=1e-12)
    assert lrs[2:7] == [1.0] * 5 and lrs[-1] == pytest.approx(0.25)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "lr" in r]
    assert np.allclose([r["lr"] for r in steps][-4:], [cfg.train.lr * f for f in lrs[-4:]])
    cosine = train_reference(cfg.updated({"train.lr_schedule": "cosine"}), progress=False)
    assert not np.allclose(ref.losses, cosine.losses)
