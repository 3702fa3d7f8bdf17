"""Run configuration: frozen dataclasses loaded from YAML.

A config is a tree of sections (``data``, ``batching``, ``target``, ``drafter``,
``train``, ``topology``, ``runtime``, ``eval``, ``monitor``). ``load_config`` merges, in
order, the dataclass defaults, a YAML file and overrides (``(key, value)`` pairs, or
``--set section.key=value`` text), then validates once.
Every error is a ``ConfigError`` whose one-line message starts with the key path, so a
user sees ``batching.token_budget: must be >= 1 (got 0)`` rather than a traceback.

Field constraints live next to the field (``metadata={"check": ...}``); rules that tie
two sections together live in ``Config.__post_init__``. The checking machinery and the
``runtime`` section belong to the generic runtime (``runtime.config``).

Every command line that trains (``launch.py``, ``launch.py reference``) takes its
options through ``add_config_args``, so all of them start from the same default file,
``configs/default.yaml``. ``Config.updated`` derives a config from another with some
keys changed, as data: how the launch applies what it computes (a chosen topology, an
adapted accumulation, injected faults) without parsing text again.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Optional

import yaml

from .console import first_line
from .runtime.config import (
    ConfigError,
    RuntimeConfig,
    above,
    at_least,
    build,
    checked,
    in_range,
    nonempty,
    optional,
)

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
"""The embedded default: a tiny synthetic target and dataset, on CPU."""


# ---------------------------------------------------------------------------
# sections


@dataclass(frozen=True)
class SyntheticDataConfig:
    """The embedded default dataset: prompts then completions drawn from a sparse
    random first-order Markov chain, so that the next token is learnable (``branching``
    likely successors per word) rather than uniform noise."""

    num_samples: int = checked(1024, at_least(1))
    heldout_samples: int = checked(32, at_least(0))
    vocab_size: int = checked(256, at_least(8))
    prompt_len: tuple[int, int] = (8, 32)
    completion_len: tuple[int, int] = (48, 160)
    branching: int = checked(3, at_least(1))
    seed: int = 1234

    def __post_init__(self):
        for name in ("prompt_len", "completion_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ConfigError(f"{name}: must be [min, max] with 1 <= min <= max (got {[lo, hi]})")


@dataclass(frozen=True)
class DataConfig:
    path: Optional[str] = checked(None, optional(nonempty))
    """HF ``save_to_disk`` directory, ``.arrow`` or ``.parquet``; None = synthetic."""
    max_seq_len: int = checked(4096, at_least(2))
    overlong: Literal["truncate", "drop"] = "truncate"
    cache_dir: str = ".cache"
    """Where the synthetic dataset and target are generated (keyed by their config)."""
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)


@dataclass(frozen=True)
class BatchingConfig:
    token_budget: int = checked(65536, at_least(1))
    """Padded tokens per batch: n_samples * longest_sample <= token_budget."""
    max_samples: int = checked(512, at_least(1))
    sort_pool: int = checked(64, at_least(1))
    """Length grouping sorts pools of about this many batches' worth of samples."""


@dataclass(frozen=True)
class TinyTargetConfig:
    """Shape of the synthetic Qwen3 target built from config (random init, then a short
    fit to the synthetic data so that its greedy text is not degenerate). Heads of 32:
    the smallest a serving engine has kernels for (vLLM's CPU attention refuses 16), so
    that the demo's drafter can be served (``launch.py serve-check``)."""

    hidden_size: int = checked(128, at_least(8))
    num_layers: int = checked(4, at_least(1))
    num_heads: int = checked(4, at_least(1))
    num_kv_heads: int = checked(2, at_least(1))
    intermediate_size: int = checked(256, at_least(1))
    pretrain_steps: int = checked(300, at_least(0))
    pretrain_batch: int = checked(8, at_least(1))
    """Sequences per pretraining step (the fit is kept short: seconds on one thread)."""

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"hidden_size: must be divisible by num_heads={self.num_heads} (got {self.hidden_size})")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads: must be divisible by num_kv_heads={self.num_kv_heads} (got {self.num_heads})")


