from tests.support.leakcheck import no_leaks  # noqa: F401  (autouse fixture for every test here)
