"""The target families users bring (issue 56's zoo, first part): for each, a tiny random
target from transformers' own config class with the family's features on (MoE routing,
attention sinks, alternating sliding and full layers, linear attention, MLA, partial
rotary, soft-capping), and the hidden-state self-check on its features, with sequences
longer than any sliding window. Not yet here: the kill-and-resume runs, ``evaluate`` and
the plan at full size per family."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_actors.config import load_config
from dflash_actors.models.self_check import self_check
from dflash_actors.models.target import TargetModel, load_target
from dflash_actors.models.target_dir import attention_for
from tests.support.pipeline import ROOT

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
WINDOW = 8
"""Every sliding window here is 8 positions; the self-check's sequences are 12 and 24."""
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
              full_attention_interval=2)
FAMILIES = {
    "llama": {},
    "qwen3": {},
    "qwen3_moe": dict(num_experts=4, decoder_sparse_step=1, **MOE),
    "qwen3_next": dict(num_experts=4, shared_expert_intermediate_size=32, partial_rotary_factor=0.25, **MOE, **LINEAR),
    "qwen3_5_text": dict(LINEAR),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
    # MLA: no grouped KV heads, its own head sizes.
    "deepseek_v3": dict(num_key_value_heads=4, head_dim=None, n_routed_experts=4, n_shared_experts=1,
                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1, **MOE),
    "gemma3_text": dict(sliding_window=WINDOW, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "glm4_moe": dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                     partial_rotary_factor=0.5, **MOE),
    "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2, rotary_dim=8),
}


def family_config(family: str):
    kw = {k: v for k, v in {**BASE, **FAMILIES[family]}.items() if v is not None}
    return AutoConfig.for_model(family, **kw)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_self_check_passes_on_every_family(family):
    config = family_config(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention_for(config)).float()
    self_check(TargetModel(model, [0, 2]), length=24)


def test_a_family_without_sdpa_loads_with_eager_attention(tmp_path):
    # gpt-oss's sinks have no SDPA path: transformers refuses "sdpa" for it outright,
    # which load_target used to pass for every target.
    config = family_config("gpt_oss")
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert attention_for(config) == "eager" and attention_for(family_config("qwen3")) == "sdpa"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, attn_implementation="eager").save_pretrained(tmp_path / "t")
    cfg = load_config(ROOT / "configs/default.yaml", [f"target.path={tmp_path / 't'}",
                                                      "drafter.target_layer_ids=[0, 2]"])
    target = load_target(cfg, "cpu")
    assert target.model.config._attn_implementation == "eager"
    self_check(target, length=24)
