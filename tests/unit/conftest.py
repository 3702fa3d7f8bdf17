from pathlib import Path

import pytest
import torch

from dflash_actors.config import load_config
from dflash_actors.models.target import load_target

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(cfg, target): the default config with a briefly fitted tiny target, built once."""
    torch.set_num_threads(1)
    cfg = load_config(ROOT / "configs" / "default.yaml",
                      [f"data.cache_dir={tmp_path_factory.getbasetemp() / 'models'}", "target.tiny.pretrain_steps=20"])
    return cfg, load_target(cfg)