@dataclass(frozen=True)
class TargetConfig:
    path: Optional[str] = checked(None, optional(nonempty))
    """Local HF causal-LM directory (or GGUF package dir with ``gguf_file``); None = tiny."""
    gguf_file: Optional[str] = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """auto: bfloat16 on CUDA, float32 on CPU."""
    self_check: bool = True
    """Each target actor checks at start that its packed-batch features equal the
    model's plain forward (``output_hidden_states``) at the configured layers, and
    stops the job before training if they differ. With shared weights on CPU, once per
    job: a restart computes on the very bytes the first start checked."""
    feature_cache: Literal["off", "memory", "disk"] = "off"
    """Offline mode for repeated epochs: a sample's features are computed once, in the
    first batch that holds it, and reused by later epochs instead of running the target
    again. ``memory``: kept in shared host memory for the job's life; ``disk``: kept in
    ``<run_dir>/feature-cache`` and reused by a resumed job (checked against the data
    and the target, discarded when they differ)."""
    feature_cache_gb: float = checked(4.0, above(0))
    """Size budget of the feature cache; samples past it are computed every epoch."""
    share_weights: Literal["auto", "on", "off"] = "auto"
    """``on``: the job reads the target's weights once into shared host memory before
    the targets start, and every target actor, first start or restart, maps them (on
    CPU it computes on them in place; on a GPU it copies them to its device) instead of
    reading the checkpoint (``models.shared_weights``). ``off``: each target actor reads
    the checkpoint itself. auto = on when the weights take at most half of the host's
    available memory; the job says which in one line."""
    tiny: TinyTargetConfig = field(default_factory=TinyTargetConfig)


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


@dataclass(frozen=True)
class TopologyConfig:
    num_targets: int = checked(1, at_least(1))
    num_drafters: int = checked(1, at_least(1))
    nodes: int = checked(1, at_least(1))
    """Machines, each running this N-M topology with its own supervisor (``cluster``);
    ``launch.py`` sets it from ``--nnodes`` or the torchrun/SLURM environment."""
    target_tp: int = checked(1, at_least(1))
    """Devices (processes) per target actor: above 1 the target runs tensor parallel
    over a gang of that many ranks (``runtime.supervisor``: one actor, restarted as
    one; ``docs/tensor-parallel.md``). ``--topology NxK-M`` sets it to K."""
    target_devices: Optional[tuple[str, ...]] = None
    """None = cuda:0..N*K-1 when enough GPUs exist (a gang's ranks adjacent), else cpu
    (``wiring.resolve_devices``; cpu too when only ``drafter_devices`` is given);
    given: one device per rank, target by target (N*K entries). A gang's K entries are
    all cpu or K distinct GPUs; separate actors may share a GPU."""
    drafter_devices: Optional[tuple[str, ...]] = None
    """None = cuda:N*K..N*K+M-1 when enough GPUs exist, else cpu (cpu too when only
    ``target_devices`` is given)."""

    def __post_init__(self):
        for name, n in (("target_devices", self.num_targets * self.target_tp),
                        ("drafter_devices", self.num_drafters)):
            devs = getattr(self, name)
            if devs is not None and len(devs) != n:
                raise ConfigError(f"{name}: needs {n} entries to match the topology (got {list(devs)})")
            for d in devs or ():
                if d != "cpu" and not (d.startswith("cuda:") and d[5:].isdigit()):
                    raise ConfigError(f"{name}: devices are 'cpu' or 'cuda:N' (got {d!r})")
        k = self.target_tp
        if self.target_devices is None or k == 1:
            return
        for i in range(self.num_targets):
            gang = list(self.target_devices[i * k:(i + 1) * k])
            # Each rank picks its backend from its own device (gloo on cpu, NCCL on cuda),
            # so a mixed gang's ranks would never meet in one process group.
            if "cpu" in gang and len(set(gang)) > 1:
                raise ConfigError(f"target_devices: target {i}'s gang {gang} mixes cpu and cuda; a gang's "
                                  "ranks are all cpu (gloo) or all on GPUs (NCCL)")
            if "cpu" not in gang and len(set(gang)) < k:
                raise ConfigError(f"target_devices: target {i}'s gang {gang} repeats a GPU; NCCL needs "
                                  f"{k} distinct GPUs for its {k} ranks")


