"""``launch.py taps``: rank which target layers should feed the drafter, on your own target
and data, with short runs.

Which layers a drafter reads (``drafter.target_layer_ids``) moves its acceptance as much
as most training choices, and the default (z-lab's spread over layers 1..L-3) is a guess.
A short run ranks candidate sets the way a full run would (the ranking held from small
to large data in a public sweep; ``docs/taps.md`` has the evidence and this project's
own check), so the search costs a few short runs rather than a full one per candidate.

Every candidate trains with the single-process reference trainer (the pipeline's exact
math) for the same ``--steps`` from the same seed and batches, differing only in its
taps, and is then measured on the held-out texts (``eval.data``; the synthetic held-out
split of the embedded default): walk tau, real decoding's walk replayed on the drafter's
acceptances (``eval.tau.walk_counts``), with its 95% bootstrap interval over texts, and
its difference to the control (the config's own taps) with a paired interval. Equal
steps rather than equal minutes: the ranking is then about the signal each set carries,
not about how busy the machine was, and a tap set changes a step's cost little (the
target stops at the deepest tapped layer; ``s_per_step`` is reported).

The search, unless ``--candidates`` names the sets:
  stage 1  ``--grid G`` single layers spread evenly over 1..L-1;
  stage 2  the best m of them together, for each m in ``--sizes`` (m <= G).
The control runs in every search. A candidate that names a layer the target lacks, or a
malformed list, exits 2 with one line before any run starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from ..config import Config, ConfigError, add_config_args, config_from_args
from ..console import first_line

HELDOUT_TEXTS = 64
"""Held-out texts measured per candidate (all of them when fewer)."""


def parse_candidates(text: str) -> list[tuple[int, ...]]:
    """``"1,27 14,27;20"`` -> ``[(1, 27), (14, 27), (20,)]``: sets separated by spaces or
    ``;``, layers by commas; each set sorted, no layer twice, no set twice."""
    out: list[tuple[int, ...]] = []
    for part in text.replace(";", " ").split():
        try:
            layers = [int(x) for x in part.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--candidates: {part!r} is not a comma-separated list of layer numbers") from None
        if not layers or any(i < 0 for i in layers) or len(set(layers)) != len(layers):
            raise ConfigError(f"--candidates: {part!r} must name distinct layers, each 0 or above")
        taps = tuple(sorted(layers))
        if taps not in out:
            out.append(taps)
    if not out:
        raise ConfigError("--candidates: name at least one set, e.g. '1,27 20,27'")
    return out


def grid_layers(num_layers: int, grid: int) -> list[tuple[int, ...]]:
    """``grid`` single layers spread evenly over 1..L-2 (layer 0 is nearly the embedding;
    the last layer is served unlike it trains, ``check_served_taps``)."""
    lo, hi = 1, max(1, num_layers - 2)
    if grid == 1 or hi <= lo:
        return [(hi,)]
    return sorted({(round(lo + i * (hi - lo) / (grid - 1)),) for i in range(grid)})


def combined(ranked_singles: list[tuple[int, ...]], sizes: list[int]) -> list[tuple[int, ...]]:
    """The best ``m`` single layers together, for each ``m`` in ``sizes`` (2 and up)."""
    return [tuple(sorted(t[0] for t in ranked_singles[:m])) for m in sizes if 2 <= m <= len(ranked_singles)]


def check_layers(candidates: list[tuple[int, ...]], num_layers: int) -> None:
    from ..models.target import check_served_taps
    for taps in candidates:
        bad = [i for i in taps if i >= num_layers]
        if bad:
            raise ConfigError(f"--candidates: layer {bad[0]} does not exist in a {num_layers}-layer target")
        try:
            check_served_taps(taps, num_layers, "--candidates")
        except ValueError as e:
            raise ConfigError(str(e)) from None


def target_layers(cfg: Config) -> tuple[int, list[int]]:
    """The target's layer count and the config's own taps (the control), read from the
    target's config alone, so that bad input is refused before any weights load."""
    from ..models.head import target_config
    from ..models.target import configured_layer_ids, ensure_target
    from ..models.tiny import tiny_target_config

    # The demo's tiny target is fitted on first use: its shape is known before that.
    config = tiny_target_config(cfg) if cfg.target.path is None else target_config(ensure_target(cfg))
    n = int(config.num_hidden_layers)
    return n, configured_layer_ids(cfg, n)


