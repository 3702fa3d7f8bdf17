"""NVIDIA NeMo Automodel's own DFlash 2 training step, runnable here, as a parity reference.

Nothing of NeMo is copied into this project: NeMo's modules are imported *unmodified*
(Apache-2.0) from the pinned ``nemo-automodel`` wheel that ``make peers`` puts in
``.cache/peers`` (``benchmarks/peers.py``: the version and sha256 live there, the wheel's
bytes are checked against them, and the import runs from its files extracted beside it,
each compared with the wheel's). This file only drives them: it builds NeMo's ``Qwen3DFlash2DraftModel``
and ``DFlash2TrainerModule`` from our config and weights, forces the anchors a check wants
(by replacing the bound sampling method on the trainer *instance*; NeMo's class is
untouched), runs forward and backward on CPU in float32 with the ``sdpa`` mask path, and
returns the loss, gradients in the published key names, and metrics. Without the wheel
``load_nemo()`` raises ``peers.PeerUnavailable`` with the reason, and callers skip.

Import mechanics: NeMo's package ``__init__`` files import most of the framework
(datasets, distributed, model registries, and patches to transformers). They are bypassed
by registering empty package modules whose ``__path__`` points into those files for
``nemo_automodel``, ``nemo_automodel.components`` and the sub-packages on the import
path; the leaf modules (``core``, ``dflash2_core``, ``draft_qwen3``,
``draft_qwen3_dflash2``, ``target``, ``attention/dflash_mask``, ``loss/dllm_loss``,
``datasets/llm/packed_sequence``) are then imported normally with this venv's torch and
transformers. ``datasets`` is the one import that may be stubbed (``peers.importing``),
and only where HuggingFace ``datasets`` is not installed: ``packed_sequence.py`` imports
``Dataset`` and ``DatasetDict`` at module level and nothing on the training step uses
them. No NeMo module is stubbed.

NeMo's DFlash 2 semantics, read from git snapshot 36044ad3; the line numbers are that
snapshot's (in the 0.7.0 wheel they have moved, the functions have not). Paths under
``nemo_automodel/components/``; ``core`` = ``speculative/dflash/core.py``, ``d2core`` =
``speculative/dflash/dflash2_core.py``, ``dq3`` = ``speculative/dflash/draft_qwen3.py``,
``dq2`` = ``speculative/dflash/draft_qwen3_dflash2.py``, ``mask`` =
``attention/dflash_mask.py``, ``dllm`` = ``loss/dllm_loss.py``. ``m`` is the loss mask,
``L`` the sequence length, ``bs`` the block size, ``a`` an anchor, ``k`` a block slot.

Anchors (``core:230-286``)
  * Candidates are ``a in [0, max(L - bs, 0)]`` with ``m[a] > 0.5`` (``core:251-253``).
    Only ``m[a]`` is required -- NOT ``m[a+1]``. Since ``a <= L - bs``, ``a + bs - 1 <=
    L - 1``: a sampled block never runs past the sequence end (only when ``L < bs`` is
    ``max_anchor`` clamped to 0 and then the tail is cut by ``a + k < L`` below).
  * ``N = min(num_anchors, max valid count over the batch)`` (``core:265``); raises
    ``NoValidAnchorsError`` when 0 (``core:266-272``). Anchors are a uniformly random
    subset without replacement (``torch.rand`` + sort, ``core:274-281``), sorted
    ascending (``core:282``).
  * ``keep_mask[b, j] = j < min(valid_count[b], N)``; dropped slots get anchor 0
    (``core:284-285``). With one sequence per batch keep is all True. Kept-false blocks
    are not removed from the tensors: their noise is all MASK (``core:344-348``), they
    attend only to their own block (``mask:143-149``), and ``block_mask`` is 0 for them
    (``core:419``), so they add nothing to loss or metrics.
  * ``block_mask[b, j, k] = keep[b, j] * (a_j + k < L) * m[a_j + k]`` (``core:409-420``,
    index clamped to ``L - 1`` for the gather); ``pred_mask = block_mask[:, :, 1:]``
    (``d2core:252``). So a slot k >= 1 is supervised iff ``m[a+k] == 1`` (and in range);
    ``m[a+1] == 0`` only zeroes that one slot, later slots still count.
  * Targets: slot k predicts ``input_ids[a + k]`` (``core:410-417``).

Attention (``mask:66-153``, sdpa path chosen when ``attention_backend != "flex_attention"``,
``core:491-515``)
  * KV = ``[context (L) | block_0 | ... | block_{N-1}]``; Q = blocks only.
  * Block j sees context positions ``< a_j`` STRICTLY (``mask:115``, ``kv_idx <
    anchor``): the anchor's own target hidden state is not visible; the anchor token
    enters only through the block's slot 0 embedding.
  * Own block: bidirectional (``mask:134-136``, DFlash ``causal=False``). Other blocks:
    invisible. Optional ``sliding_window`` (trainer default ``None``, ``core:212``) adds
    ``(a_j + k) - kv < window`` on context keys (``mask:116-123``).

Positions (``core:310-328, 485-489``)
  * Context position ids ``arange(L)``; block j slot k has position id ``a_j + k``;
    full ids ``cat([arange(L), blocks])``. RoPE: keys rotated with the full table,
    queries with its trailing ``N*bs`` slice (``dq3:63-75``).

Inputs of the draft
  * Noise embedding per block: ``embed([tok[a], MASK, ..., MASK])`` using the target's
    embedding (``core:330-351``); all MASK for kept-false blocks.
  * Context: ``ctx = hidden_norm(fc(features))`` where ``features`` is the concat of the
    tapped target layers' outputs (``dq3:404``; layer i is HF ``hidden_states[i + 1]``,
    ``dq3:291-299``); shared by every layer. K/V = ``k_proj``/``v_proj`` of
    ``[ctx ; noise]`` with ``k_norm`` on both halves (``dq3:205-214``).
  * DFlash 2 layer (``dq2:412-433``): ``x + conv_a.finish(attn(conv_a.prepare(ln1(x))))``
    then ``x + conv_m.finish(mlp(conv_m.prepare(ln2(x))))``. Each conv:
    ``y_t = sum_o (base_kernel[i, o] + dyn[t, o, group]) * x_{t-o}`` within the block,
    zero padding before slot 0 (``dq2:72-114``); ``dyn = kernel_projection(sublayer
    input)`` viewed ``[..., 2, kernel, groups]``, index 0 for the pre-conv and 1 for the
    post-conv, both from the *sublayer input* (``dq2:152-184``). Final ``norm``
    (``dq3:417``). Conv block = ``bs`` in training (``dq2:485-486``).

Logits and dtypes
  * ``logits = lm_head(hidden)`` in the model dtype (``d2core:240``); ``topk`` runs on
    those logits in that dtype (``d2core:188``); the base CE runs in the logits' dtype
    (``dllm:36-44``, no fp32 upcast on this path); the selector CE upcasts scores with
    ``.float()`` (``d2core:268``). Here everything is float32 anyway.

Base loss (``DFlashDecayLoss(loss_gamma=gamma, normalize="mean")``, ``core:225``;
``dllm:406-443``; call at ``d2core:256-262``)
  * Over the ``bs-1`` predicted slots of every block: weight ``w_k = exp(-(k-1)/gamma)``
    for slot ``k = 1..bs-1`` (``exp(-j/gamma)``, j = 0..bs-2, reset per block,
    ``dllm:413-417``); ``gamma=None`` -> all ones (``dllm:411-412``).
  * ``base = sum(nll * w * pred_mask) / (sum(w * pred_mask) + 1e-6)`` (``dllm:431-435``).

Selector loss (``d2core:156-191, 264-270``; ``CandidateSelector.pair_scores``,
``dq2:231-259``)
  * ``unary, cand = topk(pred_logits, top_k)``; predecessor of slot k is the ground
    truth ``tok[a + k - 1]`` (``target_ids[:, :, :-1]``), so slot 1 uses the anchor token
    ``tok[a]`` -- teacher-forced, regardless of ``m``.
  * ``score[c] = unary[c] + <P[pred] * (W_h h_k), S[cand[c]]>`` with ``P`` =
    ``predecessor_codebook``, ``S`` = ``successor_codebook``, ``W_h`` =
    ``hidden_projection`` and ``h_k`` the draft output hidden state of slot k.
  * ``target_index`` = slot of ``tok[a+k]`` in ``cand`` (0 if absent), ``has_target`` =
    present. ``sel_mask = pred_mask * has_target``; ``sel_w = sel_mask * exp(-(k-1)/gamma)``
    (``d2core:140-154``); ``selector = sum(CE(score.float(), target_index) * sel_w) /
    (sum(sel_w) + 1e-6)``. Gradient reaches the backbone through the top-k ``unary``
    values as well as the selector parameters.
  * ``loss = base + selector_loss_weight * selector`` (``d2core:271``).

Metrics (``d2core:273-299``, ``core:122-165``)
  * ``valid_tokens = sum(pred_mask)``; ``selected = cand[argmax score]`` using the same
    *teacher-forced* pair scores (not the sequential walk); ``correct_tokens`` /
    ``base_correct_tokens`` count ``selected == target`` / ``argmax(pred_logits) ==
    target`` on ``pred_mask``; ``accuracy = correct / max(valid_tokens, 1)``.
  * Acceptance (``compute_accept_len``): per block, ``sum_k cumprod_k(correct_k |
    ~valid_k) * valid_k`` -- masked slots neither break the run nor count. ``valid_blocks``
    = blocks with any valid slot; ``accept_len_sum = sum over valid blocks of (accept +
    1)`` (bonus-inclusive); ``accept_len = accept_len_sum / max(valid_blocks, 1)``. Base
    stats the same on ``argmax(pred_logits)``.
  * ``candidate_recall = sum(sel_mask) / max(valid_tokens, 1)``; ``loss_weight =
    sum(pred_mask * exp(-(k-1)/gamma))``.

Decode-time walk (``CandidateSelector.walk``, ``dq2:261-314``): ``unary, cand =
topk(logits)``, ``g = hidden_projection(hidden)``; predecessor starts at the anchor
(last verified) token; per position ``argmax_c unary[c] + <P[pred] * g_t, S[cand[c]]>``
(first max on ties) and the pick becomes the next predecessor. ``spec_generate`` feeds
it the draft hidden of the ``bs - 1`` non-anchor slots and ``lm_head`` of them
(``dq2:601-615``).

Run ``python -m benchmarks.nemo_dflash2`` for a tiny random smoke step (one JSON line).
"""

