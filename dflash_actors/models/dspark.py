"""DSpark's additions to the DFlash drafter: the shifted labels, a Markov head, a
confidence head, and their three-term objective (``drafter.arch: dspark``).

What is computed (DSpark, arXiv 2607.05147; DeepSpec's trainer and NeMo Automodel 0.7.0's
``speculative/dspark`` port of it are the reference for each fact):

* **Labels.** The backbone is DFlash's unchanged (block ``[tok[a], MASK x (B-1)]`` at
  positions ``a .. a+B-1``, seeing context ``< a``), but slot k predicts ``tok[a+k+1]``:
  the anchor slot proposes too, so a block of B slots makes B proposals (DeepSeek's
  "block 7" drafts 7 tokens and verifies 8). A slot is supervised while every slot
  before it is: the first slot whose label falls outside the sequence or the loss mask
  ends the block (``build_eval_mask``'s cumulative product in NeMo's ``common.py``).
* **Markov head** (``markov_rank`` r, the vanilla form): ``logits_k = h_k W^T +
  W2 W1[prev_k]``, a rank-r full-vocabulary bias from the token before the slot
  (``markov_w1`` an ``[V, r]`` embedding, ``markov_w2`` a bias-free ``r -> V`` linear;
  NeMo's ``markov_head.py`` ``VanillaMarkov``). Training teacher-forces ``prev_k =
  tok[a+k]`` (slot 0's is the anchor); decoding takes the token just drafted
  (``markov_walk``), which is the same token while every earlier draft is right, so the
  leading correct slots (tau) are the walk's.
* **Confidence head**: one logit per slot from ``Linear(H + r -> 1)`` on ``[h_k ;
  W1[prev_k]]`` (``[h_k]`` alone without ``confidence_with_markov``), trained towards the
  slot's acceptance probability under the target, ``1 - TV(p_draft, p_target)``
  (NeMo's ``common.py`` ``AcceptRatePredictor``, ``loss.py``). Serving multiplies the
  sigmoids along the block to choose how much to verify.
* **Objective** (``DSparkObjective``; NeMo ``loss.py``): ``ce_alpha * CE +
  distance_alpha * D + confidence_alpha * BCE(conf, 1 - TV)``, each ``sum(term * w) /
  sum(w)`` with ``w = exp(-k/gamma)`` on supervised slots (slot 0 weighs 1). CE is against
  the data's token, on the Markov-corrected logits; ``D`` is ``L1 = sum_v |p_draft -
  p_target|`` over the whole vocabulary in fp32 (DeepSpec, NeMo, SpecForge), or ``kl``,
  ``KL(p_target || p_draft)`` (speculators' default); the BCE target is detached either
  way. ``p_target`` is the target's softmax for that token, from the last-layer state
  that ``train.loss: distill`` puts into the features, through the frozen head.

The tensor names are the published ones (``markov_head.markov_w1.weight``,
``markov_head.markov_w2.weight``, ``confidence_head.proj.{weight,bias}``), and the flat
config keys (``DSPARK_KEYS``) what DeepSpec writes and vLLM's ``Qwen3DSparkModel`` reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .marks import keep_off_muon

DSPARK_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
"""Flat config keys of a DSpark drafter (DeepSpec's ``config.json``; vLLM reads all but the type)."""

DSPARK_ARCH = "Qwen3DSparkModel"

ROWS_PER_CHUNK = 1024
"""Supervised rows whose ``[rows, vocab]`` logits (and the teacher's) exist at once."""

DEFAULT_GAMMA = 4.0
"""DeepSpec's slot decay ``exp(-k/4)``, whatever the block (``train.gamma`` overrides it)."""


def is_dspark(config) -> bool:
    return getattr(config, "markov_rank", None) is not None


def dspark_fields(drafter_cfg) -> dict | None:
    """The flat config additions of ``drafter.arch: dspark`` (None otherwise)."""
    if drafter_cfg.arch != "dspark":
        return None
    confidence = drafter_cfg.dspark_confidence_alpha > 0
    return {"markov_rank": int(drafter_cfg.markov_rank), "markov_head_type": "vanilla",
            "enable_confidence_head": confidence,
            "confidence_head_with_markov": bool(confidence and drafter_cfg.confidence_with_markov)}


class MarkovHead(nn.Module):
    """The vanilla Markov head: a rank-r bias over the vocabulary from the previous token."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        if rank < 1:
            raise ValueError(f"drafter.markov_rank: must be >= 1 (got {rank})")
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        self._mark()

    def _mark(self) -> None:
        # Token tables, not maps: Muon leaves them to AdamW (speculators' rule, by name).
        keep_off_muon(self.markov_w1.weight, self.markov_w2.weight)

    def _apply(self, fn, recurse=True):
        # ``to_empty`` from the meta device (``drafter_shell``) makes new parameters.
        out = super()._apply(fn, recurse)
        self._mark()
        return out

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        """``W1[prev]`` ``[..., r]``: what the bias and the confidence head read of the previous token."""
        return self.markov_w1(prev.long())

    def bias(self, embedded: torch.Tensor) -> torch.Tensor:
        """fp32 ``[..., V]`` added to the head's logits."""
        return F.linear(embedded.float(), self.markov_w2.weight.float())


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor | None) -> torch.Tensor:
        """The acceptance logit ``[...]`` (fp32) of drafter states ``hidden`` ``[..., H]``,
        beside ``W1[prev]`` when the head was built with the Markov embedding."""
        x = hidden if embedded is None else torch.cat([hidden, embedded.to(hidden.dtype)], dim=-1)
        return self.proj(x.to(self.proj.weight.dtype)).squeeze(-1).float()


