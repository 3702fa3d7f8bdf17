"""The frozen vocabulary head's cross-entropy: fused (gradient made in the forward)
against checkpointed autograd, at SmolLM2-135M's shape (vocabulary 49,152, hidden 576).

Rows are the loss rows of one 2,048-token batch of the SmolLM2 config at 16 anchors per
sequence (2,126 rows, measured on its regenerated data) and at 64 (8,400). Hidden rows,
head and labels are random (the cost does not depend on their values); each case runs
``(CE * w).sum().backward()`` on one thread, best of 3, alternating. Also the largest
gradient difference between the two, relative to the largest gradient. Then the fused
head restricted to a training vocabulary (``train.head_vocab: data``) of the size found
under the loss mask of the SmolLM2 data in ``--data`` (when prepared) and of 8,192 and
16,384 rows, each with its time against the full fused head's. One JSON line.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from benchmarks import harness
from dflash_actors.models.head_loss import VocabRows, head_ce, restricted_ce

VOCAB, HIDDEN = 49152, 576
ROWS = {"anchors_16": 2126, "anchors_64": 8400}
REPEATS = 3
SUBSETS = (8192, 16384)
DATA = harness.ROOT / ".cache" / "smollm2-train"


def run(how: str, h: torch.Tensor, W: torch.Tensor, lab: torch.Tensor, w: torch.Tensor, rows=None):
    x = h.clone().requires_grad_()
    t = time.perf_counter()
    ce, _, _ = head_ce(x, W, lab, how) if rows is None else restricted_ce(x, W, lab, rows, how)
    (ce * w).sum().backward()
    return time.perf_counter() - t, x.grad


def subsets(data: Path) -> dict[str, int]:
    out = {f"rows_{n}": n for n in SUBSETS}
    if (data / "prepare.json").is_file():
        from dflash_actors.data.dataset import TokenDataset
        ds = TokenDataset(data, progress=False)
        out = {f"data_{len(ds)}_completions": len(ds.supervised_tokens())} | out
    return out


def restricted(h, w, W, full_s: float, g: torch.Generator, sizes: dict[str, int]) -> dict:
    """The fused head over ``n`` random rows, labels drawn among them, against the full one."""
    out = {}
    for name, n in sizes.items():
        ids = torch.randperm(VOCAB, generator=g)[:n].sort().values
        lab = ids[torch.randint(0, n, (len(h),), generator=g)]
        rows = VocabRows(ids, VOCAB, "cpu")
        best = min(run("fused", h, W, lab, w, rows)[0] for _ in range(REPEATS))
        out[name] = {"vocab_rows": n, "fused_s": round(best, 3), "time_vs_full": round(best / full_s, 3)}
    return out


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--data", type=Path, default=DATA)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    W = torch.randn(VOCAB, HIDDEN, generator=g) * 0.05
    sizes = subsets(args.data)
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
                     "grad_rel_diff_max": float(f"{diff:.2g}"),
                     "restricted": restricted(h, w, W, best["fused"], g, sizes)}
        harness.say(f"{name}: {out[name]}")
    harness.emit(out, args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
