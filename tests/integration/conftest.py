import pytest

from dflash_actors.config import load_config
from dflash_actors.models.target import ensure_target
from tests.support.chat import tiny_chat_target
from tests.support.leakcheck import no_leaks  # noqa: F401  (autouse fixture for every test here)
from tests.support.pipeline import HEADS_16, ROOT, SMALL


@pytest.fixture(scope="session")
def chat_target(cache_dir, tmp_path_factory):
    """The tiny chat target's directory (``tests.support.chat``), built once per session."""
    cfg = load_config(ROOT / "configs/default.yaml", SMALL + HEADS_16 + [f"data.cache_dir={cache_dir}"])
    return tiny_chat_target(ensure_target(cfg), tmp_path_factory.mktemp("chat") / "target")
