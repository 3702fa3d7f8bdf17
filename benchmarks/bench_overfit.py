"""The overfit gate on a real model: SmolLM2-135M memorises a few of its own texts, then
decodes them for real.

    python -m benchmarks.bench_overfit [--prompts 4] [--steps 300]

The first ``--prompts`` held-out prompts are continued by the target (``prepare``,
greedy, 64 new tokens), the drafter trains on exactly those texts with every anchor
(the reference trainer: the pipeline's math; features cached after the first step),
and real greedy speculative decoding from the same prompts must accept nearly whole
blocks: the gate is real tau >= 0.9 x block size. One JSON line with the training
tau, real tau, losslessness and whether the gate passed. Skipped without SmolLM2.
"""

from __future__ import annotations

import sys
import time

from benchmarks import harness
from benchmarks.harness import ROOT

CONFIG = ROOT / "configs" / "smollm2-135m.yaml"


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if why := harness.smollm2_missing():
        harness.skipped("overfit", why, args.save)
        return 0
    from transformers.utils import logging as hf_logging

    from benchmarks.bench_real import PROMPTS, prepared
    from dflash_actors.config import load_config
    from dflash_actors.data.dataset import open_dataset
    from dflash_actors.eval.tau import real_tau
    from dflash_actors.job.reference import train_reference
    from dflash_actors.models.drafter_start import build_drafter
    from dflash_actors.models.target import ensure_target, load_target
    from dflash_actors.prepare.generate import stop_ids
    from dflash_actors.prepare.regenerate import load_tokenizer, prompts_of

    hf_logging.disable_progress_bar()
    data = ROOT / ".cache" / f"smollm2-overfit-{args.prompts}"
    prepared(data, PROMPTS / "heldout.jsonl", 64, args.threads, args.prompts)
    cfg = load_config(CONFIG, [f"data.path={data}", f"train.epochs={args.steps}", "train.num_anchors=512",
                               "train.lr=3e-3", "train.warmup_ratio=0.02", f"train.num_threads={args.threads}",
                               "eval.every=0",
                               # The gate as first set: block 8 (tau 8 of 8), the exact head, a cosine.
                               "drafter.block_size=8", "train.head_vocab=full", "train.lr_schedule=cosine"])
    t = time.perf_counter()
    result = train_reference(cfg, progress=False)
    train_s = time.perf_counter() - t
    target = load_target(cfg)
    drafter = build_drafter(cfg, target)
    drafter.load_state_dict(result.state_dict)
    drafter.eval()
    texts = open_dataset(cfg.data, progress=False, path=data)
    stops = tuple(stop_ids(load_tokenizer(ensure_target(cfg)), target.model))
    real = real_tau(drafter, target, [p for p, _ in prompts_of(texts)], 64, stops, check_lossless="cached")
    B = cfg.drafter.block_size
    out = {"bench": "overfit", "target": "SmolLM2-135M-Instruct", "prompts": args.prompts, "steps": result.steps,
           "block_size": B, "final_loss": round(result.losses[-1], 4),
           "training_tau": round(result.metrics[-1]["tau"], 3),
           "real_tau": round(real["tau"], 3), "lossless": real["lossless"], "gate": 0.9 * B,
           "passed": bool(real["lossless"] and real["tau"] >= 0.9 * B), "train_s": round(train_s, 1)}
    harness.emit(out, args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
