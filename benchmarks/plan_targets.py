"""The memory plan at full size for each published target users train DFlash drafters
for: each fixture of ``tests/fixtures/targets`` (the shape facts of the target's real
``config.json``, each naming its source) becomes a directory holding only a
``config.json``, written by transformers' own config class, and ``launch.py --plan-only
--json --gpu-memory GIB`` plans a template on it for each placement. One JSON line per
(target, placement); nothing here needs a GPU or the weights.

    python -m benchmarks.plan_targets [--targets NAME,...] [--placements 2-2,1x4-4]
        [--gpu-memory 80] [--config configs/qwen3-8b.yaml] [--write] [--save NAME]
    python -m benchmarks.plan_targets --templates [--write]     # the GPU templates on 8 GPUs

``--write`` keeps what the plans decided, one file per target, in
``benchmarks/results/plans/<target>.json`` (``tests/integration/test_plan_targets.py``
re-plans some and holds them to it); with ``--templates``, ``plans/template-<name>.json``.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "targets"
PLANS = harness.RESULTS / "plans"
PLACEMENTS = ("2-2", "1x4-4")
"""Two target GPUs and two drafter GPUs; one gang of four tensor-parallel ranks
(``topology.target_tp`` 4) and four drafters: the two placements an 80 GB user tries."""
TEMPLATE = "configs/qwen3-8b.yaml"
"""The batching, drafter and training keys every target is planned with: the GPU
template's (65,536-token batches of up to 3,072-token sequences, a 5-layer drafter)."""
TEMPLATES = {
    # template: (its target's fixture, the topology a user runs on one 8-GPU machine)
    "configs/qwen3-8b.yaml": ("qwen3-8b", "4-4"),
    "configs/qwen3.6-27b.yaml": ("qwen3.6-27b", "4-4"),
    "configs/qwen3-coder-30b-a3b.yaml": ("qwen3-coder-30b-a3b", "4-4"),
    "configs/gpt-oss-20b.yaml": ("gpt-oss-20b", "4-4"),
}
"""The GPU templates, each planned on 8 GPUs of 80 and of 141 GiB (``--templates``). Four
targets and four drafters each: a target fits one GPU whole in every one of them, and
the template's own comment says why its two sides cost about the same."""
TEMPLATE_GIBS = (80, 141)
KEPT_PARTS = ("weights", "forward", "step at its peak", "its step", "a whole target")
"""The parts a kept plan lists per GPU (the rest are summed into its need)."""


def fixtures() -> dict[str, dict]:
    """Every fixture by name."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(FIXTURES.glob("*.json"))}


def target_config(fixture: dict):
    """The fixture's facts in transformers' own config class for its ``model_type``."""
    from transformers import AutoConfig
    facts = dict(fixture["config"])
    return AutoConfig.for_model(facts.pop("model_type"), **facts)


def write_target(fixture: dict, where: Path) -> Path:
    """A target directory holding only the fixture's ``config.json``."""
    target_config(fixture).save_pretrained(where)
    return where


def plan(target_dir: Path, placement: str, gpu_gib: float, run_dir: Path, template: str = TEMPLATE,
         sets: tuple[str, ...] = ()) -> tuple[int, dict | None, str]:
    """``launch.py --plan-only --json`` of ``template`` on ``target_dir``: its exit code,
    its JSON line (None where it refused before planning) and its last stderr line."""
    import launch
    out, err = io.StringIO(), io.StringIO()
    argv = ["--plan-only", "--json", "--config", str(ROOT / template), "--topology", placement,
            "--gpu-memory", str(gpu_gib), "--run-dir", str(run_dir), "--set", f"target.path={target_dir}"]
    for kv in sets:
        argv += ["--set", kv]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = launch.main(argv)
    lines = out.getvalue().splitlines()
    errors = [line for line in err.getvalue().splitlines() if line.startswith("error: ")]
    return code, json.loads(lines[-1]) if lines else None, errors[-1] if errors else ""


