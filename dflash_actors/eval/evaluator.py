"""evaluator: periodic held-out evaluation during training, beside the pipeline.

Contract:
  reads     the published weights (``WeightStore``), never writes shared state: it is
            not a pipeline stage, so a slow or dead evaluator cannot delay a batch or
            change the math (runs stay bit-identical with it on or off)
  produces  one ``{"kind": "eval", ...}`` line in ``<run_dir>/metrics.jsonl`` per
            evaluated version: simulated tau and per-position conditional acceptance on
            the held-out split, and real speculative-decoding tau on its first
            ``eval.real_prompts`` prompts, replayed on the target's greedy text of
            those prompts (``tau.replayed_tau``; ``launch.py evaluate`` decodes for real)
  when      once a multiple of ``eval.every`` optimizer steps is reached, on the newest
            published version then (the only one whose weights are still held);
            one that falls behind skips ahead rather than queueing
  plateau   with ``eval.plateau`` N, each line also carries the held-out walk tau (real
            decoding's walk replayed, per text); once the newest is not above the one N
            evaluations before beyond the 95% interval (paired over the texts), the line
            says so and the job ends as done at the version training has reached
            (``Supervisor.request_finish``; exit 0). The only way it touches the run,
            and it decides when training stops, never what a step computes.
  lifetime  a plain child process of the job, started with the supervisor and told to
            finish when it returns (it then evaluates the final version once); it exits
            on its own as soon as its parent is gone, so a killed job leaves no orphan.
  errors    a failed evaluation is a warning and training goes on; a metrics.jsonl it
            cannot append to stops the job (``Evaluator.start``'s ``on_error``, with
            ``files.cannot_write``'s line), as it does when the monitor's append fails.

Why its own process and not "between steps": an evaluation of a real model takes
seconds to minutes; between steps, every drafter would wait for it. Here it competes
only for CPU (it runs at a lower priority) or its own ``eval.device``.

What a version costs: only the drafter and the target's frozen head. The held-out
texts' target features, and the target's greedy continuation of the real-tau prompts
with its features, are computed once at the start; real tau then follows from the
drafter's blocks on that text, as in decoding (lossless decoding verifies exactly that
text), without the target forward per verify step that decoding for real costs. So the
whole target is released once those are computed (``prepare``): for the rest of the run
``eval.device`` holds the drafter, the features and the target's ``embed_tokens`` and
``lm_head``, not a second copy of the target beside ``target.0`` (54 GB at 27B). On
SmolLM2 a version takes about 5 s of one CPU thread (90 s when it decoded for real) and
about 45 s beside training on 2 cores at this lower priority (docs/watching.md).

Weights are read without a lock, seqlock style: version v lives in buffer v % 2 and the
optimizer rewrites that buffer only while building v + 2, which it cannot start before
v + 1 is published. A copy taken while the version still reads v or v + 1 afterwards is
therefore whole; otherwise it is discarded and taken again.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..data.dataset import open_dataset
from ..data.synthetic import ensure_synthetic_dataset
from ..models.drafter import DFlashDrafter
from ..models.drafter_start import build_drafter
from ..models.target import TargetModel, load_target
from ..runtime.boot import Deferred, boot
from ..runtime.files import cannot_write
from .decode import verify_block
from .intervals import pooled_difference_interval, pooled_interval
from .tau import TargetTexts, completion_mask, drafter_correct, replayed_tau, text_features, text_metrics, text_walk

POLL_S = 0.5


def due_versions(first: int, last: int, every: int) -> list[int]:
    """Versions to evaluate in ``(first, last]``: multiples of ``every``, and ``last``."""
    out = list(range((first // every + 1) * every, last + 1, every))
    return out if out and out[-1] == last else out + [last]


def snapshot(store, version: int) -> torch.Tensor | None:
    """A whole copy of the flat weights of ``version``, or None if the buffer was
    recycled while copying (see the module docstring)."""
    flat = store.weights[version % 2].clone()
    return flat if store.version <= version + 1 else None


class HeldOut:
    """The held-out texts with their target features, and the target's greedy text of the
    first ``real_prompts`` prompts (``TargetTexts``) with its features, computed once."""

    def __init__(self, cfg, target, max_samples: int, real_prompts: int, max_new_tokens: int):
        ds = open_dataset(cfg.data, progress=False, path=heldout_path(cfg))
        self.items = []
        for i in range(min(len(ds), max_samples)):
            ids, mask = ds.sample(i)
            if not mask.any():
                continue
            first = int(np.argmax(mask))
            ids_t = torch.from_numpy(ids.astype(np.int64))
            self.items.append((ids_t, first, text_features(target, ids_t)))
        self.real, self.real_feats = None, []
        if real_prompts:
            prompts = [ids[:first] for ids, first, _ in self.items[:real_prompts]]
            verify = cfg.drafter.block_size + (cfg.drafter.arch == "dspark")   # decode.verify_block
            self.real = TargetTexts.greedy(target, prompts, max_new_tokens, verify, ())
            self.real_feats = [text_features(target, x) for x in self.real.texts]


def heldout_path(cfg) -> Path:
    """``eval.data``, else the synthetic held-out split of the embedded default."""
    if cfg.eval.data is not None:
        return Path(cfg.eval.data)
    return ensure_synthetic_dataset(cfg.data)[1]


class Head:
    """What evaluating a version reads of the target (``tau.drafter_correct`` given the
    features): its frozen embeddings and vocabulary head, their device and dtype."""

    def __init__(self, target: TargetModel):
        self.embed_tokens, self.lm_head = target.embed_tokens, target.lm_head
        self.device, self.dtype = target.device, target.dtype


def prepare(cfg) -> tuple[DFlashDrafter, Head, HeldOut]:
    """The drafter to load versions into, the target's ``Head`` and the ``HeldOut`` set,
    on ``eval.device``; the rest of the target is freed before this returns. A job's
    config comes here resolved by its memory plan; ``auto`` still standing means no plan
    ran (a direct call), and the host is where the plan's own search ends."""
    target = load_target(cfg, "cpu" if cfg.eval.device == "auto" else cfg.eval.device)
    drafter = build_drafter(cfg, target).eval()
    heldout = HeldOut(cfg, target, cfg.eval.max_samples, cfg.eval.real_prompts, cfg.eval.max_new_tokens)
    head = Head(target)
    del target
    gc.collect()
    if head.device.type == "cuda":      # the caching allocator would keep the freed layers reserved
        with torch.cuda.device(head.device):
            torch.cuda.empty_cache()
    return drafter, head, heldout


