"""The runtime tests' leak check (``tests/support/leakcheck.py``): which new /dev/shm
entries it counts as leaks."""

import os
import uuid

import pytest

from tests.support.leakcheck import leaked


@pytest.fixture
def shm_entry():
    """Make a /dev/shm entry that nobody maps; removed after the test."""
    made = []

    def make(name: str) -> str:
        with open(f"/dev/shm/{name}", "wb") as f:
            f.write(bytes(64))
        made.append(name)
        return name
    yield make
    for name in made:
        try:
            os.unlink(f"/dev/shm/{name}")
        except FileNotFoundError:
            pass


def test_only_this_processs_cuda_ipc_ref_counters_are_excused(shm_entry):
    """torch's ``torch_<pid>_*`` ref counters of the pytest process itself (a CUDA ring it
    shared) stay while it lives; the same name for another live process, or a pid that
    merely starts with ours, or any other name, is a leak."""
    tag, pid = uuid.uuid4().hex[:8], os.getpid()
    ours = shm_entry(f"torch_{pid}_{tag}_0")
    theirs = shm_entry(f"torch_{os.getppid()}_{tag}_0")
    longer_pid = shm_entry(f"torch_{pid}0_{tag}_0")
    other = shm_entry(f"leakcheck-{tag}")
    assert leaked({ours, theirs, longer_pid, other}) == {theirs, longer_pid, other}
