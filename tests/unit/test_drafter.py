import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash_actors.config import load_config
from dflash_actors.models.drafter import DFlashDrafter, sdpa_dense
from dflash_actors.models.drafter_start import build_drafter, choose_mask_token, drafter_shell
from dflash_actors.train.params import ParamLayout, WeightStore
from tests.support.pipeline import HEADS_16

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
    cfg, target, _ = setup
    cfg = cfg.updated({"drafter.init": "random"})
    d, again = build_drafter(cfg, target), build_drafter(cfg, target)
    assert all(torch.equal(a, b) for a, b in zip(d.state_dict().values(), again.state_dict().values()))
    other = build_drafter(cfg.updated({"train.seed": 1}), target)
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
                                  "block_size": 8,
                                  "mask_token_reason": "last embedding row (the target has no tokenizer)"}
    assert c["num_hidden_layers"] == cfg.drafter.num_layers and c["hidden_size"] == target.hidden_size
    assert c["tie_word_embeddings"] is False and len(c["layer_types"]) == cfg.drafter.num_layers
    with safe_open(str(tmp_path / "dr" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == ZLAB_NAMES     # no embed_tokens, no lm_head


def test_init_from_a_saved_drafter(setup, tmp_path):
    cfg, target, d = setup
    d.save_pretrained(tmp_path / "dr")
    base = [f"data.cache_dir={cfg.data.cache_dir}", "target.tiny.pretrain_steps=20", *HEADS_16,
            f"drafter.init_from={tmp_path / 'dr'}"]
    again = build_drafter(load_config(ROOT / "configs" / "default.yaml", base), target)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in d.state_dict().items())
    with pytest.raises(ValueError, match="drafter.init_from"):
        build_drafter(load_config(ROOT / "configs" / "default.yaml", base + ["drafter.block_size=16"]), target)


def test_a_shell_loaded_from_the_store_is_the_drafter_without_drawing_weights(setup, monkeypatch):
    """What the drafter and optimizer actors build: no seeded draw (not even torch's
    default init, which would move the global generator), then the store's weights
    make it the supervisor's drafter in every parameter, buffer and output bit."""
    cfg, target, d = setup

    def draw(*args, **kwargs):
        raise AssertionError("a shell draws no weights")
    monkeypatch.setattr(torch, "randn", draw)
    monkeypatch.setattr(DFlashDrafter, "init_weights", draw)
    rng = torch.get_rng_state()
    shell = drafter_shell(cfg, target)
    assert torch.equal(torch.get_rng_state(), rng)
    monkeypatch.undo()
    layout = ParamLayout.of(d)
    store = WeightStore.allocate(layout)
    store.publish(1, list(d.parameters()), None, None)
    assert ParamLayout.of(shell) == layout
    store.load_params(list(shell.parameters()), 1)
    for got, want in ((shell.named_parameters(), d.named_parameters()), (shell.named_buffers(), d.named_buffers())):
        got, want = dict(got), dict(want)
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert (got[k].dtype, got[k].device, got[k].requires_grad) == (v.dtype, v.device, v.requires_grad), k
            assert torch.equal(got[k], v), k
    assert {k for k, _ in d.named_buffers()} >= {"rotary_emb.inv_freq"}
    with torch.no_grad():
        assert torch.equal(run(shell), run(d))


def test_a_shell_checks_init_from_and_takes_its_shape(setup, tmp_path):
    cfg, target, _ = setup
    deeper = build_drafter(cfg.updated({"drafter.num_layers": 2}), target)
    deeper.save_pretrained(tmp_path / "dr")
    run_cfg = cfg.updated({"drafter.init_from": str(tmp_path / "dr")})
    shell = drafter_shell(run_cfg, target)
    assert len(shell.layers) == 2 and ParamLayout.of(shell) == ParamLayout.of(build_drafter(run_cfg, target))
    with pytest.raises(ValueError, match=r"drafter.init_from: .* has \(layer ids, block, mask id, hidden\)"):
        drafter_shell(run_cfg.updated({"drafter.block_size": 16}), target)
    with pytest.raises(ValueError, match="drafter.init_from: .* does not exist"):
        drafter_shell(cfg.updated({"drafter.init_from": str(tmp_path / "nope")}), target)


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


def test_exported_directory_loads_with_automodel(setup, tmp_path):
    from transformers import AutoModel

    _, _, d = setup
    d.save_pretrained(tmp_path / "dr")
    hf, info = AutoModel.from_pretrained(tmp_path / "dr", trust_remote_code=True, output_loading_info=True)
    assert type(hf).__name__ == "DFlashDraftModel"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert all(torch.equal(v, hf.state_dict()[k]) for k, v in d.state_dict().items())
    g = torch.Generator().manual_seed(3)
    B, C, H = d.block_size, 11, d.config.hidden_size
    noise, feats = torch.randn(2, B, H, generator=g), torch.randn(2, C, d.fc.in_features, generator=g)
    pos = torch.stack([torch.arange(C + B), torch.arange(C + B) + 5])
    # Each query sees a different prefix of the context, and the whole block.
    mask = torch.ones(2, 1, B, C + B, dtype=torch.bool)
    mask[..., :C] = torch.arange(C) < torch.arange(3, 3 + B)[:, None]
    with torch.no_grad():
        for m in (None, mask):
            want = d(noise, d.context(feats), pos, sdpa_dense(m))
            torch.testing.assert_close(hf(noise, feats, pos, attention_mask=m), want, atol=1e-5, rtol=0)


SLIDING = dict(layer_types=["sliding_attention"], use_sliding_window=True, sliding_window=64)


@pytest.mark.parametrize("change, says", [
    (dict(layer_types=["linear_attention"]), "sets layer_types ['linear_attention']"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types names 2 layers"),
    ({**SLIDING, "use_sliding_window": False}, "sliding_attention without use_sliding_window"),
    ({**SLIDING, "is_causal": None}, "no is_causal"),
    ({**SLIDING, "sliding_window": 4}, "sliding_window 4 is smaller than its block of 8"),
    (dict(attention_bias=True), "sets attention_bias"),
    (dict(is_causal=True), "sets is_causal")])
def test_init_from_rejects_attention_we_do_not_implement(setup, tmp_path, change, says):
    cfg, target, d = setup
    d.save_pretrained(tmp_path / "dr")
    path = tmp_path / "dr" / "config.json"
    c = json.loads(path.read_text())
    # What transformers 4.x wrote for Qwen3 without a window: must still load.
    c.update(sliding_window=4096, use_sliding_window=False, layer_types=["full_attention"] * d.config.num_hidden_layers)
    path.write_text(json.dumps(c))
    base = [f"data.cache_dir={cfg.data.cache_dir}", "target.tiny.pretrain_steps=20", *HEADS_16,
            f"drafter.init_from={tmp_path / 'dr'}"]
    build_drafter(load_config(ROOT / "configs" / "default.yaml", base), target)
    path.write_text(json.dumps({**c, **SLIDING}))       # a non-causal sliding drafter loads, its window kept
    assert [layer.window for layer in build_drafter(load_config(ROOT / "configs" / "default.yaml", base),
                                                    target).layers] == [64]
    c.update(change)
    path.write_text(json.dumps({k: v for k, v in c.items() if v is not None}))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'dr'}: config.json") + ".*" + re.escape(says)):
        build_drafter(load_config(ROOT / "configs" / "default.yaml", base), target)


def fake_tokenizer(specials: list[str]):
    """Three words, then ``specials`` as added special tokens (the first is eos) and a
    ChatML template that uses ``<|im_start|>`` and ``<|im_end|>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=t, unk_token="[UNK]", eos_token=specials[0], additional_special_tokens=specials[1:],
        chat_template="{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")


SMOL = ["<|endoftext|>", "<|im_start|>", "<repo_name>", "<empty_output>", "<|im_end|>"]


def test_mask_token_is_a_padding_row_when_the_embedding_has_one():
    tok = fake_tokenizer(SMOL)
    assert choose_mask_token(tok, len(tok) + 5)[0] == len(tok) == 8


@pytest.mark.parametrize("extra, want", [([], "<empty_output>"), (["<|reserved_0|>"], "<|reserved_0|>"),
                                         (["<mask>", "<|reserved_0|>"], "<mask>")])
def test_mask_token_is_a_special_token_outside_the_chat_template(extra, want):
    tok = fake_tokenizer(SMOL[:2] + extra + SMOL[2:])
    i, reason = choose_mask_token(tok, len(tok))
    assert tok.convert_ids_to_tokens(i) == want and want in reason
    assert i not in (tok.eos_token_id, tok.unk_token_id) and want not in tok.chat_template


def test_mask_token_falls_back_to_the_last_row():
    tok = fake_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    i, reason = choose_mask_token(tok, len(tok))
    assert i == len(tok) - 1 and "may be a real token" in reason


def test_build_drafter_takes_the_mask_token_from_the_target_tokenizer(setup, tmp_path):
    cfg, target, _ = setup
    target.config.save_pretrained(tmp_path / "target")
    fake_tokenizer(SMOL).save_pretrained(tmp_path / "target")
    run_cfg = load_config(ROOT / "configs" / "default.yaml",
                          [f"data.cache_dir={cfg.data.cache_dir}", f"target.path={tmp_path / 'target'}"])
    d = build_drafter(run_cfg, target)    # the tiny target's 256 rows leave rows 8.. unused
    assert d.mask_token_id == 8
    d.save_pretrained(tmp_path / "dr")
    reason = json.loads((tmp_path / "dr" / "config.json").read_text())["dflash_config"]["mask_token_reason"]
    assert reason.startswith("first embedding row past")


def test_init_from_target_copies_the_layers_after_the_deepest_feature_layer(setup):
    """drafter.init=target: layers from the target right after the deepest feature layer,
    fc passing that layer through, hidden_norm and norm from the target; the same bits
    whether built next to a loaded target or from its files alone (supervisor, optimizer)."""
    from dflash_actors.models.drafter_start import target_init_plan
    from dflash_actors.models.head import target_info

    cfg, target, _ = setup
    cfg = cfg.updated({"drafter.init": "target"})
    d = build_drafter(cfg, target)
    plan = target_init_plan(target.layer_ids, target.num_layers, len(d.layers))
    assert plan["layers"] == [max(target.layer_ids) + 1]
    tl = target.model.model.layers[plan["layers"][0]]
    for name, p in d.layers[0].named_parameters():
        assert torch.equal(p, dict(tl.named_parameters())[name]), name
    h, k = d.config.hidden_size, target.layer_ids.index(max(target.layer_ids))
    assert torch.equal(d.fc.weight[:, k * h:(k + 1) * h], torch.eye(h)) and int((d.fc.weight != 0).sum()) == h
    assert torch.equal(d.hidden_norm.weight, tl.input_layernorm.weight)
    assert torch.equal(d.norm.weight, target.model.model.norm.weight)
    elsewhere = build_drafter(cfg, target_info(cfg))
    assert all(torch.equal(a, b) for a, b in zip(d.state_dict().values(), elsewhere.state_dict().values()))
    only_norm = build_drafter(cfg.updated({"drafter.init_parts": ["norm"]}), target)
    random = build_drafter(cfg.updated({"drafter.init": "random"}), target)
    assert torch.equal(only_norm.norm.weight, d.norm.weight)
    assert torch.equal(only_norm.fc.weight, random.fc.weight) and not torch.equal(random.fc.weight, d.fc.weight)


def test_init_plan_moves_down_to_layers_that_exist():
    from dflash_actors.models.drafter_start import target_init_plan

    assert target_init_plan([1, 27], 30, 2)["layers"] == [28, 29]
    assert target_init_plan([1, 28], 30, 2)["layers"] == [28, 29]
    assert target_init_plan([29], 30, 1) == {"layers": [29], "deepest": 29, "hidden_norm_from": 29}
    assert target_init_plan([0], 2, 5)["layers"] == [0, 1]
