"""``train.head_vocab: sampled`` in a real pipeline: every drafter process derives the
same training vocabulary from the dataset and draws the same extra rows per batch, so a
run with a drafter killed mid-step still ends bit for bit where the reference with the
same setting does, and not where the exact head's or the data-only head's run does."""

import numpy as np

from dflash_actors.job.reference import train_reference
from dflash_actors.models.head_loss import training_vocab
from tests.support.pipeline import assert_same_weights, final_weights, losses, new_job, small_config


def test_restricted_head_pipeline_with_a_kill_is_bit_identical_to_its_reference(cache_dir, tmp_path):
    run = tmp_path / "run"
    cfg = small_config(cache_dir, run, "1-2", "train.head_vocab=sampled", "train.head_negatives=2",
                       "runtime.faults=[{actor: drafter.1, at_batch: 5, kind: sigkill}]")
    job = new_job(cfg, progress=False)
    result = job.run()
    assert result.exit_code == 0, result.reason
    assert result.summary["restarts_by_actor"] == {"drafter.1": 1}
    ref = train_reference(cfg, progress=False)
    assert losses(run) == ref.losses
    assert_same_weights(final_weights(run), ref.state_dict)
    vocab = training_vocab(cfg)
    assert 0 < len(vocab) < job.target.vocab_size
    exact = train_reference(cfg.updated({"train.head_vocab": "full"}), progress=False)
    assert training_vocab(cfg.updated({"train.head_vocab": "full"})) is None
    assert not np.allclose(ref.losses, exact.losses)
    data_only = train_reference(cfg.updated({"train.head_vocab": "data"}), progress=False)
    assert not np.allclose(ref.losses, data_only.losses)