@torch.no_grad()
def evaluate_version(drafter, head: Head | TargetModel, heldout: HeldOut) -> dict:
    masks = [completion_mask(len(ids), first) for ids, first, _ in heldout.items]
    rows = [drafter_correct(drafter, head, ids, m, feats) for (ids, _, feats), m in zip(heldout.items, masks)]
    correct, valid = zip(*rows)
    walks = [text_walk(c, m) for (c, _), m in zip(rows, masks)]
    tokens, steps = [t for t, _ in walks], [s for _, s in walks]
    out = {"simulated": text_metrics(np.concatenate(correct), np.concatenate(valid)),
           "walk": {"tau": round(sum(tokens) / max(sum(steps), 1), 4), "ci95": pooled_interval(tokens, steps),
                    "tokens": tokens, "steps": steps}}
    tt = heldout.real
    if tt is not None:
        rows = [drafter_correct(drafter, head, x, completion_mask(len(x), len(p)), f)
                for p, x, f in zip(tt.prompts, tt.texts, heldout.real_feats)]
        r = replayed_tau(rows, tt, verify_block(drafter))
        out["real"] = {k: r[k] for k in ("tau", "tau_pooled", "per_position", "verify_steps")}
    return out


def plateau(history: list[tuple[int, dict]], n: int) -> dict | None:
    """Whether the held-out curve has stopped rising: the newest evaluation of
    ``history`` (``(version, its "walk")``, in order) against the one ``n`` before; None
    while it still rises beyond the paired 95% interval, or while fewer are in."""
    if n < 1 or len(history) <= n:
        return None
    (u, old), (v, new) = history[-1 - n], history[-1]
    diff = round(new["tau"] - old["tau"], 4)
    ci = pooled_difference_interval((new["tokens"], new["steps"]), (old["tokens"], old["steps"]))
    if (ci[0] if ci is not None else diff) > 0:
        return None
    return {"versions": [u, v], "taus": [old["tau"], new["tau"]], "difference": diff, "ci95": ci}


