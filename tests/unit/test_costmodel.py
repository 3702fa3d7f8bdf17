"""The cost model against numbers worked out by hand in the comments, not by calling it twice."""

import json
from dataclasses import replace

import pytest

from dflash_actors.train import costmodel
from dflash_actors.train.costmodel import (
    NVLINK,
    PCIE,
    SHAPES,
    ModelShape,
    StageCosts,
    Workload,
    advise,
    bottleneck,
    bound_batches_per_s,
    bound_tokens_per_s,
    bytes_per_batch,
    drafter_flops_per_batch,
    drafter_params,
    explain,
    ideal_speedup,
    lockstep_batches_per_s,
    project,
    simulated_costs,
    target_flops_per_batch,
    transfer_s_per_batch,
)

# loader 1 ms, target 30 ms, drafter 10 ms per batch; optimizer 2 ms per step; 2,000 tokens per batch
C = StageCosts(loader_s=0.001, target_s=0.030, drafter_s=0.010, optimizer_s=0.002, tokens_per_batch=2000)
approx = lambda x: pytest.approx(x, rel=1e-9)


def test_one_target_one_drafter():
    # bound = min(1/0.001, 1/0.030, 1/(0.010+0.002)) = min(1000, 33.33, 83.33) = 33.33 batches/s
    assert bound_batches_per_s(C, 1, 1, 1) == approx(1 / 0.030)
    assert bound_tokens_per_s(C, 1, 1, 1) == approx(66666.666666)
    # lockstep = 1 / (0.001 + 0.030 + 0.010 + 0.002) = 1/0.043 = 23.26 batches/s
    assert lockstep_batches_per_s(C, 1, 1, 1) == approx(1 / 0.043)
    # speedup = 33.33 / 23.26 = 0.043 / 0.030 = 1.433
    assert ideal_speedup(C, 1, 1, 1) == approx(0.043 / 0.030)
    assert bottleneck(C, 1, 1, 1) == "target"


def test_three_targets_one_drafter():
    # bound = min(1000, 3/0.030 = 100, 1/0.012 = 83.33) = 83.33, the drafter chain limits
    assert bound_batches_per_s(C, 3, 1, 1) == approx(1 / 0.012)
    assert bottleneck(C, 3, 1, 1) == "drafter"
    # lockstep, P = 1: ceil(1/3) = 1 target round, so again 1/0.043
    assert lockstep_batches_per_s(C, 3, 1, 1) == approx(1 / 0.043)


def test_two_two_with_grad_accum():
    # g = 2, P = 4: bound = min(1000, 2/0.030 = 66.67, 4/(2*0.010 + 0.002) = 181.8) = 66.67
    assert bound_batches_per_s(C, 2, 2, 2) == approx(2 / 0.030)
    assert bottleneck(C, 2, 2, 2) == "target"
    # lockstep = 4 / (4*0.001 + ceil(4/2)*0.030 + 2*0.010 + 0.002) = 4/0.086 = 46.51
    assert lockstep_batches_per_s(C, 2, 2, 2) == approx(4 / 0.086)


def test_loader_bottleneck_name():
    slow_loader = StageCosts(0.1, 0.030, 0.010, 0.002, 2000)
    # min(10, 33.33, 83.33): the loader
    assert bottleneck(slow_loader, 1, 1, 1) == "loader"
    assert bound_batches_per_s(slow_loader, 1, 1, 1) == approx(10.0)


def test_zero_loader_cost_never_limits():
    free = StageCosts(0.0, 0.0, 0.010, 0.0, 2000)
    # loader and target cost nothing: only the drafter, 3 drafters at 100 batches/s each
    assert bound_batches_per_s(free, 1, 3, 1) == approx(300.0)
    assert bottleneck(free, 1, 3, 1) == "drafter"
    assert lockstep_batches_per_s(free, 1, 3, 1) == approx(300.0)   # 3 / (0 + 0 + 0.010 + 0)


def test_advise_four_devices():
    # g = 1. 1-3: min(33.33, 3/0.012 = 250) -> 66,667 tok/s; 2-2: min(66.67, 166.7) -> 133,333;
    # 3-1: min(100, 83.33) -> 166,667
    ranked = advise(C, 4, 1)
    assert [(n, m) for n, m, _ in ranked] == [(3, 1), (2, 2), (1, 3)]
    assert [tok for _, _, tok in ranked] == [approx(166666.666666), approx(133333.333333), approx(66666.666666)]


