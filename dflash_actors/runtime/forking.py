"""How actor processes start: a fresh interpreter each (spawn), or a fork of one server
process that has imported everything once (forkserver, the default where it exists).

The standard library has one fork server per process, started on first use with the
preload list set before it, and shared by everything in that process. A supervisor
needs its own: two supervisors can run in one process (the two-node tests run one per
thread), each must stop its server when it ends (a server left running would outlive
the job), and the server's parent-death signal (``forker``) is tied to the thread that
started it. So ``ForkServerStarter`` keeps a private ``multiprocessing.forkserver``
server and a ``Process`` class that forks from it; the server itself is the stdlib's
(its ``main``, and its protocol for handing a child its arguments and descriptors).

What differs from the stdlib's client, and why: the server is one process that every
actor comes from, so it must not be a silent single point of failure.
  * No silent restart. The stdlib starts a new server when it finds the old one dead,
    without our environment (no parent-death signal, no ``PYTHONPATH``), and hands out
    children of a server the supervisor does not know. Here a dead server raises
    ``ForkServerError``; the supervisor decides (``restart``, with the first start's
    settings, or spawn).
  * Nothing waits without a limit. The stdlib writes the child's arguments, then waits
    for its pid, both without limit: a stopped or hung server blocks the supervisor
    for ever. Here the pid comes first (the server forks on receiving the descriptors
    alone), within ``fork_timeout_s``, or ``first_fork_timeout_s`` while a new server
    still imports; but a server seen stopped (SIGSTOP) for ``fork_timeout_s`` is lost
    at once, imports or not: its imports are not running. Then the arguments go to a
    child known to exist, without waiting for it to read them: they exceed a pipe's
    64 KiB, and a child that does not read (stopped, stalled before its first line of
    ours) must not stall the supervisor. What is left over a pipe's worth goes from a
    thread (``_hand_over``); a child that never takes it makes no start-up progress,
    which the supervisor's start timeout sees, and its end ends the thread.
  * A child's death is its own pidfd, not the server's report. The stdlib learns it
    only from the server, which reaps it: while the server is stopped, a dead actor
    would look alive. A pidfd is readable as soon as the process has ended, whoever
    reaps it; the exit status is still the server's to give, and when it cannot
    (dead or stopped) the process counts as ended with an unknown status
    (``exit_unknown``).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from multiprocessing import forkserver, popen_forkserver, process, reduction, resource_tracker, spawn, util
from multiprocessing.connection import wait
from multiprocessing.context import set_spawning_popen
from typing import Optional

from .forker import SUPERVISOR_PID_ENV

STOP_WAIT_S = 2.0
"""After closing its pipe, how long the server has to exit before it is killed."""

STATUS_WAIT_S = 1.0
"""After a child has ended, how long the server has to report its exit status (a live
server does within milliseconds: it reaps on SIGCHLD)."""

UNKNOWN_EXIT = 255
"""The exit code of a child whose status the server could not report (the stdlib's)."""

POLL_S = 0.05
"""While waiting for a fork: how often a server that has not answered is looked at
(stopped? ended?)."""

NVML_CUDA_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
"""Set in the server: ``torch.cuda.is_available()`` then asks NVML instead of initialising
CUDA, so a preload that calls it cannot make every fork a CUDA-poisoned one."""


class ForkServerError(RuntimeError):
    """The fork server served no fork: it is gone, refused, stopped, or did not answer in
    time."""


def stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, SIGTSTP, a tracer): it runs nothing until
    continued. False once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def _hand_over(fd: int, data: memoryview) -> None:
    """Write ``data`` to the pipe ``fd`` and close it, waiting for the reader only in a
    thread: what fits goes now, the rest as the child reads. A reader that ends first
    ends the write (its pid's sentinel tells the supervisor)."""
    try:
        os.set_blocking(fd, False)
        while data:
            data = data[os.write(fd, data):]
    except BlockingIOError:
        os.set_blocking(fd, True)

        def rest(data=data):
            try:
                with open(fd, "wb", closefd=True) as f:
                    f.write(data)
            except OSError:
                pass    # the child is gone; its pidfd says so
        threading.Thread(target=rest, name="fork-handover", daemon=True).start()
        return
    except OSError:
        pass    # BrokenPipeError: it died already
    os.close(fd)


def resolve(configured: str) -> str:
    """``runtime.start_method`` resolved: auto is forkserver where the platform has it and
    pidfds (Linux), which this client watches its children by."""
    if configured == "auto":
        has = "forkserver" in multiprocessing.get_all_start_methods() and hasattr(os, "pidfd_open")
        return "forkserver" if has else "spawn"
    return configured


