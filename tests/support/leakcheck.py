"""After each runtime test: no process of the test survives and /dev/shm gained nothing
(``leaked``: but what other processes map, and torch's CUDA-IPC ref counters of ours).

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
    """The live processes of this test: those with its token, and any child of the
    session's shared fork server (``shared_server``), which outlives tests by design
    and carries a token of its own."""
    from . import shared_server  # here: it imports this module's TOKEN_VAR

    server = shared_server.pid()
    found = _server_children(server)
    for p in psutil.process_iter(["pid"]):
        if p.pid in (os.getpid(), server) or p in found:
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


def _server_children(pid) -> list[psutil.Process]:
    if pid is None:
        return []
    try:
        return [c for c in psutil.Process(pid).children() if c.status() != psutil.STATUS_ZOMBIE]
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


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
    new = leaked(set(os.listdir("/dev/shm")) - shm_before)
    if new:   # one more look: another process's entry may be between close and unlink
        time.sleep(2)
        new = leaked(new & set(os.listdir("/dev/shm")))
    assert not new, f"/dev/shm gained {sorted(new)}"


def leaked(names: set[str]) -> set[str]:
    """The new /dev/shm entries that are leaks: not mapped by a live process outside this
    test, and not torch's CUDA-IPC ref counters of this process. Sharing a CUDA tensor
    (a CUDA ring handed to a child) makes torch create ``torch_<pid>_*``, which the
    producer keeps mapped while it lives and unlinks at its exit (``runtime/channels.py``)."""
    own = f"torch_{os.getpid()}_"
    return {n for n in names if not n.startswith(own)} - _in_use_elsewhere(names)


def _in_use_elsewhere(names: set[str]) -> set[str]:
    """Entries mapped by a live process outside this test. /dev/shm is shared with
    whatever else runs on the machine (tqdm's lock alone makes ``sem.mp-*`` entries);
    a segment this test leaked is mapped by nobody, or by this process. Matched by
    inode: glibc maps a semaphore under its temporary name, then renames the file."""
    inodes = {}
    for n in names:
        try:
            inodes[os.stat(f"/dev/shm/{n}").st_ino] = n
        except FileNotFoundError:
            inodes[None] = n   # gone already: not a leak
    used = {inodes.pop(None)} if None in inodes else set()
    for pid in psutil.pids():
        if pid == os.getpid() or not inodes:
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith("/dev/shm/") and int(parts[4]) in inodes:
                        used.add(inodes[int(parts[4])])
        except OSError:
            continue
    return used