from __future__ import annotations

import copy
import sys
import types
import warnings
from functools import lru_cache

import torch
from torch import nn

from benchmarks import harness, peers

# Packages whose ``__init__`` is bypassed (registered empty, with ``__path__``).
_PACKAGES = (
    "nemo_automodel",
    "nemo_automodel.components",
    "nemo_automodel.components.attention",
    "nemo_automodel.components.loss",
    "nemo_automodel.components.datasets",
    "nemo_automodel.components.datasets.llm",
    "nemo_automodel.components.speculative",
    "nemo_automodel.components.speculative.dflash",
)
_DFLASH = "nemo_automodel.components.speculative.dflash"
_LEAVES = (
    "nemo_automodel.components.attention.dflash_mask",
    "nemo_automodel.components.loss.dllm_loss",
    f"{_DFLASH}.draft_qwen3",
    f"{_DFLASH}.draft_qwen3_dflash2",
    f"{_DFLASH}.core",
    f"{_DFLASH}.dflash2_core",
)
METRIC_NAMES = (
    "accuracy", "accept_len", "accept_len_sum", "valid_blocks", "base_accept_len", "base_accept_len_sum",
    "candidate_recall", "valid_tokens", "correct_tokens", "base_correct_tokens", "base_accuracy", "loss_weight",
)


