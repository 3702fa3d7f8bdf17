"""The DFlash training objective over a packed batch, and its metrics.

Per sequence (of length L, tokens ``tok``, loss mask ``m``):
  * anchors: up to ``num_anchors`` distinct positions ``a <= L-2`` with
    ``m[a] = m[a+1] = 1``, drawn uniformly without replacement and sorted; the draw is
    seeded by ``(seed, epoch, batch_id, row)`` only, so any process reproduces it;
  * block j: ids ``[tok[a_j], MASK x (B-1)]``, positions ``a_j + 0..B-1``; slot k >= 1
    predicts ``tok[a_j + k]`` (same position, no shift);
  * visibility: block j sees context positions ``< a_j`` of its own sequence (strictly:
    at inference the anchor's own target state does not exist yet) and its own block in
    both directions; never another block, another sequence, or anything ``>= a_j``.
    Keyed by anchor position, not block index, so overlapping blocks cannot leak;
  * loss: ``sum(CE * w) / sum(w)`` over the whole batch with
    ``w = m[a+k] * [a+k < L] * exp(-(k-1)/gamma)``, slot 0 excluded (or D-PACE's
    detached weights in place of the decay, ``train.position_weight``). CE is against
    ``tok[a+k]``, or with ``train.loss: distill`` against the target's softmax at
    position ``a+k-1`` (its logits made from the last-layer state that the features
    then carry after the drafter's layers, through the same frozen head).

All sequences given go through the drafter at once (training gives it a batch's rows a
micro-batch at a time: ``train.drafter_step``), right-padded per sequence:
context ``[R, Lmax, H]`` and noise ``[R, Nmax*B, H]`` for the R sequences that have
anchors, so each layer makes one attention call. A padded block (a row with fewer than
``Nmax`` anchors) sees only itself and is left out of the loss and the stats. Padded
rather than one packed row because the batch plan groups sequences by length (>= 95%
real), so padding costs about what a loop over sequences does, whereas a dense mask over
one packed row grows with the square of the whole batch. The visibility rule is one
function of (row, query, key) indices: on CPU it fills a dense boolean mask
``[R, 1, Nmax*B, Lmax+Nmax*B]`` for sdpa (broadcast over heads), on CUDA it is the
``mask_mod`` of a flex ``BlockMask`` with ``B=R, H=None``. The frozen LM head's
cross-entropy is ``models.head_loss``'s; the anchors, the visibility rule and the drafter's
forward over the blocks are ``models.blocks``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .blocks import PaddedBlocks, autocast_for, batch_anchors, block_labels, pad_blocks, padded_hidden, teacher_rows
from .dflash2 import SelectorObjective, selector_rows
from .dspark import DEFAULT_GAMMA, DSparkObjective, dspark_rows
from .head_loss import VocabRows, as_rows, head_candidates, restricted_ce, training_vocab
from .xpress import XPressObjective, xpress_rows


def decay_gamma(cfg) -> float:
    """Configured gamma, else 7/5/4 for block 16/10/8 (published), else B/2 - 1; a
    DSpark's 4 (DeepSpec's, every block)."""
    if cfg.train.gamma is not None:
        return float(cfg.train.gamma)
    if cfg.drafter.arch in ("dspark", "xpress"):
        return DEFAULT_GAMMA        # DeepSpec's and speculators' XPress default
    b = cfg.drafter.block_size
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(b, max(1.0, b / 2 - 1))


def slot_decay(block_size: int, gamma: float, shift: int = 0) -> torch.Tensor:
    """``[B]`` float32: 0 for the anchor slot, ``exp(-(k-1)/gamma)`` for slot k >= 1; with
    ``shift`` 1 (a DSpark's, whose anchor slot proposes) ``exp(-k/gamma)`` from slot 0."""
    k = torch.arange(block_size, dtype=torch.float64)
    w = torch.exp(-(k - 1 + shift) / gamma)
    if not shift:
        w[0] = 0.0
    return w.float()


# ---------------------------------------------------------------------------
# anchors


# ---------------------------------------------------------------------------
# masks


# ---------------------------------------------------------------------------
# forward


@dataclass
class BlockStats:
    """Sums over a batch's blocks; add them up across batches, then ``metrics``."""

    blocks: int
    accepted: int                 # sum over blocks of the leading correct slots
    slot_correct: torch.Tensor    # [B] int64 (slot 0 always 0)
    slot_total: torch.Tensor      # [B] int64
    weighted_ce: float            # sum(CE * w)
    weight: float                 # sum(w)
    # A DFlash2 proposes through its selector, which ``accepted`` and ``slot_correct``
    # score; these score the head's own argmax beside it, and how often the gold token
    # was among the candidates at all (over ``slot_total``).
    selector: bool = False
    base_accepted: int = 0
    hits: int = 0

    def __add__(self, o: "BlockStats") -> "BlockStats":
        return BlockStats(self.blocks + o.blocks, self.accepted + o.accepted, self.slot_correct + o.slot_correct,
                          self.slot_total + o.slot_total, self.weighted_ce + o.weighted_ce, self.weight + o.weight,
                          self.selector or o.selector, self.base_accepted + o.base_accepted, self.hits + o.hits)

    def metrics(self) -> dict:
        f = 0 if int(self.slot_total[0]) else 1     # a DSpark's anchor slot proposes too
        acc = (self.slot_correct[f:].double() / self.slot_total[f:].clamp(min=1)).tolist()
        out = {"loss": self.weighted_ce / max(self.weight, 1e-12),
               "tau": 1.0 + self.accepted / max(self.blocks, 1),
               "slot_acc": [round(a, 4) for a in acc], "blocks": self.blocks}
        if self.selector:
            out["tau_unary"] = 1.0 + self.base_accepted / max(self.blocks, 1)
            out["candidate_recall"] = round(self.hits / max(int(self.slot_total.sum()), 1), 4)
        return out


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, rows, alpha: float) -> torch.Tensor:
    """D-PACE's slot weights for the rows ``rows`` of ``valid`` ``[..., B]``, detached.

    With ``q_k = exp(-CE_k)`` the drafter's probability of the right token at slot k and
    ``r_k = (1 - alpha) q_k + alpha`` (alpha keeps early training from starving the later
    slots), slot j weighs ``sum_{m >= j} prod_{i <= m} r_i``: how many accepted tokens
    slot j is expected to take part in. A slot outside the loss ends the chain."""
    r = torch.zeros(valid.shape, dtype=torch.float32, device=ce.device)
    r[rows] = (1 - alpha) * torch.exp(-ce.detach().float()) + alpha
    run = r[..., 1:].cumprod(dim=-1)
    w = torch.zeros_like(r)
    w[..., 1:] = run.flip(-1).cumsum(-1).flip(-1)
    return w[rows]


