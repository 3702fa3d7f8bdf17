"""The frozen vocabulary head's cross-entropy: fused (gradient made in the forward)
against checkpointed autograd, at SmolLM2-135M's shape (vocabulary 49,152, hidden 576).

Rows are the loss rows of one 2,048-token batch of the SmolLM2 config at 16 anchors per
sequence (2,126 rows, measured on its regenerated data) and at 64 (8,400). Hidden rows,
head and labels are random (the cost does not depend on their values); each case runs
``(CE * w).sum().backward()`` on one thread, best of 3, alternating. Also the largest
gradient difference between the two, relative to the largest gradient. One JSON line.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from dflash_actors.models.loss import head_ce

VOCAB, HIDDEN = 49152, 576
ROWS = {"anchors_16": 2126, "anchors_64": 8400}
REPEATS = 3


def run(how: str, h: torch.Tensor, W: torch.Tensor, lab: torch.Tensor, w: torch.Tensor):
    x = h.clone().requires_grad_()
    t = time.perf_counter()
    ce, _, _ = head_ce(x, W, lab, how)
    (ce * w).sum().backward()
    return time.perf_counter() - t, x.grad


def main() -> int:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    W = torch.randn(VOCAB, HIDDEN, generator=g) * 0.05
    out = {"bench": "head", "vocab": VOCAB, "hidden": HIDDEN, "repeats": REPEATS}
    for name, rows in ROWS.items():
        h = torch.randn(rows, HIDDEN, generator=g)
        lab, w = torch.randint(0, VOCAB, (rows,), generator=g), torch.rand(rows, generator=g)
        best = {"fused": float("inf"), "checkpointed": float("inf")}
        grads = {}
        for _ in range(REPEATS):
            for how in best:
                s, grads[how] = run(how, h, W, lab, w)
                best[how] = min(best[how], s)
        diff = float((grads["fused"] - grads["checkpointed"]).abs().max() / grads["checkpointed"].abs().max())
        out[name] = {"rows": rows, "fused_s": round(best["fused"], 3), "checkpointed_s": round(best["checkpointed"], 3),
                     "fused_saving": round(1 - best["fused"] / best["checkpointed"], 3),
                     "grad_rel_diff_max": float(f"{diff:.2g}")}
        print(f"# {name}: {out[name]}", flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
