import sys
from pathlib import Path

# Tests import the package from this checkout, installed or not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One synthetic dataset and tiny target (keyed by their config inside) for every
    test that does not need a cache of its own: building the target costs ~20 s."""
    return tmp_path_factory.mktemp("shared-cache")
