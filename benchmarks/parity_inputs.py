"""Random inputs that the parity checks against peers' own code share
(``parity_dflash2``, ``parity_dspark``, ``parity_xpress``): a frozen embedding and head, one
text of 40 tokens over 8 ids that the head favours (so argmaxes are sometimes right), a
prompt outside the loss and optional holes inside it, the target's features and its last
layer; and a drafter whose every weight is drawn, its arch's own head at a scale of its own."""

from __future__ import annotations

from types import SimpleNamespace

import torch

LENGTH = 40


def frozen_head(embed: torch.Tensor, head: torch.Tensor) -> SimpleNamespace:
    """The target's frozen ``embed_tokens`` and ``lm_head`` over these weights."""
    out = SimpleNamespace(embed_tokens=torch.nn.Embedding.from_pretrained(embed, freeze=True),
                          lm_head=torch.nn.Linear(head.shape[1], head.shape[0], bias=False).requires_grad_(False))
    out.lm_head.weight.data.copy_(head)
    return out


def draw_drafter(drafter, g: torch.Generator, head_prefix: str, head_scale: float):
    """Every weight of ``drafter`` drawn from ``g``: norms near 1, the parameters under
    ``head_prefix`` at ``head_scale`` (a bias that changes some argmaxes), the rest scaled
    by their fan-in."""
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.startswith(head_prefix):
                p.copy_(head_scale * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return drafter


def draw_text(g: torch.Generator, vocab: int, hidden: int, holes: bool) -> SimpleNamespace:
    """``embed``, ``head``, ``ids`` ``[1, L]``, ``mask`` (the first 6 tokens out, and with
    ``holes`` three inside), ``feats`` (two target layers) and ``last`` (its last layer)."""
    embed = torch.randn(vocab, hidden, generator=g)
    head = torch.randn(vocab, hidden, generator=g) / hidden ** 0.5
    head[:8] *= 4.0          # the text's tokens (0..7) lead the logits: argmaxes are sometimes right
    ids = torch.randint(0, 8, (1, LENGTH), generator=g)
    mask = torch.ones(1, LENGTH)
    mask[0, :6] = 0
    if holes:
        mask[0, [14, 20, 30]] = 0
    feats = torch.randn(1, LENGTH, 2 * hidden, generator=g)
    last = torch.randn(1, LENGTH, hidden, generator=g)
    return SimpleNamespace(embed=embed, head=head, ids=ids, mask=mask, feats=feats, last=last)
