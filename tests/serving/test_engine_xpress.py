"""vLLM 0.33's own XPress code (``qwen3_xpress.py`` from the pinned wheel, the rest of vLLM
stubbed: ``benchmarks/engine_xpress.py``) reads what the project exports: its config keys,
its weight names, and its refiner drafts what ours drafts. Skipped where the wheel is not
in .cache/vllm-033."""

import json

import pytest
import torch

from benchmarks import engine_xpress
from dflash_actors.models.drafter import DFlashDrafter

pytestmark = [pytest.mark.serving,
              pytest.mark.skipif(not engine_xpress.WHEEL.is_file(),
                                 reason=f"no {engine_xpress.WHEEL.name} ({engine_xpress.FETCH})")]


def test_vllm_033_loads_an_xpress_export_and_drafts_as_we_do(tmp_path):
    out = engine_xpress.check(engine_xpress.tiny_export(tmp_path))
    assert out["ok"], out
    assert out["built"] == {"block_size": 4, "rank": 8, "mlp_hidden": 16, "topc": 0, "passes": 6}
    assert out["drafts_equal"] and out["drafts_moved_by_refiner"] > 0 and out["bias_max_rel_diff"] < 1e-5
    assert out["controls"]["slot0_after_another_token_drafts_otherwise"]
    assert out["controls"]["speculators_names"].startswith("vLLM refused")


def test_the_mixer_is_exported_raw_and_vllm_folds_it(tmp_path):
    path = engine_xpress.tiny_export(tmp_path)
    head, _, _ = engine_xpress.engine_head(engine_xpress.vllm_xpress(), path)
    mix = DFlashDrafter.from_pretrained(path).refiner_head.mix_l
    assert mix.abs().sum() > 0
    assert torch.equal(head.mix_L, torch.tril(mix) + torch.eye(mix.shape[-1]))


def test_without_the_sizes_vllm_would_build_another_head(tmp_path):
    # vLLM 0.33's defaults: 1 + num_speculative_tokens slots (16 by default), 512 MLP units.
    path = engine_xpress.tiny_export(tmp_path)
    conf = json.loads((path / "config.json").read_text())
    module = engine_xpress.vllm_xpress()

    def without(key):
        bare = tmp_path / f"no-{key}"
        bare.mkdir()
        (bare / "config.json").write_text(json.dumps({k: v for k, v in conf.items() if k != key}))
        (bare / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
        return bare
    with pytest.raises(RuntimeError):       # the 4-slot mixer folded into a 16-slot one
        engine_xpress.engine_head(module, without("xpress_block_size"))
    _, _, load = engine_xpress.engine_head(module, without("xpress_mlp_hidden"))
    assert {"model.xpress_head.mlp_gate.weight", "model.xpress_head.mlp_up.weight"} <= set(load["unplaced"])
