"""The DFlash objective computed one sequence at a time: the oracle the batched
``dflash_actors.models.loss.dflash_loss`` is tested against.

Each sequence with anchors is its own drafter forward with a dense mask
``[1, 1, N*B, L+N*B]`` built here (not from the package's rule), so a mistake in the
batched layout, its mask or its row order shows up as a difference. Dense sdpa only.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from dflash_actors.models.drafter import sdpa_dense
from dflash_actors.models.loss import BlockStats, slot_decay


def sequence_mask(anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """Boolean ``[1, 1, N*B, L+N*B]``: context ``< a_j``, own block bidirectional."""
    n = len(anchors)
    q_block = torch.arange(n * block_size) // block_size
    kv = torch.arange(ctx_len + n * block_size)
    ctx_ok = (kv[None, :] < ctx_len) & (kv[None, :] < anchors[q_block][:, None])
    own = (kv[None, :] >= ctx_len) & ((kv[None, :] - ctx_len) // block_size == q_block[:, None])
    return (ctx_ok | own)[None, None]


def sequence_hidden(drafter, embed_tokens, ctx: torch.Tensor, tokens: torch.Tensor,
                    anchors: torch.Tensor) -> torch.Tensor:
    """Hidden states ``[N, B, H]`` of one sequence's blocks (context ``[L, H]``, ids ``[L]``)."""
    B, L, n = drafter.block_size, len(tokens), len(anchors)
    noise_ids = torch.full((n, B), drafter.mask_token_id, dtype=torch.long)
    noise_ids[:, 0] = tokens[anchors]
    noise = embed_tokens(noise_ids).reshape(1, n * B, -1).to(ctx.dtype)
    positions = torch.cat([torch.arange(L), (anchors[:, None] + torch.arange(B)).reshape(-1)])
    out = drafter(noise, ctx[None], positions[None], sdpa_dense(sequence_mask(anchors, L, B)))
    return out.reshape(n, B, -1)


def sequence_labels(tokens: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels, valid)`` ``[N, B]`` of one sequence: ``tok[a+k]`` where ``a+k < L`` and ``m[a+k] = 1``."""
    L = len(tokens)
    pos = anchors[:, None] + torch.arange(block_size)
    inside = pos < L
    pos = pos.clamp(max=L - 1)
    valid = inside & loss_mask[pos].bool()
    valid[:, 0] = False
    return tokens[pos], valid


def dflash_loss_per_sequence(drafter, head, features: torch.Tensor, batch, anchors: list[np.ndarray],
                             gamma: float, teacher_logits=None) -> tuple[torch.Tensor, BlockStats]:
    """``(loss, stats)`` as ``dflash_loss`` defines them, one drafter forward per sequence.
    With ``teacher_logits(ids) -> [L, V]`` (the target's own forward of one sequence) each
    slot k of anchor a learns ``softmax(logits[a+k-1])``, as ``loss="distill"`` defines it."""
    B = drafter.block_size
    ids, lmask = batch.input_ids, batch.loss_mask
    ctx_all = drafter.context(features.to(drafter.fc.weight.dtype))
    decay = slot_decay(B, gamma)
    hs, labels, ws, valids, soft = [], [], [], [], []
    for (s, e), a in zip(batch.sequences(), anchors):
        if len(a) == 0:
            continue
        a = torch.as_tensor(a, dtype=torch.long)
        hs.append(sequence_hidden(drafter, head.embed_tokens, ctx_all[s:e], ids[s:e], a))
        lab, valid = sequence_labels(ids[s:e], lmask[s:e], a, B)
        if teacher_logits is not None:
            before = (a[:, None] + torch.arange(B) - 1).clamp(0, e - s - 1)
            soft.append(teacher_logits(ids[s:e]).float()[before].softmax(-1))
        labels.append(lab)
        valids.append(valid)
        ws.append(valid.float() * decay)
    if not hs:
        zero = sum(p.sum() for p in drafter.parameters()) * 0.0
        return zero, BlockStats(0, 0, torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long), 0.0, 0.0)
    valid = torch.cat(valids)
    rows = valid.nonzero(as_tuple=True)
    lab = torch.cat(labels)[rows]
    w = torch.cat(ws)[rows]
    # Plain autograd over the whole [rows, vocab] logits: none of the package's head code.
    logits = F.linear(torch.cat(hs)[rows], head.lm_head.weight).float()
    if teacher_logits is None:
        ce = F.cross_entropy(logits, lab, reduction="none")
    else:
        ce = -(torch.cat(soft)[rows] * logits.log_softmax(-1)).sum(-1)
    wce, pred = (ce * w).sum(), logits.argmax(-1)
    wsum = w.sum()
    correct = torch.zeros_like(valid)
    correct[rows] = pred == lab
    leading = correct[:, 1:].long().cumprod(dim=1).sum(dim=1)
    stats = BlockStats(
        blocks=int(valid.shape[0]), accepted=int(leading.sum()),
        slot_correct=correct.long().sum(0), slot_total=valid.long().sum(0),
        weighted_ce=float(wce.detach()), weight=float(wsum))
    return wce / wsum, stats
