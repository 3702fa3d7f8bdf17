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
    ``w = m[a+k] * [a+k < L] * exp(-(k-1)/gamma)``, slot 0 excluded.

Sequences are processed one at a time so the mask is ``[1, 1, N*B, L+N*B]`` (never
batch-wide, never per head). On CUDA with flex_attention the same rule is a
``BlockMask`` with ``H=None``. The LM head and cross-entropy run in checkpointed chunks
of rows, so ``[rows, vocab]`` logits exist only one chunk at a time, in forward and in
backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash_actors.models.drafter import sdpa_dense

CE_CHUNK_ROWS = 4096
"""Rows of [rows, vocab] logits alive at once (4096 x 152k fp32 = 2.5 GB at most)."""


def decay_gamma(cfg) -> float:
    """Configured gamma, else 7/5/4 for block 16/10/8 (published), else B/2 - 1."""
    if cfg.train.gamma is not None:
        return float(cfg.train.gamma)
    b = cfg.drafter.block_size
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(b, max(1.0, b / 2 - 1))


def slot_decay(block_size: int, gamma: float) -> torch.Tensor:
    """``[B]`` float32: 0 for the anchor slot, ``exp(-(k-1)/gamma)`` for slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float64)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w.float()


# ---------------------------------------------------------------------------
# anchors


def anchor_candidates(loss_mask: np.ndarray) -> np.ndarray:
    """Positions a with ``m[a] = m[a+1] = 1`` (so slot 1 is always supervised)."""
    m = np.asarray(loss_mask).astype(bool)
    return np.flatnonzero(m[:-1] & m[1:])


def sample_anchors(loss_mask: np.ndarray, num_anchors: int, rng: np.random.Generator) -> np.ndarray:
    cand = anchor_candidates(loss_mask)
    if len(cand) > num_anchors:
        cand = np.sort(rng.choice(cand, num_anchors, replace=False))
    return cand


def batch_anchors(batch, num_anchors: int, seed: int, epoch: int, batch_id: int) -> list[np.ndarray]:
    """Anchors of every sample row of a batch, seeded by ``(seed, epoch, batch_id, row)``."""
    mask = batch.loss_mask.cpu().numpy()
    return [sample_anchors(mask[s:e], num_anchors, np.random.default_rng([seed, epoch, batch_id, r]))
            for r, (s, e) in enumerate(batch.sequences())]


def all_anchors(batch) -> list[np.ndarray]:
    """Every candidate anchor of every row (held-out evaluation)."""
    mask = batch.loss_mask.cpu().numpy()
    return [anchor_candidates(mask[s:e]) for s, e in batch.sequences()]


# ---------------------------------------------------------------------------
# masks


def block_mask_dense(anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """Boolean ``[1, 1, N*B, L+N*B]``: context ``< a_j``, own block bidirectional."""
    n = len(anchors)
    q_block = torch.arange(n * block_size, device=anchors.device) // block_size
    kv = torch.arange(ctx_len + n * block_size, device=anchors.device)
    ctx_ok = (kv[None, :] < ctx_len) & (kv[None, :] < anchors[q_block][:, None])
    own = (kv[None, :] >= ctx_len) & ((kv[None, :] - ctx_len) // block_size == q_block[:, None])
    return (ctx_ok | own)[None, None]


def _flex_attend(anchors: torch.Tensor, ctx_len: int, block_size: int):
    from torch.nn.attention.flex_attention import create_block_mask

    n = len(anchors)

    def mask_mod(b, h, q, kv):
        j = q // block_size
        return ((kv < ctx_len) & (kv < anchors[j])) | ((kv >= ctx_len) & ((kv - ctx_len) // block_size == j))

    bm = create_block_mask(mask_mod, B=None, H=None, Q_LEN=n * block_size, KV_LEN=ctx_len + n * block_size,
                           device=anchors.device)
    return lambda q, k, v: _compiled_flex()(q, k, v, block_mask=bm, enable_gqa=q.shape[1] != k.shape[1])


@functools.cache
def _compiled_flex():
    # Uncompiled flex_attention materialises the full score matrix; compiled it is block-sparse.
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=True)


def make_attend(anchors: torch.Tensor, ctx_len: int, block_size: int):
    """flex_attention on CUDA (block-sparse, no dense mask), dense sdpa mask elsewhere."""
    if anchors.device.type == "cuda":
        return _flex_attend(anchors, ctx_len, block_size)
    return sdpa_dense(block_mask_dense(anchors, ctx_len, block_size))


# ---------------------------------------------------------------------------
# forward


def block_hidden(drafter, embed_tokens, ctx: torch.Tensor, tokens: torch.Tensor,
                 anchors: torch.Tensor) -> torch.Tensor:
    """Drafter hidden states ``[N, B, H]`` for the blocks at ``anchors`` of one sequence.

    ``ctx`` is the sequence's drafter context ``[L, H]`` (``drafter.context`` of its
    target features) and ``tokens`` its ids ``[L]``.
    """
    B, L, n = drafter.block_size, len(tokens), len(anchors)
    noise_ids = torch.full((n, B), drafter.mask_token_id, dtype=torch.long, device=tokens.device)
    noise_ids[:, 0] = tokens[anchors]
    noise = embed_tokens(noise_ids).reshape(1, n * B, -1).to(ctx.dtype)
    offsets = torch.arange(B, device=tokens.device)
    positions = torch.cat([torch.arange(L, device=tokens.device), (anchors[:, None] + offsets).reshape(-1)])
    out = drafter(noise, ctx[None], positions[None], make_attend(anchors, L, B))
    return out.reshape(n, B, -1)


def block_labels(tokens: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels, valid)`` ``[N, B]``: ``tok[a+k]`` where ``a+k < L`` and ``m[a+k] = 1``, slot 0 invalid."""
    L = len(tokens)
    pos = anchors[:, None] + torch.arange(block_size, device=tokens.device)
    inside = pos < L
    pos = pos.clamp(max=L - 1)
    valid = inside & loss_mask[pos].bool()
    valid[:, 0] = False
    return tokens[pos], valid


