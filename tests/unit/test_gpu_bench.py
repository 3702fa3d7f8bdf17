"""benchmarks.gpu_bench: its FLOP and MFU arithmetic against hand counts, the steady-rate,
plan-against-measured and final-line bookkeeping on made-up files, the heartbeat fields
it reads, and its 2a/2b code paths on CPU (tiny)."""

import json
import math

import pytest
import torch

from benchmarks.gpu_bench import collect, common, drafter, flops, launches, pipeline, target
from benchmarks.gpu_bench.common import SMOKE, TINY

# TINY: hidden 64, 4 heads of 16 (2 kv heads), MLP 128, vocab 256. One layer's weights:
# q 64*64 + k,v 2*64*32 + o 64*64 + gate,up,down 3*64*128 = 4096 + 4096 + 4096 + 24576.
LAYER = 36864


def test_target_flops_count_only_the_layers_the_forward_runs():
    # layer ids [1, 3]: layers 0..3 run (4 of 6); 2 rows x 64 tokens = 128 tokens
    matmuls = 2 * LAYER * 4 * 128
    attention = 4 * 4 * 4 * 16 * 32 * 128    # 4 per (layer, head, head dim), causal mean context 64/2, per token
    assert flops.target_flops(TINY, [1, 3], rows=2, seq_len=64) == matmuls + attention == 41_943_040
    # the deepest id decides, not how many there are
    assert flops.target_flops(TINY, [3], 2, 64) == flops.target_flops(TINY, [0, 1, 2, 3], 2, 64)


def test_drafter_flops_hand_count():
    # 2 rows x 8 anchors x block 4 = 64 block tokens; 2 draft layers; 2 feature layers
    layers = 2 * 2 * LAYER * 64
    lm_head = 2 * 64 * 256 * 64
    fc = 2 * 2 * 64 * 64 * 128                 # on every one of the 128 target tokens
    attention = 4 * 2 * 4 * 16 * (32 + 4) * 64  # context (mean 64/2) plus the block
    want = 3 * (layers + lm_head + fc + attention)
    assert want == 44_433_408
    assert flops.drafter_flops(TINY, 2, 2, rows=2, seq_len=64, anchors_per_row=8, block_size=4) == want


def test_rates_and_mfu():
    r = flops.rates(flops=989e12, seconds=2.0, tokens=16384, peak=989.0)
    assert r["tflops"] == 494.5 and r["mfu"] == 0.5 and r["tokens_per_s"] == 8192.0 and r["step_s"] == 2.0


def _step(n, t, tokens=100, drafter_busy=1.0):
    return {"kind": "step", "step": n, "time": t, "tokens": tokens,
            "stages": {"target": {"busy_s": 0.5}, "drafter": {"busy_s": drafter_busy}}}


def test_steady_rate_leaves_out_the_first_steps_and_keeps_a_repeated_steps_later_line():
    steps = [_step(1, 100.0), _step(2, 130.0), _step(3, 132.0), _step(4, 134.0, tokens=1),
             _step(4, 134.0), _step(5, 136.0)]
    r = launches.steady(steps)
    # steps 3..5 counted, from the end of step 2 (130) to the end of step 5 (136)
    assert (r["steps"], r["tokens"], r["seconds"], r["tokens_per_s"], r["step_s"]) == (3, 300, 6.0, 50.0, 2.0)
    assert r["busy_s"] == {"target": 1.5, "drafter": 3.0}
    assert launches.steady([_step(1, 1.0)]) == {}
    assert launches.steady([_step(1, 1.0), _step(2, 3.0)])["steps"] == 1


def test_steady_mfu_rescales_the_run_mfu_by_busy_time_per_token():
    summary = {"tokens": 1000, "stages": {"drafter": {"busy_s": 40.0, "busy_fraction": 0.9, "tokens_per_s": 25.0,
                                                      "tflops": 100.0, "mfu": 0.1}}}
    rate = {"tokens": 500, "busy_s": {"drafter": 10.0}}
    # whole run 0.04 busy s per token, steady 0.02: twice the FLOP rate
    assert launches.stage_view(summary, rate)["drafter"]["steady_mfu"] == 0.2


PLAN = {"processes": [{"process": "supervisor", "device": "cpu", "gib": 2.0},
                      {"process": "supervisor", "device": "cuda:0", "gib": 1.5},
                      {"process": "drafter.0", "device": "cuda:0", "gib": 60.5},
                      {"process": "optimizer.0", "device": "cpu", "gib": 19.5}],
        "memory_plan": [{"device": "cuda:0", "parts": [
            {"process": "supervisor", "what": "feature ring (4 slots)", "gib": 1.0, "key": "runtime.feature_transport"},
            {"process": "supervisor", "what": "CUDA context", "gib": 0.5, "key": "topology"},
            {"process": "drafter.0", "what": "CUDA context", "gib": 0.5, "key": "topology"},
            {"process": "drafter.0", "what": "step at its peak: micro-batches of 32768 block tokens", "gib": 50.0,
             "key": "train.drafter_block_tokens"}]}],
        "drafter_block_tokens": 32768, "checkpoint_layers": False, "optimizer_device": "cpu",
        "feature_device": "cuda:0", "problem": None}


