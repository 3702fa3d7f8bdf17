"""``launch.py serve-check``: its refusals (exit 2, one line), the K rule, and how the
project's steps are counted as vLLM counts them. The engine itself runs in
``tests/serving`` where vLLM is installed."""

import json
import stat

import pytest
import torch

from dflash_actors.eval import serve
from dflash_actors.eval.decode import Generation
from dflash_actors.models.drafter import drafter_config
from dflash_actors.train.checkpoint import save_checkpoint

pytestmark = pytest.mark.timeout(120)


def test_k_is_block_size_minus_one():
    assert serve.check_k(None, 8) == 7 and serve.check_k(3, 4) == 3
    with pytest.raises(serve.Unservable, match="--k: 8 contradicts the drafter's block size 8"):
        serve.check_k(8, 8)


def test_counted_as_vllm_drops_the_step_from_the_last_token_and_keeps_accepted_past_the_end():
    """Prompt of 5, 8 new tokens: positions 5..12. Steps from anchors 5 (accepts 2), 8 (3),
    12 (1): the last anchor is the 8th token, where a vLLM request has finished; the step
    from 8 emits 4 tokens (9..12) and counts all 3 of its accepted drafts."""
    g = Generation(ids=torch.arange(13), lengths=[3, 4, 2], starts=[5, 8, 12], accepted=[2, 3, 1])
    assert serve.served_counts(g, 5, 8) == (2, 5)
    # One that overshoots: from anchor 10 it accepts 3, of which only 2 fit in the output.
    g = Generation(ids=torch.arange(13), lengths=[3, 4], starts=[5, 10], accepted=[2, 3])
    assert serve.served_counts(g, 5, 8) == (2, 5)


@pytest.fixture(scope="module")
def run_dir(tiny, tmp_path_factory):
    """A run directory with one checkpoint of a DFlash2 drafter for the tiny target."""
    cfg, target = tiny
    d2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
    from dflash_actors.models.drafter import DFlashDrafter
    drafter = DFlashDrafter(drafter_config(target.config, 1, 8, target.layer_ids, target.vocab_size - 1, "test",
                                           target.vocab_size, d2)).init_weights(0)
    run = tmp_path_factory.mktemp("run")
    save_checkpoint(run, 1, drafter.save_pretrained, {"config": cfg.to_dict()})
    return run


def fake_python(tmp_path, probe: dict):
    """An interpreter that answers only the probe, as a vLLM install would."""
    exe = tmp_path / "python"
    exe.write_text(f"#!/bin/sh\necho '{json.dumps(probe)}'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def refusal(capsys, argv) -> str:
    assert serve.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    return err[0]


def test_refusals_are_one_line(run_dir, tmp_path, capsys):
    assert "no checkpoint to serve" in refusal(capsys, [str(tmp_path)])
    assert "--vllm-python: /no/such/python does not exist" in refusal(
        capsys, [str(run_dir), "--vllm-python", "/no/such/python"])
    assert "--k: 4 contradicts" in refusal(capsys, [str(run_dir), "--k", "4"])
    line = refusal(capsys, [str(run_dir), "--vllm-python", fake_python(tmp_path, {"version": "0.32.0",
                                                                                   "device": "cpu"})])
    assert "a DFlash2 drafter, which vLLM 0.32.0's CPU build cannot serve" in line


def test_an_interpreter_without_vllm_is_named(run_dir, tmp_path, capsys):
    exe = tmp_path / "python"
    exe.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'vllm'\" >&2\nexit 1\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    line = refusal(capsys, [str(run_dir), "--vllm-python", str(exe)])
    assert "vLLM: not importable by" in line and "No module named 'vllm'" in line
