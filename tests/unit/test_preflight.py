"""What the supervisor decides before it spawns anything, without a GPU: where the
feature ring lives (``runtime.feature_transport``)."""

import pytest

from dflash_actors.config import ConfigError
from dflash_actors.job.wiring import ring_choices


def test_the_ring_may_go_on_each_drafter_gpu_every_actor_reaches():
    gpus = ("cuda:0", "cuda:1"), ("cuda:2", "cuda:3")
    nvlink = lambda a, b: True                   # noqa: E731
    pcie_only = lambda a, b: {a, b} != {0, 2}    # noqa: E731 - cuda:0 cannot reach cuda:2
    assert ring_choices("auto", *gpus, peer=nvlink) == ("cuda:2", "cuda:3", "cpu")
    assert ring_choices("auto", ("cuda:0",), ("cuda:0",), peer=pcie_only) == ("cuda:0", "cpu")   # no peer needed
    assert ring_choices("auto", *gpus, peer=pcie_only) == ("cuda:3", "cpu")     # cuda:0 cannot reach cuda:2
    assert ring_choices("auto", ("cpu",), ("cpu",)) == ("cpu",)
    assert ring_choices("auto", ("cuda:0",), ("cpu",)) == ("cpu",)
    assert ring_choices("host", *gpus, peer=nvlink) == ("cpu",)
    assert ring_choices("cuda", *gpus, peer=nvlink) == ("cuda:2", "cuda:3")
    assert ring_choices("cuda", *gpus, peer=pcie_only) == ("cuda:3",)
    with pytest.raises(ConfigError, match="none of cuda:2, cuda:3 is reachable"):
        ring_choices("cuda", *gpus, peer=lambda a, b: False)
    with pytest.raises(ConfigError, match="cpu is in the topology"):
        ring_choices("cuda", ("cuda:0",), ("cpu",))


def test_gangs_take_adjacent_gpus_and_drafters_the_rest():
    from dflash_actors.config import load_config
    from dflash_actors.job.wiring import gang_heads, resolve_devices
    from tests.support.pipeline import ROOT

    cfg = load_config(ROOT / "configs/default.yaml", [], topology="2x4-2")
    d = resolve_devices(cfg, cuda_count=10)
    assert d.targets == tuple(f"cuda:{i}" for i in range(8)) and d.drafters == ("cuda:8", "cuda:9")
    assert gang_heads(d, 4) == ("cuda:0", "cuda:4")
    with pytest.raises(ConfigError, match=r"^topology.target_tp: 2x4-2 needs 8 target ranks \+ 2 drafters = "
                                          r"10 GPUs, but this machine has 9; use a smaller K"):
        resolve_devices(cfg, cuda_count=9)


def placement(topology, *sets, cuda_count):
    from dflash_actors.config import load_config
    from dflash_actors.job.wiring import resolve_devices
    from tests.support.pipeline import ROOT

    return resolve_devices(load_config(ROOT / "configs/default.yaml", list(sets), topology=topology),
                           cuda_count=cuda_count)


def test_a_gang_on_too_few_gpus_is_refused_but_runs_on_a_cpu_only_host():
    for topology, gpus in (("1x4-4", 6), ("2x4-2", 8), ("1x2-1", 1)):
        with pytest.raises(ConfigError, match=rf"^topology.target_tp: {topology} needs .* this machine has {gpus};"):
            placement(topology, cuda_count=gpus)
    d = placement("1x2-1", cuda_count=3)
    assert d.targets == ("cuda:0", "cuda:1") and d.drafters == ("cuda:2",)
    d = placement("1x2-1", cuda_count=0)                        # gloo on the CPU: how the CPU tests run gangs
    assert d.targets == ("cpu", "cpu") and d.drafters == ("cpu",)
    assert placement("2-2", cuda_count=3).targets == ("cpu", "cpu")   # no gang: the CPU, as before


def test_a_gang_is_all_cpu_or_distinct_gpus():
    devs = "topology.target_devices="
    with pytest.raises(ConfigError, match=r"^topology.target_devices: target 0's gang \['cuda:0', 'cpu'\] mixes"):
        placement("1x2-1", devs + "[cuda:0, cpu]", cuda_count=2)
    with pytest.raises(ConfigError, match=r"^topology.target_devices: target 1's gang \['cuda:2', 'cuda:2'\] "
                                          r"repeats a GPU"):
        placement("2x2-1", devs + "[cuda:0, cuda:1, cuda:2, cuda:2]", cuda_count=4)
    # Different actors may share a GPU: two gangs, or a gang and a drafter.
    d = placement("2x2-1", devs + "[cuda:0, cuda:1, cuda:1, cuda:0]", "topology.drafter_devices=[cuda:0]",
                  cuda_count=2)
    assert d.targets == ("cuda:0", "cuda:1", "cuda:1", "cuda:0") and d.drafters == ("cuda:0",)
    assert placement("1x2-1", devs + "[cpu, cpu]", cuda_count=4).targets == ("cpu", "cpu")
    assert placement("2-1", devs + "[cuda:0, cuda:0]", cuda_count=1).targets == ("cuda:0", "cuda:0")  # no gang
    with pytest.raises(ConfigError, match=r"^topology.target_devices: cuda:2 requested but this machine has 2"):
        placement("1x2-1", devs + "[cuda:1, cuda:2]", cuda_count=2)


def test_a_model_without_a_tensor_parallel_plan_is_refused():
    from transformers import GPT2Config

    from dflash_actors.config import ConfigError, load_config
    from dflash_actors.models import tensor_parallel
    from tests.support.pipeline import ROOT

    cfg = load_config(ROOT / "configs/default.yaml", [], topology="1x2-1")
    with pytest.raises(ConfigError, match="has no tensor-parallel plan"):
        tensor_parallel.check(cfg, GPT2Config())
    tensor_parallel.check(load_config(ROOT / "configs/default.yaml", []), GPT2Config())   # target_tp 1: anything goes
