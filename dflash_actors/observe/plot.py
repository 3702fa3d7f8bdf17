"""One picture of a run: ``python launch.py plot RUN_DIR [-o OUT.png]``.

Reads ``<RUN_DIR>/metrics.jsonl`` and writes a grid of panels (default
``<RUN_DIR>/plot.png``): loss, tau (training, with eval markers), per-slot accuracy,
tokens/s, busy percentage per actor from resource samples, and busy fraction per stage
from step lines. A panel without data says so instead of failing.

The file may be live (a run appending to it): a line that does not parse as a JSON
object is skipped, which covers a half-written last line. A resumed run may log a step
again; the last line for a step wins. Every field but ``kind`` and a step line's
``step`` is optional.

Exit status: 0 written; 1 matplotlib missing; 2 bad input (no run dir, no
``metrics.jsonl``, or no step lines in it), with one ``error:`` line on stderr.
matplotlib is imported only when drawing, so the package does not depend on it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path


def load(path: Path) -> dict[str, list[dict]]:
    """``{"steps", "evals", "resources"}``: step lines deduplicated and sorted by step,
    the others in file order."""
    steps: dict[int, dict] = {}
    evals, resources = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if not isinstance(row, dict):
                continue
            kind = row.get("kind")
            if kind == "step" and isinstance(row.get("step"), int):
                steps[row["step"]] = row
            elif kind == "eval":
                evals.append(row)
            elif kind == "resources":
                resources.append(row)
    return {"steps": [steps[k] for k in sorted(steps)], "evals": evals, "resources": resources}


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def at(*path):
    """A getter for ``row[path[0]][path[1]]...``, giving None where any part is missing."""
    def get(row):
        for key in path:
            try:
                row = row[key]
            except (KeyError, IndexError, TypeError):
                return None
        return row
    return get


def series(rows: list[dict], y, x=at("step")) -> tuple[list[float], list[float]]:
    """``(xs, ys)`` over the rows where both getters give finite numbers."""
    points = [(x(r), y(r)) for r in rows]
    points = [(a, b) for a, b in points if _num(a) and _num(b)]
    return [a for a, _ in points], [b for _, b in points]


def _smooth(points: tuple[list[float], list[float]]) -> tuple[list[float], list[float]]:
    # An EMA whose span grows with the run keeps noisy neighbouring lines apart whatever the run's length.
    xs, ys = points
    alpha, out = 2 / (max(1, len(ys) // 50) + 1), []
    for y in ys:
        out.append(y if not out else out[-1] + alpha * (y - out[-1]))
    return xs, out


def _busy(stage: str):
    def get(row):
        b, w = at("stages", stage, "busy_s")(row), at("stages", stage, "wait_s")(row)
        return b / (b + w) if _num(b) and _num(w) and b + w > 0 else None
    return get


def draw(data: dict[str, list[dict]], out: Path, title: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: saves through Agg and never opens a display

    steps, evals, res = data["steps"], data["evals"], data["resources"]
    t0 = min(series(steps, at("time"))[1], default=0.0)
    since = lambda row: row["time"] - t0 if _num(row.get("time")) else None
    fig = Figure(figsize=(14, 12))
    fig.suptitle(title)
    # Fixed margins rather than a layout engine, which would double the drawing time.
    (ax_loss, ax_tau), (ax_acc, ax_tps), (ax_actor, ax_stage) = fig.subplots(
        3, 2, gridspec_kw={"left": 0.06, "right": 0.98, "bottom": 0.05, "top": 0.95, "hspace": 0.25, "wspace": 0.15})

    def panel(ax, lines, ylabel, xlabel="step", empty="no data"):
        """Plot the ``(xs, ys, style)`` lines that have points, or write ``empty`` in the panel."""
        lines = [line for line in lines if line[0]]
        for xs, ys, style in lines:
            ax.plot(xs, ys, **style)
        if not lines:
            ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes, color="gray")
        elif any(style.get("label") for *_, style in lines):
            by_label = {}  # the eval markers share a label per kind: list it once
            for handle, label in zip(*ax.get_legend_handles_labels()):
                by_label.setdefault(label, handle)
            ax.legend(by_label.values(), by_label.keys(), fontsize="small", ncol=2)
        ax.set(xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)

    marks = {"ls": "", "mfc": "none", "ms": 8}
    # A skipped step did not update the weights, whatever loss it may have logged.
    panel(ax_loss, [(*series([s for s in steps if not s.get("skipped")], at("loss")), {"lw": 1})], "loss")
    panel(ax_tau, [(*series(steps, at("tau")), {"lw": 1, "label": "train (simulated)"}),
                   (*series(evals, at("simulated", "tau")), {**marks, "marker": "o", "label": "eval simulated"}),
                   (*series(evals, at("real", "tau")), {**marks, "marker": "s", "label": "eval real"})], "tau")

    slots = max((len(s["slot_acc"]) for s in steps if isinstance(s.get("slot_acc"), list)), default=0)
    acc = [(*_smooth(series(steps, at("slot_acc", i))), {"lw": 1, "color": f"C{i}", "label": f"slot {i + 1}"})
           for i in range(slots)]
    # Only the latest evaluation, at its step and in its slot's colour: every one would bury the lines.
    for ev, (key, marker) in itertools.product(evals[-1:], (("simulated", "o"), ("real", "s"))):
        style = {**marks, "marker": marker, "label": f"eval {key}, step {ev.get('step')}"}
        per_position = at(key, "per_position")(ev)
        acc += [(*series([ev], at(key, "per_position", i)), {**style, "color": f"C{i}"})
                for i in range(len(per_position) if isinstance(per_position, list) else 0)]
    panel(ax_acc, acc, "slot accuracy (EMA); markers: last eval")

    panel(ax_tps, [(*series(steps, at("tokens_per_s"), since), {"lw": 1})], "tokens/s", "seconds since first step")

    actors = list(dict.fromkeys(a for r in res if isinstance(r.get("actors"), dict) for a in r["actors"]))
    panel(ax_actor, [(*_smooth(series(res, at("actors", a, "busy_pct"), since)), {"lw": 1, "label": a})
                     for a in actors],
          "busy % per actor (EMA)", "seconds since first step", empty="no resource samples")
    ax_actor.set_ylim(0, 100)
    stages = list(dict.fromkeys(k for s in steps if isinstance(s.get("stages"), dict) for k in s["stages"]))
    panel(ax_stage, [(*_smooth(series(steps, _busy(st))), {"lw": 1, "label": st}) for st in stages],
          "busy fraction per stage (EMA)", empty="no stage timings")
    ax_stage.set_ylim(0, 1)

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="launch.py plot", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("-o", "--out", type=Path, help="PNG to write (default: RUN_DIR/plot.png)")
    args = p.parse_args(argv)
    path = args.run_dir / "metrics.jsonl"
    if not args.run_dir.is_dir():
        return _fail(2, f"run directory {args.run_dir} does not exist")
    if not path.is_file():
        return _fail(2, f"{path} not found")
    data = load(path)
    if not data["steps"]:
        return _fail(2, f"{path} has no step lines")
    try:
        import matplotlib  # noqa: F401  (only to ask whether it is there)
    except ImportError:
        return _fail(1, "matplotlib is not installed; pip install matplotlib "
                        "(or pip install -e '.[plot]' from the repo)")
    out = args.out or args.run_dir / "plot.png"
    draw(data, out, args.run_dir.resolve().name)
    print(f"wrote {out}: {len(data['steps'])} steps, {len(data['evals'])} evaluations, "
          f"{len(data['resources'])} resource samples")
    return 0


def _fail(code: int, message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
