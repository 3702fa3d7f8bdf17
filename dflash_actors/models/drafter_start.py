"""Where a run's drafter starts, checked against the run: ``drafter.init_from``'s
directory (its layer types, window and sizes held to what the config states), else a
fresh drafter from the seed, parts of it copied from the target (``drafter.init:
target``: ``init_from_target``, only from layers a drafter layer can be); the mask token
it owns (``choose_mask_token``); and the shell a process fills with published weights
(``drafter_shell``). The drafter itself, its config and its export are ``drafter``'s."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from .drafter import (
    SHAPE_KEYS,
    WEIGHTS,
    DFlashDrafter,
    arch_of,
    dflash2_fields,
    drafter_config,
    layer_windows,
    read_config,
    shape_fields,
)
from .dspark import dspark_fields
from .target import ensure_target, load_target
from .target_dir import has_tokenizer
from .xpress import xpress_fields


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
    xpress = xpress_fields(cfg.drafter)
    if cfg.drafter.init_from is None:
        config = drafter_config(target.config, cfg.drafter.num_layers, cfg.drafter.block_size, target.layer_ids,
                                mask_id, reason, target.vocab_size, arch, shape, dspark, xpress)
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
    want_arch = (cfg.drafter.arch, next((f for f in (arch, dspark, xpress) if f is not None), None))
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
