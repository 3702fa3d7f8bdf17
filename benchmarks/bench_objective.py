"""The batched DFlash objective against one drafter forward per sequence, on CPU.

The embedded default (tiny target, token budget 2048, block 8, 32 anchors) on real
batches of its synthetic data: ``batch_loss(...).backward()`` as the drafter actor runs
it, against the per-sequence path the project used before (now the tests' oracle,
``tests/support/oracle_loss.py``), alternating, one thread, medians. Also the same at
hidden 256, where the drafter's matmuls weigh more than the Python loop. Both give the
same loss to float rounding (checked here too). One JSON line.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.harness import ROOT
from dflash_actors.config import load_config
from dflash_actors.data.batching import Batch, BatchBuffers, assemble, plan_for
from dflash_actors.data.dataset import open_dataset
from dflash_actors.data.synthetic import ensure_synthetic_dataset
from dflash_actors.models.blocks import batch_anchors
from dflash_actors.models.drafter_start import build_drafter
from dflash_actors.models.loss import decay_gamma, dflash_loss
from dflash_actors.models.target import load_target
from tests.support.oracle_loss import dflash_loss_per_sequence

RUNS = 12
BATCHES = 4


def measure(cache: Path, extra: list[str]) -> dict:
    cfg = load_config(ROOT / "configs/default.yaml", [f"data.cache_dir={cache}", "target.tiny.pretrain_steps=0",
                                                      *extra])
    target = load_target(cfg)
    drafter = build_drafter(cfg, target)
    ds = open_dataset(cfg.data, progress=False, path=ensure_synthetic_dataset(cfg.data)[0])
    plan = plan_for(cfg, ds.lengths, 0)
    buf = BatchBuffers.allocate(cfg.batching.token_budget, cfg.batching.max_samples)
    cases = []
    for b in range(BATCHES):
        batch = Batch.from_buffers(buf, assemble(ds, plan.batch(b), buf))
        batch = Batch(*(t.clone() for t in (batch.input_ids, batch.position_ids, batch.loss_mask,
                                            batch.cu_seqlens)), batch.max_len)
        anchors = batch_anchors(batch, cfg.train.num_anchors, cfg.train.seed, 0, b)
        cases.append((batch, target.features(batch), anchors))
    gamma = decay_gamma(cfg)

    def run(fn, case) -> tuple[float, float]:
        batch, feats, anchors = case
        drafter.zero_grad(set_to_none=True)
        t = time.perf_counter()
        loss, _ = fn(drafter, target, feats, batch, anchors, gamma)
        loss.backward()
        return time.perf_counter() - t, float(loss)

    times = {"per_sequence": [], "batched": []}
    worst = 0.0
    for i in range(RUNS):
        case = cases[i % len(cases)]
        t_seq, l_seq = run(dflash_loss_per_sequence, case)
        t_bat, l_bat = run(dflash_loss, case)
        times["per_sequence"].append(t_seq)
        times["batched"].append(t_bat)
        worst = max(worst, abs(l_seq - l_bat) / abs(l_seq))
    ms = {k: round(1e3 * statistics.median(v), 1) for k, v in times.items()}
    return {"ms_median": ms, "speedup": round(ms["per_sequence"] / ms["batched"], 2),
            "sequences_per_batch": [c[0].n_samples for c in cases], "loss_rel_diff_max": float(f"{worst:.2g}")}


def main(argv=None) -> int:
    args = harness.parser(__doc__).parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        out = {"bench": "objective", "runs": RUNS}
        for name, extra in (("default", []), ("hidden_256", ["target.tiny.hidden_size=256",
                                                              "target.tiny.intermediate_size=512"])):
            harness.say(name)
            out[name] = measure(Path(tmp), extra)
    harness.emit(out, args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
