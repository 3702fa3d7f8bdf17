"""``DFlashDraftModel`` for ``AutoModel.from_pretrained(dir, trust_remote_code=True)``.

Saved as ``dflash.py`` next to every exported drafter, so it imports only torch and
transformers: the directory must load on a machine without this project. It computes
the same function as ``dflash_actors.models.drafter.DFlashDrafter`` with the same
parameter names, so ``model.safetensors`` loads as is.

Inputs (``forward``):
  * ``noise_embedding`` ``[N, Q, H]``: the target's embeddings of ``[tok[a], MASK x (Q-1)]``.
  * ``target_hidden`` ``[N, C, k*H]``: the raw target layers ``dflash_config.target_layer_ids``
    concatenated; ``fc`` and ``hidden_norm`` are applied here (``context``).
  * ``position_ids`` ``[N, C+Q]``: positions of the context, then of the block.
  * ``attention_mask``: optional boolean ``[N or 1, 1, Q, C+Q]``, True = visible; None lets
    every query see all the context and the whole block.
A ``sliding_attention`` layer (``layer_types``, ``sliding_window`` W) also keeps a query at
position p from every key at a position q with ``|p - q| >= W``, as a non-causal drafter's
window is read by z-lab's reference and vLLM.
Output: normed hidden states ``[N, Q, H]``, for the target's ``lm_head``.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half


def _rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Queries from the block; keys and values from ``[context ; block]``."""

    def __init__(self, cfg):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, mask):
        n, q_len, _ = x.shape
        d = self.head_dim
        kv_in = torch.cat([ctx, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(n, q_len, self.heads, d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(n, -1, self.kv_heads, d)).transpose(1, 2)
        v = self.v_proj(kv_in).view(n, -1, self.kv_heads, d).transpose(1, 2)
        q = _rope(q, cos[:, :, -q_len:], sin[:, :, -q_len:])
        k = _rope(k, cos, sin)
        # Expanding K/V by hand instead of sdpa's enable_gqa keeps older torch working.
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(n, q_len, -1))


class DFlashLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def _window_mask(position_ids, q_len, window, mask):
    """``mask`` and the band of keys within ``window`` of each query's position."""
    d = position_ids[:, -q_len:, None] - position_ids[:, None, :]
    band = ((d < window) & (-d < window))[:, None]
    return band if mask is None else band & mask


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashLayer"]

    def __init__(self, config):
        super().__init__(config)
        dc = config.dflash_config
        self.block_size = int(config.block_size)
        self.mask_token_id = int(dc["mask_token_id"])
        self.target_layer_ids = list(dc["target_layer_ids"])
        h = config.hidden_size
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def context(self, features):
        """Concatenated target layers ``[..., k*H]`` -> drafter context ``[..., H]``."""
        return self.hidden_norm(self.fc(features))

    def forward(self, noise_embedding, target_hidden, position_ids, attention_mask=None):
        ctx = self.context(target_hidden)
        cos, sin = (t.unsqueeze(1) for t in self.rotary_emb(noise_embedding, position_ids))
        types = getattr(self.config, "layer_types", None) or ["full_attention"] * len(self.layers)
        window = getattr(self.config, "sliding_window", None)
        sliding = None
        if window and "sliding_attention" in types:
            sliding = _window_mask(position_ids, noise_embedding.shape[1], int(window), attention_mask)
        x = noise_embedding
        for layer, kind in zip(self.layers, types):
            x = layer(x, ctx, cos, sin, sliding if kind == "sliding_attention" and sliding is not None
                      else attention_mask)
        return self.norm(x)
