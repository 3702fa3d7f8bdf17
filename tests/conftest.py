import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_actors.config import load_config  # noqa: E402


@pytest.fixture(scope="session")
def synthetic_dirs(tmp_path_factory):
    """The default synthetic train/held-out datasets, generated once per session."""
    from dflash_actors.synthetic import ensure_synthetic_dataset
    cache = tmp_path_factory.mktemp("cache")
    cfg = load_config(ROOT / "configs" / "default.yaml", [f"data.cache_dir={cache}"])
    return ensure_synthetic_dataset(cfg.data)
