"""``target.feature_cache`` in real pipelines: with targets killed, with a job stopped and
resumed on its disk cache, with entries lost, the run ends bit-identical to the
reference trainer with the cache on; and the cache changes the result only at float
rounding against no cache."""

import json

import numpy as np
import torch

from dflash_actors.job.reference import train_reference
from dflash_actors.train import feature_cache
from tests.support.pipeline import assert_same_weights, final_weights, losses, new_job, small_config

REFERENCE = {}


def reference(cfg):
    """The reference with the cache on (memory and disk make the same bits); M = 1."""
    if "on" not in REFERENCE:
        REFERENCE["on"] = train_reference(cfg.updated({"target.feature_cache": "memory"}), progress=False)
    return REFERENCE["on"]


def faults(*entries):
    return "runtime.faults=[" + ", ".join("{" + ", ".join(f"{k}: {v}" for k, v in e.items()) + "}"
                                          for e in entries) + "]"


def epoch_starts(job) -> int:
    """The first batch of epoch 2."""
    return job.schedule.first_of_step(job.schedule.steps_per_epoch[0])


def test_memory_cache_survives_target_kills(cache_dir, tmp_path):
    # target.0 dies between a store's rows and its flags in epoch 1 (the batch is
    # redone), and again in epoch 2, whose batches are all served from entries its
    # earlier incarnations wrote into the job's shared memory.
    run = tmp_path / "run"
    cfg = small_config(cache_dir, run, "1-1", "target.feature_cache=memory",
                       faults(dict(actor="target.0", at_batch=2, kind="sigkill", at="cache"),
                              dict(actor="target.0", at_batch=11, kind="sigkill")))
    job = new_job(cfg, progress=False)
    assert epoch_starts(job) == 9            # the second fault is in epoch 2
    result = job.run()
    assert result.exit_code == 0, result.reason
    assert result.summary["restarts_by_actor"] == {"target.0": 2}
    ref = reference(cfg)
    assert losses(run) == ref.losses
    assert_same_weights(final_weights(run), ref.state_dict)
    st = result.summary["feature_cache"]
    assert st["mode"] == "memory" and st["samples_cached"] == st["samples"] == 128
    # Epoch 2 repeats every sample, each served from the cache: its 9 batches skip the target.
    assert st["hit_rate"] == 1.0 and st["samples_served"] == st["samples_repeated"] == 128
    assert st["forwards_skipped"] == 9 and st["misses"] == 0 and st["forward_saved_s"] > 0
    assert ref.feature_cache == {**st, "forward_s": ref.feature_cache["forward_s"],
                                 "forward_saved_s": ref.feature_cache["forward_saved_s"]}
    status = json.loads((run / "status.json").read_text())
    assert status["feature_cache"]["samples_served"] == st["samples_served"]


def test_disk_cache_is_reused_by_a_resume_and_lost_entries_are_recomputed(cache_dir, tmp_path):
    run = tmp_path / "run"
    # The job stops in epoch 1 (the optimizer dies at batch 4 and may not restart),
    # with its checkpoint and a disk cache of the batches its targets featured.
    first = small_config(cache_dir, run, "1-1", "target.feature_cache=disk", "runtime.max_restarts=0",
                         faults(dict(actor="optimizer.0", at_batch=4, kind="exit")))
    stopped = new_job(first, progress=False)
    result = stopped.run()
    assert result.exit_code == 1 and result.summary["step"] == 4, result.reason
    plan = stopped.cache.plan
    assert result.summary["feature_cache"]["entries_present"] >= int((plan.first < 4).sum())
    # Batch 0's entries lost (their flags cleared, as a writer killed before them would
    # leave them); the resume never reruns batch 0, so epoch 2 misses them.
    lost = plan.slot[plan.first == 0]
    flags = np.memmap(run / feature_cache.CACHE_DIR / feature_cache.DiskStore.FLAGS,
                      np.uint8, "r+")
    flags[lost] = 0
    flags.flush()
    del flags
    again = small_config(cache_dir, run, "1-1", "target.feature_cache=disk",
                         faults(dict(actor="target.0", at_batch=11, kind="sigkill")))
    resumed = new_job(again, resume=True, progress=False)
    result = resumed.run()
    assert result.exit_code == 0, result.reason
    assert result.summary["resumed_from"] == 4 and result.summary["restarts_by_actor"] == {"target.0": 1}
    ref = reference(again)
    assert losses(run) == ref.losses[4:]
    assert_same_weights(final_weights(run), ref.state_dict)
    st = result.summary["feature_cache"]
    # Batches 1..3 ran only in the stopped job: their samples came from its files.
    assert st["samples_served"] >= int(np.isin(plan.first, [1, 2, 3]).sum()) > 0
    assert st["misses"] == len(lost) and st["first_batches_recomputed"] == 1
    assert st["hit_rate"] > 0


