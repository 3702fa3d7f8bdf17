import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash_actors.config import load_config
from dflash_actors.models.drafter import DFlashDrafter, build_drafter, sdpa_dense

ROOT = Path(__file__).resolve().parents[2]

ZLAB_NAMES = {
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight", "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight",
    "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
    "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight",
    "fc.weight", "hidden_norm.weight", "norm.weight",
}


@pytest.fixture(scope="module")
def setup(tiny):
    cfg, target = tiny
    return cfg, target, build_drafter(cfg, target)


def run(drafter, seed=0):
    g = torch.Generator().manual_seed(seed)
    H = drafter.config.hidden_size
    noise = torch.randn(1, drafter.block_size, H, generator=g)
    ctx = drafter.context(torch.randn(1, 11, drafter.fc.in_features, generator=g))
    return drafter(noise, ctx, torch.arange(11 + drafter.block_size)[None], sdpa_dense(None))


def test_parameter_names_are_zlab_names(setup):
    _, _, d = setup
    assert set(d.state_dict()) == ZLAB_NAMES


def test_init_depends_on_seed_only(setup):
    cfg, target, d = setup
    again = build_drafter(cfg, target)
    assert all(torch.equal(a, b) for a, b in zip(d.state_dict().values(), again.state_dict().values()))
    other = build_drafter(load_config(ROOT / "configs" / "default.yaml", ["train.seed=1"]), target)
    assert not torch.equal(other.fc.weight, d.fc.weight)


def test_save_load_round_trip_is_bit_identical(setup, tmp_path):
    _, _, d = setup
    with torch.no_grad():
        d.norm.weight.add_(0.125)      # not just the init
    d.save_pretrained(tmp_path / "dr")
    back = DFlashDrafter.from_pretrained(tmp_path / "dr")
    assert set(back.state_dict()) == set(d.state_dict())
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in d.state_dict().items())
    assert torch.equal(run(d), run(back))


def test_exported_config_and_weights(setup, tmp_path):
    cfg, target, d = setup
    d.save_pretrained(tmp_path / "dr")
    c = json.loads((tmp_path / "dr" / "config.json").read_text())
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
    assert c["block_size"] == cfg.drafter.block_size == 8
    assert c["num_target_layers"] == target.num_layers
    assert c["dflash_config"] == {"mask_token_id": target.vocab_size - 1, "target_layer_ids": target.layer_ids,
                                  "block_size": 8}
    assert c["num_hidden_layers"] == cfg.drafter.num_layers and c["hidden_size"] == target.hidden_size
    assert c["tie_word_embeddings"] is False and len(c["layer_types"]) == cfg.drafter.num_layers
    with safe_open(str(tmp_path / "dr" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == ZLAB_NAMES     # no embed_tokens, no lm_head


def test_init_from_a_saved_drafter(setup, tmp_path):
    cfg, target, d = setup
    d.save_pretrained(tmp_path / "dr")
    base = [f"data.cache_dir={cfg.data.cache_dir}", "target.tiny.pretrain_steps=20",
            f"drafter.init_from={tmp_path / 'dr'}"]
    again = build_drafter(load_config(ROOT / "configs" / "default.yaml", base), target)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in d.state_dict().items())
    with pytest.raises(ValueError, match="drafter.init_from"):
        build_drafter(load_config(ROOT / "configs" / "default.yaml", base + ["drafter.block_size=16"]), target)


def test_load_rejects_a_foreign_directory(setup, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a drafter directory"):
        DFlashDrafter.from_pretrained(tmp_path)
    _, _, d = setup
    d.save_pretrained(tmp_path / "dr")
    state = load_file(str(tmp_path / "dr" / "model.safetensors"))
    del state["fc.weight"]
    save_file(state, str(tmp_path / "dr" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing \\['fc.weight'\\]"):
        DFlashDrafter.from_pretrained(tmp_path / "dr")


def test_mask_token_must_be_in_vocab(setup):
    _, target, _ = setup
    bad = load_config(ROOT / "configs" / "default.yaml", ["drafter.mask_token_id=999"])
    with pytest.raises(ValueError, match="drafter.mask_token_id"):
        build_drafter(bad, target)
