"""The memory plan at the sizes users run, planned on this CPU: the GPU templates
(Qwen3-8B, Qwen3.6-27B-shaped) on 80 GB and 141 GB GPUs, each from a directory holding
only the target's ``config.json``; and the traced drafter step per block token, with and
without checkpointed layers, against the whole batch the drafter used to train in one
pass. One JSON line; nothing here needs a GPU or the weights.

    python -m benchmarks.bench_memplan [--save NAME]
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen3Config
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from benchmarks import harness
from benchmarks.harness import ROOT

TARGET_CONFIGS = {
    # Qwen3-8B's published shape.
    "qwen3-8b.yaml": lambda: Qwen3Config(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                                         num_key_value_heads=8, head_dim=128, num_hidden_layers=36,
                                         vocab_size=151936, max_position_embeddings=40960,
                                         tie_word_embeddings=False),
    # Qwen3.6-27B-shaped: the hybrid (linear and full attention) layers of transformers' Qwen3.5.
    "qwen3.6-27b.yaml": lambda: Qwen3_5TextConfig(hidden_size=5120, intermediate_size=17408,
                                                  num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                                                  num_hidden_layers=64, vocab_size=248320,
                                                  max_position_embeddings=262144),
}
"""The GPU templates' targets, as a ``config.json`` each (``save_pretrained`` writes it)."""


def plan(template: str, gpu_gib: float, target_dir: Path, run_dir: Path) -> dict:
    """``launch.py --plan-only --json`` of a template: its line, exit code and seconds."""
    import launch
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = launch.main(["--plan-only", "--json", "--config", str(ROOT / "configs" / template), "--gpu-memory",
                            str(gpu_gib), "--run-dir", str(run_dir), "--set", f"target.path={target_dir}"])
    line = json.loads(out.getvalue().splitlines()[-1])
    return {"template": template, "gpu_gib": gpu_gib, "exit": code, "seconds": round(time.perf_counter() - t0, 1),
            "drafter_block_tokens": line["drafter_block_tokens"], "checkpoint_layers": line["checkpoint_layers"],
            "optimizer": line["optimizer_device"], "feature_ring": line["feature_device"],
            "need_gib": {d["device"]: d["need_gib"] for d in line["memory_plan"]},
            "usable_gib": {d["device"]: d["usable_gib"] for d in line["memory_plan"]}, "problem": line["problem"]}


def per_block_token() -> dict:
    """The 8B drafter's traced step at one and two sequences of 3,072 tokens and 512
    anchors (bf16, on a GPU): saved MiB per block token, with and without checkpointing,
    and what the templates' whole batch (21 such sequences) would keep in one pass."""
    from dflash_actors.train.memtrace import trace_drafter_step
    shape = TARGET_CONFIGS["qwen3-8b.yaml"]()

    def trace(rows, ckpt):
        return trace_drafter_step(shape, layers=5, block_size=16, feature_layers=5, head_dtype=torch.bfloat16,
                                  autocast_bf16=True, cuda=True, rows=rows, ctx_len=3072, anchors=512,
                                  checkpoint_layers=ckpt)
    out = {}
    for ckpt in (False, True):
        one, two = trace(1, ckpt), trace(2, ckpt)
        slope = (two.saved - one.saved) / (512 * 16)
        key = "checkpointed" if ckpt else "plain"
        out[key] = {"saved_mib_per_block_token": round(slope / 2 ** 20, 3),
                    "peak_gib_one_sequence": round(one.peak / 2 ** 30, 2),
                    "whole_batch_saved_gib": round((one.saved + 20 * slope * 512 * 16) / 2 ** 30, 1)}
    return out


def main(argv=None) -> int:
    args = harness.parser(__doc__).parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for template, config in TARGET_CONFIGS.items():
            target = Path(tmp) / template
            config().save_pretrained(target)
            for gib in (80, 141):
                rows.append(plan(template, gib, target, Path(tmp) / "run"))
    result = {"bench": "memplan", "plans": rows, "drafter_8b": per_block_token(),
              "audit_measured_mib_per_block_token": 1.27}
    harness.emit(result, args.save)
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
