"""The target zoo (issue 56): for each family transformers ships that users bring, a tiny
random target built from transformers' own config class with the family's features on
(MoE routing, attention sinks, sliding windows, linear attention, MLA, partial rotary,
soft-capping), saved as a directory ``target.path`` loads, with the char-level chat
tokenizer of ``tests.support.chat`` so that ``evaluate`` runs on it too.

Shapes are the smallest that keep each feature real: 4 layers of width 64, 4 experts
(2 routed per token), windows of 8 positions (the self-check's sequences are 12 and 24,
the synthetic data's 10 to 40), linear attention on every other layer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_actors.models.target_dir import attention_for

from .chat import tiny_chat_target

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
"""Special ids are the chat tokenizer's (``tests.support.chat``): some families' defaults
lie past a vocabulary of 128."""
WINDOW = 8
"""Every sliding window here is 8 positions, shorter than any sequence the zoo runs."""
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
              full_attention_interval=2)
FAMILIES = {
    "llama": {},
    "qwen3": {},
    "qwen3_moe": dict(num_experts=4, decoder_sparse_step=1, **MOE),
    "qwen3_next": dict(num_experts=4, shared_expert_intermediate_size=32, partial_rotary_factor=0.25, **MOE, **LINEAR),
    "qwen3_5_text": dict(LINEAR),
    "qwen3_5_moe_text": dict(num_experts=4, shared_expert_intermediate_size=32, **MOE, **LINEAR),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
    # MLA: no grouped KV heads, its own head sizes.
    "deepseek_v3": dict(num_key_value_heads=4, head_dim=None, n_routed_experts=4, n_shared_experts=1,
                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1, **MOE),
    # Its default pattern (five sliding layers, then a full one) would leave 4 layers all sliding.
    "gemma3_text": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
                        final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "glm4_moe": dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                     partial_rotary_factor=0.5, **MOE),
    "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2, rotary_dim=8),
}
"""model_type -> what its tiny target switches on over ``BASE``."""

DATA_VOCAB = 96
"""``data.synthetic.vocab_size`` of a zoo run: its words (ids 2..94) stay below the row
the drafter takes as its mask token, the first one past the chat tokenizer's vocabulary
(``drafter_start.choose_mask_token``)."""


def family_config(family: str):
    """The tiny target's config of ``family`` (``FAMILIES``)."""
    kw = {k: v for k, v in {**BASE, **FAMILIES[family]}.items() if v is not None}
    return AutoConfig.for_model(family, **kw)


def build_model(family: str, seed: int = 0):
    """``family``'s tiny target, random from ``seed``, with the attention the project loads it with."""
    config = family_config(family)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention_for(config)).float()


def save_target(family: str, root: Path) -> Path:
    """``family``'s tiny target saved under ``root`` with a chat tokenizer: a directory
    ``target.path`` and ``evaluate --target`` both take. Built once per ``root``."""
    out = root / family
    if (out / "tokenizer.json").is_file():
        return out
    build_model(family).save_pretrained(root / f"{family}-weights")
    return tiny_chat_target(root / f"{family}-weights", out)