# --------------------------------------------------------------------------- import


@lru_cache(maxsize=None)
def load_nemo() -> types.SimpleNamespace:
    """Import NeMo's DFlash 2 modules unmodified from the pinned wheel (``peers.PeerUnavailable`` without it)."""
    import importlib

    nemo = peers.peer("nemo-automodel")
    with peers.importing(nemo, stubs=("datasets",)) as imported:
        for name in _PACKAGES:
            path = str(nemo.root.joinpath(*name.split(".")))
            have = sys.modules.get(name)
            if have is not None:
                paths = list(getattr(have, "__path__", []))
                if path not in paths:
                    raise RuntimeError(f"{name} is already imported from {paths}, not from {path}")
                continue
            pkg = types.ModuleType(name)
            pkg.__path__ = [path]
            pkg.__package__ = name
            pkg.__file__ = None
            sys.modules[name] = pkg
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, pkg)
        mods = {name.rsplit(".", 1)[-1]: importlib.import_module(name) for name in _LEAVES}
    for m in mods.values():
        if not m.__file__.startswith(str(nemo.root)):
            raise RuntimeError(f"{m.__name__} was imported from {m.__file__}, not from {nemo.root.name}")
    core, d2core, dq2 = mods["core"], mods["dflash2_core"], mods["draft_qwen3_dflash2"]
    return types.SimpleNamespace(
        peer=imported.peer,
        record=imported.record(),
        modules=mods,
        DFlash2TrainerModule=d2core.DFlash2TrainerModule,
        DFlash2StepMetrics=d2core.DFlash2StepMetrics,
        DFlashTrainerModule=core.DFlashTrainerModule,
        NoValidAnchorsError=core.NoValidAnchorsError,
        compute_accept_len=core.compute_accept_len,
        compute_acceptance_stats=core.compute_acceptance_stats,
        Qwen3DFlash2DraftModel=dq2.Qwen3DFlash2DraftModel,
        Qwen3DFlashDraftModel=mods["draft_qwen3"].Qwen3DFlashDraftModel,
        CandidateSelector=dq2.CandidateSelector,
        GroupedDynamicCausalConv=dq2.GroupedDynamicCausalConv,
        dflash2_rejection_sample=dq2.dflash2_rejection_sample,
        DFlashDecayLoss=mods["dllm_loss"].DFlashDecayLoss,
        create_dflash_sdpa_mask=mods["dflash_mask"].create_dflash_sdpa_mask,
    )


