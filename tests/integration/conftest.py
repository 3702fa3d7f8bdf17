import pytest
from support.leakcheck import no_leaks  # noqa: F401  (autouse fixture for every test here)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One synthetic dataset and tiny target for every pipeline test that does not
    build its own."""
    return tmp_path_factory.mktemp("pipeline-cache")