NEGATIVES_TAG = 1_000_003
"""Fourth seed word of a batch's drawn head rows: out of the range of the anchors' row index."""


@dataclass(frozen=True)
class Objective:
    """Everything a batch's loss depends on besides the weights and the batch: the same
    in every process (the drafter actors, the reference, the probes)."""

    num_anchors: int
    gamma: float
    seed: int
    compute_dtype: str = "auto"
    head_loss: str = "fused"
    position_weight: str = "decay"
    dpace_alpha: float = 0.5
    loss: str = "ce"
    vocab: torch.Tensor | None = field(default=None, compare=False, repr=False)
    """``training_vocab``: the head rows the softmax runs over (None: all)."""
    negatives: int = 0
    """``head_vocab: sampled``: rows drawn per batch from outside ``vocab``."""
    selector: SelectorObjective | None = None
    """A DFlash2's selector term (None: a DFlash)."""
    dspark: DSparkObjective | None = None
    """A DSpark's three terms (``models.dspark``)."""
    xpress: XPressObjective | None = None
    """An XPress's passes and terms (``models.xpress``)."""

    @classmethod
    def from_config(cls, cfg) -> "Objective":
        t = cfg.train
        return cls(t.num_anchors, decay_gamma(cfg), t.seed, t.compute_dtype,
                   "checkpointed" if t.head_loss == "checkpointed" else "fused", t.position_weight, t.dpace_alpha,
                   t.loss, training_vocab(cfg), t.head_negatives if t.head_vocab == "sampled" else 0,
                   SelectorObjective.from_config(cfg), DSparkObjective.from_config(cfg),
                   XPressObjective.from_config(cfg))