class _Server(forkserver.ForkServer):
    """The stdlib's server, asked with timeouts and never restarted behind our back."""

    def __init__(self):
        super().__init__()
        self.answered = False
        """Whether it has forked once: until then its imports may still be running."""
        self.exitcode: Optional[int] = None
        """Once it has ended and been reaped: its exit code (-N: killed by signal N)."""

    def alive(self) -> bool:
        """Whether it runs (a stopped server does); reaps it once it has ended."""
        pid = self._forkserver_pid
        if pid is None or self.exitcode is not None:
            return False
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return False
        if done:
            self.exitcode = os.waitstatus_to_exitcode(status)
        return not done

    def ask(self, fds: list[int], timeout_s: float, stopped_s: float) -> tuple[int, int, int]:
        """Have the server fork a child that inherits ``fds``: ``(pid, status_r,
        data_w)``; the child reads its arguments from ``data_w``, the server reports
        its exit status on ``status_r``. The server has ``timeout_s`` to fork, of which
        at most ``stopped_s`` stopped. Raises ForkServerError, leaking nothing."""
        if not self.alive():
            raise ForkServerError(f"the fork server (pid {self._forkserver_pid}) is not running")
        status_r, child_w = os.pipe()
        child_r, data_w = os.pipe()
        try:
            with socket.socket(socket.AF_UNIX) as client:
                client.settimeout(timeout_s)
                client.connect(self._forkserver_address)
                reduction.sendfds(client, [child_r, child_w, self._forkserver_alive_fd,
                                           resource_tracker.getfd(), *fds])
            self._await_fork(status_r, timeout_s, stopped_s)
            try:
                pid = forkserver.read_signed(status_r)
            except (OSError, EOFError):
                raise ForkServerError(f"the fork server (pid {self._forkserver_pid}) ended before it forked") from None
        except BaseException as e:
            os.close(status_r)
            os.close(data_w)
            if isinstance(e, OSError):
                raise ForkServerError(f"the fork server (pid {self._forkserver_pid}) refused: {e}") from None
            raise
        finally:
            os.close(child_r)
            os.close(child_w)
        self.answered = True
        return pid, status_r, data_w

    def _await_fork(self, status_r: int, timeout_s: float, stopped_s: float) -> None:
        """Until the server's answer is on ``status_r`` (a pid, or its end), or
        ForkServerError: ``timeout_s`` passed, or the server was seen stopped for
        ``stopped_s`` on end (a stopped server's imports do not advance either)."""
        pid = self._forkserver_pid
        start = time.monotonic()
        stopped_since = None
        while not wait([status_r], POLL_S):
            now = time.monotonic()
            if not stopped(pid):
                stopped_since = None
            elif stopped_since is None:
                stopped_since = now
            elif now - stopped_since >= stopped_s:
                raise ForkServerError(f"the fork server (pid {pid}) is stopped and did not fork within "
                                      f"{stopped_s:g}s")
            if now - start >= timeout_s:
                how = "is stopped and did not fork" if stopped_since is not None else "did not fork"
                raise ForkServerError(f"the fork server (pid {pid}) {how} within {timeout_s:g}s")


class _Popen(popen_forkserver.Popen):
    """The stdlib's forkserver Popen, asking a given server (module docstring)."""

    def __init__(self, process_obj, starter: "ForkServerStarter"):
        self._starter = starter
        self.exit_unknown = False
        super().__init__(process_obj)

    def _launch(self, process_obj):
        # As the stdlib does it: pickle the preparation data and the process object
        # with this Popen as the spawning one (descriptors are collected into
        # self._fds), hand the descriptors to the server, which forks; then the
        # pickles go to the child.
        prep = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        server = self._starter.server
        pid, self._status, w = server.ask(self._fds, self._starter.timeout_s(), self._starter.fork_timeout_s)
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError:
            # It has not read its arguments yet, so only its server's death can have
            # ended it: the server is going.
            os.close(self._status)
            os.close(w)
            raise ForkServerError(f"the fork server (pid {server._forkserver_pid}) lost its child {pid} "
                                  "at once") from None
        self.pid = pid
        self.sentinel = self._pidfd
        keep_w = os.dup(w)     # the child's view of its parent: alive while we hold it
        self.finalizer = util.Finalize(self, util.close_fds, (keep_w, self._status, self._pidfd))
        _hand_over(w, buf.getbuffer())

    def poll(self, flag=os.WNOHANG):
        if self.returncode is None:
            if not wait([self._pidfd], 0 if flag == os.WNOHANG else None):
                return None
            code = None
            if wait([self._status], STATUS_WAIT_S):
                try:
                    code = forkserver.read_signed(self._status)
                except (OSError, EOFError):
                    pass
            self.exit_unknown = code is None
            self.returncode = UNKNOWN_EXIT if code is None else code
        return self.returncode

    def _send_signal(self, sig):
        if self.returncode is None:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass


_STARTERS: dict[int, "ForkServerStarter"] = {}
"""The live private servers of this process, by key (a process object carries only
the key: it is pickled for its child, and a server is not picklable)."""


