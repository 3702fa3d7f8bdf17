"""Recipes on SmolLM2-135M side by side: at equal steps, or at equal wall-clock minutes.

    python -m benchmarks.recipes [--steps 200] [--variants anchors,init_target,...]
    python -m benchmarks.recipes --minutes 10 --parallel 2 --variants default,wsd,head_sampled

Every variant trains with the single-process reference trainer (the pipeline's exact math)
from the same data, seed and batches, one thread, and differs only in its overrides
(``VARIANTS``; ``taps:A-B-C`` reads target layers A, B, C). At the marked steps and the
last, it measures on the held-out prompts' target text (``prepare`` of
``prompts/heldout.jsonl``): the walk tau (real decoding's walk replayed on the drafter's
acceptances: on the target's own text it equals real tau up to float noise,
``eval.tau.walk_tau``) and per-slot conditional acceptance, and it records the training loss
(mean of the 5 steps up to the mark) and seconds per step. One JSON line, plus a table and a
plot in ``--out``.

``--minutes M`` gives every variant the same M minutes of training instead of the same
steps: a variant first times its own steps for ``CALIBRATION_S`` seconds, then trains
the steps that fit M minutes at that rate (``train.max_steps``), so its LR schedule ends
where its minutes do; held-out checks are not counted. The target's features come from
one disk feature cache per feature layout, filled once before the variants start
(every variant pays the same target cost in a real run; here it would only add the same
minutes to each). ``--parallel 2`` runs two variants at a time, one thread each: both
share whatever else the machine is doing, so their minutes stay comparable.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import ROOT, say

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
    # The SmolLM2 config's recipe as it is (DFlash2 since 2026-12-06; DFlash over the sampled
    # head before), exact head against the head restricted to the data's tokens.
    "default": ["drafter.init=random", "train.position_weight=dpace"],
    "head_vocab_data": ["drafter.init=random", "train.position_weight=dpace", "train.head_vocab=data"],
    # Levers against the config's recipe ("default"), for --minutes (#37).
    "head_sampled": ["drafter.init=random", "train.position_weight=dpace", "train.head_vocab=sampled"],
    "wsd": ["drafter.init=random", "train.position_weight=dpace", "train.lr_schedule=wsd"],
    "anchors32": ["drafter.init=random", "train.position_weight=dpace", "train.num_anchors=32"],
    "anchors64": ["drafter.init=random", "train.position_weight=dpace", "train.num_anchors=64"],
    "layers3": ["drafter.init=random", "train.position_weight=dpace", "drafter.num_layers=3"],
    "layers4": ["drafter.init=random", "train.position_weight=dpace", "drafter.num_layers=4"],
    "block4": ["drafter.init=random", "train.position_weight=dpace", "drafter.block_size=4"],
    "block16": ["drafter.init=random", "train.position_weight=dpace", "drafter.block_size=16"],
    "lr6e-4": ["drafter.init=random", "train.position_weight=dpace", "train.lr=6e-4"],
    "sampled_block4": ["drafter.init=random", "train.position_weight=dpace", "train.head_vocab=sampled",
                       "drafter.block_size=4"],
    "sampled_block4_wsd": ["drafter.init=random", "train.position_weight=dpace", "train.head_vocab=sampled",
                           "drafter.block_size=4", "train.lr_schedule=wsd"],
    # DFlash2 (#44) against DFlash, all over the full head (a DFlash2 selects among the whole
    # head's top-K): DFlash, the convolution alone (the selector left at DFlash's argmax),
    # and DFlash2 at two selector ranks.
    "dflash_full": ["drafter.init=random", "train.position_weight=dpace", "train.head_vocab=full"],
    "dflash2_conv": ["drafter.init=random", "train.position_weight=dpace", "train.head_vocab=full",
                     "drafter.arch=dflash2", "drafter.selector_rank=16", "train.selector_weight=0"],
    "dflash2_r32": ["drafter.init=random", "train.position_weight=dpace", "train.head_vocab=full",
                    "drafter.arch=dflash2", "drafter.selector_rank=32"],
    "dflash2_r128": ["drafter.init=random", "train.position_weight=dpace", "train.head_vocab=full",
                     "drafter.arch=dflash2", "drafter.selector_rank=128"],
    "dflash2_r32_stop": ["drafter.init=random", "train.position_weight=dpace", "train.head_vocab=full",
                         "drafter.arch=dflash2", "drafter.selector_rank=32", "train.selector_grad=stop"],
    # Signal and capacity at the journey's budget (#45, item 3), each against the config as
    # it is (DFlash2): 4x the anchors, a third drafter layer, soft labels, weight decay.
    "d2_anchors64": ["drafter.init=random", "train.position_weight=dpace", "train.num_anchors=64"],
    # A third layer reading the same taps: capacity alone (a third layer would otherwise also
    # move the default taps, which taps:A-B-C measures on its own).
    "d2_layers3": ["drafter.init=random", "train.position_weight=dpace", "drafter.num_layers=3",
                   "drafter.target_layer_ids=[1, 27]"],
    # Sliding-window drafter layers (#56) against none ("default"), on the config as it is:
    # every layer sliding_attention, a window of 64 (the texts run to about 200 tokens).
    "d2_window64": ["drafter.init=random", "train.position_weight=dpace", "drafter.sliding_window=64"],
    # Muon (#57) on the config as it is: speculators 0.9.0's split and defaults
    # (docs/objective.md, "Optimisers"), the config's lr and schedule.
    "d2_muon": ["drafter.init=random", "train.position_weight=dpace", "train.optimizer=muon"],
    # The drafter kinds vLLM serves beyond DFlash2 (#57), each as its peers train it, against
    # the config as it is, and each with Muon: DSpark (Markov and confidence heads, CE + L1 +
    # BCE, docs/dspark.md) and XPress (the Jacobi refiner, CE + TV, docs/xpress.md). Both learn
    # from the target's own distribution (its last layer, so ``distill``'s feature layout) and
    # refuse D-PACE: their slot weights are the gamma decay their peers use (DeepSpec's 4).
    # DSpark's block of 4 proposes 4 tokens a verify step where DFlash's proposes 3.
    "d2_dspark": ["drafter.init=random", "drafter.arch=dspark", "train.loss=distill",
                  "train.position_weight=decay", "train.gamma=4"],
    "d2_dspark_muon": ["drafter.init=random", "drafter.arch=dspark", "train.loss=distill",
                       "train.position_weight=decay", "train.gamma=4", "train.optimizer=muon"],
    "d2_xpress": ["drafter.init=random", "drafter.arch=xpress", "train.loss=distill",
                  "train.position_weight=decay", "train.gamma=4"],
    "d2_xpress_muon": ["drafter.init=random", "drafter.arch=xpress", "train.loss=distill",
                       "train.position_weight=decay", "train.gamma=4", "train.optimizer=muon"],
    "d2_distill": ["drafter.init=random", "train.position_weight=dpace", "train.loss=distill"],
    "d2_wd0.1": ["drafter.init=random", "train.position_weight=dpace", "train.weight_decay=0.1"],
    # The optimiser's two plain knobs at the journey's budget, neither measured upward
    # before (lr6e-4 went down): 3x the peak LR, and half the tokens per batch, which is
    # about twice the updates in the same minutes.
    "d2_lr3e-3": ["drafter.init=random", "train.position_weight=dpace", "train.lr=3e-3"],
    "d2_tokens1024": ["drafter.init=random", "train.position_weight=dpace", "batching.token_budget=1024"],
    # The data lever (#45, item 4), the config as it is on the journey's data: the 600
    # shipped prompts and the 894 wheel prompts, one greedy completion each (1,494), against
    # --data (the 600 alone, greedy). Its n-gram table is its own data's too.
    "d2_data_wheels": ["drafter.init=random", "train.position_weight=dpace", "data.path=.cache/smollm2-train-wheels"],
    # Greedy against sampled (#45, item 4): the same 1,494 prompts, one completion each at
    # temperature 0.7 (about the same generation minutes), against --data's greedy ones. The
    # held-out texts stay the target's greedy text, as the decoding it stands for is greedy.
    "d2_data_wheels_t0.7": ["drafter.init=random", "train.position_weight=dpace",
                            "data.path=.cache/smollm2-train-wheels-t0.7"],
    # The anchors' default recipe, whole: random init, decay gamma, CE, lr 6e-4 with 4%
    # warmup and a cosine, the exact head.
    "control": ["drafter.init=random", "train.position_weight=decay", "train.loss=ce", "train.lr=6e-4",
                "train.warmup_ratio=0.04", "train.lr_schedule=cosine", "train.head_vocab=full"],
}
"""The anchors' recipe is random init, cross-entropy on the target's text, gamma decay."""

BEFORE_DFLASH2 = ("drafter.arch=dflash", "train.head_vocab=sampled")
"""What the SmolLM2 config set before it trained DFlash2 (2026-12-06): the variants written
against it keep it (``overrides``), except ``default`` and the ``d2_`` variants, which
change the config as it is."""


def overrides(name: str) -> list[str]:
    """A variant's overrides of the SmolLM2 config. ``taps:A-B-C`` is the config as it is
    reading target layers A, B, C (``launch.py taps`` ranks them; this checks a ranking at
    the full budget)."""
    if name.startswith("taps:"):
        return [f"drafter.target_layer_ids=[{', '.join(name[5:].split('-'))}]"]
    own = VARIANTS[name]
    if name == "default" or name.startswith("d2_"):
        return list(own)
    keys = {o.split("=")[0] for o in own}
    return [o for o in BEFORE_DFLASH2 if o.split("=")[0] not in keys] + own

def is_taps(name: str) -> bool:
    layers = name[5:].split("-") if name.startswith("taps:") else []
    return bool(layers) and all(x.isdigit() for x in layers)


CALIBRATION_S = 90.0
"""How long a ``--minutes`` variant times steps of its own before its run (the first
two, the allocator's and kernels' warm-up, not counted): a step's cost follows its
batches' rows, and a few steps mis-estimated it by half (2026-12-05: 2.4 s/step timed
over 6 steps, 3.1 over the run)."""


OUTSIDE_TEXTS = 16


def outside_share(drafter, target, texts, vocab) -> float:
    """Of the full head's argmaxes at every draft slot of the first ``OUTSIDE_TEXTS``
    held-out texts, the share that is not in the training vocabulary ``vocab``."""
    import torch

    from dflash_actors.eval.tau import text_features
    from dflash_actors.models.blocks import anchor_candidates, block_hidden

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

    from dflash_actors.eval.tau import text_metrics, walk_counts, walk_summary, walk_tau

    pairs: list = []
    tokens, steps = walk_counts(drafter, target, texts, keep=pairs)
    sim = text_metrics(np.concatenate([c for c, _ in pairs]), np.concatenate([v for _, v in pairs]))
    out = {**walk_summary(tokens, steps), "simulated_tau": round(sim["tau"], 4),
           "slot_acc": sim["per_position"][:2], "per_position": sim["per_position"]}
    selector = drafter.candidate_selector
    if selector is not None:
        # A DFlash2 is scored on its selector's walk; its backbone's own argmax beside it.
        drafter.candidate_selector = None
        try:
            out["walk_tau_argmax"] = round(walk_tau(drafter, target, texts), 4)
        finally:
            drafter.candidate_selector = selector
    if vocab is not None:
        out["argmax_outside_vocab"] = round(outside_share(drafter, target, texts, vocab), 4)
    return out


def variant_config(name: str, base: list[str], steps: int | None = None, epochs: int | None = None):
    """The variant's config; with ``steps``, the run cut there (``train.max_steps``) and
    its epochs sized to hold them, at least ``epochs``."""
    from dflash_actors.config import load_config
    from dflash_actors.data.dataset import open_dataset
    from dflash_actors.train.sizing import sized_to_steps

    cfg = load_config(CONFIG, base + overrides(name))
    if steps is None and epochs is None:
        return cfg
    return sized_to_steps(cfg, open_dataset(cfg.data, progress=False).lengths, steps or 0, epochs or 0)


def feature_key(cfg) -> str:
    """What a variant's cached features depend on: variants with the same key share one
    disk store (its header is checked again when a variant maps it)."""
    import hashlib

    d = cfg.to_dict()
    # The drafter's depth picks the taps only when they are left to the default; named taps
    # read the same features at any depth (a third layer on [1, 27] need not fill again).
    depth = cfg.drafter.num_layers if cfg.drafter.target_layer_ids is None else None
    key = [d["data"], d["batching"], d["target"], depth, cfg.drafter.target_layer_ids,
           cfg.train.loss, cfg.train.seed, cfg.train.grad_accum, d["topology"]]
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]


RUN_EPOCHS = 20
"""Epochs of every ``--minutes`` run, its calibration and its feature fill (cut by
``train.max_steps``): the cache plan, and so the shared store's header, depends on the
epochs through the samples a short epoch count never reaches (a step's batches left
over at an epoch's end are dropped, and their samples first come in a later epoch)."""


def fill_features(cfg, root: Path) -> float:
    """Every cached sample's features into the disk store under ``root``, for a run of
    ``cfg``'s epochs (each sample's first batch, the target's forward only); seconds spent."""
    import numpy as np
    import torch

    from dflash_actors.data.dataset import open_dataset
    from dflash_actors.data.synthetic import train_path
    from dflash_actors.models.target import load_target
    from dflash_actors.runtime.channels import dtype_name
    from dflash_actors.train import feature_cache
    from dflash_actors.train.schedule import Plans
    from dflash_actors.train.simulate import feature_width

    t = time.perf_counter()
    cfg = cfg.updated({"target.feature_cache": "disk"})
    torch.set_num_threads(cfg.train.num_threads)
    target = load_target(cfg, "cpu")
    dataset = open_dataset(cfg.data, progress=False, path=train_path(cfg))
    cache = feature_cache.in_process(cfg, dataset, Plans(cfg, dataset.lengths), feature_width(cfg, target),
                                     dtype_name(target.dtype), root, target.layer_ids)
    first = cache.plan.first[cache.plan.slot >= 0]
    with torch.no_grad():
        for g in np.unique(first).tolist():
            ids, cu, batch = cache.source.batch(g)
            cache.features(g, ids, cu, batch, target.features, torch.device("cpu"))
    return time.perf_counter() - t


def variant_cache(cfg, cache_root: Path | None, name: str) -> Path | None:
    """The variant's own cache root: hard links to its layout's filled store, so a variant
    whose header differs after all rebuilds its own copy, never the shared one."""
    if cache_root is None:
        return None
    import shutil

    from dflash_actors.train.feature_cache import CACHE_DIR

    src, dst = cache_root / feature_key(cfg) / CACHE_DIR, cache_root / "variants" / name / CACHE_DIR
    shutil.rmtree(dst.parent, ignore_errors=True)
    dst.parent.mkdir(parents=True)
    shutil.copytree(src, dst, copy_function=os.link)
    return dst.parent


class _Calibrated(Exception):
    pass


def calibrate(cfg, cache_root: Path | None) -> float:
    """Seconds per step of ``cfg``, timed over its own run's steps from the third on, for
    ``CALIBRATION_S``."""
    from dflash_actors.job.reference import train_reference

    times, t0 = [], time.perf_counter()

    def on_step(step, *_):
        times.append(time.perf_counter())
        if times[-1] - t0 > CALIBRATION_S and len(times) >= 4:
            raise _Calibrated
    try:
        train_reference(cfg, progress=False, on_step=on_step, cache_root=cache_root)
    except _Calibrated:
        pass
    skip = min(2, len(times) - 2)       # fewer only when the data hold fewer steps
    return (times[-1] - times[skip - 1]) / (len(times) - skip) if skip > 0 else times[-1] - t0


def run_variant(name: str, base: list[str], steps: int | None, marks: set[int], texts, minutes: float | None = None,
                cache_root: Path | None = None, external=None) -> dict:
    """``external``: a second held-out set (the target's text of prompts somebody else
    wrote), walked at the last mark only, with its own n-gram walk."""
    import torch

    from dflash_actors.eval.tau import walk_counts, walk_summary
    from dflash_actors.job.reference import train_reference
    from dflash_actors.models.head_loss import training_vocab

    root = variant_cache(variant_config(name, base), cache_root, name)
    extra = {}
    if minutes is not None:
        # The full first epoch's config, timed: the same cache plan as the run's.
        s_step = calibrate(variant_config(name, base, epochs=RUN_EPOCHS), root)
        steps = max(8, int(minutes * 60 / s_step))      # a run shorter than its calibration says nothing
        marks = {steps // 2}
        extra = {"minutes": minutes, "calibrated_s_per_step": round(s_step, 3)}
        say(f"{name}: {s_step:.2f} s/step -> {steps} steps in {minutes:g} min")
    cfg = variant_config(name, base, steps, RUN_EPOCHS if minutes is not None else None)
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
            if external is not None and step == steps:
                drafter.eval()
                with torch.no_grad():
                    rows[-1]["external"] = walk_summary(*walk_counts(drafter, target, external))
                drafter.train()
            shown = {k: v for k, v in rows[-1].items() if k not in ("walk_tokens", "walk_steps")}
            say(f"{name} step {step}: {shown}")
            t_last[1] += t_train
            t_last[0] = time.perf_counter()
        result_losses.append(m["loss"])
    result_losses: list[float] = []
    t = time.perf_counter()
    res = train_reference(cfg, progress=False, on_step=on_step, cache_root=root)
    if root is not None:
        import shutil
        shutil.rmtree(root, ignore_errors=True)
    return {"variant": name, "overrides": overrides(name), "steps": res.steps, "first_loss": round(res.losses[0], 3),
            "marks": rows, "wall_s": round(time.perf_counter() - t, 1), "train_s": round(t_last[1], 1), **extra,
            **({} if vocab is None else {"vocab_rows": len(vocab)}), "ngram": ngram_walk(cfg, texts),
            **({} if external is None else {"ngram_external": ngram_walk(cfg, external)})}


def ngram_walk(cfg, texts) -> dict:
    """The journey's baseline, the n-gram table over the variant's own training
    completions (``decode.NgramProposer``, unchanged), walked over the same held-out
    texts: the goal is a ratio to it, and a data lever moves both sides."""
    from dflash_actors.data.dataset import open_dataset
    from dflash_actors.eval.decode import NgramProposer
    from dflash_actors.eval.tau import proposer_walk_counts, walk_summary

    B = cfg.drafter.block_size
    return walk_summary(*proposer_walk_counts(NgramProposer(open_dataset(cfg.data, progress=False), B), texts, B))


def versus_ngram(results: list[dict], external: bool = False) -> dict:
    """Each variant's last walk tau over its n-gram table's, with the paired bootstrap
    interval over the held-out texts (``external``: over the external ones)."""
    from dflash_actors.eval.intervals import pooled_ratio_interval

    out = {}
    for r in results:
        last, ngram = (r["marks"] or [{}])[-1], r.get("ngram")
        if external:
            last, ngram = last.get("external", {}), r.get("ngram_external")
        if ngram and "walk_tokens" in last:
            out[r["variant"]] = {"ngram_walk_tau": ngram["walk_tau"],
                                 "ratio": round(last["walk_tau"] / ngram["walk_tau"], 4),
                                 "ci95": pooled_ratio_interval((last["walk_tokens"], last["walk_steps"]),
                                                               (ngram["walk_tokens"], ngram["walk_steps"]))}
    return out


def table(results: list[dict]) -> str:
    lines = ["| variant | first loss | step | loss (mean of 5) | held-out walk tau [95% over texts] "
             "| its argmax's (DFlash2) | per-slot acceptance | s/step | training min |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for m in r["marks"]:
            ci = f" [{m['walk_ci95'][0]}, {m['walk_ci95'][1]}]" if m.get("walk_ci95") else ""
            lines.append(f"| {r['variant']} | {r['first_loss']} | {m['step']} | {m['loss']} | "
                         f"{m['walk_tau']}{ci} | "
                         f"{m.get('walk_tau_argmax', '-')} | "
                         f"{', '.join(str(x) for x in m.get('per_position', m['slot_acc']))} | {m['s_per_step']} | "
                         f"{m['s_per_step'] * m['step'] / 60:.1f} |")
    marks = min((len(r["marks"]) for r in results), default=0)
    for k in range(marks):
        diffs = versus_first(results, k)
        if diffs:
            which = "Last mark" if k == marks - 1 else f"Mark {k + 1}"
            lines += ["", f"{which} against {results[0]['variant']} on the same held-out texts (walk tau "
                      "difference, 95% paired bootstrap interval over texts):", ""]
            lines += [f"- {name}: {d['difference']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]"
                      for name, d in diffs.items()]
    for external, goal in ((False, "1.3x"), (True, "1.2x")):
        ratios = versus_ngram(results, external)
        texts = "external" if external else "held-out"
        if external and ratios:
            lines += ["", "Last mark on the external texts (prompts somebody else wrote), walk tau [95% over "
                      "texts], and the difference against the first variant (paired):", ""]
            diffs = versus_first(results, external=True)
            for r in results:
                e = r["marks"][-1].get("external") if r["marks"] else None
                if e:
                    d = diffs.get(r["variant"])
                    vs = f"; {d['difference']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]" if d else ""
                    lines.append(f"- {r['variant']}: {e['walk_tau']} [{e['walk_ci95'][0]}, {e['walk_ci95'][1]}]{vs}")
        if ratios:
            lines += ["", f"Last mark against the n-gram table over the variant's own training completions, {texts} "
                      f"texts (walk tau ratio, 95% paired bootstrap interval over texts; the goal is {goal}):", ""]
            lines += [f"- {name}: {d['ratio']:.4f}x [{d['ci95'][0]:.4f}, {d['ci95'][1]:.4f}] "
                      f"(n-gram walk tau {d['ngram_walk_tau']})" for name, d in ratios.items()]
    return "\n".join(lines)


def versus_first(results: list[dict], mark: int = -1, external: bool = False) -> dict:
    """Each variant's walk tau at its ``mark``-th mark (the last by default) minus the
    first variant's at the same mark, with the paired bootstrap interval over the
    held-out texts (marks that recorded each text's walk only; ``external``: the last
    mark's external texts)."""
    from dflash_actors.eval.intervals import pooled_difference_interval

    def at(r):
        m = r["marks"][mark] if -len(r["marks"]) <= mark < len(r["marks"]) else {}
        return m.get("external", {}) if external else m
    first = at(results[0]) if results else {}
    if "walk_tokens" not in first:
        return {}
    out = {}
    for r in results[1:]:
        last = at(r)
        if "walk_tokens" in last:
            out[r["variant"]] = {"difference": round(last["walk_tau"] - first["walk_tau"], 4),
                                 "ci95": pooled_difference_interval((last["walk_tokens"], last["walk_steps"]),
                                                                    (first["walk_tokens"], first["walk_steps"]))}
    return out


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


def run_parallel(names: list[str], argv: list[str], parallel: int, out: Path) -> list[dict]:
    """Each variant in its own process (``--one``), ``parallel`` at a time; results in order."""
    pending, running, done = list(names), {}, {}
    while pending or running:
        while pending and len(running) < parallel:
            name = pending.pop(0)
            path = out / f"variant-{name}.json"
            proc = subprocess.Popen([sys.executable, "-m", "benchmarks.recipes", *argv, "--one", name,
                                     "--result", str(path)], cwd=ROOT)
            running[name] = (proc, path)
        time.sleep(2)
        for name, (proc, path) in list(running.items()):
            if proc.poll() is not None:
                del running[name]
                if proc.returncode != 0:
                    raise RuntimeError(f"variant {name} failed ({proc.returncode})")
                done[name] = json.loads(path.read_text())
                path.unlink()
    return [done[n] for n in names]


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--minutes", type=float, help="equal training minutes per variant instead of equal steps")
    ap.add_argument("--parallel", type=int, default=1, help="variants run at a time (one thread each)")
    ap.add_argument("--marks", default="50,200",
                    help="steps to measure at, with --steps (--minutes measures at each run's half and end)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--data", default=str(ROOT / ".cache" / "smollm2-train"))
    ap.add_argument("--heldout", default=str(ROOT / ".cache" / "smollm2-heldout"))
    ap.add_argument("--external", help="a prepared set of the external prompts' target text, walked at the last mark")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", default=str(harness.RESULTS), help="the folder of the table, plot and JSON")
    ap.add_argument("--cache-root", default=str(ROOT / ".cache" / "recipe-features"),
                    help="--minutes: where the shared feature stores live")
    ap.add_argument("--table", metavar="JSON", help="print the table of an earlier run's JSON line and exit")
    ap.add_argument("--one", help=argparse.SUPPRESS)       # a --parallel child: this variant only
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())["results"]))
        return 0
    argv = sys.argv[1:] if argv is None else list(argv)
    if harness.smollm2_missing() or not Path(args.data, "prepare.json").is_file():
        harness.skipped("recipe", "needs SmolLM2 (make smollm) and prepared data (python -m benchmarks.bench_real "
                                  "prepares it)", args.save)
        return 0
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS and not is_taps(v)]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    from transformers.utils import logging as hf_logging

    from dflash_actors.config import load_config
    from dflash_actors.data.dataset import open_dataset

    hf_logging.disable_progress_bar()
    base = [f"data.path={args.data}", f"eval.data={args.heldout}", "train.num_threads=1", *args.overrides]
    base += ["target.feature_cache=disk"] if args.minutes else ["target.feature_cache=memory"]
    cache_root = Path(args.cache_root) if args.minutes else None
    data = load_config(CONFIG, base).data
    texts = open_dataset(data, progress=False, path=args.heldout)
    external = open_dataset(data, progress=False, path=args.external) if args.external else None
    marks = {int(x) for x in args.marks.split(",") if x}
    steps = None if args.minutes else args.steps
    if args.one:
        res = run_variant(args.one, base, steps, marks, texts, args.minutes, cache_root, external)
        Path(args.result).write_text(json.dumps(res))
        return 0
    names = args.variants.split(",")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    fill = {}
    if cache_root is not None:
        for name in names:
            cfg = variant_config(name, base, epochs=RUN_EPOCHS)
            key = feature_key(cfg)
            if key not in fill:
                say(f"features for {name}'s layout ({key})")
                fill[key] = round(fill_features(cfg.updated({"train.num_threads": max(1, os.cpu_count() or 1)}),
                                                cache_root / key), 1)
    if args.parallel > 1:
        results = run_parallel(names, argv, args.parallel, out_dir)
    else:
        results = [run_variant(v, base, steps, marks, texts, args.minutes, cache_root, external) for v in names]
    out = {"bench": "recipe", "target": "SmolLM2-135M-Instruct", "data": args.data, "heldout": args.heldout,
           "heldout_texts": len(texts), "overrides": args.overrides, "results": results,
           "versus_first": versus_first(results), "versus_ngram": versus_ngram(results),
           **({"external": args.external, "versus_first_external": versus_first(results, external=True),
               "versus_ngram_external": versus_ngram(results, True)} if external is not None else {}),
           **({"minutes": args.minutes, "parallel": args.parallel, "feature_fill_s": fill} if args.minutes
              else {"steps": args.steps})}
    tag = f"minutes-{args.minutes:g}" if args.minutes else f"{args.steps}"
    stem = out_dir / f"{time.strftime('%Y-%m-%d')}-recipe-{tag}"
    harness.write_result(stem, harness.emit(out, args.save), table(results))     # the file is the line printed
    plot(results, stem.with_name(stem.name + ".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
