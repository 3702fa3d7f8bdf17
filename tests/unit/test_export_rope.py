"""The exported RoPE is the RoPE the drafter computes, whatever the target's config carries.

A Qwen3.5/3.6 target's ``rope_parameters`` holds ``partial_rotary_factor: 0.25`` and, in
the published ``config.json``, ``mrope_section``/``mrope_interleaved``. The drafter rotates
every dimension of every head at 1-D positions; an engine reading a copied dict rotates a
quarter (vLLM's ``get_rope``: ``rope_dim``, else ``head_dim * partial_rotary_factor``) or
builds an M-RoPE. The engines' own parsing runs in ``tests/serving`` where vLLM is installed;
here, what they read from the file.
"""

import json

import pytest
import torch
from transformers import Qwen3_5TextConfig, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dflash_actors.models.drafter import ROPE_NOT_COMPUTED, DFlashDrafter, drafter_config, read_config, sdpa_dense

pytestmark = pytest.mark.timeout(60)

HEAD_DIM = 32


def qwen3_5_target():
    """A tiny Qwen3.5-shaped text config, with the M-RoPE keys of the published configs."""
    t = Qwen3_5TextConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=HEAD_DIM, intermediate_size=128, vocab_size=300)
    t.rope_parameters = {**t.rope_parameters, "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    assert t.rope_parameters["partial_rotary_factor"] == 0.25
    return t


def yarn_target():
    return Qwen3Config(hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=HEAD_DIM, intermediate_size=128, vocab_size=300,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                        "original_max_position_embeddings": 4096})


def exported(target, tmp_path, dflash2=None):
    cfg = drafter_config(target, 1, 8, [1], 299, "test", 300, dflash2)
    d = DFlashDrafter(cfg).init_weights(0)
    d.save_pretrained(tmp_path / "dr")
    return d, json.loads((tmp_path / "dr" / "config.json").read_text())


def engine_rotary_dims(conf: dict) -> int:
    """Rotated dims per head as vLLM 0.33's ``get_rope`` reads a config's ``rope_parameters``
    (``rope_dim``, else ``head_dim * partial_rotary_factor``); SGLang 0.5.23 reads the same
    ``rope_dim`` and a top-level factor."""
    rope = conf.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", conf.get("partial_rotary_factor", 1.0))
    return int(rope.get("rope_dim", conf["head_dim"] * factor))


@pytest.mark.parametrize("dflash2", [None, {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
                                            "selector_top_k": 4}], ids=["dflash", "dflash2"])
def test_qwen3_5_target_exports_the_full_head_rotation_it_trains(tmp_path, dflash2):
    d, conf = exported(qwen3_5_target(), tmp_path, dflash2)
    assert conf["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert not set(conf) & set(ROPE_NOT_COMPUTED)
    # What the drafter computes, and what an engine would rotate, are the whole head.
    assert d.rotary_emb.inv_freq.numel() * 2 == HEAD_DIM
    assert engine_rotary_dims(conf) == HEAD_DIM
    assert "mrope_section" not in conf["rope_parameters"]
    assert conf["is_causal"] is False
    # Reloaded, it computes the same rotation (and the same drafter).
    back = read_config(tmp_path / "dr")
    assert torch.equal(Qwen3RotaryEmbedding(back).inv_freq, d.rotary_emb.inv_freq)
    x = torch.randn(1, 8, 64)
    ctx = d.context(torch.randn(1, 5, 64))
    again = DFlashDrafter.from_pretrained(tmp_path / "dr")
    pos = torch.arange(13)[None]
    assert torch.equal(d(x, ctx, pos, sdpa_dense(None)), again(x, ctx, pos, sdpa_dense(None)))


def test_a_scaling_type_keeps_the_keys_the_drafter_applies(tmp_path):
    d, conf = exported(yarn_target(), tmp_path)
    assert conf["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                       "original_max_position_embeddings": 4096}
    # The drafter applies yarn as the target does: the same frequencies and scale.
    target_rope = Qwen3RotaryEmbedding(yarn_target())
    assert torch.equal(d.rotary_emb.inv_freq, target_rope.inv_freq)
    assert d.rotary_emb.attention_scaling == target_rope.attention_scaling


def test_partial_rotary_with_a_scaling_type_is_dropped_too(tmp_path):
    """transformers' yarn reads ``partial_rotary_factor`` (and would give fewer frequencies
    than the drafter's full-width rotation can use): the export never carries it."""
    t = yarn_target()
    t.rope_parameters = {**t.rope_parameters, "partial_rotary_factor": 0.5}
    d, conf = exported(t, tmp_path)
    assert "partial_rotary_factor" not in conf["rope_parameters"] and engine_rotary_dims(conf) == HEAD_DIM
    assert d.rotary_emb.inv_freq.numel() * 2 == HEAD_DIM