def test_plan_vs_measured_sets_each_planned_process_beside_its_reported_peaks():
    status = {"supervisor": {"gpu_peak_mb": 1024.0, "gpu_reserved_peak_mb": 1536.0},
              "actors": {"drafter.0": {"gpu_peak_mb": 51200.0, "gpu_reserved_peak_mb": 56320.0},
                         "optimizer.0": {"gpu_peak_mb": None, "gpu_reserved_peak_mb": None},
                         "loader.0": {"gpu_peak_mb": 512.0, "gpu_reserved_peak_mb": 2048.0}}}
    rows = launches.plan_vs_measured(PLAN, status)
    assert rows == [
        {"process": "supervisor", "device": "cpu", "planned_gib": 2.0, "context_gib": None,
         "measured_peak_gib": None, "reserved_peak_gib": None},
        {"process": "supervisor", "device": "cuda:0", "planned_gib": 1.5, "context_gib": 0.5,
         "measured_peak_gib": 1.0, "reserved_peak_gib": 1.5},
        {"process": "drafter.0", "device": "cuda:0", "planned_gib": 60.5, "context_gib": 0.5,
         "measured_peak_gib": 50.0, "reserved_peak_gib": 55.0},
        {"process": "optimizer.0", "device": "cpu", "planned_gib": 19.5, "context_gib": None,
         "measured_peak_gib": None, "reserved_peak_gib": None},
        # GPU memory the plan gave no one
        {"process": "loader.0", "device": "cuda, not planned", "planned_gib": None, "context_gib": None,
         "measured_peak_gib": 0.5, "reserved_peak_gib": 2.0}]
    # a run that wrote no status.json: the plan alone
    assert [r["measured_peak_gib"] for r in launches.plan_vs_measured(PLAN, {})] == [None] * 4
    assert launches.plan_brief(PLAN)["drafter_step_peak_gib"] == 50.0


def test_prepare_reuses_the_plan_the_background_job_made(tmp_path):
    common.write_json(PLAN, str(tmp_path / common.PLAN_FILE))
    assert pipeline.prepare(tmp_path, smoke=False) == PLAN     # nothing built, nothing planned again


def test_pytest_counts_from_the_summary_or_from_the_per_test_lines_of_a_killed_run(tmp_path):
    log = tmp_path / "cuda_tests.log"
    lines = ["tests/unit/test_loss.py::test_flex PASSED        [ 20%]",
             "tests/integration/test_runtime_gpu.py::test_ipc PASSED     [ 40%]",
             "tests/integration/test_runtime_gpu.py::test_ipc ERROR      [ 40%]",
             "tests/unit/test_loss.py::test_loss_on_cuda[bf16] FAILED  [ 60%]"]
    log.write_text("\n".join(lines + ["12.01s call     tests/unit/test_loss.py::test_flex",
                                      "==== 1 failed, 2 passed, 1 error in 80.12s (0:01:20) ===="]) + "\n")
    r = collect.pytest_counts(log)
    assert (r["passed"], r["failed"], r["errors"], r["finished"]) == (2, 1, 1, True)
    assert r["tests"] == {"test_flex": "PASSED", "test_ipc": "ERROR", "test_loss_on_cuda[bf16]": "FAILED"}
    # killed by the section's cap in the fourth test: no summary line
    log.write_text("\n".join(lines + ["tests/unit/test_loss.py::test_slow "]) + "\n")
    r = collect.pytest_counts(log)
    assert (r["passed"], r["failed"], r["errors"], r["finished"], r["killed_in"]) == (1, 1, 1, False, "test_slow")
    assert collect.pytest_counts(tmp_path / "absent.log") == {}