def measure(cfg: Config, taps: tuple[int, ...], steps: int, heldout: str, texts: int, threads: int) -> dict:
    """Train ``cfg`` with ``taps`` for ``steps`` steps (reference trainer) and measure it on
    the first ``texts`` held-out texts. Runs in a worker process."""
    import numpy as np
    import torch
    from transformers.utils import logging as hf_logging

    from ..data.dataset import open_dataset
    from ..data.synthetic import train_path
    from ..eval.tau import text_metrics, walk_counts, walk_summary
    from ..job.reference import train_reference
    from ..train.sizing import sized_to_steps

    hf_logging.disable_progress_bar()
    cfg = cfg.updated({"drafter.target_layer_ids": list(taps), "train.num_threads": threads})
    top = cfg.topology
    if torch.cuda.is_available() and top.target_devices is None and top.drafter_devices is None:
        # The reference places as the job does, which puts an N-M job on the CPU of a
        # machine with fewer than N+M GPUs; a candidate's short run is one process, so
        # it takes cuda:0 whole, as it did before the reference ran the plan.
        n, m = top.num_targets * top.target_tp, top.num_drafters
        cfg = cfg.updated({"topology.target_devices": ["cuda:0"] * n, "topology.drafter_devices": ["cuda:0"] * m})
    cfg = sized_to_steps(cfg, open_dataset(cfg.data, progress=False, path=train_path(cfg)).lengths, steps)
    kept: dict = {}

    def keep(step, drafter, target, m):
        kept.update(drafter=drafter, target=target)
    t = time.perf_counter()
    res = train_reference(cfg, progress=False, on_step=keep)
    train_s = time.perf_counter() - t
    drafter, target = kept["drafter"], kept["target"]
    drafter.eval()
    ds = open_dataset(cfg.data, progress=False, path=heldout)
    n = min(texts, len(ds))
    pairs: list = []
    with torch.no_grad():
        tokens, vsteps = walk_counts(drafter, target, ds, keep=pairs, limit=n)
    sim = text_metrics(np.concatenate([c for c, _ in pairs]), np.concatenate([v for _, v in pairs]))
    tail = res.losses[-5:]
    return {"taps": list(taps), "steps": res.steps, **walk_summary(tokens, vsteps),
            "simulated_tau": round(sim["tau"], 4), "per_position": sim["per_position"],
            "loss": round(sum(tail) / len(tail), 4), "s_per_step": round(train_s / max(res.steps, 1), 3), "texts": n}


class Runner:
    """Candidates measured ``jobs`` at a time, each in a spawned process of its own with
    ``threads`` threads; results printed as they finish."""

    def __init__(self, cfg: Config, steps: int, heldout: str, texts: int, jobs: int, threads: int, log):
        self.args = (steps, heldout, texts, threads)
        self.cfg, self.jobs, self.log = cfg, jobs, log
        self.done: dict[tuple[int, ...], dict] = {}

    def run(self, candidates: list[tuple[int, ...]], stage: str) -> list[dict]:
        todo = [c for c in candidates if c not in self.done]
        if not todo:
            return [self.done[c] for c in candidates]
        self.log(f"{stage}: {len(todo)} run(s) of {self.args[0]} steps: {', '.join(map(show, todo))}")
        if self.jobs == 1:      # in this process: no worker to start
            results = (measure(self.cfg, c, *self.args) for c in todo)
            self._collect(zip(todo, results), stage)
        else:
            with ProcessPoolExecutor(self.jobs, mp_context=get_context("spawn")) as pool:
                futures = [pool.submit(measure, self.cfg, c, *self.args) for c in todo]
                self._collect(zip(todo, (f.result() for f in futures)), stage)
        return [self.done[c] for c in candidates]

    def _collect(self, results, stage: str) -> None:
        for taps, r in results:
            self.done[taps] = r | {"stage": stage}
            self.log(f"  taps {show(taps)}: walk tau {r['walk_tau']} {r['walk_ci95']} "
                     f"loss {r['loss']} ({r['s_per_step']} s/step)")


def show(taps) -> str:
    return ",".join(map(str, taps))