def test_cache_on_and_off_agree_within_float_tolerance(cache_dir, tmp_path):
    # Not bit for bit: a sample's features are those of its first batch with the cache
    # on, of each batch that holds it with it off, and the target's kernels round
    # differently for another batch shape (on this config 4 of the 128 epoch-2 repeats
    # differ in their last bits, the rest are equal).
    cfg = small_config(cache_dir, tmp_path / "off", "1-1")
    off = train_reference(cfg, progress=False)
    on = reference(cfg)
    assert on.feature_cache["hit_rate"] == 1.0
    assert np.allclose(on.losses, off.losses, rtol=1e-5, atol=0)
    for k, want in off.state_dict.items():
        torch.testing.assert_close(on.state_dict[k], want, rtol=1e-4, atol=1e-6)


def test_distillation_pipeline_with_kills_is_bit_identical_to_its_reference(cache_dir, tmp_path):
    # train.loss=distill widens every feature slot and cache entry by the target's last
    # layer; the run, with a target killed between a store's rows and flags and a
    # drafter killed mid-step, still ends bit for bit where the reference does.
    run = tmp_path / "run"
    cfg = small_config(cache_dir, run, "1-1", "train.loss=distill", "target.feature_cache=memory",
                       faults(dict(actor="target.0", at_batch=3, kind="sigkill", at="cache"),
                              dict(actor="drafter.0", at_batch=12, kind="sigkill")))
    job = new_job(cfg, progress=False)
    result = job.run()
    assert result.exit_code == 0, result.reason
    assert job.cache.plan.width == (len(job.target.layer_ids) + 1) * job.target.hidden_size
    assert result.summary["restarts_by_actor"] == {"target.0": 1, "drafter.0": 1}
    ref = train_reference(cfg, progress=False)
    assert losses(run) == ref.losses
    assert_same_weights(final_weights(run), ref.state_dict)
    # Not the cross-entropy run: the loss learns the target's distribution.
    assert not np.allclose(ref.losses, reference(cfg.updated({"train.loss": "ce"})).losses)


def test_reference_on_a_disk_cache_left_by_another_run_skips_the_target(cache_dir, tmp_path):
    """The recipe bench's sharing: a one-epoch reference fills a disk store under its
    cache root; a two-epoch reference (another schedule, the same first epoch) maps it,
    runs no target forward at all, and ends bit for bit where the memory cache does."""
    cfg = small_config(cache_dir, tmp_path / "ref", "1-1", "target.feature_cache=disk")
    root = tmp_path / "shared"
    first = train_reference(cfg.updated({"train.epochs": 1}), progress=False, cache_root=root)
    assert first.feature_cache["forward_s"] > 0 and first.feature_cache["samples_reused"] == 0
    assert (root / feature_cache.CACHE_DIR / feature_cache.DiskStore.FLAGS).is_file()
    again = train_reference(cfg, progress=False, cache_root=root)
    st = again.feature_cache
    assert st["mode"] == "disk" and st["forward_s"] == 0 and st["first_batches_recomputed"] == 0
    assert st["samples_reused"] == st["samples_cached"] == st["samples"]
    assert again.losses == reference(cfg).losses
    assert_same_weights(again.state_dict, reference(cfg).state_dict)
