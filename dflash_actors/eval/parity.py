"""``launch.py evaluate``: train/serve parity of a trained drafter on held-out chat prompts.

For the drafter and each baseline (untrained, n-gram, repeat) it reports real greedy
speculative decoding from the prompts and the simulated objective on the very text
decoding produced, side by side with per-position acceptance (``parity``), and warns
when the two taus differ by more than ``PARITY_WARN``. Prompts are templated as the
training data was (``prepare.json``), or the run is refused: a mismatched chat
template or thinking mode is the commonest reason a drafter accepts little in serving.

What it costs, and why it is built so: the target's greedy text of every prompt is
computed once (``TargetTexts``, all prompts in one batched forward per token) and is
what every proposer is measured on. The trained drafter decodes for real, every
prompt's verify step in one batched forward (bit-identical to decoding each prompt
alone, ``decode``), and its output is checked against that text prompt by prompt:
that is the losslessness proof. The baselines' decoding is determined by that same text
(lossless decoding verifies exactly it), so their real tau is replayed from their drafts
against it (``decode.replay``) instead of paying a target forward per verify step; the
trained drafter's own replay is reported beside its real tau as the check that replaying
agrees with decoding. The simulated half reuses the text's target features, shared by
both drafters.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..config import DataConfig
from ..console import first_line, shown_path
from ..data.dataset import open_dataset
from ..models.drafter import DFlashDrafter, is_drafter_dir
from ..models.target import TargetModel
from ..models.target_dir import attention_for, resolve_target_dir
from ..prepare.generate import stop_ids
from ..prepare.prompt_sets import prompt_sets
from ..prepare.regenerate import (
    PrepareError,
    TemplateSettings,
    add_template_args,
    encode_prompt,
    load_tokenizer,
    read_metadata,
    read_prompts,
    template_opts,
    template_settings,
)
from ..train.checkpoint import STATE_FILE, latest_checkpoint, load_trainer_state
from .decode import NgramProposer, repeat_proposer
from .intervals import ratio_interval
from .prompt_set_table import format_set_table
from .tau import (
    TargetTexts,
    clip_rows,
    completion_mask,
    drafter_correct,
    proposer_correct,
    real_tau,
    replayed_tau,
    text_features,
    text_metrics,
)


def parity(name: str, rows: list[tuple[np.ndarray, np.ndarray]], tt: TargetTexts, block_size: int,
           real: dict | None = None) -> dict:
    """Real tau and simulated tau on the target's text, side by side, for one proposer.

    ``rows``: per prompt, its ``(correct, valid)`` over ``tt.texts`` (``drafter_correct``,
    ``proposer_correct``). ``real``: the ``real_tau`` of decoding for real, which then
    also gets the replayed tau as a check; without it the replay is the real figure."""
    replayed = replayed_tau(rows, tt, block_size)
    if real is None:
        real = {**replayed, "decoded": "replayed"}
    else:
        real = {**real, "decoded": "real", "replayed_tau": replayed["tau"]}
    cut = [clip_rows(c, v, len(p), len(r)) for (c, v), p, r in zip(rows, tt.prompts, tt.references)]
    sim = text_metrics(np.concatenate([c for c, _ in cut]), np.concatenate([v for _, v in cut]))
    gap = abs(sim["tau"] - real["tau"]) / real["tau"]
    return {"name": name, "real": real, "simulated": sim, "sim_vs_real": round(gap, 4),
            "parity_warning": gap > PARITY_WARN}


PARITY_WARN = 0.15
"""Simulated and real tau further apart than this (relative) are reported as a warning:
training's acceptance then does not predict serving's."""


def resolve_drafter_dir(path: str | Path) -> Path:
    """A drafter directory, a checkpoint (``step-N``) or a run directory (its latest checkpoint)."""
    p = Path(path)
    if is_drafter_dir(p):
        return p
    ckpt = latest_checkpoint(p) if p.is_dir() else None
    if ckpt is None:
        raise ValueError(f"CHECKPOINT: {p} is not a drafter directory, a checkpoint or a run directory with one")
    return ckpt


def saved_run_config(drafter_dir: Path) -> dict | None:
    """The training config stored beside a checkpoint's drafter, if any."""
    return load_trainer_state(drafter_dir).get("config") if (drafter_dir / STATE_FILE).is_file() else None


