"""One batch's drafter gradient, in micro-batches that fit the drafter's device.

A packed batch of the shipped GPU configs (65,536 tokens, 512 anchors of 16 slots per
sequence) holds 170,000 block tokens or more; trained in one forward, its saved
activations (about 1.3 MiB per block token for an 8B-sized 5-layer drafter in bf16)
would need hundreds of GiB. So a batch's anchors are split into micro-batches
(``split_anchors``) of at most ``train.drafter_block_tokens`` padded block tokens and as
many padded context tokens, each run forward and backward on its own. Each micro-batch
divides its ``sum(CE * w)`` by the whole batch's ``sum(w)``, known before any forward
(the slot weights follow from the loss masks), so the gradients it adds into ``.grad``
sum to the whole batch's gradient (at float rounding: the sums are taken in another
order). D-PACE's weights come from the drafter's own CE: over several micro-batches they
are measured first, in a forward per micro-batch without autograd.

Rows stay whole where they fit; a row with more blocks than the budget is cut into runs
of anchors, each with the row's whole context (a block sees only context before its
anchor and its own block, so cutting a row's blocks apart changes nothing but the
rounding). The split is a function of the batch and the budget alone, so the drafter
actors and the reference trainer, which both train through ``drafter_step``, take
identical steps: the pipeline still equals the reference bit for bit.

With ``train.checkpoint_layers`` each drafter layer keeps only its input for the
backward and runs again there.
"""

from __future__ import annotations

import numpy as np
import torch

from ..models.blocks import batch_anchors
from ..models.head_loss import as_rows
from ..models.loss import (
    BlockStats,
    Objective,
    batch_vocab,
    block_stats,
    blocks_loss,
    dpace_weights,
    lay_out,
    no_blocks,
)


def split_anchors(lengths: list[int], anchors: list[np.ndarray], block_size: int,
                  budget: int | None) -> list[list[np.ndarray]]:
    """Micro-batches of a batch whose rows have ``lengths`` and ``anchors``: each a list
    of anchors per row (empty for rows it leaves out). A micro-batch holds at most
    ``budget`` padded block tokens (rows x most anchors of a row x ``block_size``) and
    ``budget`` padded context tokens (rows x longest row), or a single run of one row's
    anchors; None: one micro-batch, the batch as given."""
    empty = np.zeros(0, dtype=np.int64)
    if budget is None:
        return [list(anchors)]
    per_run = max(1, budget // block_size)
    groups: list[list[np.ndarray]] = []
    members: list[tuple[int, np.ndarray]] = []
    most_anchors = longest = 0
    for r, a in enumerate(anchors):
        for s in range(0, len(a), per_run):
            run = a[s:s + per_run]
            n, L = max(most_anchors, len(run)), max(longest, lengths[r])
            k = len(members) + 1
            if members and (k * n * block_size > budget or k * L > budget):
                groups.append(_group(members, len(anchors), empty))
                members, n, L = [], len(run), lengths[r]
            members.append((r, run))
            most_anchors, longest = n, L
    if members:
        groups.append(_group(members, len(anchors), empty))
    return groups or [list(anchors)]


def _group(members: list[tuple[int, np.ndarray]], rows: int, empty: np.ndarray) -> list[np.ndarray]:
    out = [empty] * rows
    for r, run in members:
        out[r] = run
    return out


def drafter_step(drafter, head, features: torch.Tensor, batch, objective: Objective, *, epoch: int,
                 batch_id: int, block_tokens: int | None = None, checkpoint_layers: bool = False) -> BlockStats:
    """Add the gradient of batch ``batch_id`` of ``epoch`` (``models.loss.batch_loss``'s
    loss) into the drafter's ``.grad``, in micro-batches of at most ``block_tokens``
    block tokens (None: one pass); its stats."""
    o = objective
    anchors = batch_anchors(batch, o.num_anchors, o.seed, epoch, batch_id)
    if not any(len(a) for a in anchors):
        zero, stats = no_blocks(drafter)
        zero.backward()
        return stats
    lengths = [e - s for s, e in batch.sequences()]
    device = features.device
    groups = [lay_out(batch, g, drafter.block_size, device, getattr(drafter, "label_shift", 0))
              for g in split_anchors(lengths, anchors, drafter.block_size, block_tokens)
              if any(len(a) for a in g)]
    vocab = as_rows(batch_vocab(o, head, epoch, batch_id), head)
    options = dict(compute_dtype=o.compute_dtype, head_loss=o.head_loss, position_weight=o.position_weight,
                   dpace_alpha=o.dpace_alpha, loss=o.loss, vocab=vocab, checkpoint_layers=checkpoint_layers,
                   selector=o.selector, dspark=o.dspark, xpress=o.xpress)
    if len(groups) == 1:
        value, tally = blocks_loss(drafter, head, features, groups[0], o.gamma, **options)
        value.backward()
        return block_stats(groups[0], tally)
    sel = o.selector
    own_norm = sel is not None and sel.weight > 0 and sel.norm == "own" and sel.misses == "skip"
    selector_total = None
    if o.position_weight == "dpace" or own_norm:
        # What the whole batch's denominators need from the drafter's own outputs.
        weights, hit_weights = [], []
        with torch.no_grad():
            for g in groups:
                _, tally = blocks_loss(drafter, head, features, g, o.gamma, **options)
                weights.append(dpace_weights(tally.hard, g.valid, g.rows, o.dpace_alpha)
                               if o.position_weight == "dpace" else g.decay_weights(o.gamma))
                hit_weights.append(tally.hit_weight)
        if own_norm:
            selector_total = sum(hit_weights)
    else:
        weights = [g.decay_weights(o.gamma) for g in groups]
    if sel is not None and sel.weight > 0 and sel.norm == "count":
        selector_total = sum(len(g.rows[0]) for g in groups)     # the batch's supervised slots
    total = sum(w.sum() for w in weights)
    stats = None
    for g, w in zip(groups, weights):
        value, tally = blocks_loss(drafter, head, features, g, o.gamma, weights=w, total_weight=total,
                                   selector_total=selector_total, **options)
        value.backward()
        del value
        s = block_stats(g, tally)
        stats = s if stats is None else stats + s
    return stats


def step_options(cfg) -> dict:
    """``drafter_step``'s keyword options from a config whose memory plan has been
    resolved (``train.memplan``): an unresolved ``auto`` trains without checkpointing."""
    return {"block_tokens": cfg.train.drafter_block_tokens, "checkpoint_layers": cfg.train.checkpoint_layers == "on"}