def test_advise_ties_and_loader():
    # a 1 s loader caps every split at 1 batch/s = 2,000 tok/s: a tie, fewer targets first
    slow_loader = StageCosts(1.0, 0.030, 0.010, 0.002, 2000)
    assert [(n, m, tok) for n, m, tok in advise(slow_loader, 4, 1)] == [(1, 3, 2000.0), (2, 2, 2000.0), (3, 1, 2000.0)]
    # without the loader it is the ranking above
    assert [(n, m) for n, m, _ in advise(slow_loader, 4, 1, loader_bound=False)] == [(3, 1), (2, 2), (1, 3)]


@pytest.mark.parametrize("devices", [1, 0])
def test_advise_needs_two_devices(devices):
    with pytest.raises(ValueError, match="at least 2 devices"):
        advise(C, devices, 1)


def test_bad_split_rejected():
    with pytest.raises(ValueError):
        bound_batches_per_s(C, 0, 1, 1)
    with pytest.raises(ValueError):
        lockstep_batches_per_s(C, 1, 1, 0)


def test_explain_is_one_line():
    line = explain(C, 4, 1)
    assert "\n" not in line
    assert line == ("topology auto: 3-1 for 4 devices (target 30.0 ms/batch, drafter 10.0 ms/batch + optimizer "
                    "2.0 ms/step, grad_accum 1: bound 166667 tokens/s, drafter-bound; next 2-2 at 133333 tokens/s)")
    # two devices have a single split: no runner-up
    assert explain(C, 2, 1).startswith("topology auto: 1-1 for 2 devices")
    assert explain(C, 2, 1).endswith("target-bound; no other split)")


def test_qwen3_8b_shape():
    s = SHAPES["qwen3-8b"]
    # q 4096*32*128 = 16,777,216; k, v 4096*8*128 = 4,194,304 each; o 16,777,216; MLP 3*4096*12288 = 150,994,944
    assert s.layer_params() == 16_777_216 + 2 * 4_194_304 + 16_777_216 + 150_994_944 == 192_937_984
    # 5 layers = 964,689,920, fc 5*4096*4096 = 83,886,080: 1,048,576,000 (about the published 1.05B)
    assert drafter_params(s, Workload()) == 1_048_576_000
    b = bytes_per_batch(s, Workload())
    assert b["features"] == 65536 * 5 * 4096 * 2 == 2_684_354_560
    assert b["gradients"] == 2 * 1_048_576_000 * 4 == 8_388_608_000
    assert b["weights"] == 4_194_304_000
    # PCIe at 50 GB/s, g = 1: (2,684,354,560 + 8,388,608,000 + 4,194,304,000) / 50e9 = 0.3053453312 s
    assert transfer_s_per_batch(s, Workload(), PCIE) == approx(0.3053453312)
    # g = 4 spreads the weights over 4 batches: (2,684,354,560 + 8,388,608,000 + 1,048,576,000) / 50e9
    assert transfer_s_per_batch(s, Workload(), PCIE, grad_accum=4) == approx(0.2424307712)


TINY = ModelShape("tiny", hidden=4, layers=1, intermediate=8, heads=2, kv_heads=1, head_dim=2, vocab=10)
TINY_W = Workload(token_budget=8, sequences_per_batch=2, anchors=1, block_size=2, feature_layers=1, drafter_layers=1)


def test_flops_on_a_tiny_shape():
    # layer: q 4*2*2 = 16, k 8, v 8, o 16, MLP 3*4*8 = 96 -> 144
    assert TINY.layer_params() == 144
    # ctx = (8/2)/2 = 2. target: 2*144*1*8 = 2304 matmul + 4*1*(2*2)*2*8 = 256 attention -> 2560
    assert target_flops_per_batch(TINY, TINY_W) == 2560
    # drafter params 144 + 1*4*4 = 160
    assert drafter_params(TINY, TINY_W) == 160
    # block tokens Q = 2*1*2 = 4. forward: layers 2*1*144*4 = 1152, LM head 2*4*10*4 = 320,
    # fc 2*1*4*4*8 = 256, attention 4*1*4*(2+2)*4 = 256 -> 1984; x3 = 5952
    assert drafter_flops_per_batch(TINY, TINY_W) == 5952
    # checkpointed layers run their forward again: + layers 1152 + attention 256
    assert drafter_flops_per_batch(TINY, replace(TINY_W, checkpoint_layers=True)) == 5952 + 1408
    # at 1e-9 TFLOP/s = 1,000 FLOP/s
    assert simulated_costs(TINY, TINY_W, 1e-9) == (approx(2.560), approx(5.952))