def load_parity_target(target_path: str, layer_ids: list[int], cache_dir: str = ".cache", tokenizer: bool = True):
    """``(TargetModel, tokenizer)`` on CPU in float32, exposing ``layer_ids``; the
    tokenizer None unless ``tokenizer``."""
    tdir = resolve_target_dir(target_path, None, cache_dir)
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32,
                                                 attn_implementation=attention_for(AutoConfig.from_pretrained(tdir)))
    return TargetModel(model, layer_ids), (load_tokenizer(tdir) if tokenizer else None)


def check_template(tokenizer, opts: dict, dataset_dir: Path | None) -> str:
    """Refuse prompts templated unlike the training data (``prepare.json``); say what was checked."""
    mine = template_settings(tokenizer, **opts)
    meta = read_metadata(dataset_dir) if dataset_dir is not None else None
    if meta is None:
        return "not checked (the training dataset has no prepare.json)"
    theirs = TemplateSettings(**meta["template"])
    bad = mine.describe_mismatch(theirs)
    if bad:
        raise PrepareError(f"chat template mismatch with {dataset_dir}: {bad} "
                           "(pass the dataset's --thinking/--system-prompt, or evaluate with its target)")
    return f"matches {dataset_dir}"


def chat_prompts(tokenizer, path: str | Path, template: dict | None, dataset_dir: Path | None,
                 limit: int | None) -> tuple[list[torch.Tensor], str]:
    """The first ``limit`` prompts of ``path`` through the chat template (``template``: thinking
    and system prompt, default off and none), refused unless templated as the training data
    was; with what the template check found."""
    opts = template or {"enable_thinking": False, "system_prompt": None}
    checked = check_template(tokenizer, opts, dataset_dir)
    settings = template_settings(tokenizer, **opts)
    return [torch.tensor(encode_prompt(tokenizer, m, settings)) for m in read_prompts(path)[:limit]], checked


def evaluate_real(drafter_dir: str | Path, prompts_path: str | Path, *, target_path: str | None = None,
                  dataset_dir: str | Path | None = None, template: dict | None = None, max_new_tokens: int = 64,
                  limit: int | None = None, baselines: tuple[str, ...] = ("untrained", "ngram", "repeat"),
                  threads: int | None = None, cache_dir: str = ".cache", log=print) -> dict:
    """The parity report of a trained drafter and its baselines on held-out chat prompts."""
    if threads:
        torch.set_num_threads(threads)
    ddir = resolve_drafter_dir(drafter_dir)
    run_cfg = saved_run_config(ddir) or {}
    target_path = target_path or (run_cfg.get("target") or {}).get("path")
    if target_path is None:
        raise ValueError("--target: needed (the checkpoint does not name its target)")
    if dataset_dir is None and (run_cfg.get("data") or {}).get("path"):
        dataset_dir = run_cfg["data"]["path"]
    dataset_dir = Path(dataset_dir) if dataset_dir else None
    drafter = DFlashDrafter.from_pretrained(ddir).eval()
    target, tokenizer = load_parity_target(target_path, drafter.target_layer_ids, cache_dir)
    if target.hidden_size != drafter.config.hidden_size:
        raise ValueError(f"--target: hidden size {target.hidden_size}, the drafter was trained for "
                         f"{drafter.config.hidden_size}")
    prompts, checked = chat_prompts(tokenizer, prompts_path, template, dataset_dir, limit)
    stops = tuple(stop_ids(tokenizer, target.model))
    B = drafter.block_size
    drafters = {"trained": drafter}
    if "untrained" in baselines:
        seed = int((run_cfg.get("train") or {}).get("seed", 0))
        drafters["untrained"] = DFlashDrafter(drafter.config).init_weights(seed).eval()
    proposers = {}
    if "ngram" in baselines and dataset_dir is not None:
        proposers["ngram"] = NgramProposer(open_dataset(_data_cfg(), progress=False, path=dataset_dir), B)
    if "repeat" in baselines:
        proposers["repeat"] = repeat_proposer(B)
    out = {"drafter": shown_path(ddir), "target": shown_path(target_path), "prompts": shown_path(prompts_path),
           "num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "block_size": B,
           "template_check": checked, "tau_counting": TAU_COUNTING}
    return out | parity_report(target, prompts, drafters, proposers, max_new_tokens, stops, log)