@dataclass
class Blocks:
    """The blocks of some rows' anchors laid out for one drafter forward (``pad_blocks``),
    with their labels and the supervised ``(row, block, slot)`` positions: everything
    that follows from token ids and loss masks alone, known before any forward."""

    p: PaddedBlocks
    labels: torch.Tensor      # [R, N, B]
    valid: torch.Tensor       # [R, N, B] bool: a real block's slot k >= 1 inside its row with m = 1
    rows: tuple               # valid.nonzero(as_tuple=True)
    shift: int = 0            # the drafter's label_shift: slot k labels tok[a + k + shift]

    def predecessors(self) -> torch.Tensor:
        """The gold token before each supervised position (the first slot's is the anchor), in ``rows`` order."""
        r, j, k = self.rows
        if self.shift:
            return self.p.tokens[r, self.p.anchors[r, j] + k]
        return self.labels[r, j, k - 1]

    def decay_weights(self, gamma: float) -> torch.Tensor:
        """``slot_decay`` of each supervised position, in ``rows`` order."""
        B = self.valid.shape[-1]
        return slot_decay(B, gamma, self.shift).to(self.valid.device).expand(self.valid.shape)[self.rows]


def lay_out(batch, anchors: list[np.ndarray], block_size: int, device, shift: int = 0) -> Blocks:
    """``Blocks`` of ``batch`` for ``anchors`` per row (at least one somewhere); ``shift``:
    the drafter's ``label_shift``."""
    p = pad_blocks(batch, anchors, device)
    labels, valid = block_labels(p.tokens, p.loss_mask, p.anchors, block_size, shift)
    valid &= p.real[..., None]
    return Blocks(p, labels, valid, valid.nonzero(as_tuple=True), shift)


def blocks_loss(drafter, head, features: torch.Tensor, blocks: Blocks, gamma: float, *,
                compute_dtype: str = "auto", head_loss: str = "fused", position_weight: str = "decay",
                dpace_alpha: float = 0.5, loss: str = "ce", vocab: VocabRows | None = None,
                weights: torch.Tensor | None = None, total_weight: torch.Tensor | None = None,
                checkpoint_layers: bool = False, selector: SelectorObjective | None = None,
                selector_total: torch.Tensor | None = None,
                dspark: DSparkObjective | None = None,
                xpress: XPressObjective | None = None) -> tuple[torch.Tensor, "Tally"]:
    """``(sum(CE*w) / total_weight [+ the selector term], tally)`` over ``blocks``
    (``dflash_loss`` says what each option does); ``total_weight`` defaults to these
    blocks' own ``sum(w)``, and a micro-batch passes the whole batch's instead, so that
    its gradients add up to the batch's (``selector_total`` likewise for the selector's
    own denominator, ``selector.norm: own``). ``weights``: the slot weights of
    ``blocks.rows``, when the caller has them (D-PACE over micro-batches).

    A DFlash2 drafter (one with a ``candidate_selector``) is scored on what its selector
    proposes; with ``selector`` its K-way cross-entropy joins the loss
    (``models.dflash2.SelectorObjective``). A DSpark drafter (one with a ``markov_head``)
    takes ``dspark``'s three terms over the same denominator (``models.dspark``); an
    XPress drafter (one with a ``refiner_head``) ``xpress``'s passes (``models.xpress``).
    """
    if blocks.shift != getattr(drafter, "label_shift", 0):
        raise ValueError(f"blocks_loss: blocks laid out with label shift {blocks.shift} for a drafter whose "
                         f"is {drafter.label_shift} (lay_out(..., shift=drafter.label_shift))")
    with autocast_for(features.device, compute_dtype):
        hidden = padded_hidden(drafter, head.embed_tokens, features, blocks.p, checkpoint_layers)
    p, valid, rows = blocks.p, blocks.valid, blocks.rows
    lab = blocks.labels[rows]
    if getattr(drafter, "markov_head", None) is not None:
        return _dspark_loss(drafter, head, features, blocks, hidden, gamma, loss, weights, total_weight, dspark)
    if getattr(drafter, "refiner_head", None) is not None:
        return _xpress_loss(drafter, head, features, blocks, hidden, gamma, loss, weights, total_weight, xpress)
    teacher = teacher_rows(features, p, rows, hidden.shape[-1]) if loss == "distill" else None
    W = head.lm_head.weight
    chooser = drafter.candidate_selector
    top_k = 0 if chooser is None else chooser.top_k
    if vocab is None:
        ce, pred, hard, cand = head_candidates(hidden[rows], W, lab, head_loss, teacher, top_k=top_k)
    elif chooser is not None:
        raise ValueError("train.head_vocab: a DFlash2 selects among the top-K of the whole head (use full)")
    else:
        ce, pred, hard = restricted_ce(hidden[rows], W, lab, vocab, head_loss, teacher)
    if weights is not None:
        w = weights
    elif position_weight == "dpace":
        w = dpace_weights(hard, valid, rows, dpace_alpha)
    else:
        w = blocks.decay_weights(gamma)
    wce, wsum = (ce * w).sum(), w.sum()
    value = wce / (wsum if total_weight is None else total_weight)
    tally = Tally(torch.zeros_like(valid), wce.detach(), wsum, hard.detach())
    if chooser is None:
        tally.correct[rows] = pred == lab
        return value, tally
    picked = selector_rows(chooser, hidden[rows], W, cand, lab, blocks.predecessors(), w, selector)
    tally.correct[rows] = picked.chosen == lab
    tally.base_correct = torch.zeros_like(valid)
    tally.base_correct[rows] = pred == lab
    tally.hits, tally.hit_weight = picked.hit, (w * picked.hit).sum().detach()
    if selector is not None and selector.weight > 0 and torch.is_grad_enabled():
        # selector_total: the whole batch's hit weight (own) or slot count (count), from drafter_step.
        norm = selector.denominator(wsum if total_weight is None else total_weight,
                                    tally.hit_weight if selector_total is None else selector_total,
                                    len(lab) if selector_total is None else selector_total)
        value = value + selector.weight * picked.numerator / norm
    elif torch.is_grad_enabled():
        # An untrained selector still gets a (zero) gradient: every process reduces every parameter's.
        value = value + sum(q.sum() for q in chooser.parameters()) * 0.0
    return value, tally


