"""``launch.py --plan-only`` at the sizes users run, planned on this CPU from a target's
``config.json`` alone, before any data or weights exist; and a plan that does not fit
stopping a run before anything starts."""

import json

import pytest

import launch
from benchmarks.bench_memplan import TARGET_CONFIGS as TARGETS
from tests.support.pipeline import ROOT, SMALL


def plan(template, tmp_path, capsys, *sets, gpu_gib=80):
    target = tmp_path / "target"
    TARGETS[template]().save_pretrained(target)      # config.json, and nothing else
    argv = ["--plan-only", "--json", "--config", str(ROOT / "configs" / template), "--gpu-memory", str(gpu_gib),
            "--run-dir", str(tmp_path / "run"), "--set", f"target.path={target}"]
    for kv in sets:
        argv += ["--set", kv]
    code = launch.main(argv)
    out, err = capsys.readouterr()
    return code, json.loads(out.splitlines()[-1]), err


@pytest.mark.parametrize("template", list(TARGETS))
def test_the_gpu_templates_fit_80_gb_gpus(template, tmp_path, capsys):
    code, got, err = plan(template, tmp_path, capsys)
    assert code == 0, err
    gpus = [d for d in got["memory_plan"] if d["device"].startswith("cuda")]
    assert [d["device"] for d in gpus] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert all(d["fits"] and d["need_gib"] <= d["usable_gib"] < d["have_gib"] == 80 for d in gpus)
    assert got["epoch0"] is None and got["problem"] is None            # planned before the data exists
    # The batch cannot run whole: micro-batches of at least one 512-anchor sequence, no recompute.
    assert got["drafter_block_tokens"] >= 512 * 16 and not got["checkpoint_layers"]
    for j, dev in enumerate(("cuda:2", "cuda:3")):
        parts = next(d for d in gpus if d["device"] == dev)["parts"]
        step = [p for p in parts if p["process"] == f"drafter.{j}" and p["what"].startswith("step at its peak")]
        assert len(step) == 1 and step[0]["gib"] > 10
    assert {p["process"] for p in got["processes"]} >= {"target.0", "target.1", "drafter.0", "drafter.1",
                                                        "optimizer.0", "supervisor", "evaluator"}


def test_a_gpu_too_small_is_one_line_naming_a_key(tmp_path, capsys):
    code, got, err = plan("qwen3-8b.yaml", tmp_path, capsys, gpu_gib=24)
    lines = err.strip().splitlines()
    assert code == 2 and got["problem"] and lines[-1] == f"error: {got['problem']}"
    assert lines[-1].startswith("error: memory plan: cuda:") and " change " in lines[-1]
    assert not all(d["fits"] for d in got["memory_plan"])


def test_a_micro_batch_too_big_names_its_key(tmp_path, capsys):
    code, got, err = plan("qwen3-8b.yaml", tmp_path, capsys, "train.drafter_block_tokens=262144",
                          "train.checkpoint_layers=off")
    assert code == 2 and "change train.drafter_block_tokens" in err.strip().splitlines()[-1]


def test_a_run_that_cannot_fit_stops_before_anything_starts(tmp_path, cache_dir, capsys):
    """On this CPU the host is the device: a feature ring of 8 slots of 2^27 tokens does
    not fit in its memory, and the run says so in one line with nothing started or written."""
    run_dir = tmp_path / "run"
    argv = ["--topology", "1-1", "--run-dir", str(run_dir), "--set", "batching.token_budget=134217728",
            "--set", "runtime.feature_slots=8"]
    for kv in SMALL + [f"data.cache_dir={cache_dir}"]:
        argv += ["--set", kv]
    assert launch.main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(err) == 1 and err[0].startswith("error: memory plan: cpu needs"), err
    assert "change runtime.feature_slots" in err[0]
    assert not run_dir.exists()