def parity_report(target, prompts: list[torch.Tensor], drafters: dict, proposers: dict, max_new_tokens: int,
                  stop_ids: tuple[int, ...], log=print) -> dict:
    """``parity`` of each drafter (``"trained"``, decoded for real, first) and each
    feature-free proposer, all on one ``TargetTexts``; with the wall time of each part."""
    B = drafters["trained"].block_size
    out: dict = {"results": {}}
    t = time.perf_counter()
    tt = TargetTexts.greedy(target, prompts, max_new_tokens, B, stop_ids)
    # Plain greedy decoding makes one target call per token: what speculative decoding must beat.
    out["greedy"] = {"tokens_per_target_call": 1.0, "wall_s": round(time.perf_counter() - t, 1)}
    t = time.perf_counter()
    feats = [text_features(target, x) for x in tt.texts]
    out["features_wall_s"] = round(time.perf_counter() - t, 1)
    for name, d in drafters.items():
        t = time.perf_counter()
        rows = [drafter_correct(d, target, x, completion_mask(len(x), len(p)), f)
                for p, x, f in zip(prompts, tt.texts, feats)]
        real = None
        if name == "trained":       # decoded for real: the losslessness proof
            real = real_tau(d, target, prompts, max_new_tokens, stop_ids, references=tt.references)
        _record(out, log, parity(name, rows, tt, B, real), t)
    for name, propose in proposers.items():
        t = time.perf_counter()
        rows = [proposer_correct(propose, x, len(p), B) for p, x in zip(prompts, tt.texts)]
        _record(out, log, parity(name, rows, tt, B), t)
    res = out["results"]
    mine = res["trained"]["real"]["per_prompt"]
    # Every proposer went over the same prompts' texts: the ratio's interval is paired by prompt.
    res["trained"]["ratio_to"] = {
        name: {"ratio": round(float(np.mean(mine)) / float(np.mean(r["real"]["per_prompt"])), 4),
               "ci95": ratio_interval(mine, r["real"]["per_prompt"])}
        for name, r in res.items() if name != "trained"}
    return out


def _record(out: dict, log, r: dict, t: float) -> None:
    r["wall_s"] = round(time.perf_counter() - t, 1)
    out["results"][r["name"]] = r
    log(f"evaluate: {r['name']}: real tau {r['real']['tau']:.3f} ({r['real']['decoded']}), "
        f"simulated tau {r['simulated']['tau']:.3f} ({r['wall_s']:.0f} s)")


TAU_COUNTING = ("real tau as z-lab's benchmark counts it: per prompt the mean tokens per verify step "
                "(accepted drafts + 1, the last step in full), then the mean over prompts; "
                "tau_pooled pools every step of every prompt; the trained drafter decodes for real, checked "
                "against the target's greedy text (lossless), the baselines are replayed on that text")


def _data_cfg():
    return DataConfig(max_seq_len=1 << 20)


