"""runtime.forking: a private fork server per supervisor, its children, its stop; and
boot's refusal to run in a fork that inherited initialised CUDA."""

import os
import signal
import sys
import time

import psutil
import pytest
import torch

from dflash_actors.runtime import boot, forking


def _exit_with_parent_pid_mod_256():
    os._exit(os.getppid() % 256)


def _exit_0_if_cuda_checks_use_nvml():
    os._exit(0 if os.environ.get(forking.NVML_CUDA_CHECK) == "1" else 1)


def test_children_fork_from_the_private_server_and_stop_takes_it_away(monkeypatch):
    monkeypatch.delenv(forking.NVML_CUDA_CHECK, raising=False)
    starter = forking.ForkServerStarter()
    env = dict(os.environ)
    pid = starter.start(["dflash_actors.runtime.forker", "json"], os.getpid())
    try:
        assert psutil.Process(pid).ppid() == os.getpid()
        assert dict(os.environ) == env              # what the server needed was set for its start only
        proc = starter.Process(target=_exit_with_parent_pid_mod_256)
        proc.start()
        proc.join(30)
        assert proc.exitcode == pid % 256           # its parent was the server, not us
        # The server's environment, its children's: a preload calling
        # torch.cuda.is_available() there asks NVML and cannot poison the forks.
        proc = starter.Process(target=_exit_0_if_cuda_checks_use_nvml)
        proc.start()
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        starter.stop()
    assert starter.pid is None and not psutil.pid_exists(pid)


def test_auto_is_forkserver_on_linux():
    assert forking.resolve("auto") == ("forkserver" if sys.platform == "linux" else "spawn")
    assert forking.resolve("spawn") == "spawn"


def test_a_fork_with_initialised_cuda_is_refused_plainly(monkeypatch):
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    with pytest.raises(RuntimeError, match="forked from a process that had initialised CUDA"):
        boot._check_fork_is_cuda_safe()
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: False)
    boot._check_fork_is_cuda_safe()


def test_a_fork_from_a_stopped_server_fails_within_the_fork_timeout_even_while_it_imports():
    """A stopped server's imports do not advance: its first fork, which may wait
    ``first_fork_timeout_s`` for them, fails once it has been stopped ``fork_timeout_s``."""
    starter = forking.ForkServerStarter()
    starter.set_timeouts(start_timeout_s=120.0, fork_timeout_s=0.5)
    pid = starter.start(["dflash_actors.runtime.forker", "json"], os.getpid())
    try:
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(forking.ForkServerError, match=r"is stopped and did not fork within 0.5s"):
            starter.Process(target=_exit_with_parent_pid_mod_256).start()
        assert time.monotonic() - t0 < 10.0, "waited as for a server importing"
    finally:
        starter.stop(wait_s=0.0)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_child_that_does_not_read_its_arguments_does_not_block_the_hand_over():
    """More than a pipe holds, to a reader that never reads: the call returns at once,
    and the rest goes when (if) the reader takes it."""
    r, w = os.pipe()
    data = bytes(range(256)) * 4096     # 1 MiB
    t0 = time.monotonic()
    forking._hand_over(w, memoryview(data))
    assert time.monotonic() - t0 < 1.0
    got = bytearray()
    with open(r, "rb") as f:
        while chunk := f.read(65536):
            got += chunk
    assert bytes(got) == data
