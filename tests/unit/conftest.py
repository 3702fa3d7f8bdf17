from pathlib import Path

import pytest
import torch

from dflash_actors.config import load_config
from dflash_actors.models.target import load_target
from tests.support.pipeline import HEADS_16

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(cfg, target): the default config with a briefly fitted tiny target, built once."""
    torch.set_num_threads(1)
    cfg = load_config(ROOT / "configs" / "default.yaml",
                      [f"data.cache_dir={tmp_path_factory.getbasetemp() / 'models'}", "target.tiny.pretrain_steps=20",
                       *HEADS_16])
    return cfg, load_target(cfg)


@pytest.fixture
def host_registers(monkeypatch) -> list:
    """A GPU host as far as ``channels.page_lock`` can tell: ``"cudart"`` when it reaches
    CUDA (what would create a context), then each ``(address, bytes)`` it registers."""
    calls = []

    class CudaRt:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append((ptr, size))
            return 0

    def cudart():
        calls.append("cudart")
        return CudaRt()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", cudart)
    return calls
