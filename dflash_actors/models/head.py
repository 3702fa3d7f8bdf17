"""The slice of the target a drafter process needs: embed_tokens, lm_head, config.

A drafter actor must not load the whole target (27B of weights to use two matrices),
so this reads only those tensors from the target's safetensors files. It quacks like
``TargetModel`` where the drafter and the loss look (``config``, ``vocab_size``,
``layer_ids``, ``device``, ``embed_tokens``, ``lm_head``). Targets without a
``config.json`` and safetensors (GGUF files) fall back to loading the whole model once
and keeping the two modules.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..console import first_line
from .target import check_served_taps, configured_layer_ids, ensure_target, load_target, resolve_dtype
from .target_dir import is_hf_dir

EMBED_KEYS = ("model.embed_tokens.weight", "embed_tokens.weight", "transformer.wte.weight")
HEAD_KEYS = ("lm_head.weight",)


def _find_tensors(path: Path, keys: tuple[str, ...]) -> dict[str, Path]:
    """Which safetensors file holds each of ``keys`` (single file or sharded index)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: path / weight_map[k] for k in keys if k in weight_map}
    single = path / "model.safetensors"
    if not single.is_file():
        return {}
    with safe_open(str(single), "pt") as f:
        present = set(f.keys())
    return {k: single for k in keys if k in present}


def _read(file: Path, key: str) -> torch.Tensor:
    with safe_open(str(file), "pt") as f:
        return f.get_tensor(key)


class TargetInfo:
    """What building a drafter needs to know of the target: no weights at all."""

    def __init__(self, config, vocab_size: int, layer_ids: list[int], device: torch.device):
        self.config = config
        self.hidden_size = int(config.hidden_size)
        self.num_layers = int(config.num_hidden_layers)
        self.vocab_size = int(vocab_size)
        self.layer_ids = list(layer_ids)
        self.device = device


class TargetHead(TargetInfo):
    def __init__(self, config, embed: torch.Tensor, head: torch.Tensor, layer_ids: list[int],
                 device: torch.device):
        super().__init__(config, embed.shape[0], layer_ids, device)
        self.embed_tokens = nn.Embedding.from_pretrained(embed.to(device), freeze=True)
        self.lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False, device=device, dtype=head.dtype)
        self.lm_head.weight = nn.Parameter(head.to(device), requires_grad=False)


def layer_ids_for(cfg, target_config) -> list[int]:
    n = int(target_config.num_hidden_layers)
    ids = configured_layer_ids(cfg, n)
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        raise ValueError(f"drafter.target_layer_ids: layer {bad[0]} does not exist in a {n}-layer target")
    check_served_taps(ids, n, "drafter.target_layer_ids")
    return ids


def target_config(path: Path):
    """The target's HF config; a directory that is not a causal LM is a one-line error."""
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"target.path: no loadable model config in {path} ({first_line(e)})") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"target.path: {path} holds a {config.model_type!r} model, not a causal LM")
    return config


def target_info(cfg, device: str | torch.device = "cpu") -> TargetInfo:
    """The target's shape from its config.json alone (the supervisor and the optimizer
    build drafters but never run the target). GGUF targets have no config.json: their
    shape comes from loading the head."""
    path = ensure_target(cfg)
    if is_hf_dir(path):
        config = target_config(path)
        return TargetInfo(config, config.vocab_size, layer_ids_for(cfg, config), torch.device(device))
    return load_head(cfg, device)


def load_head(cfg, device: str | torch.device = "cpu") -> TargetHead:
    """embed_tokens and lm_head of ``cfg``'s target on ``device``, in the target's dtype."""
    device = torch.device(device)
    path = ensure_target(cfg)
    dtype = resolve_dtype(cfg.target.dtype, device)
    if is_hf_dir(path):
        config = target_config(path)
        found = _find_tensors(path, EMBED_KEYS + HEAD_KEYS)
        embed_key = next((k for k in EMBED_KEYS if k in found), None)
        head_key = next((k for k in HEAD_KEYS if k in found), None)
        if embed_key and (head_key or getattr(config, "tie_word_embeddings", False)):
            embed = _read(found[embed_key], embed_key).to(dtype)
            head = _read(found[head_key], head_key).to(dtype) if head_key else embed
            return TargetHead(config, embed, head, layer_ids_for(cfg, config), device)
    target = load_target(cfg, device)
    return TargetHead(target.config, target.embed_tokens.weight.detach(), target.lm_head.weight.detach(),
                      target.layer_ids, device)
