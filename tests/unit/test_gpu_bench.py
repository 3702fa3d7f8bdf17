"""benchmarks.gpu_bench: its FLOP and MFU arithmetic against hand counts, the steady-rate
and final-line bookkeeping on made-up files, and its 2a/2b code paths on CPU (tiny)."""

import json
import math

import pytest
import torch

from benchmarks import gpu_bench
from benchmarks.gpu_bench import SMOKE, TINY

# TINY: hidden 64, 4 heads of 16 (2 kv heads), MLP 128, vocab 256. One layer's weights:
# q 64*64 + k,v 2*64*32 + o 64*64 + gate,up,down 3*64*128 = 4096 + 4096 + 4096 + 24576.
LAYER = 36864


def test_target_flops_count_only_the_layers_the_forward_runs():
    # layer ids [1, 3]: layers 0..3 run (4 of 6); 2 rows x 64 tokens = 128 tokens
    matmuls = 2 * LAYER * 4 * 128
    attention = 4 * 4 * 4 * 16 * 32 * 128    # 4 per (layer, head, head dim), causal mean context 64/2, per token
    assert gpu_bench.target_flops(TINY, [1, 3], rows=2, seq_len=64) == matmuls + attention == 41_943_040
    # the deepest id decides, not how many there are
    assert gpu_bench.target_flops(TINY, [3], 2, 64) == gpu_bench.target_flops(TINY, [0, 1, 2, 3], 2, 64)


def test_drafter_flops_hand_count():
    # 2 rows x 8 anchors x block 4 = 64 block tokens; 2 draft layers; 2 feature layers
    layers = 2 * 2 * LAYER * 64
    lm_head = 2 * 64 * 256 * 64
    fc = 2 * 2 * 64 * 64 * 128                 # on every one of the 128 target tokens
    attention = 4 * 2 * 4 * 16 * (32 + 4) * 64  # context (mean 64/2) plus the block
    want = 3 * (layers + lm_head + fc + attention)
    assert want == 44_433_408
    assert gpu_bench.drafter_flops(TINY, 2, 2, rows=2, seq_len=64, anchors_per_row=8, block_size=4) == want


def test_rates_and_mfu():
    r = gpu_bench.rates(flops=989e12, seconds=2.0, tokens=16384, peak=989.0)
    assert r["tflops"] == 494.5 and r["mfu"] == 0.5 and r["tokens_per_s"] == 8192.0 and r["step_s"] == 2.0


def _step(n, t, tokens=100, drafter_busy=1.0):
    return {"kind": "step", "step": n, "time": t, "tokens": tokens,
            "stages": {"target": {"busy_s": 0.5}, "drafter": {"busy_s": drafter_busy}}}


def test_steady_rate_leaves_out_the_first_steps_and_keeps_a_repeated_steps_later_line():
    steps = [_step(1, 100.0), _step(2, 130.0), _step(3, 132.0), _step(4, 134.0, tokens=1),
             _step(4, 134.0), _step(5, 136.0)]
    r = gpu_bench.steady(steps)
    # steps 3..5 counted, from the end of step 2 (130) to the end of step 5 (136)
    assert (r["steps"], r["tokens"], r["seconds"], r["tokens_per_s"], r["step_s"]) == (3, 300, 6.0, 50.0, 2.0)
    assert r["busy_s"] == {"target": 1.5, "drafter": 3.0}
    assert gpu_bench.steady([_step(1, 1.0)]) == {}
    assert gpu_bench.steady([_step(1, 1.0), _step(2, 3.0)])["steps"] == 1


def test_steady_mfu_rescales_the_run_mfu_by_busy_time_per_token():
    summary = {"tokens": 1000, "stages": {"drafter": {"busy_s": 40.0, "busy_fraction": 0.9, "tokens_per_s": 25.0,
                                                      "tflops": 100.0, "mfu": 0.1}}}
    rate = {"tokens": 500, "busy_s": {"drafter": 10.0}}
    # whole run 0.04 busy s per token, steady 0.02: twice the FLOP rate
    assert gpu_bench.stage_view(summary, rate)["drafter"]["steady_mfu"] == 0.2


def test_collect_names_failures_and_derives_the_pipeline_ratios(tmp_path):
    (tmp_path / "sections.tsv").write_text("env\t0\t3\ntarget\t124\t90\n"
                                           "pipe_pipelined_cuda\t0\t100\npipe_lockstep_cuda\t0\t100\n"
                                           "pipe_pipelined_host\t1\t5\nnodes\tskipped\t0\n")
    (tmp_path / "env.json").write_text(json.dumps({"section": "env", "torch": "x"}))
    (tmp_path / "target.log").write_text("building\nRuntimeError: CUDA out of memory\n\n")
    (tmp_path / "pipe_pipelined_cuda.json").write_text(json.dumps({"tokens_per_s": 3000.0}))
    (tmp_path / "pipe_lockstep_cuda.json").write_text(json.dumps({"tokens_per_s": 2000.0}))
    (tmp_path / "pipe_pipelined_host.json").write_text(json.dumps({"tokens_per_s": None, "error": "exit 2; bad"}))
    r = gpu_bench.collect(tmp_path)
    assert r["check"] == "gpu_check" and r["env"]["torch"] == "x"
    assert r["pipeline"]["pipelined_over_lockstep"] == 1.5 and r["pipeline"]["cuda_over_host"] is None
    assert r["failed"] == [
        {"section": "target", "rc": "124", "error": "timed out after 90 s: RuntimeError: CUDA out of memory"},
        {"section": "pipe_pipelined_host", "rc": "1", "error": "exit 2; bad"}]
    assert r["skipped"] == ["nodes"]


@pytest.fixture(scope="module")
def cpu():
    torch.set_num_threads(1)
    return torch.device("cpu")


def test_smoke_target_forward_gives_finite_rates(cpu):
    r = gpu_bench.bench_target(SMOKE, cpu)
    assert r["layer_ids"] == [1, 3] and r["layers_run"] == 4 and r["features_finite"]
    for k in ("tokens_per_s", "tflops", "mfu"):
        assert math.isfinite(r[k]) and r[k] > 0


def test_smoke_drafter_step_gives_finite_rates_per_compute_dtype(cpu):
    r = gpu_bench.bench_drafter(SMOKE, cpu)
    assert set(r["variants"]) == set(gpu_bench.COMPUTE_DTYPES)
    for v in r["variants"].values():
        assert "error" not in v, v
        assert v["anchors_per_row"] == SMOKE.num_anchors
        for k in ("tokens_per_s", "tflops", "mfu", "loss"):
            assert math.isfinite(v[k]) and v[k] > 0