def test_project_is_json_and_complete():
    for name in SHAPES:
        p = project(SHAPES[name], Workload(), tflops=400)
        json.dumps(p)
        assert {"model", "assumptions", "target_s", "drafter_s", "optimizer_s", "drafter_params",
                "bytes_per_batch_gb", "no_transfer", "links"} <= p.keys()
        assert p["model"] == name
        assert set(p["links"]) == {PCIE.name, NVLINK.name}
        for link in p["links"].values():
            assert 0 < link["overhead_fraction"] < 1
            for devices in (4, 8):
                n, m = map(int, link["topologies"][str(devices)]["best"].split("-"))
                assert n >= 1 and m >= 1 and n + m == devices


def test_project_pcie_overhead_by_hand():
    p = project(SHAPES["qwen3-8b"], Workload(), tflops=400)
    # transfer 0.3053 s over PCIe (above); NVLink moves 400 GB/s against 50, so 8x less time
    assert p["links"][PCIE.name]["transfer_s"] == 0.3053
    assert p["links"][NVLINK.name]["transfer_s"] == pytest.approx(0.3053453312 / 8, rel=1e-3)
    # features 2.684 GB, gradients 8.389 GB, weights 4.194 GB
    assert p["bytes_per_batch_gb"] == {"features": 2.684, "gradients": 8.389, "weights": 4.194}
    # optimizer default: 1,048,576,000 * 16 / 4.8e12 = 3.495 ms
    assert p["optimizer_s"] == 0.003495


def test_control_latency_lengthens_the_drafter_chain_and_can_change_the_advice():
    # 3-1, g=1: drafter chain 10 + 2 ms -> 83.3 batches/s beats 2-2's target 66.7; with 5 ms of
    # control per step the chain is 17 ms -> 58.8 batches/s, and 2-2 (target-bound, 66.7) wins.
    slow = StageCosts(0.001, 0.030, 0.010, 0.002, 2000, control_s=0.005)
    assert bound_batches_per_s(slow, 3, 1, 1) == pytest.approx(1 / 0.017)
    assert advise(C, 4, 1)[0][:2] == (3, 1)
    assert advise(slow, 4, 1)[0][:2] == (2, 2)
    assert "control 5.0 ms/step" in explain(slow, 4, 1)


def test_scale_out_charges_each_step_one_exchange():
    shape, w = costmodel.SHAPES["qwen3-8b"], costmodel.Workload()
    link = costmodel.Link("x", 10.0)
    size = costmodel.drafter_params(shape, w) * 4
    assert costmodel.exchange_s(1000, 1, link) == 0.0
    # two nodes: the chain is one transfer, the broadcast another
    assert costmodel.exchange_s(size // 4, 2, link) == pytest.approx(2 * size / 10e9, rel=1e-3)
    # each further hop adds a chunk, not a whole transfer
    extra = costmodel.exchange_s(size // 4, 8, link) - costmodel.exchange_s(size // 4, 2, link)
    assert 6 * costmodel.CHAIN_CHUNK_BYTES / 10e9 <= extra < 0.05 * 2 * size / 10e9
    est = costmodel.scale_out(shape, w, 50_000.0, 4, [link], nodes=(1, 2, 8))
    rows = est["links"]["x"]
    compute = 4 * w.token_budget / 50_000.0
    assert est["step_compute_s"] == pytest.approx(compute, rel=1e-3)
    assert rows["1"] == {"tokens_per_s": 50_000.0, "efficiency": 1.0, "exchange_s": 0.0}
    for k in ("2", "8"):
        x = rows[k]["exchange_s"]
        assert rows[k]["efficiency"] == pytest.approx(compute / (compute + x), abs=2e-3)
        assert rows[k]["tokens_per_s"] == pytest.approx(int(k) * 50_000.0 * compute / (compute + x), rel=2e-3)


def test_gangs_count_their_devices_and_split_the_target_ideally():
    from dflash_actors.train.costmodel import gang_costs
    assert [(n, m) for n, m, _ in advise(C, 8, 1, tp=4)] == [(1, 4)]
    assert sorted((n, m) for n, m, _ in advise(C, 10, 1, tp=4)) == [(1, 6), (2, 2)]
    assert gang_costs(C, 4).target_s == C.target_s / 4
    with pytest.raises(ValueError, match="at least 5 devices"):
        advise(C, 4, 1, tp=4)
    assert explain(C, 10, 1, tp=4).startswith("topology auto: ") and "x4-" in explain(C, 10, 1, tp=4)
