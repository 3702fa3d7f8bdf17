"""``launch.py --plan-only`` at the sizes users run, planned on this CPU from a target's
``config.json`` alone, before any data or weights exist; and a plan that does not fit
stopping a run before anything starts."""

import json

import pytest
from transformers import Qwen3Config

import launch
from benchmarks.bench_memplan import TARGET_CONFIGS as TARGETS
from tests.support.pipeline import ROOT, SMALL

QWEN3_32B = dict(hidden_size=5120, intermediate_size=25600, num_attention_heads=64, num_key_value_heads=8,
                 head_dim=128, num_hidden_layers=64, vocab_size=151936, max_position_embeddings=40960,
                 tie_word_embeddings=False)
"""Qwen3-32B's published shape: 61 GiB of bf16 weights, most of an 80 GB GPU."""


def plan(template, tmp_path, capsys, *sets, gpu_gib=80, target_config=None):
    target = tmp_path / "target"
    (target_config or TARGETS[template]()).save_pretrained(target)      # config.json, and nothing else
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


def test_a_32b_target_on_the_8b_template_places_its_evaluator(tmp_path, capsys):
    """Two 61 GiB targets fill cuda:0 and cuda:1 and the drafters fill the others: the
    evaluator, which holds a whole target at its start, fits on the host only. With
    eval.device auto the plan puts it there; set on cuda:0, the line names eval.device,
    and the drafters' GPUs, which fit, keep the step they would take."""
    config = Qwen3Config(**QWEN3_32B)
    code, got, err = plan("qwen3-8b.yaml", tmp_path, capsys, "eval.device=auto", target_config=config)
    assert code == 0 and got["problem"] is None, err
    assert got["eval_device"] == "cpu" and all(d["fits"] for d in got["memory_plan"])
    assert got["drafter_block_tokens"] >= 512 * 16 and not got["checkpoint_layers"]
    weights = [p["gib"] for d in got["memory_plan"] for p in d["parts"] if p["what"].startswith("weights (bf")]
    assert weights and all(60 < w < 62 for w in weights)

    code, stuck, err = plan("qwen3-8b.yaml", tmp_path, capsys, "eval.device=cuda:0", target_config=config)
    lines = err.strip().splitlines()
    assert code == 2 and lines[-1] == f"error: {stuck['problem']}"
    assert lines[-1].startswith("error: memory plan: cuda:0 needs") and "change eval.device" in lines[-1]
    assert "target_tp" not in lines[-1]
    assert (stuck["drafter_block_tokens"], stuck["checkpoint_layers"]) == \
        (got["drafter_block_tokens"], got["checkpoint_layers"])
    assert [d["device"] for d in stuck["memory_plan"] if not d["fits"]] == ["cuda:0"]
