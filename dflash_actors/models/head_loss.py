"""The frozen vocabulary head's cross-entropy over a drafter's supervised rows, and the
vocabulary it runs over.

The head and its cross-entropy run in chunks of rows, so ``[rows, vocab]`` logits exist
only one chunk at a time. By default the chunk's gradient is made in the forward
(``fused_ce``: two matmuls of the head per row instead of checkpointing's three). The same
chunks give a DFlash2 its candidates, each row's top-K head rows (``head_candidates``).
``train.head_vocab`` may restrict the softmax to the data's tokens, or to those plus
rows drawn per batch (``VocabRows``, ``restricted_ce``).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CE_CHUNK_ROWS = 4096
"""Rows of [rows, vocab] logits alive at once (4096 x 152k fp32 = 2.5 GB at most)."""


def _chunk_rows(teacher) -> int:
    # Distillation keeps the teacher's logits beside the drafter's: half the rows, same memory.
    return CE_CHUNK_ROWS if teacher is None else CE_CHUNK_ROWS // 2


def _logits(h, weight, bias):
    # The frozen head keeps the target's dtype (bf16 on GPU); CE itself runs in fp32.
    logits = F.linear(h.to(weight.dtype), weight).float()
    return logits if bias is None else logits.add_(bias)


def _top(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` best head rows of each row of logits (a DFlash2's candidates), best first."""
    return logits.topk(k, dim=-1).indices if k else logits.new_zeros((len(logits), 0), dtype=torch.long)


def _ce_rows(hidden, weight, labels, teacher=None, bias=None, top_k=0):
    logits = _logits(hidden, weight, bias)
    hard = F.cross_entropy(logits, labels, reduction="none")
    cand = _top(logits.detach(), top_k)
    if teacher is None:
        return hard, logits.argmax(-1), hard.detach(), cand
    target_p = _logits(teacher, weight, bias).softmax(-1)
    return -(target_p * logits.log_softmax(-1)).sum(-1), logits.argmax(-1), hard.detach(), cand


def checkpointed_ce(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                    teacher: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                    top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss per row, argmax, CE against labels)`` by autograd over checkpointed chunks:
    the head's matmul runs three times (forward, recomputed forward, backward), four
    with a ``teacher``, and one chunk of logits is alive at a time. The loss is CE
    against ``labels``, or against ``softmax(teacher @ W.T)`` when ``teacher`` rows are given.
    ``bias`` (one float per head row, fp32) is added to every row's logits, the teacher's too.
    A fourth result holds each row's ``top_k`` best head rows (``[rows, 0]`` for none)."""
    out = []
    n = _chunk_rows(teacher)
    for s in range(0, len(hidden), n):
        sl = slice(s, s + n)
        out.append(checkpoint(_ce_rows, hidden[sl], lm_head_weight, labels[sl],
                              None if teacher is None else teacher[sl], bias, top_k, use_reentrant=False))
    return tuple(torch.cat(parts) for parts in zip(*out))


class _FusedHeadCE(torch.autograd.Function):
    """CE per row of a frozen head, its gradient made in the forward.

    The head takes no gradient and every use of the rows' CE downstream is a weighted
    sum with weights that take none either (slot decay, D-PACE's detached weights), so
    d(sum w*CE)/d(hidden) = w * (softmax - onehot) @ W per row: computed chunk by chunk
    while the chunk's logits exist, kept as ``[rows, H]``, scaled by the incoming
    weights in the backward. Two matmuls instead of the checkpointed path's three, and
    no logits outlive their chunk. With ``teacher`` rows the target is
    ``p = softmax(teacher @ W.T)`` instead of the one-hot: the loss is
    ``lse - p . logits`` and the gradient ``(softmax - p) @ W`` (one more matmul, for p)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, teacher, bias, top_k):
        losses, preds, hards, cands = [], [], [], []
        grad = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        n = _chunk_rows(teacher)
        for s in range(0, len(hidden), n):
            h, lab = hidden[s:s + n], labels[s:s + n]
            logits = _logits(h, weight, bias)
            preds.append(logits.argmax(-1))
            cands.append(_top(logits, top_k))
            lse = torch.logsumexp(logits, dim=-1)
            hards.append(lse - logits.gather(1, lab[:, None]).squeeze(1))
            if teacher is not None:
                target_p = _logits(teacher[s:s + n], weight, bias).softmax(-1)
                losses.append(lse - (target_p * logits).sum(-1))
            probs = logits.sub_(lse[:, None]).exp_()          # softmax, in the logits' memory
            if teacher is None:
                probs[torch.arange(len(lab), device=lab.device), lab] -= 1.0
            else:
                probs.sub_(target_p)
                del target_p
            grad[s:s + len(h)] = (probs.to(weight.dtype) @ weight).float()
            del logits, probs
        ctx.save_for_backward(grad)
        ctx.hidden_dtype = hidden.dtype
        empty = hidden.new_zeros(0, dtype=torch.float32)
        pred = torch.cat(preds) if preds else labels.new_zeros(0)
        hard = torch.cat(hards) if hards else empty
        cand = torch.cat(cands) if cands else labels.new_zeros((0, top_k))
        ctx.mark_non_differentiable(pred, hard, cand)
        loss = hard.clone() if teacher is None else (torch.cat(losses) if losses else empty)
        return loss, pred, hard, cand

    @staticmethod
    def backward(ctx, grad_loss, _grad_pred, _grad_hard, _grad_cand):
        (grad,) = ctx.saved_tensors
        return (grad * grad_loss[:, None]).to(ctx.hidden_dtype), None, None, None, None, None


def fused_ce(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
             teacher: torch.Tensor | None = None, bias: torch.Tensor | None = None,
             top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``checkpointed_ce``'s results with the gradient made in the forward (``_FusedHeadCE``)."""
    if lm_head_weight.requires_grad:
        raise ValueError("fused_ce: the head must be frozen (its gradient is not computed)")
    return _FusedHeadCE.apply(hidden, lm_head_weight, labels, teacher, bias, top_k)