@dataclass
class BlockStats:
    """Sums over a batch's blocks; add them up across batches, then ``metrics``."""

    blocks: int
    accepted: int                 # sum over blocks of the leading correct slots
    slot_correct: torch.Tensor    # [B] int64 (slot 0 always 0)
    slot_total: torch.Tensor      # [B] int64
    weighted_ce: float            # sum(CE * w)
    weight: float                 # sum(w)

    def __add__(self, o: "BlockStats") -> "BlockStats":
        return BlockStats(self.blocks + o.blocks, self.accepted + o.accepted, self.slot_correct + o.slot_correct,
                          self.slot_total + o.slot_total, self.weighted_ce + o.weighted_ce, self.weight + o.weight)

    def metrics(self) -> dict:
        acc = (self.slot_correct[1:].double() / self.slot_total[1:].clamp(min=1)).tolist()
        return {"loss": self.weighted_ce / max(self.weight, 1e-12),
                "tau": 1.0 + self.accepted / max(self.blocks, 1),
                "slot_acc": [round(a, 4) for a in acc], "blocks": self.blocks}


def _ce_chunk(hidden, weight, labels, w):
    # The frozen head keeps the target's dtype (bf16 on GPU); CE itself runs in fp32.
    logits = F.linear(hidden.to(weight.dtype), weight).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (ce * w).sum(), logits.argmax(-1)


def chunked_ce(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
               w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum(CE * w), argmax)`` over rows, never holding more than one chunk of logits."""
    total, preds = hidden.new_zeros((), dtype=torch.float32), []
    for s in range(0, len(hidden), CE_CHUNK_ROWS):
        sl = slice(s, s + CE_CHUNK_ROWS)
        part, pred = checkpoint(_ce_chunk, hidden[sl], lm_head_weight, labels[sl], w[sl], use_reentrant=False)
        total = total + part
        preds.append(pred)
    return total, torch.cat(preds)


def dflash_loss(drafter, head, features: torch.Tensor, batch, anchors: list[np.ndarray],
                gamma: float) -> tuple[torch.Tensor, BlockStats]:
    """``(loss, stats)`` for a packed batch given its anchors per row.

    ``head`` provides the frozen target ``embed_tokens`` and ``lm_head``; ``features``
    are the packed target features ``[T, k*H]``. With no anchor anywhere in the batch
    the loss is a zero that still reaches every parameter, so gradient accumulation
    needs no special case.
    """
    device = features.device
    B = drafter.block_size
    ids, lmask = batch.input_ids.to(device), batch.loss_mask.to(device)
    ctx_all = drafter.context(features.to(drafter.fc.weight.dtype))
    decay = slot_decay(B, gamma).to(device)
    hs, labels, ws, valids = [], [], [], []
    for (s, e), a in zip(batch.sequences(), anchors):
        if len(a) == 0:
            continue
        a = torch.as_tensor(a, dtype=torch.long, device=device)
        h = block_hidden(drafter, head.embed_tokens, ctx_all[s:e], ids[s:e], a)
        lab, valid = block_labels(ids[s:e], lmask[s:e], a, B)
        hs.append(h)
        labels.append(lab)
        valids.append(valid)
        ws.append(valid.float() * decay)
    if not hs:
        zero = sum(p.sum() for p in drafter.parameters()) * 0.0
        return zero, BlockStats(0, 0, torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long), 0.0, 0.0)
    valid = torch.cat(valids)
    rows = valid.nonzero(as_tuple=True)
    h = torch.cat(hs)[rows]
    lab = torch.cat(labels)[rows]
    w = torch.cat(ws)[rows]
    wce, pred = chunked_ce(h, head.lm_head.weight, lab, w)
    wsum = w.sum()
    loss = wce / wsum
    correct = torch.zeros_like(valid)
    correct[rows] = pred == lab
    leading = correct[:, 1:].long().cumprod(dim=1).sum(dim=1)
    stats = BlockStats(
        blocks=int(valid.shape[0]), accepted=int(leading.sum()),
        slot_correct=correct.long().sum(0).cpu(), slot_total=valid.long().sum(0).cpu(),
        weighted_ce=float(wce.detach()), weight=float(wsum))
    return loss, stats


def batch_loss(drafter, head, features: torch.Tensor, batch, *, num_anchors: int, gamma: float,
               seed: int, epoch: int, batch_id: int) -> tuple[torch.Tensor, BlockStats]:
    """The training loss of batch ``batch_id`` of ``epoch``: seeded anchors, then ``dflash_loss``."""
    return dflash_loss(drafter, head, features, batch,
                       batch_anchors(batch, num_anchors, seed, epoch, batch_id), gamma)