def build_heads(config) -> tuple[MarkovHead, ConfidenceHead | None]:
    """The two heads a DSpark config (``DSPARK_KEYS``) asks for."""
    if str(getattr(config, "markov_head_type", "vanilla")).lower() != "vanilla":
        raise ValueError(f"markov_head_type {config.markov_head_type!r}: only the vanilla Markov head is "
                         "implemented (and vLLM's Qwen3 DSpark serves no other)")
    markov = MarkovHead(int(config.vocab_size), int(config.markov_rank))
    confidence = None
    if getattr(config, "enable_confidence_head", False):
        extra = int(config.markov_rank) if getattr(config, "confidence_head_with_markov", False) else 0
        confidence = ConfidenceHead(int(config.hidden_size) + extra)
    return markov, confidence


# ---------------------------------------------------------------------------
# the objective


@dataclass(frozen=True)
class DSparkObjective:
    """How the three terms weigh (``drafter.dspark_*``): DeepSpec's 0.1 / 0.9 / 1.0 by default."""

    ce_alpha: float = 0.1
    distance_alpha: float = 0.9
    confidence_alpha: float = 1.0
    distance: str = "l1"

    @property
    def needs_teacher(self) -> bool:
        return self.distance_alpha > 0 or self.confidence_alpha > 0

    @classmethod
    def from_config(cls, cfg) -> "DSparkObjective | None":
        d = cfg.drafter
        if d.arch != "dspark":
            return None
        return cls(d.dspark_ce_alpha, d.dspark_distance_alpha, d.dspark_confidence_alpha, d.dspark_distance)


def _head_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # The frozen head keeps the target's dtype; everything after it runs in fp32.
    return F.linear(h.to(weight.dtype), weight).float()


def _chunk(h, embedded, weight, w2, labels, teacher, distance: str):
    logits = _head_logits(h, weight) + F.linear(embedded.float(), w2.float())
    logp = logits.log_softmax(-1)
    ce = -logp.gather(1, labels[:, None]).squeeze(1)
    pred = logits.detach().argmax(-1)
    if teacher is None:
        zero = ce.new_zeros(ce.shape)
        return ce, zero, zero, pred
    with torch.no_grad():
        target_p = _head_logits(teacher, weight).softmax(-1)
    diff = logp.exp() - target_p
    l1 = diff.abs().sum(-1)
    tv = 0.5 * l1.detach()
    if distance == "kl":
        dist = (target_p * (target_p.clamp_min(1e-30).log() - logp)).sum(-1)
    else:
        dist = l1
    return ce, dist, tv, pred