@dataclass(frozen=True)
class SimulateConfig:
    """Simulated compute (``runtime.simulate``): target and drafter actors replace their
    model with a wait of this cost, which leaves the CPU free as a GPU kernel would.
    Everything else stays real: batches, feature slots of the real width, gradient
    sums, weights, the optimizer step, every message. ``make bench`` measures the
    pipeline's own cost this way."""

    enabled: bool = False
    target_us_per_token: float = checked(0.0, at_least(0))
    target_ms_per_batch: float = checked(0.0, at_least(0))
    drafter_us_per_token: float = checked(0.0, at_least(0))
    drafter_ms_per_batch: float = checked(0.0, at_least(0))
    model: Optional[str] = checked(None, optional(nonempty))
    """A ``costmodel.SHAPES`` name (e.g. qwen3-8b): per-token costs derived from that
    target shape, a 5-layer drafter and ``tflops``, added to the costs above (the name
    is checked by the preflight, ``simulate.check``)."""
    tflops: float = checked(400.0, above(0))
    """Sustained TFLOP/s assumed for ``model``."""
    feature_width: Optional[int] = checked(None, optional(at_least(1)))
    """Feature floats per token in the slots; None = what the target would produce."""


@dataclass(frozen=True)
class JobRuntimeConfig(RuntimeConfig):
    """The runtime's section plus the training job's own runtime choices."""

    schedule: Literal["pipelined", "lockstep"] = "pipelined"
    """lockstep: the old loop, for comparison: each step loads, then runs the targets,
    then the drafters, then the optimizer, with no overlap (same math, same bytes)."""
    simulate: SimulateConfig = field(default_factory=SimulateConfig)
    grad_durability: Literal["batch", "step"] = "step"
    """Where a drafter keeps its running gradient sum between the batches of a step
    (it matters only with ``train.grad_accum`` > 1). ``step``: on its device, stored in
    shared memory once, with the step's last batch; a drafter that dies has its
    batches of the step made again, from the loader on. ``batch``: stored in shared
    memory after every batch, so a dying drafter loses nothing, at the price of
    copying the whole sum from and back to the device for every batch. The math is
    the same, bit for bit. ``benchmarks/bench_durability.py`` measures both."""
    optimizer_device: str = "auto"
    """Where the optimizer keeps the drafter's weights, both AdamW moments and the step's
    gradient sum (about 6 x 4 bytes a parameter at its peak): ``cpu``, ``cuda:N``, or
    auto: the memory plan's choice, a GPU where it leaves the drafters the most room
    (targets' GPUs first), else the host (``--plan-only`` shows it)."""
    feature_transport: Literal["auto", "host", "cuda"] = "auto"
    """Where the feature ring (the target's hidden states for the drafters) lives.
    ``host``: shared host memory, page-locked by every GPU actor that copies it;
    ``cuda``: device memory of a drafter's GPU that every target and drafter reaches
    (peer to peer from other GPUs), written by the targets and read in place by the
    drafters through CUDA IPC; ``auto``: either, where the memory plan finds the most
    room (``--plan-only`` shows it)."""

    def __post_init__(self):
        d = self.optimizer_device
        if d not in ("auto", "cpu") and not (d.startswith("cuda:") and d[5:].isdigit()):
            raise ConfigError(f"optimizer_device: 'auto', 'cpu' or 'cuda:N' (got {d!r})")


