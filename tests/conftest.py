import pytest

from tests.support import shared_server

# Tests import the package and their helpers (``tests.support``) from this checkout,
# installed or not: setup.cfg puts the repository root on sys.path (``pythonpath``).


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One synthetic dataset and tiny target (keyed by their config inside) for every
    test that does not need a cache of its own: building the target costs ~20 s."""
    return tmp_path_factory.mktemp("shared-cache")


def pytest_sessionfinish(session, exitstatus):
    shared_server.stop()    # it would die with this process anyway; this is the tidy way
