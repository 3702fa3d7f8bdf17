"""The DFlash drafter, in the layout z-lab's ``DFlashDraftModel``, vLLM and SGLang load.

Queries come from the noise block ``[tok[a], MASK x (B-1)]`` (embedded by the frozen
target); keys and values from ``[context ; noise]`` where the context is
``hidden_norm(fc(concat(target layers)))``, shared by every layer. Parameter names and
``config.json`` fields match z-lab's checkpoints; embeddings and the LM head belong to
the target and are never saved here.

Attention takes an explicit mask (``attend``), so the loss module decides who sees
what: a dense boolean ``[.., Q, KV]`` mask broadcast over heads for sdpa, or a flex
``BlockMask`` on CUDA.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from .dflash2 import DFLASH2_KEYS, BlockConv, CandidateSelector
from .dspark import DSPARK_ARCH, DSPARK_KEYS, build_heads, dspark_fields, is_dspark
from .target import ensure_target, load_target
from .target_dir import has_tokenizer, is_hf_dir

WEIGHTS = "model.safetensors"
# Saved as ``dflash.py`` beside the weights: config.json's ``auto_map`` names it.
HF_MODELING = Path(__file__).with_name("hf_dflash.py")


SHAPE_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
"""``drafter`` keys that size the drafter's layers apart from its target's (None = the target's)."""


def drafter_config(target_config, num_layers: int, block_size: int, layer_ids: list[int],
                   mask_token_id: int, mask_token_reason: str, vocab_size: int,
                   dflash2: dict | None = None, shape: dict | None = None,
                   dspark: dict | None = None) -> Qwen3Config:
    """A Qwen3 config sized like the target (hidden, heads, MLP, RoPE), with DFlash fields;
    a DFlash2's with ``dflash2`` (its four ``DFLASH2_KEYS``, ``dflash2_fields``), a DSpark's
    with ``dspark`` (``DSPARK_KEYS``, ``dspark_fields``). ``shape``
    (``shape_fields``) overrides the sizes of ``SHAPE_KEYS`` and gives ``layer_types`` and
    ``sliding_window``."""
    t, shape = target_config, dict(shape or {})
    heads = int(shape.get("num_attention_heads") or t.num_attention_heads)
    head_dim = shape.get("head_dim") or getattr(t, "head_dim", None) or t.hidden_size // int(t.num_attention_heads)
    kv_heads = shape.get("num_key_value_heads") or int(getattr(t, "num_key_value_heads", None) or heads)
    if heads % kv_heads:
        raise ValueError(f"drafter.num_key_value_heads: {kv_heads} KV heads do not group the drafter's {heads} "
                         "heads; set drafter.num_key_value_heads")
    cfg = Qwen3Config(
        vocab_size=vocab_size, hidden_size=t.hidden_size,
        intermediate_size=int(shape.get("intermediate_size") or target_mlp_width(t)),
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=int(kv_heads),
        head_dim=int(head_dim), rms_norm_eps=float(getattr(t, "rms_norm_eps", 1e-6)), rope_parameters=drafter_rope(t),
        max_position_embeddings=int(t.max_position_embeddings), tie_word_embeddings=False,
        attention_bias=False, use_sliding_window=False)
    layer_types, window = shape.get("layer_types"), shape.get("sliding_window")
    if layer_types is not None and "sliding_attention" in layer_types:
        # As the published drafters write it: the types per layer, the window, and the
        # flag without which Qwen3Config (and z-lab's loader through it) drops the window.
        cfg.layer_types, cfg.sliding_window, cfg.use_sliding_window = list(layer_types), int(window), True
        cfg.max_window_layers = num_layers
    cfg.architectures = ["DFlashDraftModel"]
    # Stated for every arch: z-lab's reference makes a layer causal when it is absent,
    # and vLLM falls back to layer_types, which an engine may read otherwise.
    cfg.is_causal = False
    cfg.auto_map = {"AutoModel": "dflash.DFlashDraftModel"}
    cfg.block_size = block_size
    cfg.num_target_layers = int(t.num_hidden_layers)
    cfg.dflash_config = {"mask_token_id": mask_token_id, "mask_token_reason": mask_token_reason,
                         "target_layer_ids": list(layer_ids), "block_size": block_size}
    if dflash2 is not None:
        # As published: no auto_map (the engines and z-lab's package bring the code).
        cfg.architectures = ["DFlash2DraftModel"]
        del cfg.auto_map
        cfg.dflash_config.update({k: int(dflash2[k]) for k in DFLASH2_KEYS})
    if dspark is not None:
        # DeepSpec's flat layout, which vLLM's Qwen3DSparkModel reads: the heads' keys and
        # the mask and taps at the top level (``dflash_config`` stays, for vLLM's DFlash
        # backbone and this project's reader). No auto_map: the engines bring the code.
        cfg.architectures = [DSPARK_ARCH]
        del cfg.auto_map
        for k in DSPARK_KEYS:
            setattr(cfg, k, dspark[k])
        cfg.mask_token_id, cfg.target_layer_ids = mask_token_id, list(layer_ids)
    return cfg


ROPE_NOT_COMPUTED = ("partial_rotary_factor", "rope_dim", "mrope_section", "mrope_interleaved", "type")
"""Target RoPE keys the drafter does not compute: its attention rotates every dimension of
every head at the block's 1-D positions (``Qwen3RotaryEmbedding`` over ``head_dim``). An
engine reads each of them from a drafter's ``rope_parameters`` (vLLM's ``get_rope`` rotates
``head_dim * partial_rotary_factor`` dims, or ``rope_dim``, and builds an M-RoPE from
``mrope_section``), so a copied Qwen3.5/3.6 dict would be served with a quarter of each
head rotated. (``type`` is the old spelling of ``rope_type``.)"""


def drafter_rope(target_config) -> dict:
    """The drafter's ``rope_parameters``: what it computes and nothing else. ``rope_theta``
    and ``rope_type``, and a scaling type's own keys (yarn's, llama3's...), which the
    drafter applies as the target does; never ``ROPE_NOT_COMPUTED``."""
    t = target_config
    rope = dict(getattr(t, "rope_parameters", None) or {})
    if set(rope) and all(isinstance(v, dict) for v in rope.values()):
        # Per layer type (Gemma-style {"full_attention": {...}, ...}): the drafter's layers are full.
        rope = dict(rope.get("full_attention") or next(iter(rope.values())))
    kind = rope.get("rope_type") or rope.get("type") or "default"
    theta = rope.get("rope_theta", getattr(t, "rope_theta", None))
    out = {"rope_type": kind, "rope_theta": float(theta if theta is not None else 1e4)}
    if kind != "default":
        out |= {k: v for k, v in rope.items() if k not in (*ROPE_NOT_COMPUTED, "rope_type", "rope_theta")}
    return out


def target_mlp_width(t) -> int:
    """The target's dense MLP width: a MoE target's ``intermediate_size`` is its dense
    layers' (gpt-oss has only experts: theirs)."""
    width = getattr(t, "intermediate_size", None) or getattr(t, "moe_intermediate_size", None)
    if width is None:
        raise ValueError(f"drafter.intermediate_size: the target ({t.model_type}) states no MLP width; set it")
    return int(width)


def shape_fields(drafter_cfg) -> dict:
    """The ``shape`` of ``drafter_config`` that ``drafter_cfg`` (the ``drafter`` section)
    states: its ``SHAPE_KEYS`` and, with a window, ``layer_types`` and ``sliding_window``."""
    out = {k: getattr(drafter_cfg, k) for k in SHAPE_KEYS if getattr(drafter_cfg, k) is not None}
    if drafter_cfg.windows is not None:
        out |= {"layer_types": list(drafter_cfg.windows), "sliding_window": drafter_cfg.sliding_window}
    return out


def layer_windows(config) -> list[int | None]:
    """Each layer's window (None: full attention) as ``config.json`` states it."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    return [int(window) if kind == "sliding_attention" else None for kind in types]


def dflash2_fields(drafter_cfg) -> dict | None:
    """The ``dflash_config`` additions of ``drafter.arch: dflash2`` (None for dflash)."""
    if drafter_cfg.arch != "dflash2":
        return None
    return {k: getattr(drafter_cfg, k) for k in DFLASH2_KEYS}


def arch_of(config) -> tuple[str, dict | None]:
    """``(drafter.arch, the sizes that arch adds)`` of a drafter config."""
    if is_dflash2(config):
        return "dflash2", {k: int(config.dflash_config[k]) for k in DFLASH2_KEYS}
    if is_dspark(config):
        return "dspark", {k: getattr(config, k, None) for k in DSPARK_KEYS}
    return "dflash", None


def is_dflash2(config) -> bool:
    return all(k in (getattr(config, "dflash_config", None) or {}) for k in DFLASH2_KEYS)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def forward(self, x, ctx, rope, attend):
        """x ``[N, Q, H]`` noise, ctx ``[N, C, H]`` context; rope covers the C+Q key positions."""
        q_len = x.shape[1]
        cos, sin = rope[0].unsqueeze(1), rope[1].unsqueeze(1)
        k, v = self.keys_values(torch.cat([ctx, x], dim=1), cos, sin)
        return self._attend_out(x, k, v, cos[:, :, -q_len:], sin[:, :, -q_len:], attend)

    def keys_values(self, inp, cos, sin):
        """Rotated keys and values ``[N, kv_heads, L, d]`` of ``inp`` ``[N, L, H]``."""
        n, d = inp.shape[0], self.head_dim
        k = self.k_norm(self.k_proj(inp).view(n, -1, self.kv_heads, d)).transpose(1, 2)
        v = self.v_proj(inp).view(n, -1, self.kv_heads, d).transpose(1, 2)
        return _rope(k, cos, sin), v

    def forward_cached(self, x, ctx_kv, rope, mask=None):
        """The block ``x`` against context keys/values computed earlier (``keys_values``):
        decoding's path, where every block query sees the whole context and block, or,
        with ``mask`` (a sliding layer's), what it allows."""
        cos, sin = rope[0].unsqueeze(1), rope[1].unsqueeze(1)
        k, v = self.keys_values(x, cos, sin)
        k, v = torch.cat([ctx_kv[0], k], dim=2), torch.cat([ctx_kv[1], v], dim=2)
        return self._attend_out(x, k, v, cos, sin, sdpa_dense(mask))

    def _attend_out(self, x, k, v, cos, sin, attend):
        n, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(n, q_len, self.heads, self.head_dim)).transpose(1, 2)
        out = attend(_rope(q, cos, sin), k, v)
        return self.o_proj(out.transpose(1, 2).reshape(n, q_len, -1))


class DFlashLayer(nn.Module):
    """A Qwen3 layer over the block; a DFlash2's also convolves the block stream in and
    out of each sublayer (``BlockConv``; the context rows are never convolved).
    ``window``: a ``sliding_attention`` layer's window (None: full attention), which the
    ``attend`` it is given applies (``blocks.make_attends``)."""

    def __init__(self, cfg: Qwen3Config, window: int | None = None):
        super().__init__()
        self.window = window
        self.self_attn = DFlashAttention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.attention_conv = self.mlp_conv = None
        if is_dflash2(cfg):
            dc, h = cfg.dflash_config, cfg.hidden_size
            taps, group, block = int(dc["conv_kernel_size"]), int(dc["conv_group_size"]), int(cfg.block_size)
            self.attention_conv = BlockConv(h, taps, group, block)
            self.mlp_conv = BlockConv(h, taps, group, block)

    def forward(self, x, ctx, rope, attend):
        return self._layer(x, lambda h: self.self_attn(h, ctx, rope, attend))

    def forward_cached(self, x, ctx_kv, rope, mask=None):
        return self._layer(x, lambda h: self.self_attn.forward_cached(h, ctx_kv, rope, mask))

    def _layer(self, x, attention):
        x = x + _wrapped(attention, self.input_layernorm(x), self.attention_conv)
        return x + _wrapped(self.mlp, self.post_attention_layernorm(x), self.mlp_conv)


def _wrapped(sublayer, h, conv: BlockConv | None):
    if conv is None:
        return sublayer(h)
    h, delta = conv.before(h)
    return conv.after(sublayer(h), delta)


def window_band(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """``[N, Q, K]``: key positions within ``window`` of each query position, both ways
    (a non-causal sliding layer, as z-lab's reference and vLLM read one)."""
    d = query_pos[:, :, None] - key_pos[:, None, :]
    return (d < window) & (-d < window)


def sdpa_dense(mask: torch.Tensor):
    """An ``attend`` for sdpa with a boolean mask ``[N or 1, 1, Q, KV]`` (True = visible)."""
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return attend


class DFlashDrafter(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        dc = config.dflash_config
        self.block_size = int(config.block_size)
        self.mask_token_id = int(dc["mask_token_id"])
        self.target_layer_ids = list(dc["target_layer_ids"])
        h = config.hidden_size
        self.layers = nn.ModuleList(DFlashLayer(config, w) for w in layer_windows(config))
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.candidate_selector = None
        if is_dflash2(config):
            self.candidate_selector = CandidateSelector(config.vocab_size, h, int(dc["selector_rank"]),
                                                        int(dc["selector_top_k"]))
        # A DSpark's heads (``models.dspark``): registered last, so that the backbone's
        # initial draw is a DFlash's of the same seed.
        self.markov_head = self.confidence_head = None
        if is_dspark(config):
            self.markov_head, self.confidence_head = build_heads(config)
        # Slot k's label is tok[a + k + label_shift]: 0 for DFlash (slot 0 proposes
        # nothing), 1 for DSpark (every slot proposes).
        self.label_shift = 1 if self.markov_head is not None else 0

    @property
    def proposals(self) -> int:
        """Tokens a block drafts: ``block_size - 1``, a DSpark's ``block_size``."""
        return self.block_size - 1 + self.label_shift

    def init_weights(self, seed: int, selector_init: str = "zeros") -> "DFlashDrafter":
        """Normal(0, initializer_range) linears and unit norms, from ``seed`` alone. A
        DFlash2's convolutions and selector keep their own start (the identity, and
        DFlash's argmax), drawn after the rest: a DFlash2 starts computing what the
        DFlash of the same seed computes."""
        g = torch.Generator().manual_seed(seed)
        std = float(self.config.initializer_range)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif not name.startswith("candidate_selector.") and "_conv." not in name:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        for layer in self.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                if conv is not None:
                    conv.reset_parameters()
        if self.candidate_selector is not None:
            self.candidate_selector.reset_parameters(g, successors=selector_init)
            with torch.no_grad():
                w = self.candidate_selector.hidden_projection.weight
                w.copy_(torch.randn(w.shape, generator=g) * std)
        if self.confidence_head is not None:
            with torch.no_grad():
                self.confidence_head.proj.bias.zero_()     # as HF's init of a Linear's bias
        return self

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated target layers ``[..., k*H]`` -> drafter context ``[..., H]``. Columns
        past ``k*H`` (a distilling target's last layer, ``train.loss: distill``) are not
        context and are left out."""
        return self.hidden_norm(self.fc(features[..., :self.fc.in_features]))

    @property
    def windows(self) -> set[int | None]:
        """The distinct windows of its layers (None: full attention)."""
        return {layer.window for layer in self.layers}

    def forward(self, noise: torch.Tensor, ctx: torch.Tensor, position_ids: torch.Tensor, attend,
                checkpoint_layers: bool = False) -> torch.Tensor:
        """noise ``[N, Q, H]`` embeddings, ctx ``[N, C, H]`` (from ``context``), position_ids
        ``[N, C+Q]``; returns normed hidden states ``[N, Q, H]`` for the target's lm_head.
        ``attend``: one attention for every layer, or a dict from each layer's window to
        its own (``blocks.make_attends``). ``checkpoint_layers``: keep only each layer's
        input for the backward, which runs the layer again (``train.checkpoint_layers``)."""
        rope = self.rotary_emb(noise, position_ids)
        x = noise
        for layer in self.layers:
            a = attend[layer.window] if isinstance(attend, dict) else attend
            if checkpoint_layers and torch.is_grad_enabled():
                x = checkpoint(layer, x, ctx, rope, a, use_reentrant=False)
            else:
                x = layer(x, ctx, rope, a)
        return self.norm(x)

    # -- decoding with a context cache -------------------------------------------
    # The context enters every layer only through that layer's k/v projections of the
    # same ``ctx`` rows, so each verified position's keys and values are computed once
    # and kept; a draft step then costs one block, not the whole prefix.

    def context_kv(self, ctx: torch.Tensor, position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, keys and values of context rows ``ctx`` ``[N, C, H]`` at ``position_ids`` ``[N, C]``."""
        cos, sin = self.rotary_emb(ctx, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def forward_cached(self, noise: torch.Tensor, ctx_kv: list, position_ids: torch.Tensor) -> torch.Tensor:
        """``forward`` for one block per row that sees all of its context (a sliding
        layer: what its window keeps): noise ``[N, Q, H]`` at ``position_ids`` ``[N, Q]``,
        context from ``context_kv``, whose rows are positions ``0 .. C-1``."""
        rope = self.rotary_emb(noise, position_ids)
        C = ctx_kv[0][0].shape[2] if ctx_kv else 0
        keys = torch.cat([torch.arange(C, device=noise.device).expand(len(position_ids), C), position_ids], 1)
        masks = {w: None if w is None else window_band(position_ids, keys, w)[:, None] for w in self.windows}
        x = noise
        for layer, kv in zip(self.layers, ctx_kv):
            x = layer.forward_cached(x, kv, rope, masks[layer.window])
        return self.norm(x)

    # -- HF directory ------------------------------------------------------------

    def save_pretrained(self, path: str | Path) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        d = self.config.to_dict()
        d["architectures"] = [{"dflash2": "DFlash2DraftModel", "dspark": DSPARK_ARCH}.get(arch_of(self.config)[0],
                                                                                        "DFlashDraftModel")]
        (path / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True))
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / WEIGHTS), metadata={"format": "pt"})
        if arch_of(self.config)[0] == "dflash":
            shutil.copyfile(HF_MODELING, path / "dflash.py")
        return path

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu") -> "DFlashDrafter":
        path = Path(path)
        model = cls(read_config(path))
        try:
            state = load_file(str(path / WEIGHTS))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError, or OSError
            raise ValueError(f"{path / WEIGHTS}: not readable as safetensors ({e or type(e).__name__})") from None
        # Codebooks saved as nn.Embedding weights (``...codebook.weight``) are the same tensors.
        state = {k.removesuffix(".weight") if k.endswith("_codebook.weight") else k: v for k, v in state.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{path}: weights do not match its config.json "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
        return model.to(device)


def read_config(path: str | Path) -> Qwen3Config:
    """The config of a drafter directory (what ``save_pretrained`` writes), refused
    unless it describes a drafter this module computes."""
    path = Path(path)
    if not is_drafter_dir(path):
        raise ValueError(f"{path}: not a drafter directory (needs config.json and {WEIGHTS})")
    conf = path / "config.json"
    try:
        d = json.loads(conf.read_text())
    except (OSError, ValueError) as e:      # ValueError: JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{conf}: not readable as JSON ({e})") from None
    if isinstance(d, dict) and "dflash_config" not in d and DSPARK_ARCH in (d.get("architectures") or ()):
        # DeepSpec's own DSpark configs are flat: the mask and the taps at the top level.
        d["dflash_config"] = {k: d.get(k) for k in ("mask_token_id", "target_layer_ids", "block_size")}
    if isinstance(d, dict) and "block_size" not in d and "block_size" in (d.get("dflash_config") or {}):
        d["block_size"] = d["dflash_config"]["block_size"]     # DFlash2's published configs keep it only there
    if not isinstance(d, dict) or not {"block_size", "dflash_config"} <= set(d):
        raise ValueError(f"{conf}: not a DFlash drafter config (needs block_size and dflash_config)")
    _check_supported(path, d)
    extra = {k: d.pop(k) for k in ("block_size", "num_target_layers", "dflash_config", "auto_map", "is_causal")
             if k in d}
    cfg = Qwen3Config.from_dict(d)
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cfg


LAYER_TYPES = ("full_attention", "sliding_attention")


def _check_supported(path: Path, d: dict) -> None:
    """Refuse configs whose attention differs from ours: loading their weights would
    silently compute something else. Qwen3Config itself writes all-"full_attention"
    ``layer_types`` and a ``sliding_window`` that counts only with ``use_sliding_window``;
    without ``layer_types`` it makes the layers from ``max_window_layers`` on sliding."""
    types = d.get("layer_types")
    if types is not None:
        unknown = set(types) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"{path}: config.json sets layer_types {sorted(unknown)}; this drafter implements "
                             f"{' and '.join(LAYER_TYPES)}")
        if len(types) != d.get("num_hidden_layers"):
            raise ValueError(f"{path}: config.json's layer_types names {len(types)} layers, its "
                             f"num_hidden_layers is {d.get('num_hidden_layers')}")
        sliding = "sliding_attention" in types
        if sliding and not (d.get("use_sliding_window") and d.get("sliding_window")):
            # Qwen3Config (and z-lab's loader through it) drops the window without the flag.
            raise ValueError(f"{path}: config.json's layer_types name sliding_attention without "
                             f"use_sliding_window and a sliding_window (got {d.get('use_sliding_window')}, "
                             f"{d.get('sliding_window')})")
        if sliding and d.get("is_causal") is None:
            raise ValueError(f"{path}: config.json's sliding_attention layers with no is_causal: z-lab's "
                             "reference and vLLM then read them as causal in the block; this drafter's blocks "
                             "attend both ways")
    window, block = d.get("sliding_window"), d.get("block_size")
    if d.get("use_sliding_window") and window and block and int(window) < int(block):
        raise ValueError(f"{path}: config.json's sliding_window {window} is smaller than its block of {block}")
    if d.get("attention_bias"):
        raise ValueError(f"{path}: config.json sets attention_bias; this drafter has no attention biases")
    dc = d.get("dflash_config") or {}
    named = set(DFLASH2_KEYS) & set(dc)
    if 0 < len(named) < len(DFLASH2_KEYS) or (not named and "DFlash2DraftModel" in (d.get("architectures") or ())):
        missing = sorted(set(DFLASH2_KEYS) - named)
        raise ValueError(f"{path}: a DFlash2 config needs dflash_config keys {list(DFLASH2_KEYS)} (missing {missing})")
    if d.get("is_causal"):
        raise ValueError(f"{path}: config.json sets is_causal; a DFlash block attends both ways")


def choose_mask_token(tokenizer, embedding_rows: int) -> tuple[int, str]:
    """A mask token id the drafter may own, and why it was chosen.

    The drafter's noise block embeds it (with the target's frozen embedding) at every
    position still to be guessed, so it must not look like text the target produces: an unused padding row if the
    embedding has one, else an added special token outside the chat template.
    """
    n = len(tokenizer)
    if embedding_rows > n:
        return n, f"first embedding row past the tokenizer's {n} tokens"
    template = tokenizer.chat_template or ""
    template = " ".join(template.values()) if isinstance(template, dict) else template
    common = {getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad", "unk")}
    free = [(i, t.content) for i, t in tokenizer.added_tokens_decoder.items()
            if t.special and i < embedding_rows and i not in common and t.content not in template]
    if not free:
        return embedding_rows - 1, "last embedding row (no unused special token; it may be a real token)"

    def rank(item):
        name = item[1].lower()
        return (0 if "mask" in name else 1 if "reserved" in name or "unused" in name else 2, -item[0])
    i, name = min(free, key=rank)
    return i, f"special token {name!r}, outside the chat template"


def is_drafter_dir(path: Path) -> bool:
    """An HF directory with a drafter's weights (what ``save_pretrained`` writes)."""
    return is_hf_dir(path) and (Path(path) / WEIGHTS).is_file()


def _default_mask_token(cfg, target) -> tuple[int, str]:
    path = ensure_target(cfg)
    if not has_tokenizer(path):
        return target.vocab_size - 1, "last embedding row (the target has no tokenizer)"
    from transformers import AutoTokenizer

    return choose_mask_token(AutoTokenizer.from_pretrained(path), target.vocab_size)


INIT_PARTS = ("layers", "fc", "hidden_norm", "norm")


def target_init_plan(layer_ids: list[int], num_target_layers: int, num_layers: int) -> dict:
    """Which target tensors ``init_from_target`` copies: the drafter's layers continue
    the target right after its deepest feature layer ``d`` (layers ``d+1 ..``, moved
    down as far as needed to exist), so the context that ``fc`` passes through (layer
    ``d``'s output, normed as layer ``d+1``'s input norm would) is what those layers
    were trained to read. A drafter deeper than the target keeps its extra layers random."""
    deepest = max(layer_ids)
    first = max(0, min(deepest + 1, num_target_layers - num_layers))
    return {"layers": list(range(first, min(first + num_layers, num_target_layers))), "deepest": deepest,
            "hidden_norm_from": min(deepest + 1, num_target_layers - 1)}


OFFSET_NORM_FAMILIES = ("gemma", "gemma2", "gemma3", "gemma3_text", "qwen3_next", "qwen3_5", "qwen3_5_text",
                        "qwen3_5_moe", "qwen3_5_moe_text")
"""Target families whose RMSNorm scales by ``1 + w`` (zero-centred weights) where the
drafter's scales by ``w``: their norms are copied as ``1 + w``, the same function
(``tests/unit/test_target_zoo.py`` holds this list to transformers' own modules)."""
NOT_IN_A_DRAFTER_LAYER = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
                          "self_attn.o_proj.bias", "self_attn.sinks", "pre_feedforward_layernorm.weight",
                          "post_feedforward_layernorm.weight")
"""Target layer tensors whose layer computes what a drafter layer cannot (biases, gpt-oss's
attention sinks, Gemma's sandwich norms, where ``post_attention_layernorm`` normalises the
attention's output): copying the rest would start the drafter from another function."""
OPTIONAL_IN_TARGET = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
"""A Llama has no q/k norms: the drafter's stay at 1, which is what a Llama computes."""


@torch.no_grad()
def init_from_target(drafter: DFlashDrafter, read, num_target_layers: int,
                     parts: tuple[str, ...] = INIT_PARTS, family: str = "") -> DFlashDrafter:
    """Overwrite ``parts`` of ``drafter`` with the target's own weights, ``read(name)``
    giving a target tensor by its HF name (or None when the target has none).

    * ``layers``: drafter layer i <- target layer ``plan["layers"][i]`` (attention
      projections, MLP, both norms), refused unless that layer is a Qwen3-style layer
      whole (a MoE, linear-attention or MLA layer has other tensors; ``NOT_IN_A_DRAFTER_LAYER``);
    * ``fc``: ``[0 | .. | I | .. | 0]``, the deepest feature layer passed through;
    * ``hidden_norm``: that next target layer's input norm;
    * ``norm``: the target's final norm, which the target's own head expects.

    A ``family`` of ``OFFSET_NORM_FAMILIES`` has its norms copied as ``1 + w``.
    """
    unknown = set(parts) - set(INIT_PARTS)
    if unknown:
        raise ValueError(f"drafter.init_parts: unknown {sorted(unknown)} (choose from {list(INIT_PARTS)})")
    plan = target_init_plan(drafter.target_layer_ids, num_target_layers, len(drafter.layers))
    instead = "drop layers from drafter.init_parts, or set drafter.init: random"

    def put(param: torch.Tensor, name: str, t: torch.Tensor | None = None) -> None:
        t = read(name) if t is None else t
        if t is None:
            return
        if t.shape != param.shape:
            raise ValueError(f"drafter.init: target tensor {name} has shape {tuple(t.shape)}, "
                             f"the drafter's is {tuple(param.shape)}")
        if name.endswith("norm.weight") and family in OFFSET_NORM_FAMILIES:
            t = 1.0 + t.float()
        param.copy_(t.to(param.dtype))
    if "layers" in parts:
        for layer, src in zip(drafter.layers, plan["layers"]):
            # A DFlash2's block convolutions are the drafter's own (they start as the identity).
            names = {n: p for n, p in layer.named_parameters() if "_conv." not in n}
            theirs = {n: read(f"model.layers.{src}.{n}") for n in (*names, *NOT_IN_A_DRAFTER_LAYER)}
            missing = [n for n in names if n not in OPTIONAL_IN_TARGET and theirs[n] is None]
            extra = [n for n in NOT_IN_A_DRAFTER_LAYER if theirs[n] is not None]
            other = [n for n, p in names.items() if theirs[n] is not None and theirs[n].shape != p.shape]
            if missing or extra or other:
                why = (f"has no {missing[0]}" if missing else f"has {extra[0]}, which a drafter layer lacks" if extra
                       else f"has {other[0]} of shape {tuple(theirs[other[0]].shape)}, the drafter's "
                            f"{tuple(names[other[0]].shape)}")
                raise ValueError(f"drafter.init_parts: layers: the {family or 'target'}'s layer {src} {why}, so it "
                                 f"is no drafter layer to copy; {instead}")
            for name, param in names.items():
                put(param, f"model.layers.{src}.{name}", theirs[name])
    if "fc" in parts:
        h = drafter.config.hidden_size
        k = drafter.target_layer_ids.index(plan["deepest"])
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, k * h:(k + 1) * h] = torch.eye(h)
    if "hidden_norm" in parts:
        put(drafter.hidden_norm.weight, f"model.layers.{plan['hidden_norm_from']}.input_layernorm.weight")
    if "norm" in parts:
        put(drafter.norm.weight, "model.norm.weight")
    return drafter


def target_reader(cfg, target):
    """``read(name)`` over the target's safetensors files, as stored: every process
    (the supervisor and optimizer hold no target; a target actor may hold it in bf16 on
    a GPU) then starts from the same bits. A loaded ``TargetModel``'s own state only
    when the directory has no safetensors."""
    from .head import _find_tensors, _read

    path = ensure_target(cfg)
    if not ((path / WEIGHTS).is_file() or (path / "model.safetensors.index.json").is_file()):
        model = getattr(target, "model", None) or load_target(cfg, "cpu").model
        sd = model.state_dict()
        return lambda name: sd.get(name)

    def read(name: str):
        found = _find_tensors(path, (name,))
        return _read(found[name], name) if name in found else None
    return read


def start_config(cfg, target) -> Qwen3Config:
    """The config of the drafter a run starts from: ``drafter.init_from``'s, checked
    against this run, else a fresh one for ``target``."""
    if cfg.drafter.mask_token_id is not None:
        mask_id, reason = cfg.drafter.mask_token_id, "set by drafter.mask_token_id"
    else:
        mask_id, reason = _default_mask_token(cfg, target)
    if not 0 <= mask_id < target.vocab_size:
        raise ValueError(f"drafter.mask_token_id: {mask_id} is outside the target's vocab of {target.vocab_size}")
    arch, shape, dspark = dflash2_fields(cfg.drafter), shape_fields(cfg.drafter), dspark_fields(cfg.drafter)
    if cfg.drafter.init_from is None:
        config = drafter_config(target.config, cfg.drafter.num_layers, cfg.drafter.block_size, target.layer_ids,
                                mask_id, reason, target.vocab_size, arch, shape, dspark)
        _check_target_init(cfg.drafter, config, target.config)
        return config
    if not Path(cfg.drafter.init_from).exists():
        raise ValueError(f"drafter.init_from: {cfg.drafter.init_from} does not exist")
    try:
        config = read_config(cfg.drafter.init_from)
    except ValueError as e:     # its message names the file; the key says where the path came from
        raise ValueError(f"drafter.init_from: {e}") from None
    dc = config.dflash_config
    have = (list(dc["target_layer_ids"]), int(config.block_size), int(dc["mask_token_id"]), config.hidden_size)
    want = (target.layer_ids, cfg.drafter.block_size, mask_id, target.hidden_size)
    if have != want:
        raise ValueError(f"drafter.init_from: {cfg.drafter.init_from} has (layer ids, block, mask id, hidden) "
                         f"{have}, this run needs {want} (mask id: {reason})")
    have_arch = arch_of(config)
    want_arch = (cfg.drafter.arch, arch if arch is not None else dspark)
    if have_arch != want_arch:
        name = lambda a: a[0] if a[1] is None else f"{a[0]} {a[1]}"   # noqa: E731
        raise ValueError(f"drafter.init_from: {cfg.drafter.init_from} is a {name(have_arch)} drafter, this run "
                         f"trains {name(want_arch)} (drafter.arch and its sizes)")
    _check_stated_shape(cfg.drafter, config)
    return config


def _check_stated_shape(drafter_cfg, config) -> None:
    """What the ``drafter`` section states of the layers must be what ``init_from`` has
    (unstated: its own); a contradiction is refused, never trained one way and exported
    the other."""
    windows = layer_windows(config)
    have = {"layer_types": [("sliding_attention" if w else "full_attention") for w in windows],
            "sliding_window": max((w for w in windows if w), default=None),
            **{k: getattr(config, k) for k in SHAPE_KEYS}}
    for key, want in shape_fields(drafter_cfg).items():
        if have[key] != want:
            raise ValueError(f"drafter.{key}: {drafter_cfg.init_from} has {have[key]}, this config states {want}")


def _check_target_init(drafter_cfg, config, target_config) -> None:
    """``init: target`` copies target layers: refused when the drafter's attention or MLP
    is shaped otherwise (the copy would fail in every actor, after the spawn)."""
    if drafter_cfg.init != "target" or "layers" not in drafter_cfg.init_parts:
        return
    t_heads = int(target_config.num_attention_heads)
    theirs = (t_heads, int(getattr(target_config, "num_key_value_heads", None) or t_heads),
              int(getattr(target_config, "head_dim", None) or target_config.hidden_size // t_heads),
              getattr(target_config, "intermediate_size", None))
    ours = tuple(getattr(config, k) for k in SHAPE_KEYS)
    if ours != theirs:
        raise ValueError(f"drafter.init_parts: copying the target's layers needs the target's (heads, KV heads, "
                         f"head_dim, MLP) {theirs}, the drafter has {ours}; drop layers from init_parts or use "
                         "init: random")


def build_drafter(cfg, target) -> DFlashDrafter:
    """The drafter a run starts from: ``drafter.init_from`` if set, else a fresh one
    initialised from ``cfg.train.seed`` (identical in every process) and, with
    ``drafter.init: target``, parts of it copied from the target (``init_from_target``)."""
    config = start_config(cfg, target)
    if cfg.drafter.init_from is not None:
        try:
            return DFlashDrafter.from_pretrained(cfg.drafter.init_from, target.device)
        except ValueError as e:
            raise ValueError(f"drafter.init_from: {e}") from None
    d = DFlashDrafter(config).init_weights(cfg.train.seed, cfg.drafter.selector_init)
    if cfg.drafter.init == "target":
        init_from_target(d, target_reader(cfg, target), int(target.config.num_hidden_layers), cfg.drafter.init_parts,
                         getattr(target.config, "model_type", ""))
    return d.to(target.device)


def drafter_shell(cfg, target) -> DFlashDrafter:
    """``build_drafter``'s drafter, its checks included, with parameters left
    uninitialised: for a process that loads them (``WeightStore.load_params``) before
    any use. Drawing every weight first would cost seconds per start at 8B scale."""
    config = start_config(cfg, target)
    with torch.device("meta"):
        d = DFlashDrafter(config)
    d.to_empty(device=target.device)
    # Buffers are computed, never loaded: the rotary frequencies must be a normal build's.
    d.rotary_emb = Qwen3RotaryEmbedding(config).to(target.device)
    return d