def _dspark_loss(drafter, head, features, blocks: Blocks, hidden, gamma, loss, weights, total_weight,
                 objective: DSparkObjective | None) -> tuple[torch.Tensor, "Tally"]:
    rows = blocks.rows
    teacher = teacher_rows(features, blocks.p, rows, hidden.shape[-1], blocks.shift) if loss == "distill" else None
    w = blocks.decay_weights(gamma) if weights is None else weights
    out = dspark_rows(drafter, hidden[rows], head.lm_head.weight, blocks.labels[rows], blocks.predecessors(),
                      teacher, w, objective)
    wsum = w.sum()
    value = out.numerator / (wsum if total_weight is None else total_weight)
    tally = Tally(torch.zeros_like(blocks.valid), (out.ce.detach() * w).sum(), wsum, out.ce.detach())
    tally.correct[rows] = out.pred == blocks.labels[rows]
    return value, tally


def _xpress_loss(drafter, head, features, blocks: Blocks, hidden, gamma, loss, weights, total_weight,
                 objective: XPressObjective | None) -> tuple[torch.Tensor, "Tally"]:
    p, rows = blocks.p, blocks.rows
    teacher = teacher_rows(features, p, rows, hidden.shape[-1]) if loss == "distill" else None
    w = blocks.decay_weights(gamma) if weights is None else weights
    # tok[a+k] for every slot (labels: clamped past a row's end, where nothing is supervised)
    # and tok[a-1], the anchor's own token at a row's first position.
    before = p.tokens.gather(1, (p.anchors - 1).clamp(min=0))
    before = torch.where(p.anchors > 0, before, p.tokens.gather(1, p.anchors))
    out = xpress_rows(drafter.refiner_head, hidden, head.lm_head.weight, blocks.labels, before, rows, teacher, w,
                      objective)
    wsum = w.sum()
    value = out.numerator / (wsum if total_weight is None else total_weight)
    tally = Tally(torch.zeros_like(blocks.valid), (out.hard * w).sum(), wsum, out.hard)
    tally.correct[rows] = out.pred == blocks.labels[rows]
    return value, tally


@dataclass
class Tally:
    """What ``blocks_loss`` measured besides its value: ``block_stats`` counts it."""

    correct: torch.Tensor         # [R, N, B] bool: the proposal at that slot is the gold token
    wce: torch.Tensor             # sum(CE * w)
    wsum: torch.Tensor            # sum(w)
    hard: torch.Tensor            # [n] CE against the data's tokens, per supervised slot (D-PACE's input)
    base_correct: torch.Tensor | None = None   # a DFlash2's: the head's own argmax is the gold token
    hits: torch.Tensor | None = None           # [n] a DFlash2's: the gold token is among the candidates
    hit_weight: torch.Tensor | None = None     # sum(w) over those slots (``selector.norm: own``)


def _leading(correct: torch.Tensor, first: int = 1) -> int:
    return int(correct[..., first:].long().cumprod(dim=-1).sum())


