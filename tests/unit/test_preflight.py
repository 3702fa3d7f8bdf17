"""What the supervisor decides before it spawns anything, without a GPU: where the
feature ring lives (``runtime.feature_transport``)."""

import pytest

from dflash_actors.config import ConfigError
from dflash_actors.job.wiring import feature_device


def test_feature_ring_device_follows_the_transport_and_the_topology():
    gpus = ("cuda:0", "cuda:1"), ("cuda:2", "cuda:3")
    nvlink = lambda a, b: True                   # noqa: E731
    pcie_only = lambda a, b: {a, b} != {0, 2}    # noqa: E731 - cuda:0 cannot reach cuda:2
    assert feature_device("auto", *gpus, peer=nvlink) == "cuda:2"        # the first drafter's GPU
    assert feature_device("auto", ("cuda:0",), ("cuda:0",), peer=pcie_only) == "cuda:0"   # one GPU: no peer needed
    assert feature_device("auto", *gpus, peer=pcie_only) == "cpu"
    assert feature_device("auto", ("cpu",), ("cpu",)) == "cpu"
    assert feature_device("auto", ("cuda:0",), ("cpu",)) == "cpu"
    assert feature_device("host", *gpus, peer=nvlink) == "cpu"
    assert feature_device("cuda", *gpus, peer=nvlink) == "cuda:2"
    with pytest.raises(ConfigError, match="cuda:0 cannot reach peer to peer"):
        feature_device("cuda", *gpus, peer=pcie_only)
    with pytest.raises(ConfigError, match="cpu is in the topology"):
        feature_device("cuda", ("cuda:0",), ("cpu",))



def test_gangs_take_adjacent_gpus_and_drafters_the_rest():
    from dflash_actors.config import load_config
    from dflash_actors.job.wiring import gang_heads, resolve_devices
    from tests.support.pipeline import ROOT

    cfg = load_config(ROOT / "configs/default.yaml", [], topology="2x4-2")
    d = resolve_devices(cfg, cuda_count=10)
    assert d.targets == tuple(f"cuda:{i}" for i in range(8)) and d.drafters == ("cuda:8", "cuda:9")
    assert gang_heads(d, 4) == ("cuda:0", "cuda:4")
    assert resolve_devices(cfg, cuda_count=9).targets == ("cpu",) * 8     # too few GPUs: the CPU


def test_a_model_without_a_tensor_parallel_plan_is_refused():
    from transformers import GPT2Config

    from dflash_actors.config import ConfigError, load_config
    from dflash_actors.models import tensor_parallel
    from tests.support.pipeline import ROOT

    cfg = load_config(ROOT / "configs/default.yaml", [], topology="1x2-1")
    with pytest.raises(ConfigError, match="has no tensor-parallel plan"):
        tensor_parallel.check(cfg, GPT2Config())
    tensor_parallel.check(load_config(ROOT / "configs/default.yaml", []), GPT2Config())   # target_tp 1: anything goes
