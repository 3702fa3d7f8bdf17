"""A real vLLM (its CPU build, in the venv ``make serve-check`` creates) reads and serves
what launch.py trains. Skipped where that venv does not exist; ``make serve-check`` runs it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".cache" / "vllm-venv" / "bin" / "python"

pytestmark = [pytest.mark.serving,
              pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM venv at {VLLM_PYTHON} (make serve-check)")]

# vLLM's own reading of a drafter directory's RoPE: its config loader, then the get_rope
# its DFlash attention calls.
ROPE_AS_VLLM_READS = """
import json, sys
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.transformers_utils.config import get_config
cfg = get_config(sys.argv[1], trust_remote_code=False)
with set_current_vllm_config(VllmConfig()):
    rope = get_rope(cfg.head_dim, max_position=4096, is_neox_style=True, rope_parameters=cfg.rope_parameters)
print(json.dumps({"rotary_dim": rope.rotary_dim, "kind": type(rope).__name__}))
"""


def vllm_rope(drafter_dir: Path) -> dict:
    r = subprocess.run([str(VLLM_PYTHON), "-c", ROPE_AS_VLLM_READS, str(drafter_dir)], capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_vllm_rotates_the_dims_the_drafter_trained_with(tmp_path):
    """A Qwen3.5-shaped target (partial_rotary_factor 0.25): the drafter rotates all 32 dims
    of each head, and so does vLLM reading its export. The control, the target's dict
    copied as the export once did, makes vLLM rotate 8."""
    from transformers import Qwen3_5TextConfig

    from dflash_actors.models.drafter import DFlashDrafter, drafter_config
    t = Qwen3_5TextConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=32, intermediate_size=128, vocab_size=300)
    d = DFlashDrafter(drafter_config(t, 1, 8, [1], 299, "test", 300)).init_weights(0)
    d.save_pretrained(tmp_path / "dr")
    assert vllm_rope(tmp_path / "dr") == {"rotary_dim": d.rotary_emb.inv_freq.numel() * 2, "kind": "RotaryEmbedding"}
    conf = json.loads((tmp_path / "dr" / "config.json").read_text())
    conf["rope_parameters"] = dict(t.rope_parameters)
    (tmp_path / "copied").mkdir()
    (tmp_path / "copied" / "config.json").write_text(json.dumps(conf))
    assert vllm_rope(tmp_path / "copied")["rotary_dim"] == 8


# vLLM's own reading of each DFlash draft layer's attention: (sliding window, causal).
ATTENTION_AS_VLLM_READS = """
import json, sys
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.models.qwen3_dflash import _resolve_layer_attention
from vllm.transformers_utils.config import get_config
cfg = get_config(sys.argv[1], trust_remote_code=False)
with set_current_vllm_config(VllmConfig()):
    print(json.dumps([_resolve_layer_attention(cfg, i) for i in range(cfg.num_hidden_layers)]))
"""


@pytest.mark.timeout(300)
def test_vllm_reads_the_window_and_the_blocks_both_ways(tmp_path):
    """A drafter whose layers are all sliding_attention of 64: vLLM gives each layer that
    window, non-causal, as trained. The control, the export without ``is_causal``, is read
    causal in the block (why the export always writes it)."""
    from transformers import Qwen3Config

    from dflash_actors.models.drafter import DFlashDrafter, drafter_config
    t = Qwen3Config(hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                    intermediate_size=128, vocab_size=300)
    shape = {"layer_types": ["sliding_attention"] * 2, "sliding_window": 64}
    DFlashDrafter(drafter_config(t, 2, 8, [1], 299, "test", 300, None, shape)).init_weights(0).save_pretrained(
        tmp_path / "dr")

    def read(path):
        r = subprocess.run([str(VLLM_PYTHON), "-c", ATTENTION_AS_VLLM_READS, str(path)], capture_output=True,
                           text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])
    assert read(tmp_path / "dr") == [[64, False], [64, False]]
    conf = json.loads((tmp_path / "dr" / "config.json").read_text())
    del conf["is_causal"]
    (tmp_path / "causal").mkdir()
    (tmp_path / "causal" / "config.json").write_text(json.dumps(conf))
    assert read(tmp_path / "causal") == [[64, True], [64, True]]


@pytest.mark.timeout(900)
def test_serve_check_agrees_on_a_short_demo_run(tmp_path, cache_dir):
    run = tmp_path / "run"
    train = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--topology", "1-1", "--run-dir", str(run),
                            "--set", f"data.cache_dir={cache_dir}", "--set", "train.epochs=2"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert train.returncode == 0, train.stderr[-2000:]
    r = subprocess.run([sys.executable, str(ROOT / "launch.py"), "serve-check", str(run), "--limit", "4",
                        "--max-new-tokens", "32", "--vllm-python", str(VLLM_PYTHON)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert line["lossless_prompts"] == line["num_prompts"] == 4
    assert line["engine_acceptance"] == line["project_counted"]
    assert abs(line["engine_acceptance"] - line["evaluate"]["tau"]) < 0.05
    assert line["k"] == line["block_size"] - 1