def ranked(results: list[dict], control: tuple[int, ...]) -> list[dict]:
    """Results best first, each with its difference to the control and that difference's
    paired 95% interval over the held-out texts; ``better`` when the interval is above 0."""
    from ..eval.intervals import pooled_difference_interval

    base = next(r for r in results if tuple(r["taps"]) == control)
    out = []
    for r in sorted(results, key=lambda r: -r["walk_tau"]):
        d = {"difference": round(r["walk_tau"] - base["walk_tau"], 4), "ci95": None, "better": False}
        if tuple(r["taps"]) != control:
            d["ci95"] = pooled_difference_interval((r["walk_tokens"], r["walk_steps"]),
                                                   (base["walk_tokens"], base["walk_steps"]))
            d["better"] = bool(d["ci95"] and d["ci95"][0] > 0)
        out.append({k: v for k, v in r.items() if k not in ("walk_tokens", "walk_steps")}
                   | {"control": tuple(r["taps"]) == control, "versus_control": d})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| taps | stage | held-out walk tau [95%] | vs control [95%, paired] | loss | s/step |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        v = r["versus_control"]
        vs = "control" if r["control"] else (f"{v['difference']:+.4f} [{v['ci95'][0]:+.4f}, {v['ci95'][1]:+.4f}]"
                                             if v["ci95"] else f"{v['difference']:+.4f}")
        ci = f" [{r['walk_ci95'][0]}, {r['walk_ci95'][1]}]" if r["walk_ci95"] else ""
        lines.append(f"| {show(r['taps'])} | {r['stage']} | {r['walk_tau']}{ci} | {vs} | {r['loss']} | "
                     f"{r['s_per_step']} |")
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="launch.py taps", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    add_config_args(ap)
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per candidate (default 200)")
    ap.add_argument("--candidates", help="the sets to rank, e.g. '1,27 14,27 20,24,27' (default: the staged search)")
    ap.add_argument("--grid", type=int, default=6, help="search: single layers tried in stage 1 (default 6)")
    ap.add_argument("--sizes", default="2,3", help="search: how many of the best single layers to combine "
                                                   "in stage 2 (default 2,3)")
    ap.add_argument("--texts", type=int, default=HELDOUT_TEXTS, help="held-out texts measured (default 64)")
    ap.add_argument("--jobs", type=int, default=1, help="candidates trained at a time (default 1)")
    ap.add_argument("--out", help="also write the report (JSON) here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    log = lambda msg: print(f"# {msg}", file=sys.stderr, flush=True)    # noqa: E731
    try:
        if args.steps < 1 or args.grid < 1 or args.texts < 1 or args.jobs < 1:
            raise ConfigError("--steps, --grid, --texts and --jobs must each be at least 1")
        try:
            sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
        except ValueError:
            sizes = []
        if not sizes or min(sizes) < 2:
            raise ConfigError(f"--sizes: {args.sizes!r} must list counts of 2 or more, e.g. 2,3")
        cfg = config_from_args(args)
        explicit = parse_candidates(args.candidates) if args.candidates is not None else None
        num_layers, control = target_layers(cfg)
        control = tuple(sorted(control))
        check_layers(explicit or [], num_layers)
        from ..eval.evaluator import heldout_path

        heldout = heldout_path(cfg)
        if not (heldout / "state.json").is_file() and not (heldout / "prepare.json").is_file():
            raise ConfigError(f"eval.data: no dataset at {heldout} (prepare the held-out prompts first)")
    except (ValueError, OSError) as e:
        print(f"error: {first_line(e)}", file=sys.stderr)
        return 2
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    runner = Runner(cfg, args.steps, str(heldout), args.texts, args.jobs, threads, log)
    t = time.perf_counter()
    if explicit is not None:
        results = runner.run([control] + [c for c in explicit if c != control], "given")
    else:
        singles = runner.run(grid_layers(num_layers, args.grid), "single")
        best = [tuple(r["taps"]) for r in sorted(singles, key=lambda r: -r["walk_tau"])]
        runner.run([control, *combined(best, sizes)], "sets")
        results = list(runner.done.values())       # each candidate once, in the order measured
    rows = ranked(results, control)
    report = {"tool": "taps", "target_layers": num_layers, "control": list(control), "steps": args.steps,
              "heldout": str(heldout), "minutes": round((time.perf_counter() - t) / 60, 1), "ranked": rows,
              "best": rows[0]["taps"]}
    print(table(rows), file=sys.stderr)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