@dataclass(frozen=True)
class EvalConfig:
    """Periodic held-out evaluation during training (``evaluator``: its own process,
    reading published weights, so it never holds up the pipeline)."""

    every: int = checked(0, at_least(0))
    """Optimizer steps between evaluations (and the final weights); 0 = off."""
    data: Optional[str] = checked(None, optional(nonempty))
    """Held-out dataset of target text (``prepare`` on held-out prompts); None = the
    synthetic held-out split."""
    max_samples: int = checked(32, at_least(1))
    real_prompts: int = checked(0, at_least(0))
    """Also run real speculative decoding on this many held-out prompts."""
    max_new_tokens: int = checked(64, at_least(1))
    device: str = "auto"
    """Where the evaluator runs: ``cpu``, ``cuda:N``, or auto: the memory plan's choice, as
    for the optimizer: a GPU with room for a whole target beside what is there (it holds
    one while it computes the held-out features at its start), else the host."""
    plateau: int = checked(0, at_least(0))
    """Stop training (done, exit 0) once the held-out walk tau has not risen beyond its 95%
    interval over this many evaluations: the newest against the one that many before,
    paired over the held-out texts (``evaluator.plateau``); 0 = train every step."""

    def __post_init__(self):
        if self.device not in ("auto", "cpu") and not (self.device.startswith("cuda:") and self.device[5:].isdigit()):
            raise ConfigError(f"device: 'cpu' or 'cuda:N', or 'auto' (got {self.device!r})")
        if self.plateau and not self.every:
            raise ConfigError("eval.plateau: needs eval.every, the evaluations it compares")


