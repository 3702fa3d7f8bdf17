"""What each ``runtime.grad_durability`` costs: in steady state, and when a drafter dies.

The training job at 1-1 with ``train.grad_accum=4`` under simulated compute
(``benchmarks.simulated``), with a drafter whose gradient sum is 140 MB (a 5-layer
drafter of a hidden-768 target: the copies are real, at this machine's memcpy rate,
where a GPU would pay PCIe). Four runs:

* ``batch`` and ``step``, clean: the steady tokens/s, and from the trace the mean
  "gradient load" and "gradient commit" spans per drafter batch (``step`` skips the
  load after a step's first batch and commits only the last);
* the same two with ``drafter.0`` killed (SIGKILL, fault point ``work``) at the last
  batch of step ``KILL_STEP``, where ``step`` loses the most: the three batches of the
  step before it are made again from the loader on. ``recovery_s`` is how much longer
  that step took than the median step (so it holds the restart in both modes, and in
  ``step`` the redone batches too); both runs must still end bit-identical to the
  clean ones.

Then the paper arithmetic at the real size (``costmodel``): what ``batch`` would add per
batch for a Qwen3-8B drafter over PCIe, against what ``step`` redoes after a death.
One JSON line.
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks import harness, simulated
from dflash_actors.train import costmodel
from dflash_actors.train.checkpoint import list_checkpoints

GRAD_ACCUM = 4
KILL_STEP = 5
DRAFTER_MS_PER_BATCH = 150     # a GPU-like share: the 8B drafter's copies are ~5-15% of its compute
BIG_DRAFTER = ("target.tiny.hidden_size=768", "target.tiny.intermediate_size=2048", "target.tiny.pretrain_steps=0",
               "drafter.num_layers=5", f"train.grad_accum={GRAD_ACCUM}", "data.synthetic.num_samples=640",
               f"runtime.simulate.drafter_ms_per_batch={DRAFTER_MS_PER_BATCH}")


def one(tmp: Path, mode: str, kill: bool) -> dict:
    run_dir = tmp / f"{mode}-{'kill' if kill else 'clean'}"
    extra = [*BIG_DRAFTER, f"runtime.grad_durability={mode}"]
    if kill:
        last = (KILL_STEP + 1) * GRAD_ACCUM - 1
        extra.append(("runtime.faults", [{"actor": "drafter.0", "at_batch": last, "kind": "sigkill"}]))
    cfg = simulated.sim_config(run_dir, "1-1", epochs=1, extra=extra)
    m = simulated.run(cfg)
    spans = m.spans
    publish = sorted(s["ts"] + s["dur"] for s in spans if s["name"] == "publish")
    step_s = [(b - a) / 1e6 for a, b in zip(publish, publish[1:])]
    per_batch = {name: round(sum(s["dur"] for s in spans if s["name"] == name) / 1e3
                             / sum(1 for s in spans if s["name"] == "drafter forward/backward"), 2)
                 for name in ("gradient load", "gradient commit")}
    events = harness.events(run_dir)
    died = [e for e in events if e["event"] == "died"]
    out = {"tokens_per_s": round(m.tokens_per_s), "gradient_ms_per_batch": per_batch,
           "step_s_median": round(statistics.median(step_s), 3), "wall_s": m.wall_s,
           "final": _final_hash(run_dir), "grad_mb": round(m.param_bytes / 1e6, 1)}
    if kill:
        # publish[k] ends step k; the step the kill hit is KILL_STEP (publish[KILL_STEP] ends it)
        out["recovery_s"] = round(step_s[KILL_STEP - 1] - statistics.median(step_s), 2)
        out["redone"] = died[0].get("redone", []) if died else None
        out["evicted"] = sum(len(e["batches"]) for e in events if e["event"] == "evicted")
    return out


def _final_hash(run_dir: Path) -> str:
    """The final drafter weights' hash (every run must end on the same bytes)."""
    ck = list_checkpoints(run_dir)[-1]
    return hashlib.sha256((ck / "model.safetensors").read_bytes()).hexdigest()[:16]


def paper(grad_accum: int = GRAD_ACCUM) -> dict:
    """At a Qwen3-8B drafter's size: ``batch`` moves the fp32 sum to and from the GPU on
    every batch but a step's first (load) and every batch (commit); ``step`` commits
    once per step, and after a drafter's death redoes up to grad_accum-1 batches."""
    shape, w = costmodel.SHAPES["qwen3-8b"], costmodel.Workload()
    target_s, drafter_s = costmodel.simulated_costs(shape, w, 400.0)
    grad_gb = costmodel.drafter_params(shape, w) * w.grad_bytes / 1e9
    out = {"drafter_params": costmodel.drafter_params(shape, w), "grad_gb": round(grad_gb, 2),
           "drafter_s_per_batch": round(drafter_s, 2), "target_s_per_batch": round(target_s, 2)}
    for link in (costmodel.PCIE, costmodel.Link("pageable host memory", 12.0)):
        copies = (2 * grad_accum - 1) / grad_accum      # per batch: a commit each, a load all but the first
        batch_s = copies * grad_gb / link.gb_per_s
        out[link.name] = {"batch_s_per_batch": round(batch_s, 3), "batch_share": round(batch_s / drafter_s, 3),
                          "step_s_per_batch": round(grad_gb / link.gb_per_s / grad_accum, 3)}
    out["step_redo_s_worst"] = round((grad_accum - 1) * max(target_s, drafter_s), 1)
    return out


def main(argv=None) -> int:
    args = harness.parser(__doc__).parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        runs = {}
        for mode in ("batch", "step"):
            for kill in (False, True):
                harness.say(f"{mode} {'with a drafter kill' if kill else 'clean'}")
                runs[f"{mode}_{'kill' if kill else 'clean'}"] = one(tmp, mode, kill)
    finals = {r["final"] for r in runs.values()}
    b, s = runs["batch_clean"], runs["step_clean"]
    harness.emit({
        "bench": "durability", "grad_accum": GRAD_ACCUM, "drafter_ms_per_batch": DRAFTER_MS_PER_BATCH,
        "grad_mb": b["grad_mb"], "runs": runs,
        "step_over_batch_tokens_per_s": round(s["tokens_per_s"] / b["tokens_per_s"], 3),
        "bit_identical": len(finals) == 1, "paper_qwen3_8b": paper()}, args.save)
    return 0 if len(finals) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