# --------------------------------------------------------------------------- config / weights


def _dflash_fields(config) -> dict:
    dc = dict(getattr(config, "dflash_config", None) or {})
    dc.setdefault("block_size", getattr(config, "block_size", None))
    return dc


def nemo_config(config, attn: str = "sdpa"):
    """A copy of ``config`` as NeMo's draft reads it: DFlash 2 fields in ``dflash_config``
    (top-level copies of ``block_size``/``mask_token_id``/conv/selector fields are moved in
    when absent there), float32, ``_attn_implementation = attn``."""
    cfg = copy.deepcopy(config)
    dc = _dflash_fields(cfg)
    for key in ("mask_token_id", "target_layer_ids", "conv_kernel_size", "conv_group_size",
                "selector_rank", "selector_top_k"):
        if key not in dc and getattr(cfg, key, None) is not None:
            dc[key] = getattr(cfg, key)
    if dc.get("block_size") is None:
        raise ValueError("config carries no block_size (top level or dflash_config)")
    cfg.dflash_config = dc
    cfg.block_size = int(dc["block_size"])
    if not hasattr(cfg, "num_target_layers"):
        cfg.num_target_layers = max(dc["target_layer_ids"]) + 1
    cfg._attn_implementation = attn
    return cfg


def _load_strict(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    want = module.state_dict()
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    shapes = sorted(k for k in set(want) & set(state) if tuple(want[k].shape) != tuple(state[k].shape))
    if missing or unexpected or shapes:
        raise KeyError(
            f"{what}: state does not match NeMo's parameters -- missing {missing}, unexpected {unexpected}, "
            f"shape mismatch {[(k, tuple(state[k].shape), tuple(want[k].shape)) for k in shapes]}"
        )
    module.load_state_dict({k: v.detach().to(torch.float32) for k, v in state.items()}, strict=True)


def build_draft(config, state: dict[str, torch.Tensor] | None = None, attn: str = "sdpa") -> nn.Module:
    """NeMo's ``Qwen3DFlash2DraftModel`` from ``config`` in float32 on CPU, loaded strictly from ``state``."""
    ns = load_nemo()
    draft = ns.Qwen3DFlash2DraftModel(nemo_config(config, attn)).to(torch.float32)
    if state is not None:
        _load_strict(draft, state, "Qwen3DFlash2DraftModel")
    return draft


# --------------------------------------------------------------------------- the step


def _as_anchor_tensors(anchors, keep, device):
    a = torch.as_tensor(list(anchors), dtype=torch.long, device=device).view(1, -1)
    if keep is None:
        k = torch.ones_like(a, dtype=torch.bool)
    else:
        k = torch.as_tensor(list(keep), dtype=torch.bool, device=device).view(1, -1)
        if k.shape != a.shape:
            raise ValueError(f"keep has {k.shape[1]} entries for {a.shape[1]} anchors")
    return a, torch.where(k, a, torch.zeros_like(a)), k


def nemo_samplable(anchors, loss_mask: torch.Tensor, block_size: int) -> list[bool]:
    """Whether NeMo's sampler could draw each anchor (``a <= max(L - bs, 0)`` and ``m[a] > 0.5``)."""
    m = loss_mask.reshape(-1)
    top = max(m.numel() - block_size, 0)
    return [bool(0 <= a <= top and float(m[a]) > 0.5) for a in anchors]


def nemo_step(
    config,
    state: dict[str, torch.Tensor],
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    features: torch.Tensor,
    anchors: list[int] | None,
    gamma: float | None,
    selector_loss_weight: float = 1.0,
    *,
    keep: list[bool] | None = None,
    num_anchors: int = 512,
    seed: int | None = None,
    sliding_window: int | None = None,
) -> dict:
    """One NeMo ``DFlash2TrainerModule`` forward + backward (sdpa mask, float32, CPU).

    ``anchors`` (sorted ints) replace NeMo's random draw; ``None`` lets NeMo's own sampler
    pick up to ``num_anchors`` (seeded by ``seed`` when given). ``keep`` marks padded
    blocks the way NeMo's keep mask does (their anchor is set to 0, as NeMo does).
    Anchors NeMo's sampler could never draw (``m[a] == 0`` or ``a > L - bs``) are still
    run, with a warning; ``result["nemo_samplable"]`` lists which were.

    Returns a dict: ``loss``, ``base_loss``, ``selector_loss`` (floats); ``grads``
    ``{published key: tensor}`` for every drafter parameter (zeros where NeMo left
    ``.grad`` as ``None``, those names in ``no_grad``); the metrics of ``METRIC_NAMES``
    (floats); ``hidden`` ``[N, bs, H]`` (the draft's normed output) and ``logits``
    ``[N, bs, V]``, both detached; ``anchors``/``keep`` as used; ``nemo_samplable``.
    """
    ns = load_nemo()
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, L], got {tuple(input_ids.shape)}")
    draft = build_draft(config, state)
    cfg = draft.config
    bs = int(draft.block_size)
    vocab, hidden = embed_weight.shape
    embed = nn.Embedding(vocab, hidden).to(torch.float32)
    embed.weight.data.copy_(embed_weight.detach().to(torch.float32))
    embed.weight.requires_grad_(False)
    head = nn.Linear(hidden, lm_head_weight.shape[0], bias=False).to(torch.float32)
    head.weight.data.copy_(lm_head_weight.detach().to(torch.float32))
    head.weight.requires_grad_(False)

    trainer = ns.DFlash2TrainerModule(
        draft_model=draft,
        target_lm_head=head,
        target_embed_tokens=embed,
        mask_token_id=int(cfg.dflash_config["mask_token_id"]),
        block_size=bs,
        attention_backend="sdpa",
        num_anchors=num_anchors,
        loss_decay_gamma=None if gamma is None else float(gamma),
        selector_loss_weight=float(selector_loss_weight),
        sliding_window=sliding_window,
    )
    trainer.train()

    input_ids = input_ids.to(torch.long)
    loss_mask = loss_mask.to(torch.float32)
    features = features.to(torch.float32)
    samplable = None
    if anchors is not None:
        anchors = [int(a) for a in anchors]
        if anchors != sorted(anchors):
            raise ValueError(f"anchors must be sorted, got {anchors}")
        if not anchors or min(anchors) < 0 or max(anchors) >= input_ids.shape[1]:
            raise ValueError(f"anchors must be non-empty and in [0, {input_ids.shape[1]}), got {anchors}")
        samplable = nemo_samplable(anchors, loss_mask, bs)
        if not all(samplable):
            warnings.warn(f"NeMo's sampler would never draw anchors {[a for a, s in zip(anchors, samplable) if not s]}"
                          f" (needs m[a] > 0.5 and a <= L - bs); running them anyway", stacklevel=2)
        _, forced, keep_t = _as_anchor_tensors(anchors, keep, input_ids.device)

        def forced_anchors(seq_len, loss_mask, device, doc_remaining=None):
            return forced.to(device), keep_t.to(device)

        # Instance attribute shadows the bound method; NeMo's class is untouched.
        trainer._sample_anchor_positions = forced_anchors
    elif seed is not None:
        torch.manual_seed(seed)

    used = {}
    original_sample = trainer._sample_anchor_positions

    def recording_sample(*args, **kwargs):
        out = original_sample(*args, **kwargs)
        used["anchors"], used["keep"] = out[0].detach().clone(), out[1].detach().clone()
        return out

    trainer._sample_anchor_positions = recording_sample
    captured = {}
    hooks = [
        draft.register_forward_hook(lambda mod, args, out: captured.__setitem__("hidden", out)),
        head.register_forward_hook(lambda mod, args, out: captured.__setitem__("logits", out)),
    ]
    try:
        out = trainer(input_ids=input_ids, hidden_states=features, loss_mask=loss_mask)
        out.loss.backward()
    finally:
        for h in hooks:
            h.remove()

    grads, no_grad = {}, []
    for name, p in draft.named_parameters():
        if p.grad is None:
            no_grad.append(name)
            grads[name] = torch.zeros_like(p)
        else:
            grads[name] = p.grad.detach().clone()
    n = used["anchors"].shape[1]
    result = {
        "loss": float(out.loss.detach()),
        "base_loss": float(out.base_loss),
        "selector_loss": float(out.selector_loss),
        "grads": grads,
        "no_grad": no_grad,
        "hidden": captured["hidden"].detach().reshape(n, bs, -1),
        "logits": captured["logits"].detach().reshape(n, bs, -1),
        "anchors": used["anchors"][0].tolist(),
        "keep": used["keep"][0].tolist(),
        "nemo_samplable": samplable if samplable is not None else nemo_samplable(
            used["anchors"][0].tolist(), loss_mask, bs),
        "peer": ns.record,
    }
    for name in METRIC_NAMES:
        result[name] = float(getattr(out, name))
    return result


