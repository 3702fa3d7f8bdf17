"""After each runtime test: no process of the test survives and /dev/shm gained nothing.

Every process the test starts (actors, a supervisor in a subprocess, its actors)
inherits a token in its environment, so survivors are found even after they were
orphaned and reparented away from pytest.
"""

import os
import time
import uuid

import psutil
import pytest

TOKEN_VAR = "DFLASH_LEAKCHECK_TOKEN"


def _holders(token: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["pid"]):
        if p.pid == os.getpid():
            continue
        try:
            # The stdlib resource tracker is started by the first spawn and lives as long
            # as its parent, by design; it holds no project state.
            if (p.environ().get(TOKEN_VAR) == token and p.status() != psutil.STATUS_ZOMBIE
                    and "resource_tracker" not in " ".join(p.cmdline())):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


@pytest.fixture(autouse=True)
def no_leaks():
    token = uuid.uuid4().hex
    old = os.environ.get(TOKEN_VAR)
    os.environ[TOKEN_VAR] = token
    shm_before = set(os.listdir("/dev/shm"))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(TOKEN_VAR)
        else:
            os.environ[TOKEN_VAR] = old
    deadline = time.monotonic() + 10   # room for a loaded machine to reap exiting children
    while (left := _holders(token)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in left:
        p.kill()   # so one failure does not cascade into the next test
    assert not left, f"processes survived the test: {[(p.pid, p.cmdline()[:3]) for p in left]}"
    new = set(os.listdir("/dev/shm")) - shm_before
    assert not new, f"/dev/shm gained {sorted(new)}"
