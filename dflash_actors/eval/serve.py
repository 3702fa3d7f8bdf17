"""``launch.py serve-check RUN_DIR``: the run's newest drafter served by a real vLLM, beside ``evaluate``.

The proof that what trained is served as trained. vLLM serves the run's target with its
newest drafter (``speculative_config`` ``method: dflash``, K = block size - 1) and decodes
the held-out prompts greedily; the project decodes the same prompts (``tau.real_tau``,
what ``evaluate`` reports). Compared, prompt by prompt:

* losslessness: vLLM's output with the drafter, without it, and batched, each equal to the
  target's greedy text as the project computes it;
* acceptance: vLLM's mean acceptance length (1 + accepted / drafts, from its
  ``spec_decode`` counters) against ``evaluate``'s real tau, and per slot. The two differ
  only at the end of a text: a vLLM request ends once it holds ``max_tokens``, where
  z-lab's figure also counts the step taken from the last token. So the project's own
  steps are also counted vLLM's way (``served_counts``); vLLM must equal that figure within
  ``--tolerance`` (0.01 by default), and the real tau is shown beside both;
* speed users serve for: tokens/s with the drafter over tokens/s without it, one request
  at a time and all prompts batched, in the same engine.

vLLM runs in its own environment (it pins its own torch): ``--vllm-python``, else
``.cache/vllm-venv`` (``make serve-check`` creates it), else this interpreter if it has
vLLM. The engine side is ``engine_vllm.py``, a script that imports vLLM only.

Exit 0 when they agree, 1 with one line naming the first prompt that differs, 2 with one
line for what cannot be checked (no checkpoint, no engine, an arch the engine cannot
serve here, a K that contradicts the block size). The readable report goes to stderr,
one JSON line to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..config import config_from_dict
from ..console import first_line, shown_path
from ..data.dataset import open_dataset
from ..models.drafter import DFlashDrafter, is_dflash2
from ..models.target import ensure_target
from ..models.target_dir import has_tokenizer
from ..prepare.generate import stop_ids as tokenizer_stop_ids
from ..prepare.prompt_sets import prompt_set
from ..prepare.regenerate import add_template_args, template_opts
from .evaluator import heldout_path
from .parity import chat_prompts, load_parity_target, resolve_drafter_dir, saved_run_config
from .tau import TargetTexts, real_tau

ENGINE_SCRIPT = Path(__file__).with_name("engine_vllm.py")
TOLERANCE = 0.01


class Unservable(ValueError):
    """What cannot be checked here: exit 2, one line."""


class Disagreement(Exception):
    """Engine and project differ: exit 1, one line naming the first prompt."""


def engine_python(given: str | None, cache_dir: str) -> str:
    """The interpreter that has vLLM (module docstring)."""
    if given is not None:
        if not Path(given).is_file():
            raise Unservable(f"--vllm-python: {given} does not exist")
        return given
    venv = Path(cache_dir) / "vllm-venv" / "bin" / "python"
    return str(venv) if venv.is_file() else sys.executable


def probe(python: str) -> dict:
    """vLLM's version and device, from ``python``; Unservable when it has no vLLM."""
    try:
        r = subprocess.run([python, str(ENGINE_SCRIPT), "--probe"], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unservable(f"vLLM: cannot run {python} ({first_line(e)})") from None
    if r.returncode != 0:
        raise Unservable(f"vLLM: not importable by {python} ({_last_error(r.stderr)}); `make serve-check` "
                         "creates .cache/vllm-venv, or pass --vllm-python")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _last_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or ["no output"])[-1][:300]


def check_k(k: int | None, block_size: int) -> int:
    """K, the tokens drafted after the bonus token: block size - 1 for DFlash, which predicts
    slots 1..B-1 of a block that starts at the bonus token. vLLM accepts any K and never
    checks it against the drafter: K = B runs a block longer than trained."""
    if k is None:
        return block_size - 1
    if k != block_size - 1:
        raise Unservable(f"--k: {k} contradicts the drafter's block size {block_size} (a DFlash drafter is "
                         f"served with K = block size - 1 = {block_size - 1})")
    return k