@dataclass
class DSparkRows:
    numerator: torch.Tensor   # ce_alpha*sum(CE w) + distance_alpha*sum(D w) + confidence_alpha*sum(BCE w)
    ce: torch.Tensor          # [n] CE against the data's token (Markov-corrected logits)
    tv: torch.Tensor          # [n] TV to the target (0 without one), detached
    pred: torch.Tensor        # [n] the corrected logits' argmax after the gold predecessor
    confidence: torch.Tensor | None   # [n] acceptance logits


def dspark_rows(drafter, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, prev: torch.Tensor,
                teacher: torch.Tensor | None, w: torch.Tensor, objective: DSparkObjective | None) -> DSparkRows:
    """DSpark's terms over ``n`` supervised slots: drafter states ``hidden`` ``[n, H]``, the
    frozen head ``weight``, gold ``labels`` and teacher-forced predecessors ``prev`` ``[n]``,
    the target's last-layer states ``teacher`` ``[n, H]`` (None: no target distribution),
    slot weights ``w``. Logits exist ``ROWS_PER_CHUNK`` rows at a time, recomputed in the
    backward (checkpointed, as NeMo's L1 is)."""
    o = objective or DSparkObjective(1.0, 0.0, 0.0)
    if o.needs_teacher and teacher is None and torch.is_grad_enabled():
        raise ValueError("drafter.arch: dspark's distance and confidence terms need the target's distribution "
                         "(train.loss: distill), or set drafter.dspark_distance_alpha and "
                         "dspark_confidence_alpha to 0")
    markov = drafter.markov_head
    embedded = markov.embed(prev)
    parts = []
    for s in range(0, len(hidden), ROWS_PER_CHUNK):
        sl = slice(s, s + ROWS_PER_CHUNK)
        t = None if teacher is None else teacher[sl]
        args = (hidden[sl], embedded[sl], weight, markov.markov_w2.weight, labels[sl], t, o.distance)
        parts.append(checkpoint(_chunk, *args, use_reentrant=False) if torch.is_grad_enabled() else _chunk(*args))
    if parts:
        ce, dist, tv, pred = (torch.cat(x) for x in zip(*parts))
    else:
        ce = dist = tv = hidden.new_zeros(0, dtype=torch.float32)
        pred = labels.new_zeros(0)
    numerator = o.ce_alpha * (ce * w).sum()
    if o.distance_alpha > 0:
        numerator = numerator + o.distance_alpha * (dist * w).sum()
    conf = None
    if drafter.confidence_head is not None:
        with_markov = drafter.confidence_head.proj.in_features > hidden.shape[-1]
        conf = drafter.confidence_head(hidden, embedded if with_markov else None)
        if o.confidence_alpha > 0 and teacher is not None:
            bce = F.binary_cross_entropy_with_logits(conf, (1.0 - tv).clamp(0.0, 1.0), reduction="none")
            numerator = numerator + o.confidence_alpha * (bce * w).sum()
        else:
            # An unused head still gets a (zero) gradient: every process reduces every parameter's.
            numerator = numerator + conf.sum() * 0.0
    return DSparkRows(numerator, ce, tv.detach(), pred, conf)


# ---------------------------------------------------------------------------
# decoding


@torch.no_grad()
def markov_walk(markov: MarkovHead, logits: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Greedy proposals ``[N, B]`` from the head's logits ``[N, B, V]`` of every slot of
    ``N`` blocks after their anchors ``[N]``: slot by slot, the argmax of the logits plus
    the Markov bias of the token just chosen (slot 0's: the anchor)."""
    prev, path = anchors, []
    for k in range(logits.shape[1]):
        prev = (logits[:, k].float() + markov.bias(markov.embed(prev))).argmax(-1)
        path.append(prev)
    return torch.stack(path, dim=1)