def nemo_walk(
    state: dict[str, torch.Tensor],
    config,
    hidden: torch.Tensor,
    logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    *,
    return_candidates: bool = False,
):
    """NeMo's ``CandidateSelector.walk`` at temperature 0: the selected path ``[N, D]``.

    ``state`` may be the whole drafter state (only ``candidate_selector.*`` is used) or
    just those keys. ``hidden`` ``[N, D, H]`` and ``logits`` ``[N, D, V]`` are the draft
    hidden states and logits of the ``D`` predicted slots; ``anchor_ids`` ``[N]`` the
    last verified token of each block. With ``return_candidates`` also returns the
    ``[N, D, top_k]`` candidate ids.
    """
    ns = load_nemo()
    dc = nemo_config(config).dflash_config
    selector = ns.CandidateSelector(
        vocab_size=int(config.vocab_size),
        hidden_size=int(config.hidden_size),
        rank=int(dc.get("selector_rank", 256)),
        top_k=int(dc.get("selector_top_k", 16)),
    ).to(torch.float32)
    prefix = "candidate_selector."
    sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if not sub:
        sub = dict(state)
    _load_strict(selector, sub, "CandidateSelector")
    selector.eval()
    with torch.no_grad():
        path, cand, _ = selector.walk(
            hidden.to(torch.float32), logits.to(torch.float32), anchor_ids.to(torch.long).view(-1), 0.0
        )
    return (path, cand) if return_candidates else path