def block_stats(blocks: Blocks, tally: Tally) -> "BlockStats":
    """The ``BlockStats`` of ``blocks_loss``'s tally."""
    t = tally
    stats = BlockStats(
        blocks=int(blocks.p.real.sum()), accepted=_leading(t.correct, blocks.shift ^ 1),
        slot_correct=t.correct.long().sum((0, 1)).cpu(), slot_total=blocks.valid.long().sum((0, 1)).cpu(),
        weighted_ce=float(t.wce), weight=float(t.wsum))
    if t.hits is not None:
        stats.selector, stats.base_accepted, stats.hits = True, _leading(t.base_correct), int(t.hits.sum())
    return stats


def no_blocks(drafter) -> tuple[torch.Tensor, "BlockStats"]:
    """A batch without an anchor: a zero loss that still reaches every parameter (so
    gradient accumulation needs no special case), and empty stats."""
    B = drafter.block_size
    zero = sum(p.sum() for p in drafter.parameters()) * 0.0
    return zero, BlockStats(0, 0, torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long), 0.0, 0.0,
                            selector=drafter.candidate_selector is not None)


def dflash_loss(drafter, head, features: torch.Tensor, batch, anchors: list[np.ndarray],
                gamma: float, *, compute_dtype: str = "auto", head_loss: str = "fused",
                position_weight: str = "decay", dpace_alpha: float = 0.5, loss: str = "ce",
                vocab: torch.Tensor | VocabRows | None = None,
                selector: SelectorObjective | None = None,
                dspark: DSparkObjective | None = None,
                xpress: XPressObjective | None = None) -> tuple[torch.Tensor, BlockStats]:
    """``(loss, stats)`` for a packed batch given its anchors per row, in one forward.

    ``head`` provides the frozen target ``embed_tokens`` and ``lm_head``; ``features``
    are the packed target features ``[T, k*H]``. The drafter runs under
    ``autocast_for(device, compute_dtype)``, the cross-entropy in fp32 (``head_ce``).
    Slots weigh ``exp(-(k-1)/gamma)`` or, with ``position_weight="dpace"``, D-PACE's
    detached weights (``dpace_weights``, from the CE against the data's tokens). With
    ``loss="distill"`` the features' last ``H`` columns are the target's last layer and
    each slot learns the target's softmax there, one position back. With ``vocab`` (sorted
    token ids, or ``VocabRows``) the softmax, its argmax and the teacher's run over those
    rows of the head only (``train.head_vocab``). With no anchor anywhere in the batch it
    returns ``no_blocks``. Training splits a batch into micro-batches (``train.drafter_step``).
    """
    if not any(len(a) for a in anchors):
        return no_blocks(drafter)
    blocks = lay_out(batch, anchors, drafter.block_size, features.device, getattr(drafter, "label_shift", 0))
    value, tally = blocks_loss(drafter, head, features, blocks, gamma, compute_dtype=compute_dtype,
                               head_loss=head_loss, position_weight=position_weight, dpace_alpha=dpace_alpha,
                               loss=loss, vocab=as_rows(vocab, head), selector=selector, dspark=dspark,
                               xpress=xpress)
    return value, block_stats(blocks, tally)


def batch_vocab(objective: "Objective", head, epoch: int, batch_id: int) -> VocabRows | torch.Tensor | None:
    """The head rows batch ``batch_id`` of ``epoch`` trains over: ``objective.vocab``,
    plus (``head_vocab: sampled``) its negatives, drawn from (seed, epoch, batch) so that
    every process that makes this batch's gradient draws the same rows."""
    o = objective
    if o.vocab is None or not o.negatives:
        return o.vocab
    seed = np.random.SeedSequence([o.seed, epoch, batch_id, NEGATIVES_TAG]).generate_state(1)[0]
    g = torch.Generator().manual_seed(int(seed))
    W = head.lm_head.weight
    return VocabRows.sampled(o.vocab, W.shape[0], o.negatives, g, W.device)


def batch_loss(drafter, head, features: torch.Tensor, batch, objective: Objective, *,
               epoch: int, batch_id: int) -> tuple[torch.Tensor, BlockStats]:
    """The training loss of batch ``batch_id`` of ``epoch`` in one forward: seeded
    anchors, then ``dflash_loss`` (``train.drafter_step`` trains it in micro-batches)."""
    o = objective
    return dflash_loss(drafter, head, features, batch, batch_anchors(batch, o.num_anchors, o.seed, epoch, batch_id),
                       o.gamma, compute_dtype=o.compute_dtype, head_loss=o.head_loss,
                       position_weight=o.position_weight, dpace_alpha=o.dpace_alpha, loss=o.loss,
                       vocab=batch_vocab(o, head, epoch, batch_id), selector=o.selector, dspark=o.dspark,
                       xpress=o.xpress)