def plateau_reason(p: dict) -> str:
    (u, v), (a, b), ci = p["versions"], p["taus"], p["ci95"]
    within = f" [{ci[0]:+.4f}, {ci[1]:+.4f}], 95% paired over the held-out texts" if ci else ""
    return (f"plateau: held-out walk tau {b:.4f} at step {v} against {a:.4f} at step {u} "
            f"({p['difference']:+.4f}{within})")


def run(cfg, store, run_dir: str, first_version: int, last_version: int, stop, parent: int, tell) -> None:
    """The process body (see the module contract); ``tell``: the pipe to the job,
    ``("error", line)`` for an unwritable metrics.jsonl, ``("plateau", reason)``."""
    try:
        os.nice(10)
    except OSError:
        pass
    torch.set_num_threads(cfg.train.num_threads)
    drafter, head, heldout = prepare(cfg)
    params = list(drafter.parameters())
    due = due_versions(first_version, last_version, cfg.eval.every)
    path = Path(run_dir) / "metrics.jsonl"
    history: list[tuple[int, dict]] = []
    while due and os.getppid() == parent:
        v = store.version
        ready = [d for d in due if d <= v]
        if not ready:
            if stop.is_set():
                return
            time.sleep(POLL_S)
            continue
        flat = snapshot(store, v)
        if flat is None:
            continue
        with torch.no_grad():
            for p, w in zip(params, store.layout.views(flat)):
                p.copy_(w)
        t = time.perf_counter()
        line = {"kind": "eval", "step": v, "time": round(time.time(), 3),
                **evaluate_version(drafter, head, heldout)}
        line["wall_s"] = round(time.perf_counter() - t, 2)
        history.append((v, line["walk"]))
        flat_at = plateau(history, cfg.eval.plateau) if v < last_version else None
        if flat_at is not None:
            line["plateau"] = flat_at
        try:
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as e:
            tell.send(("error", cannot_write(path, e)))
            return
        if flat_at is not None:
            tell.send(("plateau", plateau_reason(flat_at)))
            return
        due = [d for d in due if d > v]


def main(cfg, store, run_dir, first_version, last_version, stop, parent, tell) -> None:
    try:
        run(cfg, store, run_dir, first_version, last_version, stop, parent, tell)
    except Exception as e:      # an evaluation must never take training down with it
        print(f"warning: evaluator stopped: {type(e).__name__}: {e}", file=sys.stderr)


class Evaluator:
    """The job's handle: ``start()`` with the supervisor, ``finish()`` after it returns."""

    def __init__(self, cfg, store, run_dir: Path, first_version: int, last_version: int):
        import torch.multiprocessing as mp

        self.ctx = mp.get_context("spawn")
        self.stop = self.ctx.Event()
        self.told, self.tell = self.ctx.Pipe(duplex=False)
        args = (cfg, store, str(run_dir), first_version, last_version, self.stop, os.getpid(), self.tell)
        self.proc = self.ctx.Process(target=boot, name="evaluator", daemon=True,
                                     args=(os.getpid(), Deferred(args), "dflash_actors.eval.evaluator:main"))

    def start(self, on_error: Callable[[str], None], on_plateau: Callable[[str], None]) -> None:
        """Start it; from a thread of this process, ``on_error`` gets the line of an
        unwritable metrics.jsonl (the supervisor's ``request_failure``) and ``on_plateau``
        the reason training stops paying (``request_finish``; ``eval.plateau``)."""
        self.proc.start()
        self.tell.close()       # the child's copy is then the only one: its exit ends the pipe
        self.listener = threading.Thread(target=self._listen, args=({"error": on_error, "plateau": on_plateau},),
                                         name="evaluator-messages", daemon=True)
        self.listener.start()

    def _listen(self, handlers: dict[str, Callable[[str], None]]) -> None:
        try:
            kind, text = self.told.recv()
        except EOFError:        # it ended without one
            return
        handlers[kind](text)

    def finish(self, timeout_s: float) -> None:
        """Let it evaluate what is due (the final version included), then make sure it is gone."""
        self.stop.set()
        self.proc.join(timeout_s)
        if self.proc.is_alive():
            print(f"warning: evaluator still busy after {timeout_s:.0f} s; stopped", file=sys.stderr)
            self.proc.kill()
            self.proc.join()
        self.listener.join()    # at once: the process's exit closed the pipe
        self.told.close()
