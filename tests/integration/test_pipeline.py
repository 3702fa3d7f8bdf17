"""The actor pipeline against the single-process reference trainer (the oracle); 2-2
pipelined as a user runs it: ``launch.py`` with its output in a file, watched with
``launch.py status``, then plotted."""

import json
import re
import subprocess
import sys
import time
from collections import defaultdict

import pytest

from dflash_actors.config import dump_config
from dflash_actors.job.reference import train_reference
from dflash_actors.observe import statusview
from dflash_actors.observe.status import read as read_status
from dflash_actors.runtime import trace
from dflash_actors.train.schedule import Schedule
from tests.support.pipeline import ROOT, assert_same_weights, final_weights, losses, new_job, small_config

REFERENCE = {}


def reference(cache_dir, tmp_path, topology):
    """Reference results depend on M only (targets do not change the math)."""
    m = topology.split("-")[1]
    if m not in REFERENCE:
        REFERENCE[m] = train_reference(small_config(cache_dir, tmp_path / "ref", topology), progress=False)
    return REFERENCE[m]


# Pipelined 2-2 is the launched test below; 1-3 runs lock-step here (three drafters and
# the no-overlap trace in one job, to keep make test inside its time).
@pytest.mark.parametrize("topology,schedule", [("1-1", "pipelined"), ("1-3", "lockstep")])
def test_pipeline_is_bit_identical_to_reference(cache_dir, tmp_path, topology, schedule):
    # 1-1 also runs the periodic evaluator: reading the published weights must not
    # change a bit of the training.
    every = 3 if topology == "1-1" else 0
    cfg = small_config(cache_dir, tmp_path / "run", topology, f"runtime.schedule={schedule}",
                       f"runtime.trace={schedule == 'lockstep'}", f"eval.every={every}", "eval.real_prompts=2",
                       "eval.max_new_tokens=8")
    job = new_job(cfg, progress=False)
    result = job.run()
    assert result.exit_code == 0, result.reason
    ref = reference(cache_dir, tmp_path, topology)
    assert result.summary["step"] == ref.steps == result.summary["total_steps"]
    assert sorted(result.committed) == list(range(ref.steps * cfg.train.grad_accum * cfg.topology.num_drafters))
    assert losses(tmp_path / "run") == ref.losses
    assert_same_weights(final_weights(tmp_path / "run"), ref.state_dict)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["tokens"] == ref.tokens and summary["restarts"] == 0
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["training"]["step"] == ref.steps and status["training"]["loss"] == ref.losses[-1]
    if schedule == "lockstep":
        assert_no_overlap(trace.load(tmp_path / "run" / trace.TRACE_FILE), job.schedule)
    if every:
        assert_eval_lines(tmp_path / "run", every, ref.steps, cfg.drafter.block_size)


def test_plateau_ends_the_run_as_done_with_the_reference_weights(cache_dir, tmp_path):
    """``eval.plateau``: at an LR too small to move the held-out walk, two evaluations in a
    row are level, so the evaluator ends the job early: exit 0, the reason in the summary,
    and a checkpoint equal to the reference's weights at the step training reached."""
    cfg = small_config(cache_dir, tmp_path / "run", "1-1", "train.epochs=40", "train.lr=1e-12", "eval.every=1",
                       "eval.plateau=1", "eval.max_samples=4")
    result = new_job(cfg, progress=False).run()
    assert result.exit_code == 0, result.reason
    step, total = result.summary["step"], result.summary["total_steps"]
    assert result.reason.startswith("plateau: held-out walk tau") and 0 < step < total
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in evals if x["kind"] == "eval"]
    assert "plateau" in evals[-1] and all("plateau" not in x for x in evals[:-1])
    u, v = evals[-1]["plateau"]["versions"]
    assert [u, v] == [x["step"] for x in evals[-2:]] and v <= step
    kept = {}

    class Enough(Exception):
        pass

    def keep(s, drafter, *_):
        if s == step:
            kept.update({k: t.detach().clone() for k, t in drafter.state_dict().items()})
            raise Enough
    with pytest.raises(Enough):
        train_reference(cfg.updated({"runtime.run_dir": str(tmp_path / "ref")}), progress=False, on_step=keep)
    assert_same_weights(final_weights(tmp_path / "run"), kept)


