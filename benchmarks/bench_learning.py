"""Does the drafter learn? Untrained vs trained, simulated vs real tau, in one run.

    python -m benchmarks.bench_learning [--epochs 16]

Trains the reference on the tiny target's greedy completions of the synthetic training
prompts (the DFlash recipe: regenerate the data with the target), then evaluates both
the untrained and the trained drafter on the target's held-out text: simulated tau
(anchors at every position) and real tau (greedy draft-then-verify, lossless). The
issue's bars: trained simulated tau >= untrained + 1.0, and simulated within 15% of
real. Prints one JSON line.
"""

from __future__ import annotations

import time

from transformers.utils import logging as hf_logging

from benchmarks import harness
from benchmarks.harness import ROOT
from dflash_actors.config import load_config
from dflash_actors.eval.tau import evaluate_drafter
from dflash_actors.job.reference import train_reference
from dflash_actors.prepare.regenerate import ensure_target_text


def main(argv=None) -> dict:
    ap = harness.parser(__doc__)
    ap.add_argument("--epochs", type=int, default=16)
    args = ap.parse_args(argv)
    hf_logging.disable_progress_bar()
    overrides = [f"train.epochs={args.epochs}"]
    text = ensure_target_text(load_config(ROOT / "configs/default.yaml", overrides))
    cfg = load_config(ROOT / "configs/default.yaml", overrides + [f"data.path={text}"])
    before = evaluate_drafter(cfg, None)
    t = time.perf_counter()
    trained = train_reference(cfg, progress=False)
    wall = time.perf_counter() - t
    after = evaluate_drafter(cfg, trained.state_dict)
    sim0, sim1 = before["simulated_target_text"]["tau"], after["simulated_target_text"]["tau"]
    real1 = after["real"]["tau"]
    out = {"bench": "learning", "epochs": args.epochs, "steps": trained.steps, "train_wall_s": round(wall, 1),
           "simulated_tau_untrained": round(sim0, 3), "simulated_tau_trained": round(sim1, 3),
           "real_tau_untrained": round(before["real"]["tau"], 3), "real_tau_trained": round(real1, 3),
           "lossless": after["real"]["lossless"], "sim_vs_real": round(abs(sim1 - real1) / real1, 3),
           "raw_heldout_simulated_tau": [round(before["simulated_heldout_data"]["tau"], 3),
                                         round(after["simulated_heldout_data"]["tau"], 3)],
           "target_text_entropy_bits": round(after["target_text_entropy_bits"], 2)}
    return harness.emit(out, args.save)


if __name__ == "__main__":
    main()