def head_candidates(hidden, lm_head_weight, labels, how: str = "fused", teacher=None, bias=None, top_k: int = 0):
    """``head_ce``'s three results and each row's ``top_k`` best head rows, from the same
    chunks of logits (a DFlash2's candidates cost no second pass over the head)."""
    f = checkpointed_ce if how == "checkpointed" else fused_ce
    return f(hidden, lm_head_weight, labels, teacher, bias, top_k)


def head_ce(hidden, lm_head_weight, labels, how: str = "fused", teacher=None, bias=None):
    """Loss per row, argmax and CE against ``labels`` of the frozen head, by
    ``train.head_loss`` (auto = fused); the loss is distillation's with ``teacher`` rows."""
    return head_candidates(hidden, lm_head_weight, labels, how, teacher, bias)[:3]


@functools.lru_cache(maxsize=4)
def _data_vocab(path: str) -> torch.Tensor:
    from ..data.dataset import TokenDataset
    return torch.from_numpy(TokenDataset(path, progress=False).supervised_tokens())


def training_vocab(cfg) -> torch.Tensor | None:
    """``train.head_vocab``'s rows of the head, sorted (None: the full head). Read from
    the training dataset once per process: every process that trains (drafter actors,
    the reference) derives the same set from the same files."""
    if cfg.train.head_vocab == "full":
        return None    # sampled: the data's rows plus, per batch, rows drawn from the rest
    from ..data.synthetic import train_path
    return _data_vocab(str(train_path(cfg)))


class VocabRows:
    """A restricted training head: the rows ``ids`` of the full head, with labels and
    argmaxes mapped between the two numberings, and ``bias`` (None, or one float per
    row) added to those rows' logits."""

    def __init__(self, ids: torch.Tensor, vocab_size: int, device, bias: torch.Tensor | None = None):
        self.ids = ids.to(device)
        self.bias = None if bias is None else bias.to(device, torch.float32)
        self.position = torch.full((vocab_size,), -1, dtype=torch.long, device=device)
        self.position[self.ids] = torch.arange(len(ids), device=device)

    @classmethod
    def sampled(cls, vocab: torch.Tensor, vocab_size: int, negatives: int, generator: torch.Generator,
                device) -> "VocabRows":
        """``vocab`` plus ``negatives`` rows drawn without replacement from the rest of
        the head, each drawn logit raised by log(rest / negatives): the drawn rows'
        exp-sum is then an unbiased estimate of the whole rest's, so every row outside
        ``vocab`` keeps being pushed down (sampled softmax)."""
        inside = torch.zeros(vocab_size, dtype=torch.bool)
        inside[vocab] = True
        rest = (~inside).nonzero()[:, 0]
        k = min(negatives, len(rest))
        drawn = rest[torch.randperm(len(rest), generator=generator)[:k]]
        bias = torch.zeros(len(vocab) + k)
        if k:
            bias[len(vocab):] = math.log(len(rest) / k)
        return cls(torch.cat([vocab, drawn]), vocab_size, device, bias)

    def labels(self, lab: torch.Tensor) -> torch.Tensor:
        out = self.position[lab]
        if (out < 0).any():
            bad = int(lab[out < 0][0])
            raise ValueError(f"train.head_vocab: label token {bad} is not in the training vocabulary "
                             "(the dataset changed under the job?)")
        return out


def restricted_ce(hidden, lm_head_weight, labels, rows: VocabRows, how: str = "fused", teacher=None):
    """``head_ce`` with the softmax over ``rows`` only: results in the full numbering."""
    ce, pred, hard = head_ce(hidden, lm_head_weight.index_select(0, rows.ids), rows.labels(labels), how, teacher,
                             rows.bias)
    return ce, rows.ids[pred], hard


def as_rows(vocab, head) -> VocabRows | None:
    """``vocab`` (None, sorted token ids, or ``VocabRows``) as ``VocabRows`` of ``head``."""
    if vocab is None or isinstance(vocab, VocabRows):
        return vocab
    W = head.lm_head.weight
    return VocabRows(vocab, W.shape[0], W.device)