class ServerProcess(process.BaseProcess):
    """A process forked from the private server named by its ``_server_key``."""

    _start_method = "forkserver"
    _server_key = -1

    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj, _STARTERS[process_obj._server_key])


def exit_unknown(proc) -> bool:
    """Whether ``proc`` (ended) was forked from a server that could not give its status."""
    return bool(getattr(getattr(proc, "_popen", None), "exit_unknown", False))


FIRST_FORK_FLOOR_S = 30.0
"""The least a new fork server is given for its first fork (its imports come first)."""


class ForkServerStarter:
    """A private fork server, and ``Process`` objects that fork from it."""

    def __init__(self):
        self.server = _Server()
        self._key = id(self)
        self.preload: tuple[str, ...] = ()
        """What the server imports before it serves a fork, ``forker`` first."""
        self.sentinel: Optional[int] = None
        """The server's pidfd: readable once it has ended."""
        self.first_fork_timeout_s = 300.0
        """How long a new server may take to fork its first child (its imports first)."""
        self.fork_timeout_s = 10.0
        """How long a server whose imports are done may take to fork."""
        self._supervisor_pid: Optional[int] = None

    def Process(self, **kwargs) -> ServerProcess:
        proc = ServerProcess(**kwargs)
        proc._server_key = self._key
        return proc

    def timeout_s(self) -> float:
        return self.fork_timeout_s if self.server.answered else self.first_fork_timeout_s

    def set_timeouts(self, start_timeout_s: float, fork_timeout_s: float) -> None:
        """An actor's ``runtime`` timeouts, for this server's forks. A new server imports
        torch and the preloads before its first fork: seconds, more on a loaded machine,
        and none of it an actor's start-up, so a short ``start_timeout_s`` must not call
        it hung (``FIRST_FORK_FLOOR_S``)."""
        self.first_fork_timeout_s = max(start_timeout_s, FIRST_FORK_FLOOR_S)
        self.fork_timeout_s = fork_timeout_s

    def start(self, modules: list[str], supervisor_pid: int) -> int:
        """Start the server with ``forker`` and then ``modules`` imported before it serves
        the first fork (that fork waits for the imports); its pid. ``forker`` learns
        whom to die with from the environment, set for this start only; so does the
        server's ``sys.path``: ``PYTHONPATH``, then ours, as spawn gives a child (the
        stdlib's server does not apply the path it is handed before its imports, and a
        failed preload import is silently skipped), and its ``NVML_CUDA_CHECK``."""
        _STARTERS[self._key] = self
        self.preload = tuple(dict.fromkeys([f"{__package__}.forker", *modules]))
        self._supervisor_pid = supervisor_pid
        self.server.set_forkserver_preload(list(self.preload))
        saved = {k: os.environ.get(k) for k in (SUPERVISOR_PID_ENV, "PYTHONPATH", NVML_CUDA_CHECK)}
        os.environ[SUPERVISOR_PID_ENV] = str(supervisor_pid)
        os.environ[NVML_CUDA_CHECK] = "1"
        os.environ["PYTHONPATH"] = os.pathsep.join([*filter(None, [saved["PYTHONPATH"]]), *filter(None, sys.path)])
        try:
            self.server.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.sentinel = os.pidfd_open(self.server._forkserver_pid)
        return self.server._forkserver_pid

    def restart(self) -> int:
        """A new server with the settings of the first start, in place of this one (which
        is killed if it still runs); its pid."""
        self.stop(wait_s=0.0)
        self.server = _Server()
        return self.start(list(self.preload[1:]), self._supervisor_pid)

    @property
    def pid(self) -> Optional[int]:
        return self.server._forkserver_pid

    def alive(self) -> bool:
        return self.server.alive()

    def ended_how(self) -> str:
        """How the server ended, in a phrase (it has: ``alive`` is False)."""
        self.server.alive()
        code = self.server.exitcode
        if code is None:
            return "ended"
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """Close the server's pipe, which tells it to exit; kill it if it has not within
        ``wait_s`` (its children are gone by now: the supervisor stops its actors first).
        A server still importing, or stopped, notices the pipe only later."""
        s = self.server
        pid = s._forkserver_pid
        if pid is None:
            return
        os.close(s._forkserver_alive_fd)
        end, killed = time.monotonic() + wait_s, False
        while s.alive():
            now = time.monotonic()
            if now >= end:
                if killed:
                    break   # still in the kernel (uninterruptible): it ends with the kill, unreaped
                os.kill(pid, signal.SIGKILL)    # a stopped server dies of it too
                end, killed = now + STOP_WAIT_S, True
            time.sleep(0.005)
        address = s._forkserver_address
        if address and not util.is_abstract_socket_namespace(address):
            try:
                os.unlink(address)
            except OSError:
                pass
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None
        s._forkserver_pid = s._forkserver_alive_fd = s._forkserver_address = None
        _STARTERS.pop(self._key, None)
