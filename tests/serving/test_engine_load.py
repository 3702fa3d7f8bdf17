"""vLLM's own DFlash / DFlash2 / DSpark model classes load what the project exports, through
their own weight loaders (``benchmarks/engine_load.py``, run in the vLLM venv that
``make serve-check`` creates): every tensor consumed, every parameter written with the
export's values, and the dflash_config the classes are built from read as written.
Skipped where that venv does not exist."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".cache" / "vllm-venv" / "bin" / "python"
SCRIPT = ROOT / "benchmarks" / "engine_load.py"

pytestmark = [pytest.mark.serving,
              pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM venv at {VLLM_PYTHON} (make serve-check)")]

# Not the defaults (2/16, 256/16): a value the engine read from elsewhere would show.
DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 32, "selector_rank": 24, "selector_top_k": 6}
DSPARK = {"markov_rank": 12, "markov_head_type": "vanilla", "enable_confidence_head": True,
          "confidence_head_with_markov": True}


def export(path: Path, dflash2: dict | None, dspark: dict | None = None) -> Path:
    """A 2-layer drafter over 2 target layers, saved as training exports it, with every
    parameter drawn at random (so a shard put in the wrong place shows)."""
    from transformers import Qwen3Config

    from dflash_actors.models.drafter import DFlashDrafter, drafter_config
    target = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=512)
    d = DFlashDrafter(drafter_config(target, 2, 8, [1, 2], 299, "test", 300, dflash2, None, dspark))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return d.save_pretrained(path)


def engine_load(*dirs: Path) -> list[dict]:
    r = subprocess.run([str(VLLM_PYTHON), str(SCRIPT), *map(str, dirs)], capture_output=True, text=True,
                       timeout=400, env=os.environ | {"OMP_NUM_THREADS": "1"})
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == len(dirs), (r.stdout[-2000:], r.stderr[-3000:])
    return lines


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-load")
    dflash2, dflash = export(root / "dflash2", DFLASH2), export(root / "dflash", None)
    # The same DFlash2 with one tensor left out: vLLM's loader does not notice (its
    # DFlash load_weights returns no names), the check must.
    (root / "short").mkdir()
    (root / "short" / "config.json").write_text((dflash2 / "config.json").read_text())
    state = load_file(str(dflash2 / "model.safetensors"))
    del state["layers.1.mlp_conv.base_kernel"]
    save_file(state, str(root / "short" / "model.safetensors"), metadata={"format": "pt"})
    dspark = export(root / "dspark", None, DSPARK)
    # The same DSpark with its Markov rank misstated: the engine builds the head from the config.
    (root / "rank").mkdir()
    conf = json.loads((dspark / "config.json").read_text())
    (root / "rank" / "config.json").write_text(json.dumps({**conf, "markov_rank": 16}))
    (root / "rank" / "model.safetensors").write_bytes((dspark / "model.safetensors").read_bytes())
    return dict(zip(("dflash2", "dflash", "short", "dspark", "rank"),
                    engine_load(dflash2, dflash, root / "short", dspark, root / "rank")))


@pytest.mark.timeout(480)
def test_vllm_dflash2_class_loads_every_tensor_of_the_export(results):
    r = results["dflash2"]
    assert r["model_class"].endswith("qwen3_dflash2.DFlash2Qwen3ForCausalLM")
    assert (r["tensors"], r["consumed"]) == (36, 36)
    assert (r["missing"], r["unexpected"], r["shape_mismatches"], r["value_mismatches"], r["unwritten_nan"]) == \
        ([], [], [], [], [])
    assert r["config_read"] == {"fc_in": 128, "mask_token_id": 299, **DFLASH2, "mlp_conv": [3, 32]}
    assert set(r["not_from_export"]) == {"model.embed_tokens.weight", "lm_head.weight", "model.mask_embedding"}
    assert r["draft_attn_causal"] == [False, False]
    assert r["ok"], r


@pytest.mark.timeout(480)
def test_vllm_dflash_class_loads_every_tensor_of_the_export(results):
    r = results["dflash"]
    assert r["model_class"].endswith("qwen3_dflash.DFlashQwen3ForCausalLM")
    assert (r["tensors"], r["consumed"]) == (25, 25)
    assert r["config_read"] == {"fc_in": 128, "mask_token_id": 299}
    assert r["ok"], r


@pytest.mark.timeout(480)
def test_a_tensor_missing_from_the_export_is_caught(results):
    r = results["short"]
    assert r["missing"] == ["model.layers.1.mlp_conv.base_kernel"]
    assert r["unwritten_nan"] == ["model.layers.1.mlp_conv.base_kernel"]
    assert not r["ok"]


@pytest.mark.timeout(480)
def test_vllm_dspark_class_loads_every_tensor_of_the_export(results):
    """vLLM's ``Qwen3DSparkForCausalLM`` (built as ``method: "dspark"`` with K = block size)
    takes every tensor of a DSpark export, its heads built from the flat keys as written;
    its Markov table pads the vocabulary to a multiple of 64 rows, the export's rows first.
    (vLLM's CPU build refuses to run a DSpark draft on the V1 model runner: a runner check,
    passed over to load the class.)"""
    r = results["dspark"]
    assert r["model_class"].endswith("qwen3_dspark.Qwen3DSparkForCausalLM")
    assert r["tensors"] == r["consumed"] == 29
    assert r["config_read"] == {"fc_in": 128, "mask_token_id": 299, "markov_rank": 12,
                                "enable_confidence_head": True, "confidence_head_with_markov": True}
    assert any("vocabulary padding" in n for n in r["notes"])
    assert r["draft_attn_causal"] == [False, False]
    assert r["ok"], r


@pytest.mark.timeout(480)
def test_a_dspark_config_that_misstates_its_heads_is_caught(results):
    r = results["rank"]
    # The engine's own loader stops at the confidence head, sized hidden + rank (64 + 16).
    assert not r.get("ok") and "Size([1, 76])" in r["error"] and "Size([1, 80])" in r["error"], r