def heldout_prompts(cfg, limit: int) -> list[torch.Tensor]:
    """The run's held-out texts cut before their completion (``eval.data``, or the
    synthetic held-out split): the prompts its evaluator decodes from."""
    ds = open_dataset(cfg.data, progress=False, path=heldout_path(cfg))
    out = []
    for i in range(len(ds)):
        ids, mask = ds.sample(i)
        if mask.any() and np.argmax(mask) > 0:
            out.append(torch.from_numpy(ids[:int(np.argmax(mask))].astype(np.int64)))
        if len(out) == limit:
            break
    return out


def run_engine(python: str, job: dict, threads: int, timeout_s: float) -> dict:
    """``engine_vllm.py`` on ``job``; its result, or Unservable with the engine's last error."""
    with tempfile.TemporaryDirectory(prefix="serve-check-") as tmp:
        job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_file.write_text(json.dumps({**job, "threads": threads}))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND":
               os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, range(threads))))}
        try:
            r = subprocess.run([python, str(ENGINE_SCRIPT), str(job_file), str(out_file)], capture_output=True,
                               text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            raise Unservable(f"vLLM: no result in {timeout_s:.0f} s") from None
        if r.returncode != 0 or not out_file.is_file():
            raise Unservable(f"vLLM could not serve it: {_last_error(r.stderr)}")
        return json.loads(out_file.read_text())


def served_counts(gen, prompt_len: int, max_new_tokens: int) -> tuple[int, int]:
    """``(drafts, accepted)`` of one project generation as vLLM counts them. vLLM's first
    token is the prefill's, as here; a request that holds ``max_new_tokens`` tokens is
    finished, so the step the project takes from the last of them (z-lab's count keeps it)
    never runs; and each step that runs counts every draft its sampler accepted, also those
    that ``max_tokens`` then cuts from the output."""
    last = prompt_len + max_new_tokens - 1
    taken = [a for s, a in zip(gen.starts, gen.accepted) if s < last]
    return len(taken), sum(taken)


def compare(gens, prompts, references, vllm_spec: dict, vllm_plain: dict, max_new_tokens: int, k: int,
            tolerance: float) -> dict:
    """Prompt by prompt, engine against project (module docstring); raises Disagreement
    at the first prompt that differs."""
    rows = []
    for i, (g, p, ref, spec_out, plain_out, batched_out, c) in enumerate(zip(
            gens, prompts, references, vllm_spec["outputs"], vllm_plain["outputs"], vllm_spec["batched_outputs"],
            vllm_spec["per_prompt"])):
        want = ref[len(p):].tolist()
        for name, got in (("with the drafter", spec_out), ("without it", plain_out), ("batched", batched_out)):
            if got != want:
                at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                raise Disagreement(f"prompt {i}: vLLM's output {name} leaves the target's greedy text at token "
                                   f"{at} ({len(got)} against {len(want)} tokens)")
        drafts, accepted = served_counts(g, len(p), max_new_tokens)
        rows.append({"engine": 1 + c["accepted"] / max(c["drafts"], 1), "drafts": c["drafts"],
                     "accepted": c["accepted"], "project_counted": 1 + accepted / max(drafts, 1),
                     "project_drafts": drafts, "project_accepted": accepted,
                     "real_tau": float(np.mean(g.lengths))})
    engine = float(np.mean([r["engine"] for r in rows]))
    counted = float(np.mean([r["project_counted"] for r in rows]))
    if abs(engine - counted) > tolerance:
        worst = next(i for i, r in enumerate(rows) if abs(r["engine"] - r["project_counted"]) > 1e-9)
        r = rows[worst]
        raise Disagreement(f"prompt {worst}: vLLM accepted {r['accepted']} of {r['drafts']} drafts, the project "
                           f"{r['project_accepted']} of {r['project_drafts']}: mean acceptance {engine:.4f} "
                           f"against {counted:.4f} (tolerance {tolerance})")
    per_pos = np.sum([c["per_position"] + [0] * (k - len(c["per_position"])) for c in vllm_spec["per_prompt"]],
                     axis=0)
    drafts = sum(r["drafts"] for r in rows)
    conditional = [float(per_pos[0] / max(drafts, 1))] + \
        [float(per_pos[j] / per_pos[j - 1]) if per_pos[j - 1] else None for j in range(1, k)]
    return {"rows": rows, "engine_acceptance": engine, "project_counted": counted,
            "engine_pooled": 1 + sum(r["accepted"] for r in rows) / max(drafts, 1),
            "engine_per_position": conditional, "lossless_prompts": len(rows)}


def serve_check(run_dir: str, *, prompts: str | None = None, limit: int = 32, max_new_tokens: int = 64,
                k: int | None = None, tolerance: float = TOLERANCE, vllm_python: str | None = None,
                threads: int = 1, template: dict | None = None, cache_dir: str = ".cache",
                timeout_s: float = 3600, log=print) -> dict:
    """The report ``main`` prints; raises Unservable or Disagreement (module docstring)."""
    try:
        ddir = resolve_drafter_dir(run_dir)
    except ValueError:
        raise Unservable(f"{run_dir}: no checkpoint to serve (not a run directory with one, a checkpoint or "
                         "a drafter directory)") from None
    saved = saved_run_config(ddir)
    if saved is None:
        raise Unservable(f"{ddir}: has no trainer state naming its run's target; serve-check needs a run's checkpoint")
    cfg = config_from_dict(saved)
    drafter = DFlashDrafter.from_pretrained(ddir).eval()
    K = check_k(k, drafter.block_size)
    python = engine_python(vllm_python, cache_dir)
    engine = probe(python)
    if is_dflash2(drafter.config) and engine["device"] == "cpu":
        raise Unservable(f"{ddir}: a DFlash2 drafter, which vLLM {engine['version']}'s CPU build cannot serve "
                         "(Model Runner V1 does not support DFlash candidate-head drafts; V2 needs Triton); "
                         "see docs/serving.md for llama.cpp")
    torch.set_num_threads(threads)
    tdir = ensure_target(cfg)
    target, tokenizer = load_parity_target(str(tdir), drafter.target_layer_ids, cache_dir,
                                           tokenizer=has_tokenizer(tdir))
    if prompts is None:
        ids, where = heldout_prompts(cfg, limit), f"the run's held-out texts ({shown_path(heldout_path(cfg))})"
    else:
        if tokenizer is None:
            raise Unservable(f"--prompts: chat prompts need the target's tokenizer, and {tdir} has none")
        path = prompt_set(prompts)
        ids, _ = chat_prompts(tokenizer, path, template, Path(cfg.data.path) if cfg.data.path else None, limit)
        where = shown_path(path)
    if not ids:
        raise Unservable(f"{where}: no prompts")
    stops = tuple(tokenizer_stop_ids(tokenizer, target.model)) if tokenizer is not None else ()
    log(f"serve-check: {len(ids)} prompts from {where}; project decoding")
    tt = TargetTexts.greedy(target, ids, max_new_tokens, drafter.block_size, stops)
    gens: list = []
    mine = real_tau(drafter, target, ids, max_new_tokens, stops, references=tt.references, keep=gens)
    job = {"target": str(tdir), "prompts": [p.tolist() for p in ids], "max_new_tokens": max_new_tokens,
           "stop_ids": list(stops), "k": K, "tokenizer": tokenizer is not None,
           "max_model_len": max(len(p) for p in ids) + max_new_tokens + drafter.block_size + 16}
    log(f"serve-check: vLLM {engine['version']} ({engine['device']}) without the drafter")
    plain = run_engine(python, {**job, "drafter": None}, threads, timeout_s)
    log(f"serve-check: vLLM with the drafter, K = {K}")
    spec = run_engine(python, {**job, "drafter": str(ddir)}, threads, timeout_s)
    report = {"check": "serve-check", "run": shown_path(run_dir), "drafter": shown_path(ddir),
              "target": shown_path(tdir),
              "engine": f"vllm {engine['version']} ({engine['device']})", "k": K, "block_size": drafter.block_size,
              "prompts": where, "num_prompts": len(ids), "max_new_tokens": max_new_tokens, "tolerance": tolerance,
              "evaluate": {key: mine[key] for key in ("tau", "tau_ci95", "tau_pooled", "per_position",
                                                      "lossless_prompts", "prompts")}}
    report["speed"] = {mode: {"with_drafter": spec[mode]["tokens_per_s"], "without": plain[mode]["tokens_per_s"],
                              "speedup": round(spec[mode]["tokens_per_s"] / plain[mode]["tokens_per_s"], 3)}
                       for mode in ("one_at_a_time", "batched")}
    report["speed"]["batch"] = len(ids)
    if mine["lossless_prompts"] != len(ids):
        raise Disagreement(f"prompt {mine['mismatches'][0]['prompt']}: the project's own speculative decoding "
                           "leaves the target's greedy text (see launch.py evaluate)")
    report |= compare(gens, ids, tt.references, spec, plain, max_new_tokens, K, tolerance)
    return report


def format_report(r: dict) -> str:
    ev = r["evaluate"]
    lo, hi = ev["tau_ci95"] or (float("nan"), float("nan"))
    pos = lambda xs: " ".join("  - " if x is None else f"{x:.3f}" for x in xs)      # noqa: E731
    sp = r["speed"]
    return "\n".join([
        f"serve-check {r['drafter']} in {r['engine']}, K = {r['k']} (block {r['block_size']}); "
        f"{r['num_prompts']} prompts from {r['prompts']}, {r['max_new_tokens']} new tokens, greedy",
        f"{'':28} {'acceptance':>10} {'pooled':>7}  per-slot acceptance (conditional), slot 1..",
        f"{'evaluate (real tau)':28} {ev['tau']:10.4f} {ev['tau_pooled']:7.4f}  {pos(ev['per_position'])}"
        f"   [95% {lo:.3f}, {hi:.3f}]",
        f"{'project, counted as vLLM':28} {r['project_counted']:10.4f}",
        f"{'vLLM':28} {r['engine_acceptance']:10.4f} {r['engine_pooled']:7.4f}  {pos(r['engine_per_position'])}",
        f"agree: vLLM - project {r['engine_acceptance'] - r['project_counted']:+.4f} (tolerance {r['tolerance']}); "
        f"vLLM - evaluate's real tau {r['engine_acceptance'] - ev['tau']:+.4f}",
        f"lossless: {r['lossless_prompts']}/{r['num_prompts']} prompts equal the target's greedy text in vLLM with "
        "the drafter, without it, and batched",
        f"speed in vLLM: one request at a time {sp['one_at_a_time']['with_drafter']:.1f} tokens/s with the drafter, "
        f"{sp['one_at_a_time']['without']:.1f} without ({sp['one_at_a_time']['speedup']:.2f}x); "
        f"{sp['batch']} batched {sp['batched']['with_drafter']:.1f} against {sp['batched']['without']:.1f} "
        f"({sp['batched']['speedup']:.2f}x)"])


def summary_line(r: dict) -> dict:
    keep = ("check", "run", "engine", "k", "block_size", "prompts", "num_prompts", "max_new_tokens", "tolerance",
            "engine_acceptance", "project_counted", "engine_pooled", "engine_per_position", "lossless_prompts",
            "speed")
    out = {key: r[key] for key in keep}
    out["evaluate"] = {key: r["evaluate"][key] for key in ("tau", "tau_ci95", "tau_pooled", "per_position")}
    return json.loads(json.dumps(out), parse_float=lambda x: round(float(x), 4))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="launch.py serve-check", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a run directory (its newest checkpoint), a checkpoint step-N")
    ap.add_argument("--prompts", help="humaneval, mtbench or a JSONL/text file of chat prompts "
                                      "(default: the run's held-out texts, cut before their completion)")
    ap.add_argument("--limit", type=int, default=32, help="the first N prompts (default 32)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, help="speculative tokens after the bonus token (default and only value: "
                                          "block size - 1)")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE,
                    help=f"largest |vLLM - project| mean acceptance length that agrees (default {TOLERANCE})")
    ap.add_argument("--vllm-python", help="the interpreter of an environment with vLLM "
                                          "(default: .cache/vllm-venv/bin/python, else this one)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads for the project and for vLLM")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds each vLLM run may take")
    add_template_args(ap)
    ap.add_argument("--cache-dir", default=".cache")
    ap.add_argument("--json", help="also write the full report here")
    args = ap.parse_args(argv)
    if args.limit < 1 or args.max_new_tokens < 1 or args.threads < 1 or not args.tolerance >= 0:
        print("error: --limit, --max-new-tokens and --threads must be >= 1, --tolerance >= 0", file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    log = lambda m: print(m, file=sys.stderr)      # noqa: E731
    try:
        report = serve_check(args.run_dir, prompts=args.prompts, limit=args.limit,
                             max_new_tokens=args.max_new_tokens, k=args.k, tolerance=args.tolerance,
                             vllm_python=args.vllm_python, threads=args.threads, template=template_opts(args),
                             cache_dir=args.cache_dir, timeout_s=args.timeout, log=log)
    except Disagreement as e:
        print(f"serve-check: disagree: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        print(f"error: {first_line(e)}", file=sys.stderr)
        return 2
    log(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(json.dumps(summary_line(report)))
    return 0
