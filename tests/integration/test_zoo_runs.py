"""Every family of the target zoo (``tests.support.zoo``) trained as users run it: a 1-1
job on the tiny target's directory, its drafter and its target each killed with -9 mid-run,
ends bit-identical to the single-process reference; then ``evaluate`` decodes from the
finished run's drafter, losslessly.

What it costs, and why it is built so: about 6 s a family. The jobs run in this
process and fork from the session's shared server (``new_job``), as launch.py's job
forks from the one it starts early; the data is the synthetic set cut to one epoch of
64 samples (five steps, enough for both kills to land mid-run and each actor to come
back); the reference of a run that small takes under a second; ``evaluate`` runs
in-process on two prompts of eight new tokens without baselines."""

import json

import pytest

from dflash_actors.eval.parity import main as evaluate_main
from dflash_actors.job.reference import train_reference
from dflash_actors.models.drafter import DFlashDrafter
from dflash_actors.train.checkpoint import latest_checkpoint
from tests.support.pipeline import assert_same_weights, final_weights, losses, new_job, small_config
from tests.support.zoo import DATA_VOCAB, FAMILIES, save_target

ZOO = ("data.synthetic.num_samples=64", "train.epochs=1", f"data.synthetic.vocab_size={DATA_VOCAB}")
KILLS = ("runtime.faults", [{"actor": "target.0", "at_batch": 1, "kind": "sigkill"},
                            {"actor": "drafter.0", "at_batch": 3, "kind": "sigkill"}])

LAYERS_COPIED = {"llama", "qwen3"}
"""Families whose decoder layers are a drafter layer whole: ``drafter.init: target`` copies
them. The others' layers hold what a drafter layer has not (experts, gated queries, MLA,
sinks and biases, sandwich norms: ``init_from_target`` refuses them), so their drafters
take the target's fc pass-through and norms only (Gemma's and Qwen3.5's as ``1 + w``)."""


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """``(targets root, runs)``: each family's saved target, built on first use, and
    the run directory each kill test leaves for the evaluate test."""
    return tmp_path_factory.mktemp("zoo"), {}


def extra(family, target_dir):
    parts = () if family in LAYERS_COPIED else ("drafter.init_parts=[fc, hidden_norm, norm]",)
    return (*ZOO, f"target.path={target_dir}", *parts)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_run_with_its_drafter_and_target_killed_equals_the_reference(zoo, cache_dir, tmp_path, family):
    root, runs = zoo
    target = save_target(family, root / "targets")
    run_dir = root / "runs" / family
    result = new_job(small_config(cache_dir, run_dir, "1-1", *extra(family, target), KILLS), progress=False).run()
    assert result.exit_code == 0, result.reason
    assert result.summary["restarts_by_actor"] == {"target.0": 1, "drafter.0": 1}
    ref = train_reference(small_config(cache_dir, tmp_path / "ref", "1-1", *extra(family, target)), progress=False)
    assert result.summary["step"] == ref.steps >= 4
    assert losses(run_dir) == ref.losses
    assert_same_weights(final_weights(run_dir), ref.state_dict)
    runs[family] = run_dir


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_evaluate_decodes_losslessly_from_the_finished_run(zoo, tmp_path, family):
    root, runs = zoo
    if family not in runs:
        pytest.skip("its run did not finish (the test above failed)")
    drafter = DFlashDrafter.from_pretrained(latest_checkpoint(runs[family]))
    assert drafter.mask_token_id >= DATA_VOCAB
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Count to {i}."}]}) + "\n"
                               for i in (3, 5)))
    report = tmp_path / "report.json"
    assert evaluate_main([str(runs[family]), "--prompts", str(prompts), "--max-new-tokens", "8", "--baselines", "none",
                          "--threads", "1", "--json", str(report)]) == 0
    trained = json.loads(report.read_text())["results"]["trained"]
    assert trained["real"]["lossless"] and trained["real"]["prompts"] == 2
    assert 1.0 <= trained["real"]["tau"] <= drafter.block_size