def test_collect_names_failures_and_gathers_the_plan_rows(tmp_path):
    (tmp_path / "sections.tsv").write_text("env\t0\t3\ncuda_tests\t124\t150\ntarget\t124\t60\n"
                                           "prepare\t0\t90\ndrafter\t0\t80\npipeline\t1\t5\nserving\tskipped\t0\n")
    (tmp_path / "env.json").write_text(json.dumps({"section": "env", "torch": "x"}))
    (tmp_path / "cuda_tests.log").write_text("tests/a.py::test_one PASSED [50%]\ntests/a.py::test_two \n")
    (tmp_path / "target.log").write_text("building\nRuntimeError: CUDA out of memory\n\n")
    row = {"process": "drafter.0", "device": "cuda:0", "planned_gib": 60.5, "context_gib": 0.5,
           "measured_peak_gib": 50.0, "reserved_peak_gib": 55.0}
    brief = {"drafter_block_tokens": 32768, "problem": None}
    (tmp_path / "prepare.json").write_text(json.dumps({"plan_s": 12.0, "plan": brief}))
    (tmp_path / "drafter.json").write_text(json.dumps({"mfu": 0.41, "loss": None, "plan": brief,
                                                       "plan_vs_measured": [row]}))
    (tmp_path / "pipeline.json").write_text(json.dumps({"error": "plan: memory plan: cuda:0 needs more",
                                                        "plan_vs_measured": [row]}))
    r = collect.collect(tmp_path)
    assert r["check"] == "gpu_check" and r["env"]["torch"] == "x" and r["drafter"]["mfu"] == 0.41
    assert r["cuda_tests"]["passed"] == 1 and r["cuda_tests"]["killed_in"] == "test_two"
    # the rows once, at the top; the tests that did not pass, by name
    assert r["plan_vs_measured"] == [{"section": "drafter", **row}, {"section": "pipeline", **row}]
    assert "plan_vs_measured" not in r["drafter"] and r["cuda_tests"]["tests"] == {}
    # nulls and the plan prepare shows already left out of the sections
    assert r["drafter"] == {"mfu": 0.41} and r["prepare"] == {"plan_s": 12.0, "plan": {"drafter_block_tokens": 32768}}
    assert r["failed"] == [
        {"section": "cuda_tests", "rc": "124", "error": "timed out after 150 s: killed in test_two"},
        {"section": "target", "rc": "124", "error": "timed out after 60 s: RuntimeError: CUDA out of memory"},
        {"section": "pipeline", "rc": "1", "error": "plan: memory plan: cuda:0 needs more"}]
    assert r["skipped"] == ["serving"]
    lines = collect.report_lines(r)
    assert lines[0] == "env: 0 in 3 s"
    assert lines[3:5] == ["prepare: 0 in 90 s; plan_s 12.0", "drafter: 0 in 80 s; mfu 0.41"]
    assert lines[-1] == ("plan pipeline drafter.0 cuda:0: 60.5 GiB planned (0.5 context); "
                         "peak 50.0 allocated, 55.0 reserved")
    assert len(lines) == 7 + 2 and all(len(x) <= 200 for x in lines)


def test_heartbeats_carry_the_gpu_peaks_into_status_fields():
    from dflash_actors.runtime.actor import Heartbeats, gpu_memory
    from dflash_actors.runtime.status import gpu_fields as _gpu_fields

    hb = Heartbeats.allocate(2)
    # this process has not used CUDA: zeros, and nothing initialises it
    assert gpu_memory() == {"gpu_mb": 0.0, "gpu_peak_mb": 0.0, "gpu_reserved_peak_mb": 0.0}
    assert not torch.cuda.is_initialized()
    hb.set(1, gpu_mb=300.04, gpu_peak_mb=1234.56, gpu_reserved_peak_mb=2048.0)
    assert _gpu_fields(hb.row(1)) == {"gpu_mem_mb": 300.0, "gpu_peak_mb": 1234.6, "gpu_reserved_peak_mb": 2048.0}
    assert _gpu_fields(hb.row(0)) == {"gpu_mem_mb": None, "gpu_peak_mb": None, "gpu_reserved_peak_mb": None}


@pytest.fixture(scope="module")
def cpu():
    torch.set_num_threads(1)
    return torch.device("cpu")


def test_smoke_target_forward_gives_finite_rates(cpu):
    r = target.bench_target(SMOKE, cpu)
    assert r["layer_ids"] == [1, 3] and r["layers_run"] == 4 and r["features_finite"]
    for k in ("tokens_per_s", "tflops", "mfu"):
        assert math.isfinite(r[k]) and r[k] > 0


def test_smoke_drafter_step_runs_at_the_plans_micro_batch(cpu):
    # 2 rows x 8 anchors x block 4 = 64 block tokens; a budget of 16 makes micro-batches of 4 anchors
    plan = {**PLAN, "drafter_block_tokens": 16,
            "processes": [{"process": "drafter.0", "device": "cpu", "gib": 0.5}]}
    r = drafter.bench_drafter(SMOKE, cpu, plan)
    assert "error" not in r, r
    assert r["block_tokens"] == 16 and r["micro_batches"] == 4 and r["anchors_per_row"] == SMOKE.num_anchors
    for k in ("tokens_per_s", "tflops", "mfu", "loss"):
        assert math.isfinite(r[k]) and r[k] > 0
    assert r["plan_vs_measured"] == [{"process": "drafter.0", "device": "cpu", "planned_gib": 0.5,
                                      "context_gib": None, "measured_peak_gib": None, "reserved_peak_gib": None}]
    assert r["memory"]["planned_step_peak_gib"] == 50.0


def test_smoke_drafter_step_without_a_plan_measures_and_says_so(cpu):
    r = drafter.bench_drafter(SMOKE, cpu, {"error": "launch.py --plan-only exit 1: boom"})
    assert r["block_tokens"] == common.FALLBACK_BLOCK_TOKENS and r["micro_batches"] == 1
    assert r["error"].startswith("no plan (launch.py --plan-only exit 1: boom)") and r["mfu"] > 0
