"""DFlash2's two additions to the DFlash drafter: the in-block convolution and the candidate selector.

**Convolution** (``BlockConv``, one per attention and one per MLP sublayer). On the
block (query) stream only, around the sublayer: before it on the normed input, after it
on the sublayer's output, each ``out_t = sum_i (base[i] + delta_t[i]) * x_{t-i}`` per
channel, ``i`` over ``conv_kernel_size`` taps. ``delta`` is shared by each group of
``conv_group_size`` channels and comes, for both sides at once, from one bias-free
projection of the sublayer's normed input. A tap never reads across a block boundary:
block position 0 (the anchor) reads zeros at tap 1, so blocks laid end to end in
training compute what one block alone computes at decoding. Identity at init (``base``
tap 0 is 1, the rest and the projection 0).

**Selector** (``CandidateSelector``). Per draft slot, the top ``selector_top_k``
candidates ``b`` of the unary (target head) logits ``U``, each scored after predecessor
``a`` as ``S(a, b) = U(b) + <A[a] * P h, B[b]>`` (rank-``selector_rank`` codebooks ``A``,
``B``, projection ``P``). Decoding walks from the anchor, each slot taking the best
candidate after the token just chosen (``walk``). Training scores each slot after its
gold predecessor (slot 1's is the anchor): while every earlier slot is right that is the
token the walk chose, so the leading correct slots, hence tau, are the walk's. At init
``B = 0``: every score is ``U`` and the walk is DFlash's argmax.

Parameter names are the published checkpoints' (``layers.N.attention_conv.base_kernel``,
``...kernel_projection.weight``, ``candidate_selector.hidden_projection.weight`` and the
bare ``candidate_selector.{predecessor,successor}_codebook``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .marks import keep_off_muon

DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
"""``dflash_config`` keys that make a drafter a DFlash2 (every engine requires all four)."""


def block_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """``out_t = sum_i (base[i] + delta_t[i]) * x_{t-i}`` inside each block.

    ``x`` ``[N, Q, H]`` holds ``Q / block_size`` blocks end to end; ``delta`` ``[N, Q,
    taps, G]`` one correction per group of ``H / G`` channels; ``base`` ``[taps, H]``. The
    shift runs along the in-block axis of a ``[N, blocks, block, G, H/G]`` view, padded
    with zeros, so position ``t < i`` of a block reads zero, never the previous block."""
    N, Q, H = x.shape
    taps, G = base.shape[0], delta.shape[-1]
    if Q % block_size:
        raise ValueError(f"block_conv: {Q} query rows are not whole blocks of {block_size}")
    xb = x.view(N, Q // block_size, block_size, G, H // G)
    db = delta.view(N, Q // block_size, block_size, taps, G, 1).to(x.dtype)
    out = None
    for i in range(min(taps, block_size)):
        shifted = xb if i == 0 else F.pad(xb[:, :, :-i], (0, 0, 0, 0, i, 0))
        term = (base[i].view(G, H // G).to(x.dtype) + db[:, :, :, i]) * shifted
        out = term if out is None else out + term
    return out.view(N, Q, H)


class BlockConv(nn.Module):
    """The convolutions before (side 0) and after (side 1) one sublayer."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"drafter.conv_kernel_size: must be >= 1 (got {kernel_size})")
        if group_size < 1 or hidden_size % group_size:
            raise ValueError(f"drafter.conv_group_size: {group_size} must divide the hidden size {hidden_size}")
        self.taps, self.groups, self.block_size = kernel_size, hidden_size // group_size, block_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The identity: tap 0 passes each channel through, nothing else contributes."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def before(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(convolved x, the after-side corrections)`` for the sublayer input ``x``."""
        delta = self.kernel_projection(x).view(*x.shape[:-1], 2, self.taps, self.groups)
        return block_conv(x, delta[..., 0, :, :], self.base_kernel[0], self.block_size), delta[..., 1, :, :]

    def after(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return block_conv(y, delta, self.base_kernel[1], self.block_size)


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        if rank < 1:
            raise ValueError(f"drafter.selector_rank: must be >= 1 (got {rank})")
        if not 1 <= top_k <= vocab_size:
            raise ValueError(f"drafter.selector_top_k: must be in 1..{vocab_size}, the vocabulary (got {top_k})")
        self.top_k = top_k
        # Bare parameters, not nn.Embedding: the published key has no ``.weight``.
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self._mark()

    def _mark(self) -> None:
        # Token tables, not maps: Muon leaves them to AdamW (speculators' rule).
        keep_off_muon(self.predecessor_codebook, self.successor_codebook)

    def _apply(self, fn, recurse=True):
        # ``to_empty`` from the meta device (``drafter_shell``) makes new parameters.
        out = super()._apply(fn, recurse)
        self._mark()
        return out

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None, std: float = 0.02,
                         successors: str = "zeros") -> None:
        """Predecessors small normal; successors (``drafter.selector_init``) 0, so every
        score is the unary logit and the successor codebook takes gradient at once, the
        other two from then on (``zeros``), or small normal too, drawn after the
        predecessors (``normal``: speculators', whose selector starts off the argmax)."""
        p = self.predecessor_codebook
        p.copy_(torch.randn(p.shape, generator=generator) * std)
        if successors == "normal":
            q = self.successor_codebook
            q.copy_(torch.randn(q.shape, generator=generator) * std)
        elif successors == "zeros":
            self.successor_codebook.zero_()
        else:
            raise ValueError(f"drafter.selector_init: zeros or normal (got {successors!r})")

    def scores(self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
               predecessors: torch.Tensor) -> torch.Tensor:
        """``S`` ``[..., K]`` of ``candidates`` ``[..., K]`` (unary logits ``unary``) after
        ``predecessors`` ``[...]``, for drafter states ``hidden`` ``[..., H]``."""
        A, B = self.predecessor_codebook, self.successor_codebook
        gate = A[predecessors] * self.hidden_projection(hidden.to(A.dtype))
        return unary.float() + torch.einsum("...r,...kr->...k", gate, B[candidates]).float()

    @torch.no_grad()
    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Greedy proposals ``[N, D]`` for drafter states ``hidden`` ``[N, D, H]`` with head
        logits ``logits`` ``[N, D, V]`` after the anchors ``[N]``: slot by slot the best
        candidate after the one just chosen. The projection and the top-K run for every
        slot at once; only the choice is sequential."""
        unary, cand = logits.topk(self.top_k, dim=-1)
        gate_h = self.hidden_projection(hidden.to(self.predecessor_codebook.dtype))
        B = self.successor_codebook[cand]                                  # [N, D, K, r]
        prev, path = anchors, []
        for d in range(hidden.shape[1]):
            gate = self.predecessor_codebook[prev] * gate_h[:, d]
            s = unary[:, d].float() + torch.einsum("nr,nkr->nk", gate, B[:, d]).float()
            prev = cand[:, d].gather(1, s.argmax(-1, keepdim=True))[:, 0]
            path.append(prev)
        return torch.stack(path, dim=1)


COUNT_EPS = 1e-5
"""``train.selector_norm: count``'s addend to the slot count (speculators' loss reduction
adds it to every denominator: ``_LOSS_REDUCTION_EPS``)."""


@dataclass(frozen=True)
class SelectorObjective:
    """How the selector's K-way cross-entropy joins the block loss (``train.selector_*``).

    ``loss = sum(CE w) / sum(w) + weight * sum(nll w [gold in top-K]) / norm``: ``norm``
    is ``own``, the selector term's own ``sum(w [gold in top-K])`` (NeMo Automodel's),
    ``dflash``, the block loss's ``sum(w)`` (SpecForge's), or ``count``, the number of
    supervised slots plus 1e-5 (speculators'). ``misses``: a slot whose gold token is not
    among the candidates carries no selector term (``skip``, what serving can select
    from) or takes the gold in place of the last candidate (``insert``, SpecForge's first
    version and speculators'). ``grad``: ``full`` lets the term's gradient reach the
    backbone through the unary logits and the drafter state (as every peer does),
    ``stop`` trains only the selector's own parameters with it."""

    weight: float = 1.0
    norm: str = "dflash"
    misses: str = "skip"
    grad: str = "full"

    def denominator(self, total_weight: torch.Tensor, hit_weight: torch.Tensor, slots) -> torch.Tensor:
        """What the selector term's numerator is divided by, given the (whole batch's)
        ``sum(w)``, ``sum(w)`` over the slots whose gold is a candidate, and the number
        of supervised ``slots``. Under ``insert`` every slot carries the term, so
        ``own`` is ``dflash`` there."""
        if self.norm == "count":
            return torch.as_tensor(slots, dtype=torch.float32, device=total_weight.device) + COUNT_EPS
        if self.norm == "dflash" or self.misses == "insert":
            return total_weight.clamp(min=1e-12)
        return hit_weight.clamp(min=1e-12)

    @classmethod
    def from_config(cls, cfg) -> "SelectorObjective | None":
        t = cfg.train
        if cfg.drafter.arch != "dflash2":
            return None
        return cls(t.selector_weight, t.selector_norm, t.selector_misses, t.selector_grad)


class _CandidateLogits(torch.autograd.Function):
    """``h . W[id]`` for each row's candidates, chunked, with the gradient into ``h`` only
    (the head is frozen): never a ``[rows, V]`` matrix, at most ``CHUNK x K x H`` gathered."""

    CHUNK = 1024

    @staticmethod
    def forward(ctx, hidden, weight, ids):
        out = torch.empty(ids.shape, dtype=torch.float32, device=hidden.device)
        for s in range(0, len(hidden), _CandidateLogits.CHUNK):
            e = s + _CandidateLogits.CHUNK
            out[s:e] = torch.einsum("nh,nkh->nk", hidden[s:e].float(), weight[ids[s:e]].float())
        ctx.save_for_backward(weight, ids)
        ctx.hidden_dtype = hidden.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, ids = ctx.saved_tensors
        out = torch.empty((len(ids), weight.shape[1]), dtype=torch.float32, device=grad.device)
        for s in range(0, len(ids), _CandidateLogits.CHUNK):
            e = s + _CandidateLogits.CHUNK
            out[s:e] = torch.einsum("nk,nkh->nh", grad[s:e].float(), weight[ids[s:e]].float())
        return out.to(ctx.hidden_dtype), None, None


def candidate_logits(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Unary logits ``[n, K]`` (fp32) of candidate ids ``[n, K]`` for rows ``hidden`` ``[n, H]``."""
    return _CandidateLogits.apply(hidden, weight, ids)


@dataclass
class SelectorRows:
    """The selector on a batch's supervised slots: its loss numerator and what it chose."""

    numerator: torch.Tensor   # sum(nll * w) over slots whose gold is a candidate (or all, with insert)
    hit: torch.Tensor         # [n] bool: the gold token is among the unary top-K
    chosen: torch.Tensor      # [n] the token the walk takes there after the gold predecessor


def selector_rows(selector: CandidateSelector, hidden: torch.Tensor, weight: torch.Tensor, candidates: torch.Tensor,
                  labels: torch.Tensor, predecessors: torch.Tensor, w: torch.Tensor,
                  objective: SelectorObjective | None) -> SelectorRows:
    """The selector over ``n`` supervised slots: drafter states ``hidden`` ``[n, H]``, the
    head ``weight``, unary top-K ``candidates`` ``[n, K]``, gold ``labels`` and gold
    ``predecessors`` ``[n]``, slot weights ``w``. Without an ``objective`` (or weight 0)
    only what it chooses, no loss."""
    hit_at = candidates == labels[:, None]
    hit = hit_at.any(-1)
    train = objective is not None and objective.weight > 0 and torch.is_grad_enabled()
    if not train:
        with torch.no_grad():
            s = selector.scores(hidden, candidate_logits(hidden, weight, candidates), candidates, predecessors)
        return SelectorRows(s.new_zeros(()), hit, candidates.gather(1, s.argmax(-1, keepdim=True))[:, 0])
    scored = candidates
    if objective.misses == "insert":
        scored = candidates.clone()
        scored[~hit, -1] = labels[~hit]
    h = hidden.detach() if objective.grad == "stop" else hidden
    s = selector.scores(h, candidate_logits(h, weight, scored), scored, predecessors)
    gold = scored == labels[:, None]
    keep = gold.any(-1)
    nll = F.cross_entropy(s, gold.long().argmax(-1), reduction="none")
    numerator = (nll * w * keep).sum()
    with torch.no_grad():
        if objective.misses == "insert":     # what serving selects from: the unary top-K alone
            s = selector.scores(hidden, candidate_logits(hidden, weight, candidates), candidates, predecessors)
        chosen = candidates.gather(1, s.argmax(-1, keepdim=True))[:, 0]
    return SelectorRows(numerator, hit, chosen)