@dataclass(frozen=True)
class MonitorConfig:
    """What a running job shows and records besides training itself (``monitor``)."""

    console: Literal["auto", "bar", "lines", "off"] = "auto"
    """auto: a live bar when stdout and stderr are terminals, else plain lines on stdout."""
    log_every_s: float = checked(30.0, above(0))
    """Seconds between the progress lines of the ``lines`` console."""
    resources_every_s: float = checked(5.0, above(0))
    """Seconds between resource samples (RSS, CPU, GPU memory, busy %) in ``metrics.jsonl``."""
    tensorboard: bool = True
    """Also write TensorBoard scalars to ``<run_dir>/tensorboard`` when ``tensorboard`` is installed."""
    peak_tflops: Optional[float] = checked(None, optional(above(0)))
    """The devices' peak TFLOP/s, for MFU in the summary; None: known CUDA devices' bf16 dense peak."""


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    runtime: JobRuntimeConfig = field(default_factory=JobRuntimeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)

    def __post_init__(self):
        if self.drafter.block_size > self.batching.token_budget:
            raise ConfigError(
                f"drafter.block_size: must be <= batching.token_budget={self.batching.token_budget} "
                f"(got {self.drafter.block_size})")
        if self.data.max_seq_len > self.batching.token_budget:
            raise ConfigError(
                f"data.max_seq_len: must be <= batching.token_budget={self.batching.token_budget}, "
                f"or the longest sample fits no batch (got {self.data.max_seq_len})")
        if self.drafter.arch == "dflash2" and self.train.head_vocab != "full":
            raise ConfigError(f"train.head_vocab: dflash2 needs full (its selector trains on the head's top-"
                              f"{self.drafter.selector_top_k} over every token, as serving picks them; "
                              f"got {self.train.head_vocab})")
        if self.drafter.arch == "dspark":
            self._check_dspark()
        if self.drafter.arch == "xpress":
            self._check_xpress()
        tokens = self.train.drafter_block_tokens
        if tokens is not None and tokens < self.drafter.block_size:
            raise ConfigError(f"train.drafter_block_tokens: must be >= drafter.block_size={self.drafter.block_size} "
                              f"(one block; got {tokens})")
        if self.drafter.block_size > self.data.max_seq_len:
            raise ConfigError(
                f"drafter.block_size: must be <= data.max_seq_len={self.data.max_seq_len} "
                f"(got {self.drafter.block_size})")
        window = self.drafter.sliding_window
        if window is not None and window >= self.data.max_seq_len:
            raise ConfigError(
                f"drafter.sliding_window: must be < data.max_seq_len={self.data.max_seq_len}, or it cuts no "
                f"context and is full attention (null); got {window}")
        if self.eval.plateau and self.topology.nodes > 1:
            # Node 0's evaluator would end node 0 alone; the others would see a lost node.
            raise ConfigError(f"eval.plateau: one machine only for now (topology.nodes={self.topology.nodes})")
        if self.topology.target_tp > 1:
            # Only a gang's rank 0 writes features: the cache does not know ranks yet.
            if self.target.feature_cache != "off":
                raise ConfigError(f"target.feature_cache: not available with topology.target_tp="
                                  f"{self.topology.target_tp} yet (a gang computes every batch); use off")
        per_step = self.train.grad_accum * self.topology.num_drafters
        if self.runtime.schedule == "lockstep":
            # A lock-step group holds a whole step's batches in each ring at once.
            for name in ("batch_slots", "feature_slots"):
                if getattr(self.runtime, name) < per_step:
                    raise ConfigError(f"runtime.{name}: lockstep holds a whole step at once, so it needs "
                                      f">= grad_accum * drafters = {per_step} (got {getattr(self.runtime, name)})")

    def _check_dspark(self) -> None:
        """What a DSpark's objective (``models.dspark``) takes from the other sections."""
        d, t = self.drafter, self.train
        if (d.dspark_distance_alpha or d.dspark_confidence_alpha) and t.loss != "distill":
            raise ConfigError(f"train.loss: dspark's distance and confidence terms learn the target's distribution, "
                              f"which only distill puts into the features (got {t.loss}; or set "
                              "drafter.dspark_distance_alpha and dspark_confidence_alpha to 0)")
        if t.head_vocab != "full":
            raise ConfigError(f"train.head_vocab: dspark needs full (its Markov head biases every token and its "
                              f"distance runs over the whole vocabulary; got {t.head_vocab})")
        if t.position_weight != "decay":
            raise ConfigError(f"train.position_weight: dspark weighs its slots by decay (got {t.position_weight})")

    def _check_xpress(self) -> None:
        """What an XPress's objective (``models.xpress``) takes from the other sections."""
        d, t = self.drafter, self.train
        if (d.xpress_tv_alpha or (d.xpress_ce_alpha and d.xpress_ce_labels == "target")) and t.loss != "distill":
            raise ConfigError(f"train.loss: xpress's TV term and target-argmax CE learn the target's distribution, "
                              f"which only distill puts into the features (got {t.loss}; or set "
                              "drafter.xpress_tv_alpha 0 and xpress_ce_labels data)")
        if t.head_vocab != "full":
            raise ConfigError(f"train.head_vocab: xpress needs full (its refiner biases every token and its "
                              f"rounds take the argmax over all of them; got {t.head_vocab})")
        if t.position_weight != "decay":
            raise ConfigError(f"train.position_weight: xpress weighs its slots by decay (got {t.position_weight})")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def carrying(self, sections: tuple[str, ...], holder: str) -> "Config":
        """This config with only ``sections`` readable: every other section is a
        ``Withheld`` that names ``holder`` when something reads it. An actor's spec
        carries such a config, so its inputs are the sections it lists, and a stage that
        starts to read one more fails on its first read instead of depending on it
        silently. Not validated again (the whole config was)."""
        unknown = sorted(set(sections) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"{holder}: no config sections {unknown}")
        out = object.__new__(Config)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            object.__setattr__(out, f.name, value if f.name in sections else Withheld(f.name, holder))
        return out

    def updated(self, changes: dict[str, Any]) -> "Config":
        """This config with ``changes`` (dotted key -> value, as data) applied, validated
        again as a whole: how the launch derives a setting it computes (a chosen
        topology, an adapted accumulation, injected faults) without re-reading text."""
        raw = self.to_dict()
        for key, value in changes.items():
            _set_path(raw, key, value)
        return config_from_dict(raw)

    def digest(self, sections: tuple[str, ...] | None = None) -> str:
        """Stable hash of the whole config or of some sections (for caches, resume)."""
        d = self.to_dict()
        if sections is not None:
            d = {k: d[k] for k in sections}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


class Withheld:
    """A config section a holder does not carry (``Config.carrying``): reading any field of
    it raises, naming the holder and the section to add to what it carries."""

    def __init__(self, section: str, holder: str):
        self._section, self._holder = section, holder

    def __getattr__(self, name: str):
        if name.startswith("_"):    # copy, pickle and hasattr probe dunders; ours are set in __init__
            raise AttributeError(name)
        raise AttributeError(f"{self._holder} does not carry config section {self._section!r} "
                             f"(read {self._section}.{name}); add it to the sections it carries")

    def __reduce__(self):
        return Withheld, (self._section, self._holder)

    def __repr__(self) -> str:
        return f"Withheld({self._section!r}, {self._holder!r})"


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for i, k in enumerate(keys[:-1]):
        child = node.setdefault(k, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(keys[:i + 1])}: is a value, not a section (in --set {dotted})")
        node = child
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=c`` -> ("a.b", c) with c parsed as a YAML scalar or list."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text}: expected key.path=value")
    if not raw.strip():
        # Read as null it would quietly mean "the default": for data.path, synthetic data.
        raise ConfigError(f"{key.strip()}: empty value in --set {text} (write {key.strip()}=null for none)")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: cannot parse value {raw!r} ({e.__class__.__name__})") from None
    return key.strip(), value


