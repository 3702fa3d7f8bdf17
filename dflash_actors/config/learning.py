"""The sections of a run's config that say what is learned and how: the drafter (its
architecture, shape, window and start, and each architecture's own keys) and the
training (objective, schedule, optimiser). Rules that tie them to the other sections
live in ``Config.__post_init__``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from ..runtime.config import (
    ConfigError,
    above,
    at_least,
    checked,
    in_range,
    nonempty,
    optional,
)


@dataclass(frozen=True)
class DrafterConfig:
    num_layers: int = checked(1, at_least(1))
    block_size: int = checked(16, at_least(2))
    target_layer_ids: Optional[tuple[int, ...]] = None
    """Target layers whose outputs feed the drafter; None = build_target_layer_ids."""
    init: Literal["random", "target"] = "target"
    """How a new drafter starts (``init_from`` wins over both). ``random``: normal(0.02)
    linears and unit norms, as every public trainer starts. ``target``: its layers copied
    from the target layers right after the deepest feature layer, ``fc`` passing that
    layer's features through, ``hidden_norm`` and the final norm from the target
    (``models.drafter_start.init_from_target``)."""
    init_parts: tuple[str, ...] = ("layers", "fc", "hidden_norm", "norm")
    """With ``init: target``, which parts come from the target (the rest stay random):
    ``layers``, ``fc``, ``hidden_norm``, ``norm``."""
    mask_token_id: Optional[int] = checked(None, optional(at_least(0)))
    """An unused embedding row of the target; None = the target's last vocab row."""
    init_from: Optional[str] = checked(None, optional(nonempty))
    """A drafter directory (e.g. a released DFlash drafter) to start from; None = ``init``."""
    arch: Literal["dflash", "dflash2", "dspark", "xpress"] = "dflash"
    """``dflash``: the drafter of April 2026 (``DFlashDraftModel``). ``dflash2``: DFlash2
    (``DFlash2DraftModel``): a two-tap in-block convolution around every sublayer and a
    candidate selector that proposes from the head's top ``selector_top_k`` per slot
    (``models.dflash2``). Both start computing the same thing. ``dspark``: DSpark
    (``Qwen3DSparkModel``): DFlash's backbone whose every slot proposes (slot k predicts
    the token after ``a + k``, so a block of B drafts B), a Markov head and a confidence
    head (``models.dspark``); its loss needs ``train.loss: distill``. ``xpress``: XPress
    (``Qwen3XPressModel``): DFlash's backbone and labels plus a causal refiner head whose
    logit bias reads each slot's previous token, trained teacher-forced and over free-running
    Jacobi rounds, decoded by Jacobi rounds (``models.xpress``); its default loss needs
    ``train.loss: distill``."""
    conv_kernel_size: int = checked(2, at_least(1))
    """dflash2: taps of the in-block convolution (self and predecessor, as published)."""
    conv_group_size: int = checked(16, at_least(1))
    """dflash2: channels that share one dynamic correction; must divide the hidden size."""
    selector_rank: int = checked(256, at_least(1))
    """dflash2: width of the selector's codebooks, two ``[vocab, rank]`` tables: 256 is
    sized for 5,120-wide targets; at a small target they outweigh the drafter (SmolLM2's
    49,152 tokens x 256 x 2 = 25M parameters), so its config takes a smaller one."""
    selector_top_k: int = checked(16, at_least(1))
    """dflash2: candidates per slot the selector chooses among."""
    sliding_window: Optional[int] = checked(None, optional(at_least(1)))
    """The window W of the drafter's ``sliding_attention`` layers: the block slot at
    position ``a + k`` (anchor a) sees the context positions c with ``c < a`` and
    ``a + k - c < W``, and its whole block (W >= block_size), as z-lab's reference, NeMo
    and vLLM read ``sliding_window`` for a non-causal drafter. None = full attention on
    every layer, or ``init_from``'s layers as they are (the published 27B DFlash2: 2048 on
    all 5; speculators 0.9.0's default: 2048)."""
    layer_types: Optional[tuple[Literal["full_attention", "sliding_attention"], ...]] = None
    """Each drafter layer's attention, ``num_layers`` of them; None = every layer
    ``sliding_attention`` when ``sliding_window`` is set, else ``full_attention``."""
    num_attention_heads: Optional[int] = checked(None, optional(at_least(1)))
    """The drafter's own attention shape; None = the target's. Published drafters may
    differ from their target: the 27B DFlash2 has 32 heads, 8 KV heads and head_dim 128
    against Qwen3.6-27B's 24, 4 and 256."""
    num_key_value_heads: Optional[int] = checked(None, optional(at_least(1)))
    head_dim: Optional[int] = checked(None, optional(at_least(1)))
    intermediate_size: Optional[int] = checked(None, optional(at_least(1)))
    """The drafter's MLP width; None = the target's (a MoE target's dense MLP width)."""
    markov_rank: int = checked(256, at_least(1))
    """dspark: width of the Markov head, two ``[vocab, rank]`` tables (``W2 W1[prev]`` is a
    full-vocabulary bias from the previous token; DeepSpec's 256 at 4,096-wide targets)."""
    confidence_with_markov: bool = True
    """dspark: the confidence head reads ``[h ; W1[prev]]`` (DeepSpec's default), else ``h`` alone."""
    dspark_ce_alpha: float = checked(0.1, at_least(0))
    """dspark: weight of the cross-entropy against the data's token."""
    dspark_distance_alpha: float = checked(0.9, at_least(0))
    """dspark: weight of the distance to the target's distribution (``dspark_distance``)."""
    dspark_confidence_alpha: float = checked(1.0, at_least(0))
    """dspark: weight of the confidence head's BCE against ``1 - TV``; 0 builds no confidence head."""
    dspark_distance: Literal["l1", "kl"] = "l1"
    """dspark: ``l1``: ``sum_v |p_draft - p_target|`` (DeepSpec, NeMo, SpecForge);
    ``kl``: ``KL(p_target || p_draft)`` (speculators' default)."""
    xpress_rank: int = checked(256, at_least(1))
    """xpress: width r of the refiner (its token table and readout are ``[vocab, r]``)."""
    xpress_mlp_ratio: int = checked(2, at_least(1))
    """xpress: the refiner's SwiGLU is ``r -> ratio*r -> r`` (2 in the released checkpoints)."""
    xpress_jacobi_passes: int = checked(6, at_least(0))
    """xpress: free-running refine rounds when decoding (speculators' ``num_jacobi_passes``;
    exported as that key)."""
    xpress_ce_alpha: float = checked(0.1, at_least(0))
    """xpress: weight of the cross-entropy in each pass's term."""
    xpress_tv_alpha: float = checked(0.9, at_least(0))
    """xpress: weight of ``TV = 1 - sum_v min(p_draft, p_target)`` in each pass's term."""
    xpress_ce_labels: Literal["target", "data"] = "target"
    """xpress: the cross-entropy's label: the target's argmax (speculators' default) or the
    data's token (its ``ce_from_data``)."""
    xpress_consistency_weight: float = checked(0.3, at_least(0))
    """xpress: weight of the mean over the free-running training rounds (0: none)."""
    xpress_consistency_passes: int = checked(3, at_least(0))
    """xpress: free-running rounds in training, each fed the previous one's argmax."""
    xpress_base_anchor_weight: float = checked(0.6, at_least(0))
    """xpress: weight of the backbone's own logits' term (keeps the Jacobi seed good)."""
    selector_init: Literal["zeros", "normal"] = "zeros"
    """dflash2: how a new drafter's selector starts (the predecessor codebook is normal(0.02)
    either way). ``zeros``: a zero successor codebook, so the selector starts at DFlash's
    argmax; ``normal``: normal(0.02), as speculators 0.9.0 starts it."""

    def __post_init__(self):
        bad = set(self.init_parts) - {"layers", "fc", "hidden_norm", "norm"}
        if bad:
            raise ConfigError(f"init_parts: unknown {sorted(bad)} (choose from layers, fc, hidden_norm, norm)")
        if self.target_layer_ids is not None and not self.target_layer_ids:
            raise ConfigError("target_layer_ids: must name at least one layer (null = the default choice)")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ConfigError(f"layer_types: names {len(self.layer_types)} layers, drafter.num_layers is "
                                  f"{self.num_layers}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ConfigError("layer_types: sliding_attention layers need drafter.sliding_window")
            if self.sliding_window is not None and "sliding_attention" not in self.layer_types:
                raise ConfigError(f"sliding_window: {self.sliding_window} with no sliding_attention layer in "
                                  "drafter.layer_types (null the window, or name the sliding layers)")
        if self.sliding_window is not None and self.sliding_window < self.block_size:
            raise ConfigError(f"sliding_window: must be >= drafter.block_size={self.block_size}, or a block "
                              f"would not see itself whole (got {self.sliding_window})")
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads is not None and kv is not None and heads % kv:
            raise ConfigError(f"num_key_value_heads: must divide drafter.num_attention_heads={heads} (got {kv})")
        if self.arch == "dspark" and not (self.dspark_ce_alpha or self.dspark_distance_alpha
                                          or self.dspark_confidence_alpha):
            raise ConfigError("dspark_ce_alpha: dspark's three loss weights are all 0; nothing would train")
        if self.arch == "xpress" and not (self.xpress_ce_alpha or self.xpress_tv_alpha):
            raise ConfigError("xpress_ce_alpha: xpress's CE and TV weights are both 0; nothing would train")

    @property
    def windows(self) -> Optional[tuple[str, ...]]:
        """``layer_types`` as the drafter gets them: stated, all sliding with a window, or
        None (full, or ``init_from``'s)."""
        if self.layer_types is not None:
            return tuple(self.layer_types)
        return ("sliding_attention",) * self.num_layers if self.sliding_window is not None else None


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    epochs: int = checked(1, at_least(1))
    lr: float = checked(6e-4, above(0))
    warmup_ratio: float = checked(0.04, in_range(0, 1))
    lr_schedule: Literal["cosine", "wsd"] = "cosine"
    """After the warmup: ``cosine`` to 0 over the remaining steps; ``wsd``
    (warmup-stable-decay) holds the peak and decays linearly to 0 over the last
    ``decay_ratio`` of the steps, so a run sized to its time budget spends most of it
    at full lr (``max_steps``)."""
    decay_ratio: float = checked(0.2, in_range(0, 1))
    max_steps: int = checked(0, at_least(0))
    """Stop after this many optimizer steps (the LR schedule then spans them); 0 = every
    step of ``epochs``. With ``epochs`` large enough it sizes a run to a time budget at a
    measured step rate (``benchmarks/bench_real.py --fit-minutes``)."""
    weight_decay: float = checked(0.0, at_least(0))
    """AdamW's decoupled weight decay (with ``optimizer: muon``, of AdamW's share)."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """``adamw``: AdamW on every parameter. ``muon``: ``torch.optim.Muon`` on the weight
    matrices (every linear weight: attention, MLP, ``fc``, DFlash2's projections) and
    AdamW on the rest (norms, conv kernels, embedding-like tables such as the selector's
    codebooks), speculators 0.9.0's split (``train.optim``); one LR schedule scales both."""
    muon_lr: Optional[float] = checked(None, optional(above(0)))
    """Muon's peak lr; None = ``lr`` (speculators' resolution of an unset ``--muon-lr``;
    its ``lr`` defaults to 1e-3). With ``muon_adjust_lr: match_rms_adamw`` an AdamW lr
    carries over."""
    muon_weight_decay: float = checked(0.1, at_least(0))
    """Muon's decoupled weight decay (speculators' default 0.1)."""
    muon_momentum: float = checked(0.95, lambda v: None if 0 <= v < 1 else "must be in [0, 1)")
    """Muon's (Nesterov) momentum (speculators' and torch's default 0.95)."""
    muon_ns_steps: int = checked(5, in_range(1, 99))
    """Newton-Schulz iterations per update (torch refuses 100 or more)."""
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """How Muon scales its lr per ``A x B`` matrix (torch's ``adjust_lr_fn``):
    ``match_rms_adamw``, ``0.2 * sqrt(max(A, B))`` (Moonshot's; speculators' default), so
    updates have AdamW's RMS; ``original``, ``sqrt(max(1, A / B))`` (Keller Jordan's)."""
    grad_clip: float = checked(1.0, above(0))
    grad_accum: int = checked(1, at_least(1))
    num_anchors: int = checked(512, at_least(1))
    gamma: Optional[float] = checked(None, optional(above(0)))
    """Loss decay over block slots; None = 7 for block 16, 5 for 10, 4 for 8."""
    position_weight: Literal["decay", "dpace"] = "decay"
    """How block slots are weighted in the loss. ``decay``: ``exp(-(k-1)/gamma)`` (the
    DFlash paper's). ``dpace``: D-PACE, each slot weighted by the expected number of
    accepted tokens it takes part in, from the drafter's own detached probabilities
    (``dpace_alpha`` is the floor of each factor); gamma is then unused."""
    dpace_alpha: float = checked(0.5, in_range(0, 1))
    loss: Literal["ce", "distill"] = "ce"
    """What each block slot learns from. ``ce``: the data's next token (cross-entropy).
    ``distill``: the target's own next-token distribution there (logit distillation:
    cross-entropy against the target's softmax, which is KL to the target plus its
    entropy); the target then also puts its last layer, after the final norm, into
    every feature slot (+H floats per token through the ring and the cache)."""
    head_loss: Literal["auto", "fused", "checkpointed"] = "auto"
    """How the frozen vocabulary head and its cross-entropy run. ``fused``: the gradient
    is computed in the forward, chunk by chunk, so the head's matmul runs twice and no
    logits are kept; ``checkpointed``: autograd over checkpointed chunks (three matmuls).
    Same loss and gradients at float rounding; auto = fused."""
    head_vocab: Literal["full", "data", "sampled"] = "full"
    """The vocabulary the training cross-entropy normalises over. ``full``: every row of
    the target's head (the exact objective, SpecForge's). ``data``: only the tokens found
    at loss_mask=1 positions of the training dataset, read once per process; an
    approximation that drops the other rows from the softmax, so the head's matmuls
    shrink by that share. The drafter and its export keep the full head: decoding and
    evaluation still pick from every token, and under ``data`` nothing in the loss
    keeps the rows outside the set from winning that argmax. ``sampled``: the data's rows plus
    ``head_negatives`` rows drawn per batch from the rest, their logits raised by
    log(rest / drawn) (sampled softmax: the drawn rows stand for all of the rest)."""
    head_negatives: int = checked(4096, at_least(1))
    """``head_vocab: sampled``: head rows outside the data's drawn per batch, seeded by
    (seed, epoch, batch), so every process draws the same."""
    checkpoint_every: int = checked(0, at_least(0))
    """Optimizer steps between checkpoints; 0 = only at the end and on signals."""
    num_threads: int = checked(1, at_least(1))
    """torch intra-op threads, the same in every actor and the reference (bit-identity)."""
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The drafter's forward and backward: auto = bf16 autocast on CUDA and fp32 on CPU;
    ``bfloat16`` autocasts on CPU too (its matmuls run about twice as fast where the CPU
    has bf16 instructions; pair it with ``target.dtype: bfloat16``, whose vocabulary head the
    loss uses). The weights, gradient sums and AdamW state stay fp32 either way."""
    drafter_block_tokens: Optional[int] = checked(None, optional(at_least(1)))
    """Padded block tokens (the drafter's queries) per forward and backward: a batch's
    anchors are trained in micro-batches of rows under this budget (and of at most as
    many context tokens, or one row), whose gradients add up to the whole batch's at
    float rounding (``train.drafter_step``). Saved activations grow with it (about
    1.3 MiB per block token for an 8B-sized 5-layer drafter in bf16). None: the memory
    plan chooses, the whole batch in one pass when that fits (``--plan-only`` shows it)."""
    checkpoint_layers: Literal["auto", "on", "off"] = "auto"
    """Recompute each drafter layer's activations in the backward instead of keeping
    them: about a third more drafter compute for most of their memory. auto: the memory
    plan turns it on only when no micro-batch of a whole sequence fits without it."""
    selector_weight: float = checked(1.0, at_least(0))
    """dflash2: weight of the selector's K-way cross-entropy beside the block loss; 0
    leaves the selector at its start (DFlash's argmax): a convolution-only DFlash2."""
    selector_norm: Literal["dflash", "own", "count"] = "dflash"
    """dflash2: the selector term's denominator. ``dflash``: the block loss's ``sum(w)``
    (SpecForge's), known before any forward. ``own``: its own ``sum(w)`` over slots whose
    gold token is a candidate (NeMo Automodel's); a batch trained in several micro-batches
    then first runs a forward without autograd per micro-batch to count them. ``count``:
    the number of supervised slots, unweighted, plus 1e-5 (speculators 0.9.0's, with
    ``selector_misses: insert`` and ``drafter.selector_init: normal``)."""
    selector_misses: Literal["skip", "insert"] = "skip"
    """dflash2: a slot whose gold token is not among the top-K carries no selector term
    (``skip``: NeMo's, and what serving can choose from), or the gold token replaces the
    last candidate in training (``insert``: SpecForge's first version, and speculators')."""
    selector_grad: Literal["full", "stop"] = "full"
    """dflash2: ``full``: the selector term's gradient also reaches the backbone, through
    the unary logits and the drafter state (both peers' default); ``stop``: it trains
    only the selector's own parameters."""
    max_bad_steps: int = checked(3, at_least(0))
    """Steps in a row whose loss or gradient is not finite that are skipped (each one
    logged) before the job stops; its final checkpoint then holds the weights from
    before the first of them, which skipped steps leave untouched."""