def test_bf16_on_cpu_is_bit_identical_to_its_reference(cache_dir, tmp_path):
    """A bf16 target and ``train.compute_dtype=bfloat16`` on CPU: every process runs the
    same bf16 kernels, so the pipeline still equals its reference; and bf16 did run (the
    losses are not fp32's)."""
    bf16 = ("target.dtype=bfloat16", "train.compute_dtype=bfloat16")
    result = new_job(small_config(cache_dir, tmp_path / "run", "1-2", *bf16), progress=False).run()
    assert result.exit_code == 0, result.reason
    ref = train_reference(small_config(cache_dir, tmp_path / "ref", "1-2", *bf16), progress=False)
    assert losses(tmp_path / "run") == ref.losses
    assert_same_weights(final_weights(tmp_path / "run"), ref.state_dict)
    fp32 = reference(cache_dir, tmp_path, "1-2")
    assert len(fp32.losses) == len(ref.losses) and fp32.losses != ref.losses
    assert ref.losses[-1] == pytest.approx(fp32.losses[-1], rel=0.05)


def assert_eval_lines(run_dir, every: int, steps: int, block: int) -> None:
    """Due versions are evaluated in order, the final weights always, each line with
    both taus in [1, block]. How many intermediate versions get evaluated depends on
    spare CPU: the evaluator runs niced and skips ahead when it falls behind (on this
    2-core machine, often to the final version)."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in lines if x["kind"] == "eval"]
    versions = [x["step"] for x in evals]
    assert versions == sorted(set(versions)) and versions[-1] == steps, versions
    # each evaluates the newest weights once a due version is reached: never before the first due one
    assert versions[0] >= min(every, steps)
    for x in evals:
        assert 1.0 <= x["simulated"]["tau"] <= block and 1.0 <= x["real"]["tau"] <= block
        walk = x["walk"]
        assert 1.0 <= walk["tau"] <= block and len(walk["tokens"]) == len(walk["steps"]) > 0
        assert walk["tau"] == round(sum(walk["tokens"]) / sum(walk["steps"]), 4)
        assert len(x["simulated"]["per_position"]) == block - 1 and x["simulated"]["anchors"] > 0


def assert_no_overlap(spans: list[dict], schedule: Schedule) -> None:
    """Lock-step, read from the trace: within a step, every load ends before the first
    target forward starts, every target before the first drafter, every drafter before
    the optimizer's step (its work on the step's last batch; the others are no-ops); and
    the next step's first load starts after that."""
    when = defaultdict(list)      # (step, role) -> [(start, end)] of its work spans
    for s in spans:
        b, role = s["args"].get("batch"), s["track"].split(".")[0]
        if s["name"] == "work" and (role != "optimizer" or schedule.is_last_of_step(b)):
            when[schedule.step_of(b), role].append((s["ts"], s["ts"] + s["dur"]))
    order = ("loader", "target", "drafter", "optimizer")
    for step in range(schedule.total_steps):
        for before, after in zip(order, order[1:]):
            assert max(e for _, e in when[step, before]) <= min(t for t, _ in when[step, after]), (step, after)
        if step + 1 < schedule.total_steps:
            assert max(e for _, e in when[step, "optimizer"]) <= min(t for t, _ in when[step + 1, "loader"])


STAMPED = re.compile(r"^\[\d\d:\d\d:\d\d\] ")


def status_verdict(run_dir) -> int:
    try:
        return statusview.verdict(read_status(run_dir), time.time())[0]
    except ValueError:      # not written yet
        return 2


