"""Pipeline vs the lock-step reference on the demo config, side by side in one run.

    python -m benchmarks.bench_pipeline [--set key=value ...]

Trains the same config three ways: the single-process reference trainer with M=2
(the same work as 2-2), then ``launch``'s pipeline at 1-1 and at 2-2. Reports for each
tokens/s over the whole wall time, and for the pipeline also the steady-state rate
(tokens between the first and the last optimizer step over that time), since actor
start-up (imports, model loads) is a fixed cost that a tiny CPU demo cannot amortize.
The two pipelines must end bit-identical to their reference; ``identical`` says so.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from dflash_actors.checkpoint import latest_checkpoint
from dflash_actors.config import load_config
from dflash_actors.metrics import read_steps
from dflash_actors.models.drafter import DFlashDrafter
from dflash_actors.models.target import ensure_target
from dflash_actors.pipeline import Job
from dflash_actors.reference import train_reference

ROOT = Path(__file__).resolve().parents[1]


def run_pipeline(cfg) -> dict:
    job = Job(cfg, progress=False)
    result = job.run()
    steps = read_steps(job.shared.step_stats)
    steady_tokens = sum(s["tokens"] for s in steps[1:])
    steady_s = steps[-1]["time"] - steps[0]["time"]
    out = {"wall_s": result.summary["wall_s"], "tokens_per_s": result.summary["tokens_per_s"],
           "steady_tokens_per_s": round(steady_tokens / max(steady_s, 1e-9), 1)}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs/default.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args(argv)
    hf_logging.disable_progress_bar()
    out = {"bench": "pipeline"}
    with tempfile.TemporaryDirectory() as tmp:
        def cfg(topology, name):
            return load_config(args.config, args.overrides + [f"runtime.run_dir={tmp}/{name}"], topology)

        ref_cfg = cfg("2-2", "ref")
        ensure_target(ref_cfg)   # the cached synthetic data and tiny target, outside the timings
        t = time.perf_counter()
        ref = train_reference(ref_cfg, progress=False)
        out["reference_m2"] = {"wall_s": round(time.perf_counter() - t, 2), "tokens_per_s": round(ref.tokens_per_s, 1),
                               "steps": ref.steps}
        for topology in ("1-1", "2-2"):
            c = cfg(topology, topology)
            out[f"pipeline_{topology}"] = run_pipeline(c)
        final = DFlashDrafter.from_pretrained(latest_checkpoint(f"{tmp}/2-2")).state_dict()
        out["identical_2_2"] = all(torch.equal(final[k], v) for k, v in ref.state_dict.items()
                                   if not k.startswith("rotary_emb."))
    r, p = out["reference_m2"], out["pipeline_2-2"]
    out["pipeline_2_2_over_reference"] = round(p["tokens_per_s"] / r["tokens_per_s"], 3)
    out["steady_2_2_over_reference"] = round(p["steady_tokens_per_s"] / r["tokens_per_s"], 3)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
