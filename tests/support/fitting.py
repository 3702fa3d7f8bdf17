"""A drafter fitted for a moment to the tiny target's greedy text of held-out prompts:
what the decoding and evaluation tests measure (it drafts some blocks right for several
slots and others not)."""

import numpy as np
import torch

from dflash_actors.data.batching import Batch
from dflash_actors.data.dataset import open_dataset
from dflash_actors.data.synthetic import ensure_synthetic_dataset
from dflash_actors.eval.decode import greedy_cached
from dflash_actors.models.blocks import all_anchors
from dflash_actors.models.loss import dflash_loss


def heldout_prompts(cfg, n: int) -> list[torch.Tensor]:
    """The first ``n`` held-out samples' prompts (up to their first supervised token)."""
    heldout = open_dataset(cfg.data, progress=False, path=ensure_synthetic_dataset(cfg.data)[1])
    return [torch.from_numpy(heldout.sample(i)[0][:int(np.argmax(heldout.sample(i)[1]))]) for i in range(n)]


def fit_briefly(drafter, target, prompts: list[torch.Tensor], new_tokens: int = 32, steps: int = 20,
                selector=None, xpress=None):
    """Train ``drafter`` (Adam, lr 3e-3, every anchor) on the target's greedy continuation
    of ``prompts``; the last step's stats. ``selector``: a DFlash2's selector objective;
    ``xpress``: an XPress's (one that needs no teacher: these features carry none)."""
    texts = [greedy_cached(target, p, new_tokens)[0] for p in prompts]
    lens = [len(x) for x in texts]
    batch = Batch(torch.cat(texts), torch.cat([torch.arange(n) for n in lens]),
                  torch.cat([torch.tensor([0] * len(p) + [1] * new_tokens, dtype=torch.int8) for p in prompts]),
                  torch.tensor(np.cumsum([0] + lens), dtype=torch.int32), max(lens))
    feats, anchors = target.features(batch), all_anchors(batch)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        loss, stats = dflash_loss(drafter, target, feats, batch, anchors, 4.0, selector=selector, xpress=xpress)
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter.eval()
    return stats, batch, feats
