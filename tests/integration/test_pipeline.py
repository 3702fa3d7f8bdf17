"""The actor pipeline against the single-process reference trainer (the oracle)."""

import json
from collections import defaultdict

import pytest
from support.pipeline import assert_same_weights, final_weights, losses, small_config

from dflash_actors.pipeline import Job
from dflash_actors.reference import train_reference
from dflash_actors.runtime import trace
from dflash_actors.schedule import Schedule

REFERENCE = {}


def reference(cache_dir, tmp_path, topology):
    """Reference results depend on M only (targets do not change the math)."""
    m = topology.split("-")[1]
    if m not in REFERENCE:
        REFERENCE[m] = train_reference(small_config(cache_dir, tmp_path / "ref", topology), progress=False)
    return REFERENCE[m]


@pytest.mark.parametrize("topology,schedule", [("1-1", "pipelined"), ("2-2", "pipelined"), ("1-3", "pipelined"),
                                               ("2-2", "lockstep")])
def test_pipeline_is_bit_identical_to_reference(cache_dir, tmp_path, topology, schedule):
    # 1-1 also runs the periodic evaluator: reading the published weights must not
    # change a bit of the training.
    every = 3 if topology == "1-1" else 0
    cfg = small_config(cache_dir, tmp_path / "run", topology, f"runtime.schedule={schedule}",
                       f"runtime.trace={schedule == 'lockstep'}", f"eval.every={every}", "eval.real_prompts=2",
                       "eval.max_new_tokens=8")
    job = Job(cfg, progress=False)
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


def test_grad_accumulation_matches_reference(cache_dir, tmp_path):
    cfg = small_config(cache_dir, tmp_path / "run", "1-2", "train.grad_accum=2")
    result = Job(cfg, progress=False).run()
    assert result.exit_code == 0, result.reason
    ref = train_reference(cfg, progress=False)
    assert losses(tmp_path / "run") == ref.losses
    assert_same_weights(final_weights(tmp_path / "run"), ref.state_dict)
