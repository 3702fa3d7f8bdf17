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
from .dspark import DSPARK_ARCH, DSPARK_KEYS, build_heads, is_dspark
from .target_dir import is_hf_dir
from .xpress import (
    XPRESS_ARCH,
    XPRESS_KEYS,
    build_refiner,
    engine_fields,
    from_engine_names,
    is_xpress,
    settle_engine_keys,
    to_engine_names,
    xpress_sizes,
)

WEIGHTS = "model.safetensors"
# Saved as ``dflash.py`` beside the weights: config.json's ``auto_map`` names it.
HF_MODELING = Path(__file__).with_name("hf_dflash.py")


SHAPE_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
"""``drafter`` keys that size the drafter's layers apart from its target's (None = the target's)."""


def drafter_config(target_config, num_layers: int, block_size: int, layer_ids: list[int],
                   mask_token_id: int, mask_token_reason: str, vocab_size: int,
                   dflash2: dict | None = None, shape: dict | None = None,
                   dspark: dict | None = None, xpress: dict | None = None) -> Qwen3Config:
    """A Qwen3 config sized like the target (hidden, heads, MLP, RoPE), with DFlash fields;
    a DFlash2's with ``dflash2`` (its four ``DFLASH2_KEYS``, ``dflash2_fields``), a DSpark's
    with ``dspark`` (``DSPARK_KEYS``, ``dspark_fields``), an XPress's with ``xpress``
    (``XPRESS_KEYS``, ``xpress_fields``). ``shape``
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
    if xpress is not None:
        # DFlash's layout (``dflash_config``) plus speculators' XPress fields at the top
        # level; slot 0 is the anchor (speculators' ``sample_from_anchor`` False).
        cfg.architectures = [XPRESS_ARCH]
        del cfg.auto_map
        for k in XPRESS_KEYS:
            setattr(cfg, k, int(xpress[k]))
        cfg.sample_from_anchor = False
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
    if is_xpress(config):
        return "xpress", xpress_sizes(config)
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
        # An XPress's refiner (``models.xpress``), likewise last.
        self.refiner_head = build_refiner(config) if is_xpress(config) else None
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
        if self.refiner_head is not None:
            with torch.no_grad():
                self.refiner_head.mix_l.zero_()      # XPress's mixer starts at zero (speculators' init)
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
        masks = {None: None}        # full attention: no mask; a window: its band over the keys' positions
        if self.windows - {None}:
            C = ctx_kv[0][0].shape[2]
            keys = torch.cat([torch.arange(C, device=noise.device).expand(len(position_ids), C), position_ids], 1)
            masks |= {w: window_band(position_ids, keys, w)[:, None] for w in self.windows - {None}}
        x = noise
        for layer, kv in zip(self.layers, ctx_kv):
            x = layer.forward_cached(x, kv, rope, masks[layer.window])
        return self.norm(x)

    # -- HF directory ------------------------------------------------------------

    def save_pretrained(self, path: str | Path) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        d = self.config.to_dict()
        d["architectures"] = [{"dflash2": "DFlash2DraftModel", "dspark": DSPARK_ARCH,
                               "xpress": XPRESS_ARCH}.get(arch_of(self.config)[0], "DFlashDraftModel")]
        if self.refiner_head is not None:
            d.update(engine_fields(xpress_sizes(self.config), self.block_size))     # vLLM 0.33's keys
        (path / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True))
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if self.refiner_head is not None:
            state = to_engine_names(state)      # vLLM 0.33's names for the refiner
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
        state = from_engine_names(state)        # an XPress refiner under vLLM's names, or speculators'

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
    if is_xpress(cfg):
        settle_engine_keys(cfg)
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


def is_drafter_dir(path: Path) -> bool:
    """An HF directory with a drafter's weights (what ``save_pretrained`` writes)."""
    return is_hf_dir(path) and (Path(path) / WEIGHTS).is_file()