def test_2_2_launched_into_a_file_is_bit_identical_and_reports_well(cache_dir, tmp_path):
    run = tmp_path / "run"
    cfg = small_config(cache_dir, run, "2-2", "monitor.log_every_s=1", "monitor.resources_every_s=1")
    (tmp_path / "cfg.yaml").write_text(dump_config(cfg))
    with open(tmp_path / "run.log", "w") as log, open(tmp_path / "err.log", "w") as err:
        proc = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "--config", str(tmp_path / "cfg.yaml")],
                                stdout=log, stderr=err, cwd=tmp_path)
    seen = set()
    try:
        while proc.poll() is None:
            seen.add(status_verdict(run))
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert proc.returncode == 0, (tmp_path / "err.log").read_text()[-2000:]
    assert 0 in seen, seen          # healthy while it ran (1 once it stops, 3 once it is gone)
    assert '"stuck"' not in (run / "events.log").read_text()
    code, line = statusview.verdict(read_status(run), time.time())
    assert code == 3 and "done" in line, line

    ref = reference(cache_dir, tmp_path, "2-2")
    assert losses(run) == ref.losses
    assert_same_weights(final_weights(run), ref.state_dict)

    # The console in a file: whole stamped lines, the last position, then the summary.
    lines = (tmp_path / "run.log").read_text().splitlines()
    summary = json.loads(lines[-1])
    assert summary["tokens"] == ref.tokens and summary["step"] == ref.steps
    assert all(STAMPED.match(x) for x in lines[:-1]) and "\r" not in "".join(lines), lines
    assert f"step {ref.steps}/{ref.steps} (100%) epoch 2/2 | loss {ref.losses[-1]:.4f} " in lines[-2], lines[-2]
    assert any("all 6 actors ready" in x for x in lines)
    phases = {(e["actor"], e["phase"]) for e in map(json.loads, (run / "events.log").read_text().splitlines())
              if e["event"] == "starting"}
    # The two targets map the one copy of the weights the job read (share_weights auto).
    assert {("target.1", "map shared weights"), ("optimizer.0", "restore weights and optimizer state")} <= phases
    assert not any(a.startswith("target") and p == "load target weights" for a, p in phases)
    assert any("read once into shared memory for 2 target(s)" in x for x in lines), lines
    stages = summary["stages"]
    assert set(stages) == {"loader", "target", "drafter", "optimizer"}
    assert stages["drafter"]["busy_s"] > 0 and stages["target"]["tflops"] > 0 and stages["drafter"]["mfu"] is None
    assert summary["placement"] == {"targets": ["cpu", "cpu"], "drafters": ["cpu", "cpu"], "feature_ring": "cpu",
                                    "grad_durability": "step"}

    # metrics.jsonl: one step line per step, in order, adding up to the summary.
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, ref.steps + 1))
    assert [r["loss"] for r in steps] == ref.losses
    assert sum(r["tokens"] for r in steps) == summary["tokens"]
    epochs = [r["epoch"] for r in steps]
    assert epochs == sorted(epochs) and epochs[0] == 1 and epochs[-1] == 2
    for r in steps:
        assert len(r["slot_acc"]) == cfg.drafter.block_size - 1 and all(0 <= a <= 1 for a in r["slot_acc"])
        assert set(r["stages"]) == set(stages) and (r["tokens_per_s"] or 1) > 0
    assert sum(r["tokens_per_s"] is not None for r in steps) >= len(steps) // 2
    for role in stages:
        busy = sum(r["stages"][role]["busy_s"] for r in steps)
        assert busy == pytest.approx(stages[role]["busy_s"], abs=0.01 * len(steps))
    samples = [r for r in recs if r["kind"] == "resources"]
    assert samples and set(samples[-1]["actors"]) == {"loader.0", "target.0", "target.1", "drafter.0",
                                                      "drafter.1", "optimizer.0"}
    assert any(all((a["rss_mb"] or 0) > 0 for a in x["actors"].values()) for x in samples)

    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "done" and status["training"]["step"] == ref.steps
    assert status["training"]["tokens"] == ref.tokens and status["training"]["loss"] == ref.losses[-1]

    pytest.importorskip("matplotlib")
    from dflash_actors.observe import plot
    assert plot.main([str(run)]) == 0
    assert (run / "plot.png").read_bytes()[:4] == b"\x89PNG"