def parse_topology(text: str) -> tuple[int, int]:
    """``N-M`` -> (targets, drafters); ``NxK-M`` too (``parse_gang_topology`` keeps the K)."""
    n, _, m = parse_gang_topology(text)
    return n, m


def parse_gang_topology(text: str) -> tuple[int, int, int]:
    """``N-M`` or ``NxK-M`` -> (targets, devices per target, drafters): ``2x4-2`` is two
    targets of four tensor-parallel ranks each (``topology.target_tp``) and two drafters."""
    parts = text.split("-")
    gang = parts[0].split("x") if len(parts) == 2 else []
    if len(gang) not in (1, 2) or not all(p.isdigit() for p in (*gang, parts[-1])):
        raise ConfigError(f"topology: expected N-M such as 2-2, or NxK-M such as 2x4-2 for targets of K "
                          f"devices each (got {text!r})")
    n, k, m = int(gang[0]), int(gang[1]) if len(gang) == 2 else 1, int(parts[1])
    if n < 1 or m < 1:
        raise ConfigError(f"topology: needs at least one target and one drafter (got {text!r})")
    if k < 1:
        raise ConfigError(f"topology: a target spans at least one device (got {text!r})")
    return n, k, m


def config_from_dict(raw: dict | None) -> Config:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config: top level must be a mapping (got {type(raw).__name__})")
    return build(Config, raw)


def load_config(path: str | Path | None = None, overrides: Iterable[str | tuple[str, Any]] = (),
                topology: str | None = None) -> Config:
    """Defaults <- YAML file <- ``--topology`` <- overrides, validated once. An override
    is ``(dotted key, value)``, or ``--set`` text (``key=value``, parsed here)."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config: file not found: {p}")
        try:
            raw = yaml.safe_load(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"config: {p} is not UTF-8 text (byte {e.start}: {e.reason})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config: {p} is not valid YAML ({first_line(e)})") from None
        if raw is None:
            # An empty file is more likely a failed write or the wrong file than a wish
            # for the dataclass defaults (which are not configs/default.yaml); ``{}`` says that.
            raise ConfigError(f"config: {p} is empty (no settings; write {{}} for the built-in defaults)")
        if not isinstance(raw, dict):
            raise ConfigError(f"config: {p} must hold a mapping at top level")
    if topology is not None:
        n, k, m = parse_gang_topology(topology)
        _set_path(raw, "topology.num_targets", n)
        _set_path(raw, "topology.num_drafters", m)
        if "x" in topology:
            _set_path(raw, "topology.target_tp", k)
    for item in overrides:
        key, value = parse_override(item) if isinstance(item, str) else item
        _set_path(raw, key, value)
    return config_from_dict(raw)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(json.loads(json.dumps(cfg.to_dict())), sort_keys=False)


def add_config_args(ap: argparse.ArgumentParser) -> None:
    """``--config``, ``--topology`` and ``--set``, the same in every command."""
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: %(default)s)")
    ap.add_argument("--topology", help="N-M: N target actors, M drafter actors (e.g. 2-2); NxK-M: each target "
                                       "a tensor-parallel gang of K devices (e.g. 2x4-2); launch.py also "
                                       "takes auto: measure the stages and split the devices")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set train.lr=3e-4 (repeatable)")


def config_from_args(args: argparse.Namespace) -> Config:
    """The config ``add_config_args`` describes (``launch.py`` adds the node and the run
    directory to the same, ``launch.config_of``)."""
    # None: --config not given (launch.py tells that apart from the default for --resume).
    return load_config(args.config or DEFAULT_CONFIG, args.overrides, topology=args.topology)