# --------------------------------------------------------------------------- smoke


def published_shapes(config) -> dict[str, tuple[int, ...]]:
    """Shapes of the DFlash 2 drafter's published keys, from the config alone."""
    dc = nemo_config(config).dflash_config
    h, inter = int(config.hidden_size), int(config.intermediate_size)
    heads, kv, hd = int(config.num_attention_heads), int(config.num_key_value_heads), int(config.head_dim)
    ksize, group = int(dc.get("conv_kernel_size", 2)), int(dc.get("conv_group_size", 16))
    rank, vocab = int(dc.get("selector_rank", 256)), int(config.vocab_size)
    shapes = {
        "fc.weight": (h, len(dc["target_layer_ids"]) * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
        "candidate_selector.hidden_projection.weight": (rank, h),
        "candidate_selector.predecessor_codebook": (vocab, rank),
        "candidate_selector.successor_codebook": (vocab, rank),
    }
    for i in range(int(config.num_hidden_layers)):
        p = f"layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (heads * hd, h),
            p + "self_attn.k_proj.weight": (kv * hd, h),
            p + "self_attn.v_proj.weight": (kv * hd, h),
            p + "self_attn.o_proj.weight": (h, heads * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
        for conv in ("attention_conv", "mlp_conv"):
            shapes[p + conv + ".base_kernel"] = (2, ksize, h)
            shapes[p + conv + ".kernel_projection.weight"] = (2 * ksize * (h // group), h)
    return shapes


def random_state(config, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random drafter weights with the DFlash 2 identity start broken (conv taps, codebooks)."""
    state = {}
    for name, shape in published_shapes(config).items():
        if name.endswith("base_kernel"):
            t = 0.3 * torch.randn(shape, generator=generator)
            t[:, 0] += 1.0
        elif len(shape) == 1:
            t = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        elif "codebook" in name:
            t = 0.5 * torch.randn(shape, generator=generator)
        else:
            t = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
        state[name] = t
    return state


def tiny_config():
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attention_bias=False,
        attention_dropout=0.0, tie_word_embeddings=False, use_sliding_window=False,
    )
    cfg.block_size = 4
    cfg.num_target_layers = 4
    cfg.dflash_config = {
        "mask_token_id": 299, "target_layer_ids": [0, 2], "block_size": 4, "conv_kernel_size": 2,
        "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 5,
    }
    return cfg


def main(argv=None) -> None:
    args = harness.parser(__doc__).parse_args(argv)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    cfg = tiny_config()
    h, v, seq = cfg.hidden_size, cfg.vocab_size, 40
    state = random_state(cfg, g)
    embed = torch.randn(v, h, generator=g)
    head = torch.randn(v, h, generator=g) / h**0.5
    head[:8] *= 4.0  # tokens 0..7 dominate the logits, so the text below often lands in the top-k
    input_ids = torch.randint(0, 8, (1, seq), generator=g)
    loss_mask = torch.ones(1, seq)
    loss_mask[0, :6] = 0  # prompt
    loss_mask[0, [12, 20, 21, 30]] = 0  # 12 = a+1 for anchor 11
    features = torch.randn(1, seq, 2 * h, generator=g)
    anchors = [6, 11, 17, 25, 33]
    res = nemo_step(cfg, state, embed, head, input_ids, loss_mask, features, anchors, gamma=7.0)
    n = len(anchors)
    anchor_tok = input_ids[0, torch.tensor(anchors)]
    path = nemo_walk(state, cfg, res["hidden"][:, 1:], res["logits"][:, 1:], anchor_tok)
    # Self-check of the anchor injection: with num_anchors above the valid count NeMo's own
    # sampler takes every valid anchor, so forcing that same set must give the same loss.
    every = [a for a in range(seq) if nemo_samplable([a], loss_mask, cfg.block_size)[0]]
    own = nemo_step(cfg, state, embed, head, input_ids, loss_mask, features, None, gamma=7.0, num_anchors=10_000)
    forced = nemo_step(cfg, state, embed, head, input_ids, loss_mask, features, every, gamma=7.0)
    check = max([abs(own["loss"] - forced["loss"])] + [
        float((own["grads"][k] - forced["grads"][k]).abs().max()) for k in own["grads"]])
    if own["anchors"] != every or check > 1e-6:
        raise AssertionError(f"anchor injection differs from NeMo's sampler: {own['anchors']} vs {every}, {check}")
    grad_norms = {k: round(float(res["grads"][k].norm()), 6) for k in (
        "fc.weight", "layers.0.self_attn.q_proj.weight", "layers.1.attention_conv.base_kernel",
        "layers.1.mlp_conv.kernel_projection.weight", "candidate_selector.successor_codebook",
        "candidate_selector.predecessor_codebook", "candidate_selector.hidden_projection.weight")}
    harness.emit({
        "bench": "nemo_dflash2", **res["peer"],
        "loss": round(res["loss"], 6), "base_loss": round(res["base_loss"], 6),
        "selector_loss": round(res["selector_loss"], 6),
        **{k: round(res[k], 6) for k in METRIC_NAMES},
        "anchors": res["anchors"], "nemo_samplable": res["nemo_samplable"],
        "n_grads": len(res["grads"]), "no_grad": res["no_grad"], "grad_norms": grad_norms,
        "hidden_shape": list(res["hidden"].shape), "walk_path": path.view(n, -1).tolist(),
        "sampler_vs_forced_max_abs_diff": check,
    }, args.save)


if __name__ == "__main__":
    main()