def format_report(report: dict) -> str:
    """The side-by-side table ``evaluate`` prints."""
    lines = [f"drafter {report['drafter']} on {report['num_prompts']} prompts, {report['max_new_tokens']} new tokens; "
             f"chat template {report['template_check']}",
             f"{'':10} {'real tau':>8} {'pooled':>7} {'sim tau':>8} {'gap':>6} {'tok/call':>8} {'lossless':>9}  "
             "real per-position acceptance (slot 1..)"]
    for name, r in report["results"].items():
        real, sim = r["real"], r["simulated"]
        pos = " ".join("-" if x is None else f"{x:.2f}" for x in real["per_position"][:8])
        lossless = f"{real['lossless_prompts']:>4}/{real['prompts']:<4}" if real["decoded"] == "real" else "replayed"
        lines.append(f"{name:10} {real['tau']:8.3f} {real['tau_pooled']:7.3f} {sim['tau']:8.3f} "
                     f"{r['sim_vs_real']:6.1%} {real['tokens_per_target_call']:8.2f} {lossless:>9}  {pos}")
    trained = report["results"]["trained"]
    if trained["real"].get("tau_ci95"):
        lo, hi = trained["real"]["tau_ci95"]
        ratios = "; ".join(f"{name} x{r['ratio']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]"
                           for name, r in trained.get("ratio_to", {}).items() if r["ci95"])
        lines.append(f"trained real tau 95% interval over prompts [{lo:.3f}, {hi:.3f}]; against each: {ratios}")
    g = report["greedy"]
    lines.append(f"plain greedy decoding (KV cache): {g['tokens_per_target_call']:.2f} tokens per target call, "
                 f"{g['wall_s']:.0f} s. " + report["tau_counting"] + ".")
    for name, r in report["results"].items():
        if r["parity_warning"] and name == "trained":
            lines.append(f"warning: {name}: simulated tau {r['simulated']['tau']:.2f} and real tau "
                         f"{r['real']['tau']:.2f} differ by {r['sim_vs_real']:.0%} (> {PARITY_WARN:.0%}): "
                         "training's acceptance does not predict serving's; check the chat template, "
                         "thinking mode and target layers")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="launch.py evaluate",
                                 description="Simulated against real acceptance of a drafter on held-out prompts")
    ap.add_argument("checkpoint", help="drafter directory, checkpoint step-N, or run directory")
    ap.add_argument("--prompts", required=True,
                    help="held-out JSONL chat prompts or text lines, a prompt set (humaneval, mtbench), "
                         "or a comma list of them, each evaluated in turn")
    ap.add_argument("--target", help="target path or pkg:NAME (default: the one the run trained against)")
    ap.add_argument("--dataset", help="the training dataset, for its template metadata and the n-gram "
                                      "baseline (default: the run's data.path)")
    add_template_args(ap)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, help="only the first N prompts")
    ap.add_argument("--baselines", default="untrained,ngram,repeat", help="comma list, or none")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--cache-dir", default=".cache")
    ap.add_argument("--json", help="also write the full report here")
    args = ap.parse_args(argv)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    reports = {}
    try:
        sets = prompt_sets(args.prompts)
        for name, path in sets.items():
            if len(sets) > 1:
                print(f"evaluate: prompt set {name} ({path})", file=sys.stderr)
            reports[name] = evaluate_real(
                args.checkpoint, path, target_path=args.target, dataset_dir=args.dataset,
                template=template_opts(args), max_new_tokens=args.max_new_tokens, limit=args.limit,
                baselines=tuple(b for b in args.baselines.split(",") if b and b != "none"),
                threads=args.threads, cache_dir=args.cache_dir, log=lambda m: print(m, file=sys.stderr))
    except (ValueError, OSError) as e:
        print(f"error: {first_line(e)}", file=sys.stderr)
        return 2
    if len(reports) == 1:
        report = next(iter(reports.values()))
        print(format_report(report))
    else:
        report = {"sets": reports}
        print("\n\n".join(f"== {name}\n{format_report(r)}" for name, r in reports.items()))
        print("\n" + format_set_table(reports))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0
