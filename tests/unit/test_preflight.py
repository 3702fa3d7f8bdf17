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