def decided(code: int, line: dict | None, error: str) -> dict:
    """What a plan decided, small: fits or not, each GPU's need against its room and its
    largest parts, the drafter's micro-batch and checkpointing, where the optimizer and
    the evaluator go; or the one line that refused it."""
    out = {"exit": code, "fits": code == 0, "refusal": error[len("error: "):] if error else None}
    if line is None:
        return out
    gpus = []
    for d in line["memory_plan"]:
        if not d["device"].startswith("cuda"):
            continue
        parts = [{"process": p["process"], "what": p["what"].split(" (")[0], "gib": p["gib"]}
                 for p in d["parts"] if p["what"].startswith(KEPT_PARTS) and p["gib"] >= 0.01]
        gpus.append({"device": d["device"], "need_gib": d["need_gib"], "usable_gib": d["usable_gib"],
                     "fits": d["fits"], "largest_parts": parts})
    return {**out, "gpus": gpus, "drafter_block_tokens": line["drafter_block_tokens"],
            "checkpoint_layers": line["checkpoint_layers"], "optimizer_device": line["optimizer_device"],
            "feature_device": line["feature_device"], "eval_device": line["eval_device"],
            "problem": line["problem"]}


def plan_target(name: str, fixture: dict, placements, gpu_gib: float, template: str, tmp: Path,
                sets: tuple[str, ...] = ()) -> list[dict]:
    """One record per placement of target ``name``."""
    target = write_target(fixture, tmp / name / "target")
    rows = []
    for placement in placements:
        harness.say(f"{name}: planning {placement} on {gpu_gib:g} GiB GPUs")
        t0 = time.perf_counter()
        code, line, error = plan(target, placement, gpu_gib, tmp / name / f"run-{placement}", template, sets)
        rows.append({"bench": "plan_targets", "target": name, "hf_repo": fixture["hf_repo"],
                     "family": fixture["config"]["model_type"], "template": template, "placement": placement,
                     "gpu_gib": gpu_gib, "seconds": round(time.perf_counter() - t0, 1),
                     **decided(code, line, error)})
    return rows


def kept(rows: list[dict]) -> dict:
    """A target's committed plan file: its records without the stamp or timings."""
    first = rows[0]
    return {"target": first["target"], "hf_repo": first["hf_repo"], "family": first["family"],
            "template": first["template"], "gpu_gib": first["gpu_gib"],
            "plans": {r["placement"]: {k: v for k, v in r.items() if k not in (
                "bench", "target", "hf_repo", "family", "template", "gpu_gib", "placement", "seconds",
                *harness.STAMP)} for r in rows}}


def plan_templates(args) -> int:
    """``--templates``: each template's plans, kept as ``plans/template-<stem>.json``."""
    every = fixtures()
    with tempfile.TemporaryDirectory() as tmp:
        for template, (name, placement) in TEMPLATES.items():
            kept_plans = {}
            for gib in TEMPLATE_GIBS:
                rows = plan_target(name, every[name], [placement], gib, template, Path(tmp) / f"{gib}",
                                   tuple(args.set))
                for r in rows:
                    harness.emit(r, args.save, many=True)
                kept_plans[f"8x{gib}"] = kept(rows)["plans"][placement]
            if args.write:
                PLANS.mkdir(parents=True, exist_ok=True)
                data = {"template": template, "target": name, "hf_repo": every[name]["hf_repo"],
                        "placement": placement, "plans": kept_plans}
                harness.write_text(PLANS / f"template-{Path(template).stem}.json",
                                   json.dumps(harness.portable(data), indent=1) + "\n")
    return 0


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--targets", default=None, help="comma-separated fixture names (default: all)")
    ap.add_argument("--placements", default=",".join(PLACEMENTS))
    ap.add_argument("--gpu-memory", type=float, default=80.0)
    ap.add_argument("--config", default=TEMPLATE, help="the template each target is planned with")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE for every plan, as launch.py's")
    ap.add_argument("--write", action="store_true", help="keep each target's plans in benchmarks/results/plans/")
    ap.add_argument("--out", default=None, help="with --write: the file name (default: <target>.json)")
    ap.add_argument("--templates", action="store_true",
                    help="plan each GPU template (TEMPLATES) on 8 GPUs of 80 and 141 GiB instead")
    args = ap.parse_args(argv)
    if args.templates:
        return plan_templates(args)
    every = fixtures()
    names = args.targets.split(",") if args.targets else list(every)
    unknown = [n for n in names if n not in every]
    if unknown:
        ap.error(f"--targets: no fixture {unknown} in tests/fixtures/targets")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            rows = plan_target(name, every[name], args.placements.split(","), args.gpu_memory, args.config,
                               Path(tmp), tuple(args.set))
            for r in rows:
                harness.emit(r, args.save, many=True)
            if args.write:
                PLANS.mkdir(parents=True, exist_ok=True)
                harness.write_text(PLANS / (args.out or f"{name}.json"),
                                   json.dumps(harness.portable(kept(rows)), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
