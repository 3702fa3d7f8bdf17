"""Sliding-window drafter layers through the pipeline: a window that cuts the context (16
tokens, rows of up to ~190) on one layer of two, under a kill -9, ends bit-identical to the
reference; and a drafter shaped like the published 27B DFlash2 (``tests/fixtures/drafters``:
5 ``sliding_attention`` layers of 2048, its own 32/8 heads of 128, block 8, DFlash2 sizes;
hidden, MLP and vocabulary those of the tiny target it drafts for) starts a run through
``drafter.init_from``, stops, resumes, equals the reference and exports its layer types
as it read them."""

import json

from safetensors.torch import save_file

import launch
from dflash_actors.job.reference import train_reference
from dflash_actors.models.drafter import WEIGHTS, DFlashDrafter, read_config
from dflash_actors.models.drafter_start import start_config
from dflash_actors.models.head import load_head
from dflash_actors.train.checkpoint import latest_checkpoint
from tests.support.pipeline import (
    ROOT,
    assert_same_weights,
    final_weights,
    losses,
    new_job,
    run_until_stopped,
    small_config,
)

PUBLISHED = ROOT / "tests/fixtures/drafters/qwen3.6-27b-dflash2.json"
WINDOWED = ("drafter.num_layers=2", "drafter.sliding_window=16",
            "drafter.layer_types=[sliding_attention, full_attention]", "train.grad_accum=2")


def test_a_window_that_cuts_survives_a_kill_bit_for_bit(cache_dir, tmp_path):
    kill = ("runtime.faults", [{"actor": "drafter.1", "at_batch": 5, "kind": "sigkill"}])
    job = new_job(small_config(cache_dir, tmp_path / "run", "2-2", *WINDOWED, kill), progress=False)
    result = job.run()
    assert result.exit_code == 0, result.reason
    assert result.summary["restarts_by_actor"] == {"drafter.1": 1}
    ref = train_reference(small_config(cache_dir, tmp_path / "ref", "2-2", *WINDOWED), progress=False)
    assert_same_weights(final_weights(tmp_path / "run"), ref.state_dict)
    assert losses(tmp_path / "run") == ref.losses
    conf = json.loads((latest_checkpoint(tmp_path / "run") / "config.json").read_text())
    assert (conf["layer_types"], conf["sliding_window"], conf["use_sliding_window"], conf["is_causal"]) == (
        ["sliding_attention", "full_attention"], 16, True, False)
    # The window changed what was learned: the same run with full attention loses otherwise.
    full = [s for s in WINDOWED if "window" not in s and "layer_types" not in s]
    unwindowed = train_reference(small_config(cache_dir, tmp_path / "full", "2-2", *full), progress=False)
    assert unwindowed.losses != ref.losses


SHAPE = ("drafter.num_layers=5", "drafter.arch=dflash2", "drafter.block_size=8", "drafter.selector_rank=256",
         "drafter.selector_top_k=16", "drafter.conv_kernel_size=2", "drafter.conv_group_size=16",
         "drafter.num_attention_heads=32", "drafter.num_key_value_heads=8", "drafter.head_dim=128",
         "drafter.init=random", "train.num_anchors=8", "train.max_steps=4", "train.checkpoint_every=2")


def published_shaped(cfg, path):
    """The published config with the sizes the tiny target fixes (hidden, MLP, vocabulary,
    positions, its layers and mask token) put in, random weights beside it."""
    facts = json.loads(PUBLISHED.read_text())["config"]
    ours = start_config(cfg, load_head(cfg)).to_dict()
    keep = ("hidden_size", "intermediate_size", "vocab_size", "max_position_embeddings", "num_target_layers")
    conf = {**facts, **{k: ours[k] for k in keep}}
    conf["dflash_config"] = {**facts["dflash_config"], **{k: ours["dflash_config"][k]
                                                         for k in ("mask_token_id", "target_layer_ids")}}
    path.mkdir()
    (path / "config.json").write_text(json.dumps(conf))
    (path / WEIGHTS).touch()        # read_config wants a drafter directory; the weights follow from it
    d = DFlashDrafter(read_config(path)).init_weights(7)
    save_file({k: v.contiguous() for k, v in d.state_dict().items()}, str(path / WEIGHTS))
    return facts


def test_the_published_27b_dflash2_shape_trains_resumes_and_exports(cache_dir, tmp_path):
    run_dir, start = tmp_path / "run", tmp_path / "published"
    facts = published_shaped(small_config(cache_dir, run_dir, "1-1", *SHAPE), start)
    sets = (*SHAPE, f"drafter.init_from={start}")
    first = run_until_stopped(new_job(small_config(cache_dir, run_dir, "1-1", *sets), progress=False), 2)
    assert first.exit_code == 130, first.reason
    assert launch.main(["--resume", str(run_dir)]) == 0
    ref = train_reference(small_config(cache_dir, tmp_path / "ref", "1-1", *sets), progress=False)
    assert_same_weights(final_weights(run_dir), ref.state_dict)
    conf = json.loads((latest_checkpoint(run_dir) / "config.json").read_text())
    for key in ("architectures", "layer_types", "sliding_window", "use_sliding_window", "is_causal",
                "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers", "rope_parameters"):
        assert conf[key] == facts[key], key
    assert conf["dflash_config"]["block_size"] == 8
    assert [layer.window for layer in DFlashDrafter.from_pretrained(latest_checkpoint(run_dir)).layers] == [2048] * 5
